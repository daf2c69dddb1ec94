"""elbowroom's mechanisms composed by hand in a plain PyTorch training loop, on the reference Llama model.

What it shows, in the order a step meets them:

- an activation policy on the model's blocks (``apply_activation_policy``): every block recomputed in
  backward, the input each one saves offloaded to host memory;
- the output head and the loss chunk by chunk (``elbowroom.linear_cross_entropy``): the logits never exist
  whole;
- the optimizer's state and step on the host for the late fraction of the parameters
  (``CPUOffloadOptimizer`` with ``offload_params=last_fraction(...)``), those weights kept on the device in
  bf16 (``param_dtype``) with their fp32 masters on the host, which is why forward runs under bf16 autocast;
- ``overlap_with_forward`` (the CPU step of the late blocks runs behind the next forward), gradient
  accumulation over micro-batches (``accumulating``) and clipping (``clip_grad_norm_``).

It trains on the built-in byte-level corpus (Python's standard-library source, built on first use and cached
under ``~/.cache/elbowroom`` or ``$ELBOWROOM_CACHE``; nothing is downloaded) and prints one ``step N loss X``
line per optimizer step.

bf16 autocast is what bf16 offloaded weights need: without it the first matmul that meets a bf16 weight and
an fp32 activation raises "expected m1 and m2 to have the same dtype". The CPU supports it too, and on CPU the
first step's loss and gradients are bitwise those of the plain fp32 model under the same autocast.

Run it:

    python examples/compose_by_hand.py             # CPU, the tiny preset: 20 steps, 5.64 -> ~2.7, seconds
    python examples/compose_by_hand.py --device cuda --preset w1 --seq-len 2048 --batch-size 8 \
        --lr 3e-4 --warmup-steps 10 --steps 30    # one GPU, W1 (1.3B)

On one H100 (torch 2.11) the W1 command runs in about a minute; its loss goes 10.9 -> ~3.0 after swinging in the
first ten steps (15.8 at step 2). The swings are the model's, not the offload's: at lr 1e-4 without warmup,
torch's own AdamW with every parameter on the device gives the same first six losses to three decimals.
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Iterator

import torch

import elbowroom
from elbowroom.activations import apply_activation_policy
from elbowroom.models import PRESETS, ModelConfig, build_model
from elbowroom.optim import last_fraction
from elbowroom.train.data import ChunkDataset, load_tokens


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cpu", help="cpu, cuda, cuda:1, ...")
    p.add_argument("--preset", default="tiny", choices=sorted(PRESETS), help="model size (tiny fits a CPU)")
    p.add_argument("--steps", type=int, default=20, help="optimizer steps")
    p.add_argument("--batch-size", type=int, default=16, help="sequences per micro-batch")
    p.add_argument("--seq-len", type=int, default=128, help="tokens per sequence")
    p.add_argument("--micro-batches", type=int, default=2, help="gradient accumulation steps per optimizer step")
    p.add_argument("--lr", type=float, default=3e-3, help="peak learning rate (W1: 3e-4)")
    p.add_argument("--warmup-steps", type=int, default=5, help="linear warmup (a 1.3B model spikes without one)")
    p.add_argument("--offload-fraction", type=float, default=0.4, help="late share of the parameters on the host")
    p.add_argument(
        "--cache-dir",
        default=os.environ.get("ELBOWROOM_CACHE"),
        help="where the built-in corpus is cached (default $ELBOWROOM_CACHE, else ~/.cache/elbowroom), as for the CLI",
    )
    return p.parse_args()


def corpus_batches(
    batch_size: int, seq_len: int, device: torch.device, cache_dir: str | None
) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """Endless ``(input_ids, targets)`` micro-batches of random windows of the built-in corpus, seeded."""
    windows = ChunkDataset(load_tokens(None, cache_dir=cache_dir).tokens, seq_len)  # built on first use, cached
    gen = torch.Generator().manual_seed(0)
    while True:
        items = [windows[i] for i in torch.randint(len(windows), (batch_size,), generator=gen).tolist()]
        input_ids = torch.stack([it["input_ids"] for it in items])
        targets = torch.stack([it["targets"] for it in items])
        yield input_ids.to(device, non_blocking=True), targets.to(device, non_blocking=True)


def main() -> None:
    args = parse_args()
    device = torch.device(args.device)
    torch.manual_seed(0)
    batches = corpus_batches(args.batch_size, args.seq_len, device, args.cache_dir)

    # --8<-- [start:core]
    model = build_model(ModelConfig.from_preset(args.preset), device=device)  # model.blocks: the repeated blocks

    # activation memory, block by block: recompute each block in backward, send the input it saves to the host
    # (nothing to enter per step: the hooks live in the blocks' forwards)
    apply_activation_policy(model, checkpoint="full", offload_checkpoint_inputs=True)

    # the optimizer's state and step on the host for the late 40% of the parameters (their gradients are final
    # first in backward and their weights are needed last in forward, so the CPU step hides best there)
    opt = elbowroom.CPUOffloadOptimizer(
        model.parameters(),
        torch.optim.AdamW,
        lr=args.lr,
        weight_decay=0.1,
        offload_params=last_fraction(model.parameters(), args.offload_fraction),
        param_dtype=torch.bfloat16,  # offloaded weights live on the device in bf16, their fp32 masters on the host
    )
    opt.overlap_with_forward(model)  # step() returns at once; each block's forward waits for its own weights
    # a torch LR scheduler drives it like any optimizer: the CPU steps read param_groups' lr
    warmup = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / max(1, args.warmup_steps)))

    def loss_fn(input_ids: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        # bf16 weights next to fp32 ones need autocast: every matmul then runs in bf16 (on CPU too)
        with torch.autocast(device.type, dtype=torch.bfloat16):
            h = model.hidden_states(input_ids)
            # the head's weight is read outside its module's forward: wait for its CPU update first
            opt.wait_for(model.output.weight)
            # the head and the loss chunk by chunk: the (tokens x vocab) logits never exist whole
            return elbowroom.linear_cross_entropy(h, model.output.weight, targets)

    for step in range(args.steps):
        step_loss = torch.zeros((), device=device)
        for i in range(args.micro_batches):
            input_ids, targets = next(batches)
            with opt.accumulating(i < args.micro_batches - 1):  # gradients move to the host once final
                loss = loss_fn(input_ids, targets) / args.micro_batches
                loss.backward()
            step_loss += loss.detach()
        opt.clip_grad_norm_(1.0)  # the optimizer's own clipping: it sees gradients already on the host too
        opt.step()
        opt.zero_grad()
        warmup.step()
        # --8<-- [end:core]
        print(f"step {step} loss {step_loss.item():.4f}", flush=True)  # .item(): a host-device sync, for the log
    opt.close()


if __name__ == "__main__":
    main()
