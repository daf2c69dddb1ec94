#!/usr/bin/env bash
# The open fault of fit(compile=True) on a Hugging Face Llama (BENCHMARKS.md, twentieth and twenty-first sessions),
# bisected in one device call: fit's own plan applied in a fresh process after what fit does first (its profiles), with
# and without the compiler's caches cleared; fit with expandable segments on from the start (so that no profile
# switches the allocator setting at run time); fit with the compiler's recompilations logged; and the three counts of
# what a compiled block saves (compiled_saved.py). Each run is bounded; a table of outcomes ends the output.
#
#   export PYTHONPATH=$PWD; OUT=$OUT bash benchmarks/hf_fault_bisect.sh
set -u
OUT=${OUT:-/tmp/hf_fault}
PLAN=${PLAN:-benchmarks/results/2026-11-28-s21/call4/plans/hf-llama-16GiB-compile.toml}
mkdir -p "$OUT"
T=${TINY:+--tiny}  # TINY=1: the same runs at a size for CPU (a check of the script)
FIT=(python3 benchmarks/hf_fit.py --arch llama --budgets ${BUDGET:-16GiB} --no-plain --steps 3 --warmup 1 --compile $T)
declare -a names results
run() {  # name, seconds, command...
  local name=$1 secs=$2; shift 2
  timeout "$secs" "$@" > "$OUT/$name.log" 2>&1
  local rc=$?
  local what
  if grep -q "illegal memory access" "$OUT/$name.log"; then what="illegal memory access"
  elif [ $rc -eq 124 ]; then what="timed out after ${secs}s"
  elif [ $rc -ne 0 ]; then what="rc $rc: $(grep -E 'Error|error' "$OUT/$name.log" | tail -1 | cut -c1-120)"
  elif grep -q "rc [0-9]" "$OUT/$name.log"; then what="a case failed: $(grep '^| ' "$OUT/$name.log" | tail -1 | cut -c1-160)"
  else what="trains"; fi
  names+=("$name"); results+=("$what")
  echo "== $name: $what" >&2
}
run plan-after-fit-profiles 150 python3 benchmarks/hf_compiled_policies.py --plan "$PLAN" --cases as-is --profile-first fit $T
run plan-after-fit-profiles-reset 150 python3 benchmarks/hf_compiled_policies.py --plan "$PLAN" --cases as-is \
  --profile-first fit --dynamo-reset $T
run fit-expandable-from-start 130 env PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True "${FIT[@]}"
run fit-recompiles-logged 130 env TORCH_LOGS=recompiles "${FIT[@]}"
run compiled-saved 60 python3 benchmarks/compiled_saved.py
echo "| run | outcome |"
echo "|---|---|"
for i in "${!names[@]}"; do echo "| ${names[$i]} | ${results[$i]} |"; done
grep -c "Recompiling function" "$OUT/fit-recompiles-logged.log" | sed 's/^/recompilations logged in fit: /'
grep -h "recompile_limit\|cache_size_limit" "$OUT"/*.log | head -3
