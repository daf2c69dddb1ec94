#!/usr/bin/env bash
# The trainer's W1 step at 24 GiB, clipped, with the recompute's checkpoint pinned reentrant or not, under DDP at
# world size 1 and in a plain process (one device call, ~6 min on an H100): where the DDP plan's backward time goes.
#   OUT=... RUNS="ddp-off-stack ddp-on single-off single-on" bash benchmarks/ddp_backward.sh
set -u
OUT=${OUT:-runs/ddp-backward}
RUNS=${RUNS:-ddp-off-stack ddp-on single-off single-on}
export PYTHONPATH=${PYTHONPATH:-$PWD} PYTHONUNBUFFERED=1
mkdir -p "$OUT"
BASE="train --config configs/w1.toml --steps 16 --train.eval_batches 0 --checkpoint.enabled false --logging.log_every 1
      --data.batch_size 4 --optimizer.param_dtype bfloat16 --budget 24GiB"
for run in $RUNS; do
  IFS=- read -r layout re stack <<< "$run"
  extra=""; [ "$layout" = ddp ] && extra="--parallel.data_parallel ddp"
  flags=""; prof=""
  if [ "${stack:-}" = stack ]; then flags="--stack"; fi
  [ "$layout" = ddp ] && prof="--profile.steps 12-13"
  dir=/tmp/ddp-backward/$run
  rm -rf "$dir"
  timeout 170 torchrun --nproc-per-node 1 benchmarks/trainer_variant.py --reentrant "$re" $flags -- $BASE $extra \
    --out "$dir" $prof > "$OUT/$run.log" 2>&1
  echo "$run rc $?"
  grep -E "predicted peak|step time|host step 0|W step" "$OUT/$run.log" | tail -7
  if [ -f "$dir/profile/trace.json" ]; then
    python3 benchmarks/trace_summary.py "$dir/profile/trace.json" > "$OUT/$run-trace-summary.txt" 2>&1
    [ "${stack:-}" = stack ] && python3 benchmarks/stack_summary.py "$dir/profile/trace.json" \
      AddBackward0 AccumulateGrad MmBackward0 > "$OUT/$run-stack-summary.txt" 2>&1
    head -30 "$OUT/$run-stack-summary.txt" 2>/dev/null
  fi
done
