#!/usr/bin/env bash
# The fault of fit(compile=True) on a Hugging Face Llama (BENCHMARKS.md, twentieth and twenty-first sessions),
# bisected in one device call. Found in the twenty-second session: the planned run reused the compiled code its
# profiles left behind (the same plan faulted after them and trained once the compiler's caches were cleared); a
# compiled profile now ends with torch.compiler.reset(), so the variants below that clear nothing no longer
# reproduce it. The runs, the most telling first: fit with expandable segments on from the start (so that no
# profile switches the allocator setting at run time); fit with the compiler's caches cleared between its profiles
# and apply (so that the planned run compiles its own graphs, as a fresh process does); fit's own plan applied in a fresh process after what fit does
# first (its profiles), with and without the compiler's caches cleared; the three counts of what a compiled block
# saves (compiled_saved.py); fit with the compiler's recompilations logged; fit under PyTorch's CUDA stream sanitizer.
# (The outcome reads the CUDA error itself, not the words: fit's own warning names the fault.) Each run is bounded, and runs that would pass DEADLINE are skipped; a table of outcomes ends the output.
#
#   export PYTHONPATH=$PWD; OUT=$OUT bash benchmarks/hf_fault_bisect.sh
#   export PYTHONPATH=$PWD; OUT=$OUT ONLY="fit-recompiles-logged fit-stream-sanitizer" bash benchmarks/hf_fault_bisect.sh
set -u
OUT=${OUT:-/tmp/hf_fault}
PLAN=${PLAN:-benchmarks/results/2026-11-28-s21/call4/plans/hf-llama-16GiB-compile.toml}
mkdir -p "$OUT"
T=${TINY:+--tiny}  # TINY=1: the same runs at a size for CPU (a check of the script)
FIT=(python3 benchmarks/hf_fit.py --arch llama --budgets ${BUDGET:-16GiB} --no-plain --steps 3 --warmup 1 --compile $T)
declare -a names results
DEADLINE=${DEADLINE:-560}  # seconds from the start: a run that could end after it is skipped (a device call has 600)
START=$SECONDS
run() {  # name, seconds, command...
  local name=$1 secs=$2; shift 2
  if [ -n "${ONLY:-}" ] && [[ " $ONLY " != *" $name "* ]]; then return; fi
  if (( SECONDS - START + secs > DEADLINE )); then
    names+=("$name"); results+=("skipped: ${secs}s would pass DEADLINE=${DEADLINE}s"); return
  fi
  timeout "$secs" "$@" > "$OUT/$name.log" 2>&1
  local rc=$?
  local what
  if grep -q "CUDA error: an illegal memory access" "$OUT/$name.log"; then what="illegal memory access"
  elif [ $rc -eq 124 ]; then what="timed out after ${secs}s"
  elif [ $rc -ne 0 ]; then what="rc $rc: $(grep -E 'Error|error' "$OUT/$name.log" | tail -1 | cut -c1-120)"
  elif grep -q "rc [0-9]" "$OUT/$name.log"; then what="a case failed: $(grep '^| ' "$OUT/$name.log" | tail -1 | cut -c1-160)"
  else what="trains"; fi
  names+=("$name"); results+=("$what")
  echo "== $name: $what" >&2
}
run fit-expandable-from-start 130 env PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True "${FIT[@]}"
run fit-dynamo-reset 130 "${FIT[@]}" --dynamo-reset
run plan-after-fit-profiles 150 python3 benchmarks/hf_compiled_policies.py --plan "$PLAN" --cases as-is --profile-first fit $T
run plan-after-fit-profiles-reset 150 python3 benchmarks/hf_compiled_policies.py --plan "$PLAN" --cases as-is \
  --profile-first fit --dynamo-reset $T
run compiled-saved 60 python3 benchmarks/compiled_saved.py
run fit-recompiles-logged 130 env TORCH_LOGS=recompiles "${FIT[@]}"
# PyTorch's CUDA stream sanitizer: unsynchronised use of one tensor on two streams, by aten ops (not Triton kernels)
[ -z "${TINY:-}" ] && run fit-stream-sanitizer 150 env TORCH_CUDA_SANITIZER=1 "${FIT[@]}"
echo "| run | outcome |"
echo "|---|---|"
for i in "${!names[@]}"; do echo "| ${names[$i]} | ${results[$i]} |"; done
for i in "${!names[@]}"; do
  if [ "${names[$i]}" = fit-recompiles-logged ] && [[ "${results[$i]}" != skipped* ]]; then
    echo "recompilations logged in fit: $(grep -c 'Recompiling function' "$OUT/fit-recompiles-logged.log")"
    grep -h "recompile_limit\|cache_size_limit" "$OUT/fit-recompiles-logged.log" | head -3
  fi
done
