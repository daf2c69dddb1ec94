"""What a profile counts as saved per block, eager against compiled (``profile(..., compiled=True)``), by kind, on
the reference Llama at a size given on the command line: the partitioner's saved bytes against eager autograd's
(with elbowroom's Triton kernels where the device has them), and what selective recompute keeps in each. Then, with
no hooks of the profile's, what the compiled blocks' autograd nodes hold after a forward under bf16 autocast (their
saved tensors, parameters left out), and on CUDA what the caching allocator holds: three counts of one thing. Each
compiled count twice: as ``compile_blocks`` compiles by default, and recomputing pointwise results in backward
(``recompute_pointwise=True``).

    python3 benchmarks/compiled_saved.py                          # the GPU test's size: 2 layers of 256, 2 x 256
    python3 benchmarks/compiled_saved.py --dim 4096 --ffn 11008 --heads 32 --batch 1 --seq 4096
    python3 benchmarks/compiled_saved.py --dim 2048 --ffn 5632 --heads 16 --held-only --weights bf16 --checkpoint full

``--held-only`` skips the profiles; ``--weights bf16`` casts the model's weights (as a bf16 plan does) and
``--checkpoint full|selective`` gives every block that policy before compiling (as a plan's recomputed blocks are
compiled); the held tensors are then listed by shape, with the model's own parameters marked.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from elbowroom.models import ModelConfig, build_model  # noqa: E402
from elbowroom.plan import measure_machine, profile  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dim", type=int, default=256)
    ap.add_argument("--ffn", type=int, default=768)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--held-only", action="store_true")
    ap.add_argument("--weights", choices=("fp32", "bf16"), default="fp32")
    ap.add_argument("--checkpoint", choices=("none", "full", "selective"), default="none")
    args = ap.parse_args()
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    cfg = ModelConfig(n_layers=args.layers, dim=args.dim, n_heads=args.heads, ffn_dim=args.ffn,
                      max_seq_len=args.seq)
    torch.manual_seed(0)
    model = build_model(cfg, device=dev)
    if args.weights == "bf16":
        model.to(torch.bfloat16)
    if args.checkpoint != "none":
        from elbowroom.activations.policy import BlockPolicy, apply_block_policies

        apply_block_policies(model, [BlockPolicy(checkpoint=args.checkpoint)] * args.layers)
    ids = torch.randint(0, cfg.vocab_size, (args.batch, args.seq), device=dev)
    machine = measure_machine(dev, cache_dir=tempfile.mkdtemp(), matmul_size=1024, adam_numel=1_000_000)
    arms = () if args.held_only else (
        ("eager", False), ("compiled", True), ("compiled, pointwise recomputed", {"recompute_pointwise": True}))
    for name, compiled in arms:
        prof = profile(model, ids, machine=machine, compiled=compiled, dtype=torch.bfloat16)
        b = prof.blocks[0]
        print(f"{name}: total {b.total_saved_bytes} selective {b.selective_saved_bytes} input {b.input_bytes}")
        print(f"  by kind {dict(b.saved_bytes)}")
        print(f"  saved sizes {sorted(b.saved_sizes, reverse=True)}")
        print(f"  kept sizes {sorted(b.kept_sizes, reverse=True)}")
    from elbowroom import compile_blocks
    from elbowroom.activations import uncompile_blocks

    for recompute_pointwise in (False, True):
        print(f"-- the blocks compiled{', pointwise recomputed' if recompute_pointwise else ''}, no hooks:")
        compile_blocks(model, recompute_pointwise=recompute_pointwise)
        _held(model, ids, dev)
        uncompile_blocks(model.blocks)


def compiled_saved(out: torch.Tensor) -> list[list[torch.Tensor]]:
    """The saved tensors of each compiled autograd node in ``out``'s graph (``CompiledFunctionBackward``)."""
    seen, stack, nodes = set(), [out.grad_fn], []
    while stack:
        node = stack.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        stack.extend(f for f, _ in node.next_functions)
        if "Compiled" in type(node).__name__:
            nodes.append([t for t in node.saved_tensors if t is not None])
    return nodes


def saved_rows(saved: list[torch.Tensor], params: set[int]) -> list[tuple[float, tuple[int, ...], str, str]]:
    """(MiB, shape, dtype, "param" or "own") per saved tensor, largest first: "param" where it shares a storage
    whose address is in ``params``."""
    return sorted(((t.untyped_storage().nbytes() / 2**20, tuple(t.shape), str(t.dtype)[6:],
                    "param" if t.untyped_storage().data_ptr() in params else "own") for t in saved), reverse=True)


def _held(model: torch.nn.Module, ids: torch.Tensor, dev: str) -> None:
    """What the compiled blocks' autograd nodes hold after a forward (and on CUDA, what the allocator holds)."""
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    for step in range(2):  # the first compiles
        if dev == "cuda":
            torch.cuda.synchronize()
            base = torch.cuda.memory_allocated()
        with torch.autocast(dev, dtype=torch.bfloat16):
            logits = model(ids)
        alive = torch.cuda.memory_allocated() - base if dev == "cuda" else None
        held, shapes = [], []
        for saved in compiled_saved(logits):
            storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in saved}
            held.append({k: v for k, v in storages.items() if k not in params})
            shapes.append(saved_rows(saved, params))
        if step == 1:
            for i, h in enumerate(held):
                print(f"compiled node {i}: holds {sum(h.values())} {sorted(h.values(), reverse=True)}")
                print("   " + "; ".join(f"{mb:.2f} MiB {shape} {dt} {kind}" for mb, shape, dt, kind in shapes[i][:12]))
            print(f"allocated after the forward (blocks, head and logits): {alive}")
        logits.float().sum().backward()
        model.zero_grad(set_to_none=True)


if __name__ == "__main__":
    main()
