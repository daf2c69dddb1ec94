"""elbowroom on a Hugging Face causal LM: recompute per decoder layer and the CPU-offloaded optimizer.

What it shows: any ``nn.Module`` works, here ``transformers``' Llama (``--arch llama``) or GPT-2
(``--arch gpt2``), built from a config so that nothing is downloaded.

- recompute: ``elbowroom.checkpoint(layer, "full")`` on every decoder layer (``model.model.layers`` of a
  Llama, ``model.transformer.h`` of GPT-2), torch's non-reentrant checkpoint underneath. The layers are
  called with keyword arguments (``attention_mask``, ``position_embeddings``, ...), which recompute passes
  through. ``use_cache=False``: a training step keeps no KV cache;
- the optimizer's state and step on the host for the late half of the parameters
  (``CPUOffloadOptimizer`` with ``offload_params=last_fraction(...)``);
- a plain training loop: ``loss = model(ids, labels=ids).loss``, ``backward``, ``step``, ``zero_grad``.

The data is one fixed batch of random tokens, so the printed loss (``step N loss X``) falls as the model
memorises it: the point is the loop, not the data.

Run it:

    python examples/huggingface.py                     # CPU, a 4-layer Llama of width 64, seconds
    python examples/huggingface.py --arch gpt2         # the same with GPT-2
    python examples/huggingface.py --device cuda --hidden-size 2048 --layers 24 --heads 16 --seq-len 2048
"""

from __future__ import annotations

import argparse

import torch
import transformers

import elbowroom
from elbowroom.optim import last_fraction


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--arch", default="llama", choices=["llama", "gpt2"])
    p.add_argument("--device", default="cpu", help="cpu, cuda, cuda:1, ...")
    p.add_argument("--steps", type=int, default=10, help="optimizer steps")
    p.add_argument("--vocab-size", type=int, default=256)
    p.add_argument("--hidden-size", type=int, default=64)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--batch-size", type=int, default=4)
    p.add_argument("--seq-len", type=int, default=64)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--offload-fraction", type=float, default=0.5, help="late share of the parameters on the host")
    return p.parse_args()


def build(args: argparse.Namespace) -> tuple[torch.nn.Module, torch.nn.ModuleList]:
    """A randomly initialised causal LM from a config (no download) and its list of decoder layers."""
    if args.arch == "llama":
        config = transformers.LlamaConfig(
            vocab_size=args.vocab_size,
            hidden_size=args.hidden_size,
            intermediate_size=4 * args.hidden_size,
            num_hidden_layers=args.layers,
            num_attention_heads=args.heads,
            num_key_value_heads=args.heads,
            max_position_embeddings=args.seq_len,
            use_cache=False,
        )
        model = transformers.LlamaForCausalLM(config)
        return model, model.model.layers
    config = transformers.GPT2Config(
        vocab_size=args.vocab_size,
        n_embd=args.hidden_size,
        n_layer=args.layers,
        n_head=args.heads,
        n_positions=args.seq_len,
        use_cache=False,
    )
    model = transformers.GPT2LMHeadModel(config)
    return model, model.transformer.h


def main() -> None:
    args = parse_args()
    device = torch.device(args.device)
    torch.manual_seed(0)
    model, layers = build(args)
    model.to(device).train()

    # recompute every decoder layer in backward (the layers keep their class, parameters and state_dict keys)
    for layer in layers:
        elbowroom.checkpoint(layer, "full")

    # the optimizer's state and step on the host for the late parameters: their gradients are final first in
    # backward, so their CPU step overlaps the rest of backward
    opt = elbowroom.CPUOffloadOptimizer(
        model.parameters(),
        torch.optim.AdamW,
        lr=args.lr,
        offload_params=last_fraction(model.parameters(), args.offload_fraction),
    )

    input_ids = torch.randint(args.vocab_size, (args.batch_size, args.seq_len), device=device)
    for step in range(args.steps):
        loss = model(input_ids=input_ids, labels=input_ids).loss  # labels are shifted inside the model
        loss.backward()
        opt.clip_grad_norm_(1.0)
        opt.step()
        opt.zero_grad()
        print(f"step {step} loss {loss.item():.4f}", flush=True)  # .item(): a host-device sync, for the log
    opt.close()


if __name__ == "__main__":
    main()
