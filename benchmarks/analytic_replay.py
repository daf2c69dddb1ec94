"""Measured bench rows priced again on the analytic profile (the device table, no GPU): each row's plan repredicted
on the same shape traced on meta, its blocks priced eager and priced compiled with pointwise recompute (what
planned runs compile with), beside what the row measured. Issue 13 asks the analytic profile's predictions to be
within 20% of the measured ones; this is how a compiled row is checked on CPU.

    python3 benchmarks/analytic_replay.py benchmarks/results/2026-11-29-s22/call5/w1-frontier.log [more ...]

Reads the JSON rows of ``bench.py`` (its log or its ``--json`` file). A plan with bf16 weights is priced on a bf16
meta trace's bytes, as ``fit`` prices that layout from an analytic profile. Ratios are predicted over measured: the
step over the row's ``step_s``, the peak over its reserved peak (the prediction counts the allocator's margin).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from elbowroom.models import ModelConfig, build_model  # noqa: E402
from elbowroom.plan import Plan, get_device, profile  # noqa: E402
from elbowroom.plan.fit import planned_compile_options  # noqa: E402
from elbowroom.plan.search import with_bytes_of  # noqa: E402


def rows_of(paths: list[str]) -> list[dict[str, Any]]:
    """The planned rows (a plan and a measured step) in these logs or JSONL files."""
    out = []
    for path in paths:
        for line in Path(path).read_text().splitlines():
            if line.startswith('{"workload"'):
                row = json.loads(line)
                if row.get("step_s") and row.get("settings", {}).get("mechanism", {}).get("plan"):
                    out.append(row)
    return out


def analytic_profiles(row: dict[str, Any]) -> dict[str, Any]:
    """The analytic profiles of the row's shape on its device's table: eager and compiled, each with the bf16
    layout's bytes beside it."""
    w = row["settings"]["workload"]
    meta = build_model(ModelConfig.from_preset(w["preset"]), device="meta")
    ids = torch.zeros((w["batch_size"], w["seq_len"]), dtype=torch.long, device="meta")
    machine = get_device("h200" if "H200" in row["settings"].get("device", "") else "h100-80gb")
    out = {}
    for name, compiled in (("eager", False), ("compiled", planned_compile_options())):
        prof = profile(meta, ids, source="analytic", machine=machine, compiled=compiled)
        bf16 = profile(meta.to(torch.bfloat16), ids, source="analytic", machine=machine, dtype=torch.bfloat16,
                       compiled=compiled)
        out[name] = (prof, with_bytes_of(prof, bf16))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("rows", nargs="+", help="bench.py logs or JSONL files")
    args = ap.parse_args()
    cache: dict[tuple[str, str], dict[str, Any]] = {}
    print("| workload | mode | measured step s | reserved GiB | fit's prediction (step, peak) | analytic eager "
          "(step, peak) | analytic compiled (step, peak) |")
    print("|---|---|---|---|---|---|---|")
    for row in rows_of(args.rows):
        key = (row["workload"], row["settings"].get("device", ""))
        if key not in cache:
            cache[key] = analytic_profiles(row)
        plan = Plan.from_dict(row["settings"]["mechanism"]["plan"])
        reserved = row.get("reserved_peak_GiB")
        cells = []
        for name in ("eager", "compiled"):
            fp32, bf16 = cache[key][name]
            again = plan.repredicted(bf16 if plan.weight_dtype == "bfloat16" else fp32)
            step, peak = again.predicted_step_seconds, again.predicted_peak_bytes / 2**30
            ratio = f"{peak / reserved:.2f}x" if reserved else "-"  # (none measured on CPU)
            cells.append(f"{step:.3f} s, {peak:.2f} GiB ({step / row['step_s']:.2f}x, {ratio})")
        print(f"| {row['workload']} | {row['mode']} | {row['step_s']:.4f} | {reserved or '-'} | "
              f"{row['pred_step_s']:.4f} s ({row['step_s'] / row['pred_step_s']:.2f}x), {row['pred_peak_GiB']:.2f} "
              f"GiB | {cells[0]} | {cells[1]} |")


if __name__ == "__main__":
    main()
