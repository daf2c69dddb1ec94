"""The cost model replayed on CPU against measured bench rows: each row's plan priced again from the measured
profiles its call kept, beside what the row measured. For changing the cost model without a GPU.

    python3 benchmarks/replay_plans.py PROFILES_DIR rows.jsonl [more.jsonl ...]

``PROFILES_DIR`` holds the profiles a ``planner_checks.sh`` call kept (``ELBOWROOM_BENCH_PROFILES``):
``<workload>-<precision>-0.json`` (the model as given) and ``-1.json`` (its bf16 copy). A row's plan is priced on
the bf16 copy's measurements when its weights are bf16 (as ``fit`` does), else on the first. Prints, per row, the
measured step and the GPU's share of it (``gpu_ms``), the recorded prediction, the replayed one and its terms.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from elbowroom.plan import Plan  # noqa: E402
from elbowroom.plan.search import with_bf16_measurements  # noqa: E402
from elbowroom.plan.types import profile_from_dict  # noqa: E402


def replay(profiles: Path, row: dict) -> Plan | None:
    """The row's plan priced again on its call's profiles (None: no plan, or no profile kept)."""
    plan_dict = row.get("settings", {}).get("mechanism", {}).get("plan")
    if not plan_dict:
        return None
    precision = "bf16" if row["mode"].startswith("fit_bf16") else "fp32"
    base = profiles / f"{row['workload']}-{precision}-0.json"
    if not base.exists():
        return None
    prof = profile_from_dict(json.loads(base.read_text()))
    copy = profiles / f"{row['workload']}-{precision}-1.json"
    if plan_dict.get("weight_dtype") == "bfloat16" and copy.exists():
        prof = with_bf16_measurements(prof, profile_from_dict(json.loads(copy.read_text())))
    return Plan.from_dict(plan_dict).repredicted(prof)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("profiles", type=Path)
    ap.add_argument("rows", nargs="+")
    args = ap.parse_args()
    print("| workload | mode | step s | GPU ms (micro-batches, step) | host wait s | recorded pred | replayed pred | "
          "replayed / measured | terms (ms) |")
    print("|---|---|---|---|---|---|---|---|---|")
    for path in args.rows:
        for line in Path(path).read_text().splitlines():
            row = json.loads(line)
            plan = replay(args.profiles, row)
            if plan is None or "step_s" not in row:
                continue
            terms = ", ".join(f"{k} {v * 1e3:.0f}" for k, v in plan.time.items() if v)
            print(f"| {row['workload']} | {row['mode']} | {row['step_s']:.3f} | {row.get('gpu_ms')} | "
                  f"{row.get('host_wait_s')} | {row['pred_step_s']:.3f} | {plan.predicted_step_seconds:.3f} | "
                  f"{plan.predicted_step_seconds / row['step_s']:.2f} | {terms} |")


if __name__ == "__main__":
    main()
