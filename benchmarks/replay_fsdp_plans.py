"""FSDP2 plans that ran on a GPU, priced again on CPU by the per-rank memory model three ways, beside the peak each
measured: by the accounting before the eighteenth session (the root's units gathered all step, fp32-autocast
activation bytes), with the root's units gathered around the head alone, and with the activation bytes of the bf16
gathers (and no autocast casts or weight cache) too. The profile is the analytic one of the device table (no GPU
needed).

    python3 benchmarks/replay_fsdp_plans.py --shards 4 --device h200 --batch 4x4096 \\
        benchmarks/results/2026-11-28-s18/call4-fsdp-budget16 \\
        benchmarks/results/2026-11-28-s18/call4-fsdp-budget7.5-clip1.0

Each argument is a run's prefix: ``PREFIX.plan.toml`` and ``PREFIX.metrics.jsonl`` (its measured peak, allocated).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

from elbowroom.models import ModelConfig, build_model  # noqa: E402
from elbowroom.plan import Plan  # noqa: E402
from elbowroom.plan.devices import get_device  # noqa: E402
from elbowroom.plan.profiler import profile  # noqa: E402
from elbowroom.plan.ranks import as_fsdp_computes, per_rank_profile  # noqa: E402

G = 2**30


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("runs", nargs="+")
    ap.add_argument("--model", default="w1")
    ap.add_argument("--device", default="h200")
    ap.add_argument("--shards", type=int, default=4)
    ap.add_argument("--batch", default="4x4096")
    a = ap.parse_args()
    b, s = (int(x) for x in a.batch.split("x"))
    model = build_model(ModelConfig.from_preset(a.model, max_seq_len=s), device="meta")
    sample = torch.zeros((b, s), dtype=torch.long, device="meta")
    prof = profile(model, sample, source="analytic", machine=get_device(a.device, host_memory=0))
    bf16 = as_fsdp_computes(model, sample, prof, torch.bfloat16)
    ways = {"before": dataclasses.replace(per_rank_profile(prof, a.shards), gathered_in_compute_dtype=False),
            "root around the head": per_rank_profile(prof, a.shards, root_apart=1.0),
            "+ bf16 gathers": per_rank_profile(bf16, a.shards, root_apart=1.0)}
    print("| run | accounting | predicted GiB (no margin) | measured GiB | predicted / measured | terms (GiB) |")
    print("|---|---|---|---|---|---|")
    for prefix in a.runs:
        plan = Plan.load(f"{prefix}.plan.toml")
        rows = [json.loads(line) for line in open(f"{prefix}.metrics.jsonl")]
        measured = max(r.get("peak_memory_bytes", 0) for r in rows) / G
        for way, rank in ways.items():
            mem = plan.repredicted(rank).memory
            total = sum(v for k, v in mem.items() if k != "allocator margin") / G
            terms = ", ".join(f"{k} {v / G:.2f}" for k, v in mem.items() if k != "allocator margin")
            print(f"| {Path(prefix).name} | {way} | {total:.2f} | {measured:.2f} | {total / measured:.2f} | {terms} |")


if __name__ == "__main__":
    main()
