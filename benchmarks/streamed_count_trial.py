"""Plans made again from a bench call's saved profiles with a streamed parameter's device bytes counted otherwise,
to run with ``plan@FILE+cap`` on the GPU: a trial of the cost model's count, not a mechanism.

Since the twenty-fourth session the cost model counts a streamed parameter's weight in every phase and its gradient
in the phases that hold it (``elbowroom.plan.cost.streamed_gradient_bytes``); ``--count now`` is that. The other
counts replace the weight's bytes by ``times`` items in every phase and leave the gradients' phases as they are
(the history below is what they were for).

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

    python3 benchmarks/streamed_count_trial.py --check-rows benchmarks/results --count weight-only

checks a count against every recorded streamed row whose call kept its profiles: counting the weight alone would
put 17 of the 19 rows' reserved peaks above their predictions (W2 at 12 GiB by 24%, the 7B shape at 48 GiB by
14-16%), and the weight and gradient once 10. Only W1's two rows stay under (0.92-0.95). So the count cannot simply
be lowered: the trial says whether W1 holds 8 GiB with it.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import Counter
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

COUNTS = {"now": None, "grad-once": 2, "weight-only": 1}  # multiples of the offloaded dtype's item size


_OWN_COUNT: Any = None  # the cost model's own streaming.device_bytes_per_param, kept when first replaced


def _count(times: int | None) -> None:
    """Make the cost model count ``times`` items of the offloaded dtype per streamed parameter (None: its own)."""
    global _OWN_COUNT
    from elbowroom.plan import cost, search, streaming

    if _OWN_COUNT is None:
        _OWN_COUNT = streaming.device_bytes_per_param
    streaming.device_bytes_per_param = (_OWN_COUNT if times is None
                                        else lambda dtype: (4 if dtype == "float32" else 2) * times)
    for mod in (search, cost, streaming):  # (memoised prices would keep the old count)
        for name in dir(mod):
            clear = getattr(getattr(mod, name), "cache_clear", None)
            if clear is not None:
                clear()


def check_rows(results: Path, times: int) -> None:
    """Every recorded bench row whose plan streams and whose call kept its profiles: its reserved peak against its
    plan's peak priced again (``Plan.repredicted``) with the cost model's count and with ``times`` items."""
    import re

    from elbowroom.plan import Plan
    from elbowroom.plan.search import with_bf16_measurements
    from elbowroom.plan.types import profile_from_dict

    def load(path: Path) -> Any:
        return profile_from_dict(json.loads(path.read_text()))

    print(f"| rows | streamed blocks | allocated GiB / predicted now | reserved GiB | predicted now | "
          f"predicted at {times} items | reserved / that |")
    print("|---|---|---|---|---|---|---|")
    over = n = alloc_over = 0
    for jf in sorted(results.glob("**/*.jsonl")):
        if jf.parent.name.startswith("call") and (jf.parent / "profiles").is_dir():
            folder, prefix = jf.parent / "profiles", ""  # a call's folder: rows and profiles side by side
        elif (m := re.match(r"(call\d+)-", jf.name)) and (jf.parent / "profiles").is_dir():
            folder, prefix = jf.parent / "profiles", m.group(1) + "-"
        else:
            continue
        for line in jf.read_text().splitlines():
            row = json.loads(line)
            plan_dict = ((row.get("settings") or {}).get("mechanism") or {}).get("plan")
            plan = Plan.from_dict(plan_dict) if plan_dict else None
            if plan is None or "reserved_peak_GiB" not in row or not plan.optimizer_stream_blocks:
                continue
            name = (f"{prefix}{row['workload']}-{'bf16' if row['mode'].startswith('fit_bf16') else 'fp32'}"
                    f"{'-compiled' if '+compile' in row['mode'] else ''}")
            if not (folder / f"{name}-0.json").exists():
                continue
            prof = load(folder / f"{name}-0.json")
            if plan.weight_dtype == "bfloat16" and (folder / f"{name}-1.json").exists():
                prof = with_bf16_measurements(prof, load(folder / f"{name}-1.json"))
            peaks, allocated = [], 0.0
            for t in (None, times):
                _count(t)
                again = plan.repredicted(prof)
                peaks.append(again.predicted_peak_bytes / 2**30)
                if t is None:  # the allocated part: the prediction less the allocator's margin
                    allocated = peaks[0] - again.memory.get("allocator margin", 0) / 2**30
            _count(None)
            ratio = row["reserved_peak_GiB"] / peaks[1]
            n, over, alloc_over = n + 1, over + (ratio > 1), alloc_over + (row["peak_GiB"] > allocated)
            print(f"| {jf.relative_to(results)} {row['mode']} | {len(plan.optimizer_stream_blocks)} | "
                  f"{row['peak_GiB']} / {allocated:.2f} | {row['reserved_peak_GiB']} | {peaks[0]:.2f} | "
                  f"{peaks[1]:.2f} | {ratio:.3f} |")
    print(f"\n{n} rows; {alloc_over} allocated peaks above the cost model's allocated part; {over} reserved peaks "
          f"above their prediction at {times} items a streamed parameter")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--check-rows", default=None, metavar="RESULTS",
                    help="instead of a plan: every recorded streamed row under RESULTS (benchmarks/results) against "
                         "its plan priced again with --count")
    ap.add_argument("--profiles", help="a bench call's ELBOWROOM_BENCH_PROFILES folder")
    ap.add_argument("--workload", default="w1")
    ap.add_argument("--precision", default="bf16-compiled", help="the profiles' name between workload and index")
    ap.add_argument("--budget")
    ap.add_argument("--count", choices=sorted(COUNTS), default="weight-only")
    ap.add_argument("--out", help="the plan file to write (.toml or .json)")
    args = ap.parse_args()
    if args.check_rows:
        check_rows(Path(args.check_rows), COUNTS[args.count] or 3)
        return
    if not (args.profiles and args.budget and args.out):
        ap.error("a plan needs --profiles, --budget and --out (or pass --check-rows)")

    from elbowroom.plan import parse_budget, plan_for
    from elbowroom.plan.types import profile_from_dict

    folder = Path(args.profiles)
    prof, bf16 = (profile_from_dict(json.loads((folder / f"{args.workload}-{args.precision}-{i}.json").read_text()))
                  for i in (0, 1))
    _count(COUNTS[args.count])
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
