#!/usr/bin/env bash
# The planner's checks on one GPU in one device call (~8 min on an H100): the GPU tests of the profile, the W1
# frontier and GPT-2-XL with the allocator capped at each budget (+cap: as on a card of that size), and the
# predicted-against-measured picture of those rows. Rows, logs and the picture go under ${OUT:-runs/planner-checks}.
#
#   bash benchmarks/planner_checks.sh
#   PARTS="2" bash benchmarks/planner_checks.sh      # only the W1 frontier
set -u
PARTS=${PARTS:-1 2 3}
part() { [[ " $PARTS " == *" $1 "* ]]; }
OUT=${OUT:-runs/planner-checks}
mkdir -p "$OUT"
export PYTHONPATH=${PYTHONPATH:-$PWD} PYTHONUNBUFFERED=1
BENCH="python3 benchmarks/bench.py --steps 6 --warmup 2"
# 1. the profile on CUDA: the expandable-segments margin measured where torch has no getter (2.11), and the rest
if part 1; then
  timeout 240 python3 -m pytest -q tests/test_plan_profile.py -k cuda 2>&1 | tail -5 | tee "$OUT/gpu-tests.log"
fi
# 2. W1 at 24, 16 and 8 GiB against plain, capped at the budget
if part 2; then
  timeout 330 $BENCH --workload w1 --json "$OUT/w1.jsonl" \
    --modes plain,fit_bf16@24GiB+cap+fl,fit_bf16@16GiB+cap+fl,fit_bf16@8GiB+cap+fl 2>&1 | grep "^|" | tee "$OUT/w1.log"
fi
# 3. GPT-2-XL at 24 GiB, capped
if part 3; then
  timeout 150 $BENCH --workload gpt2-xl --json "$OUT/gpt2xl.jsonl" --modes plain,fit_bf16@24GiB+cap 2>&1 \
    | grep "^|" | tee "$OUT/gpt2xl.log"
fi
rows=$(ls "$OUT"/*.jsonl 2>/dev/null)
if [ -n "$rows" ]; then
  python3 benchmarks/plot_predictions.py "$OUT/predicted-vs-measured.png" $rows | tee "$OUT/predictions.md"
fi
