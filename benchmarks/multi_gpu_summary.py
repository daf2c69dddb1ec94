"""Summarise the runs of ``benchmarks/multi_gpu.sh``: median tokens/s after warm-up, peak GiB per GPU, last loss,
bytes on the wire per step, one Markdown row per run (the single-GPU rows first, for the N x ratios)."""

from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path


def main(out: str) -> None:
    rows = []
    for run in sorted(p for p in Path(out).iterdir() if (p / "metrics.jsonl").is_file()):
        ms = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines() if x.strip()]
        steps = [m for m in ms if "tokens_per_s" in m]
        tail = steps[len(steps) // 3:] or steps  # after warm-up
        rows.append((run.name, statistics.median(m["tokens_per_s"] for m in tail) if tail else 0.0,
                     max((m.get("peak_memory_bytes") or 0) for m in steps) / 2**30 if steps else 0.0,
                     max((m.get("peak_reserved_bytes") or 0) for m in steps) / 2**30 if steps else 0.0,
                     steps[-1]["loss"] if steps else float("nan"),
                     steps[-1].get("comm_bytes_per_step") if steps else None))
    single = {name: tps for name, tps, *_ in rows if name.startswith("single")}
    base = single.get("single-plain")
    print("| run | tokens/s | per GPU vs single plain | peak GiB/GPU (alloc / reserved) | last loss | "
          "bytes on the wire/step |")
    print("|---|---|---|---|---|---|")
    for name, tps, peak, reserved, loss, comm in rows:
        ratio = f"{tps / base:.2f}x" if base else ""
        print(f"| {name} | {tps:,.0f} | {ratio} | {peak:.2f} / {reserved:.2f} | {loss:.4f} | {comm or ''} |")


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "runs/multi-gpu")
