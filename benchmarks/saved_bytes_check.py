"""Per block of a 7B-wide two-block model (fp32 weights, bf16 autocast): the device bytes a block's forward leaves
allocated, and what autograd saved in it, bare and under a nested autocast without its weight cache (what a block
under an elbowroom policy runs in), against the profile's count; then as a plan applies it (the offload engine's
regions recast the weights' bf16 casts), with what was alive at the forward's end (``memory_peak.py``). Bare, a
block keeps its weights' bf16 casts too (386 MiB on this shape); applied, exactly the profile's bytes.

    python3 benchmarks/saved_bytes_check.py
"""

from __future__ import annotations

import sys
from collections import Counter
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from elbowroom.models import ModelConfig, build_model  # noqa: E402


def run(model: torch.nn.Module, idx: torch.Tensor, nested: bool) -> None:
    deltas, saved = [], Counter()
    before: list[int] = []
    blocks = list(model.blocks)

    def pre(m, a):
        torch.cuda.synchronize()
        before.append(torch.cuda.memory_allocated())

    def post(m, a, out):
        torch.cuda.synchronize()
        deltas.append((torch.cuda.memory_allocated() - before.pop()) / 2**20)

    def pack(t: torch.Tensor) -> torch.Tensor:
        node = torch._C._current_autograd_node()
        name = type(node).__name__ if node is not None else "?"
        saved[(name, str(t.dtype), round(t.untyped_storage().nbytes() / 2**20, 1))] += 1
        return t

    hs = [b.register_forward_pre_hook(pre) for b in blocks] + [b.register_forward_hook(post) for b in blocks]
    fwds = [b.forward for b in blocks]
    if nested:
        for b, f in zip(blocks, fwds):
            def wrapped(*a, _f=f, **k):
                with torch.autocast("cuda", dtype=torch.bfloat16, cache_enabled=False):
                    return _f(*a, **k)
            b.forward = wrapped
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), torch.autocast("cuda", dtype=torch.bfloat16):
        h = model.hidden_states(idx)
    print(f"nested={nested}: block deltas MiB {[round(d, 1) for d in deltas]}")
    for k, v in sorted(saved.items(), key=lambda kv: -kv[0][2] * kv[1]):
        print("  ", k, "x", v)
    for hd in hs:
        hd.remove()
    for b, f in zip(blocks, fwds):
        b.forward = f
    del h


def main() -> None:
    cfg = ModelConfig(vocab_size=32000, dim=4096, n_layers=2, n_heads=32, ffn_dim=11008, max_seq_len=4096)
    model = build_model(cfg, device="cuda")
    idx = torch.randint(0, cfg.vocab_size, (1, 4096), device="cuda")
    run(model, idx, nested=False)
    run(model, idx, nested=True)
    from elbowroom.plan import apply, profile
    from elbowroom.plan.cost import Decisions, Option
    from elbowroom.plan.search import plan_from_decisions

    prof = profile(model, idx)
    print("profile saved MiB per block", [round(b.total_saved_bytes / 2**20, 1) for b in prof.blocks],
          sorted((round(s / 2**20, 1) for s in prof.blocks[0].saved_sizes), reverse=True))
    # as a plan applies it: block 0 kept, block 1 kept with a quarter offloaded (the engine and its regions on)
    d = Decisions(options=(Option(), Option("none", 0.25)), offload_blocks=(False, False))
    plan = plan_from_decisions(prof, d, 80 << 30)
    model, _ = apply(model, plan, torch.optim.AdamW, lr=1e-4)
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    import memory_peak

    blocks = list(model.blocks)
    before, deltas = [], []
    hs = [b.register_forward_pre_hook(lambda m, a: before.append(torch.cuda.memory_allocated())) for b in blocks]
    def after(m, a, o):
        deltas.append((torch.cuda.memory_allocated() - before.pop()) / 2**20)

    hs += [b.register_forward_hook(after) for b in blocks]
    for _ in range(2):  # the second pass: the engine's pool exists
        deltas.clear()
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        torch.cuda.memory._record_memory_history(max_entries=100000, stacks="python")
        with torch.autocast("cuda", dtype=torch.bfloat16):
            h = model.hidden_states(idx)
        torch.cuda.synchronize()
        snap = torch.cuda.memory._snapshot()
        torch.cuda.memory._record_memory_history(enabled=None)
        print("applied: block deltas MiB", [round(x, 1) for x in deltas])
        h.float().sum().backward()
        del h
    print(memory_peak.summarize(snap, base, top=20))


if __name__ == "__main__":
    main()
