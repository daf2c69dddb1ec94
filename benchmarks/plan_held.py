"""What the compiled blocks of a planned model hold for backward, tensor by tensor: a plan file applied as the
bench's ``plan@FILE+compile`` row applies it, one warm step, then a forward whose autograd graph is walked. Each
compiled node's saved tensors are listed by shape and dtype, marked ``param`` when they share a parameter's
storage and ``own`` when the graph made them; the parameters' dtypes are counted first.

    python3 benchmarks/plan_held.py PLAN.toml [--workload w1] [--norpw] [--top 12]

It answers "what are the weight-sized allocations a memory snapshot shows in compiled code".
"""

from __future__ import annotations

import argparse
import collections
import sys
from pathlib import Path
from types import SimpleNamespace

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import modes_plan  # noqa: E402
from compiled_saved import compiled_saved, saved_rows  # noqa: E402

from elbowroom.models import ModelConfig, build_model  # noqa: E402
from elbowroom.models.workloads import WORKLOADS  # noqa: E402
from elbowroom.ops.linear_cross_entropy import linear_cross_entropy  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("plan")
    ap.add_argument("--workload", default="w1")
    ap.add_argument("--norpw", action="store_true", help="the partitioner's defaults (+compile+norpw)")
    ap.add_argument("--top", type=int, default=12)
    a = ap.parse_args()
    w = WORKLOADS[a.workload]
    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    torch.manual_seed(0)
    cfg = ModelConfig.from_preset(w.preset, max_seq_len=max(w.seq_len, ModelConfig.from_preset(w.preset).max_seq_len))
    model = build_model(cfg, device=dev)
    idx = torch.randint(0, cfg.vocab_size, (w.batch_size, w.seq_len), device=dev)
    tgt = torch.randint(0, cfg.vocab_size, (w.batch_size, w.seq_len), device=dev)
    flags = "+cap+compile" + ("+norpw" if a.norpw else "")
    args = SimpleNamespace(sample=(idx, tgt), fused_loss=True, step_accum=1)
    setup = modes_plan.resolve(f"plan@{a.plan}{flags}")(model, args)
    opt = setup.optimizer
    print("parameters by dtype:", dict(collections.Counter(str(p.dtype)[6:] for p in model.parameters())))
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    MiB = 2**20
    for step in range(2):
        with torch.autocast(dev.type, dtype=torch.bfloat16), setup.context():
            h = model.hidden_states(idx)
            if hasattr(opt, "wait_for"):
                opt.wait_for(model.output.weight)
            loss = linear_cross_entropy(h, model.output.weight, tgt)
        if step == 1:
            for n, saved in enumerate(compiled_saved(loss)):
                rows = saved_rows(saved, params)
                own = sum(r[0] for r in rows if r[3] == "own")
                print(f"compiled node {n}: {len(rows)} saved, {own:.1f} MiB of its own")
                print("   " + "; ".join(f"{mb:.1f} MiB {shape} {dt} {kind}" for mb, shape, dt, kind in rows[:a.top]))
            if dev.type == "cuda":
                print(f"allocated after the forward: {torch.cuda.memory_allocated() / MiB:.0f} MiB")
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    if hasattr(opt, "close"):
        opt.close()


if __name__ == "__main__":
    main()
