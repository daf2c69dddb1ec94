#!/usr/bin/env bash
# The planner's checks on one GPU in one device call (~8 min on an H100): the GPU tests of the profile, the W1
# frontier and GPT-2-XL with the allocator capped at each budget (+cap: as on a card of that size), and the
# predicted-against-measured picture of those rows. Rows, the picture and one archive of logs and measured profiles
# go under ${OUT:-runs/planner-checks}.
#
#   bash benchmarks/planner_checks.sh
#   PARTS="2" bash benchmarks/planner_checks.sh      # only the W1 frontier
#   PARTS="3 2" bash benchmarks/planner_checks.sh    # GPT-2-XL, then W1 (the parts run in the order given)
#   TRACE="3" bash benchmarks/planner_checks.sh      # and a profiler trace of the last step of part 3's rows
#   PARTS="4 5 6" bash benchmarks/planner_checks.sh  # W2, then the 7B shape at one and at eight sequences a step
#   PARTS="7" bash benchmarks/planner_checks.sh      # the W1 frontier with the blocks compiled (plans priced so)
#   PEERS=1 PARTS=2 bash benchmarks/planner_checks.sh  # the W1 frontier with the peers beside it (torch checkpoint,
#                                                      # torchao's CPU offload when importable, FSDP2's CPU offload)
set -u
PARTS=${PARTS:-1 2 3}
TRACE=${TRACE:-}
PEERS=${PEERS:-0}
OUT=${OUT:-runs/planner-checks}
mkdir -p "$OUT/logs"
export PYTHONPATH=${PYTHONPATH:-$PWD} PYTHONUNBUFFERED=1
# the GPU time of each micro-batch and of the optimizer step in every row (gpu_ms), and the measured profiles kept
# (one per workload and precision, shared by its rows) so that the cost model can be replayed on CPU against the rows
export ELBOWROOM_BENCH_EVENTS=1 ELBOWROOM_BENCH_PROFILES="$OUT/logs/profiles"
BENCH="python3 benchmarks/bench.py --steps 6 --warmup 2"
for part in $PARTS; do
  if [[ " $TRACE " == *" $part "* ]]; then export ELBOWROOM_BENCH_TRACE="$OUT/logs/traces"; else unset ELBOWROOM_BENCH_TRACE; fi
  case $part in
    1)  # the profile on CUDA: the expandable-segments margin measured where torch has no getter (2.11), and the rest
      # and the device masters' step (chunked and batched) bitwise against torch's AdamW
      timeout 240 python3 -m pytest -q tests/test_plan_profile.py tests/test_optim_offload_gpu.py -k "cuda or master" \
        2>&1 | tail -5 | tee "$OUT/logs/gpu-tests.log" ;;
    2)  # W1 at 24, 16 and 8 GiB against plain, capped at the budget; with PEERS=1 the best peer of each budget
      peers=""
      if [ "$PEERS" = 1 ]; then
        peers=",torch_ckpt+fl,fsdp2_cpu_offload+ckpt"
        python3 -c "import torchao.optim" 2>/dev/null && peers="$peers,torchao_optim+ckpt"
      fi
      timeout 480 $BENCH --workload w1 --json "$OUT/w1.jsonl" \
        --modes plain,fit_bf16@24GiB+cap+fl,fit_bf16@16GiB+cap+fl,fit_bf16@8GiB+cap+fl$peers 2>&1 \
        | tee "$OUT/logs/w1.log" | grep "^|" ;;
    3)  # GPT-2-XL: room for everything (the compute and optimizer terms alone), then 24 and 16 GiB capped
      timeout 300 $BENCH --workload gpt2-xl --json "$OUT/gpt2xl.jsonl" \
        --modes plain,fit_bf16@60GiB,fit_bf16@24GiB+cap,fit_bf16@16GiB+cap 2>&1 \
        | tee "$OUT/logs/gpt2xl.log" | grep "^|" ;;
    4)  # W2 (the 8B-like shape at 8k tokens) at 24, 16 and 12 GiB; plain does not fit the card
      timeout 330 $BENCH --workload w2 --json "$OUT/w2.jsonl" \
        --modes fit_bf16@24GiB+cap+fl,fit_bf16@16GiB+cap+fl,fit_bf16@12GiB+cap+fl 2>&1 \
        | tee "$OUT/logs/w2.log" | grep "^|" ;;
    5)  # the 7B shape at one sequence a step: 76 and 48 GiB, and 76 GiB within 32 GiB of host memory
      timeout 420 $BENCH --workload w3 --json "$OUT/w3.jsonl" \
        --modes fit_bf16@76GiB+cap+fl,fit_bf16@76GiB+cap+fl+host=32GiB,fit_bf16@48GiB+cap+fl 2>&1 \
        | tee "$OUT/logs/w3.log" | grep "^|" ;;
    6)  # the 7B shape at eight sequences a step (accumulation 8), three timed steps (the last --steps counts)
      timeout 300 $BENCH --steps 3 --workload w3-accum8 --json "$OUT/w3-accum8.jsonl" \
        --modes fit_bf16@76GiB+cap+fl 2>&1 | tee "$OUT/logs/w3-accum8.log" | grep "^|" ;;
    7)  # W1 at 24, 16 and 8 GiB with the blocks compiled, each plan priced on them compiled (fit(compile=True)),
      # against plain (eager: the frontier's reference) and the eager plans' rows of part 2
      timeout 560 $BENCH --workload w1 --json "$OUT/w1-compiled.jsonl" \
        --modes plain,fit_bf16@24GiB+cap+fl+compile,fit_bf16@16GiB+cap+fl+compile,fit_bf16@8GiB+cap+fl+compile 2>&1 \
        | tee "$OUT/logs/w1-compiled.log" | grep "^|" ;;
    *) echo "planner_checks: no part $part (1 to 7)" >&2; exit 2 ;;
  esac
done
rows=$(ls "$OUT"/*.jsonl 2>/dev/null)
if [ -n "$rows" ]; then
  python3 benchmarks/plot_predictions.py "$OUT/predicted-vs-measured.png" $rows | tee "$OUT/predictions.md"
fi
tar -czf "$OUT/logs.tar.gz" -C "$OUT" logs && rm -rf "$OUT/logs"
