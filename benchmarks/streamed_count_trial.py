"""Plans made again from a bench call's saved profiles with a streamed parameter's device bytes counted otherwise,
to run with ``plan@FILE+cap`` on the GPU: a trial of the cost model's count, not a mechanism.

The cost model counts a streamed parameter's weight, its gradient, and the gradient's bytes once more
(``elbowroom.plan.streaming.device_bytes_per_param``: 6 bytes a parameter in bf16). Over the recorded rows the
streamed plans' allocated peaks came in 5-28% under their predictions on W1 and W2 (``BENCHMARKS.md``, twentieth
session, section 7), and at W1's 8 GiB that count is what keeps the planner from streaming at all. Replayed over the
twenty-first session's W1 profiles (call 4), counting the weight alone changes the 8 GiB plan from 23 blocks stepped
on the host (0.621 s predicted; 0.70-0.75 s measured on a slow host) to 11 on the host and 13 streamed (0.498 s).
Whether that plan holds 8 GiB on the GPU, and how fast it runs, is what the trial measures:

    python3 benchmarks/streamed_count_trial.py --profiles benchmarks/results/2026-11-28-s21/call4/profiles \\
      --budget 8GiB --count weight-only --out $OUT/w1-8GiB-weight-only.toml
    python3 benchmarks/bench.py --workload w1 --steps 10 --warmup 3 \\
      --modes plain,plan@$OUT/w1-8GiB-weight-only.toml+cap+compile,fit_bf16@8GiB+cap+fl+compile

(These profiles ran their blocks compiled, so the plan runs them compiled, ``+compile``, beside ``fit``'s own
compiled 8 GiB row.) Counts: ``now`` (the cost model's), ``grad-once`` (weight and gradient),
``weight-only``.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import Counter
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

COUNTS = {"now": None, "grad-once": 2, "weight-only": 1}  # multiples of the offloaded dtype's item size


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--profiles", required=True, help="a bench call's ELBOWROOM_BENCH_PROFILES folder")
    ap.add_argument("--workload", default="w1")
    ap.add_argument("--precision", default="bf16-compiled", help="the profiles' name between workload and index")
    ap.add_argument("--budget", required=True)
    ap.add_argument("--count", choices=sorted(COUNTS), default="weight-only")
    ap.add_argument("--out", required=True, help="the plan file to write (.toml or .json)")
    args = ap.parse_args()

    from elbowroom.plan import parse_budget, plan_for, streaming
    from elbowroom.plan.types import profile_from_dict

    folder = Path(args.profiles)
    prof, bf16 = (profile_from_dict(json.loads((folder / f"{args.workload}-{args.precision}-{i}.json").read_text()))
                  for i in (0, 1))
    times = COUNTS[args.count]
    if times is not None:
        streaming.device_bytes_per_param = lambda dtype: (4 if dtype == "float32" else 2) * times
    # as the bench's fit_bf16 rows plan: bf16 allowed, the fused loss, no clipping, gradients may leave in backward
    plan = plan_for(prof, parse_budget(args.budget), precision="bf16", fused_loss_allowed=True, grad_clipping=False,
                    gradient_offload_allowed=True, bf16_bytes=bf16)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    plan.save(args.out)
    blocks = dict(Counter(b.policy_label for b in plan.blocks))
    print(f"{args.count}: predicted {plan.predicted_step_seconds:.4f} s, {plan.predicted_peak_bytes / 2**30:.2f} GiB; "
          f"{len(plan.optimizer_offload_blocks)} blocks on the host, {len(plan.optimizer_stream_blocks)} streamed; "
          f"{blocks} -> {args.out}")


if __name__ == "__main__":
    main()
