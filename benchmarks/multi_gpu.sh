#!/usr/bin/env bash
# The multi-GPU set of the scaling issue in one device call on a host with N GPUs (2 or 4), each configuration in
# its own process group, single-GPU baselines on the same host. Logs and metrics go under ${OUT:-runs/multi-gpu}.
#
#   N=2 bash benchmarks/multi_gpu.sh          # on nvidia-h200-x2;  N=4 on nvidia-h200-x4
#   N=2 PARTS="1 2" DEADLINE=540 WORK=/tmp/mg bash benchmarks/multi_gpu.sh   # one device call (~4 min on 2 H200s)
#   N=2 PARTS="3 4" DEADLINE=555 ...; N=2 PARTS="5" ...                      # ~9 and ~5 min
#   N=2 PARTS="2 4 5" ONLY="ddp-budget24 fsdp-budget16 7b-tp2 ddp-hook-topk ddp-hook-int8" ...   # chosen runs
#
# A Hugging Face model in place of W1 (a config saved to a directory: TinyLlama-1.1B's shape in the nineteenth session):
#   W1_ARGS="--model.hf DIR --data.seq_len 4096 --train.dtype bf16 --optimizer.lr 3e-4 --scheduler.warmup_steps 10 \
#     --steps 30 --train.eval_batches 0 --checkpoint.enabled false --logging.log_every 1 --logging.progress false" \
#   SUFFIX=-hf N=4 PARTS="1 2 3" ONLY="single-plain fsdp fsdp-budget16 fsdp-budget7.5-clip1.0" bash benchmarks/multi_gpu.sh
#
# Rounds, for arms whose speed varies from run to run (the clipped host step: 0.30 to 0.56 s in one call), interleaved
# in one call: for r in 1 2; do SUFFIX=-r$r DEADLINE=270 ... bash benchmarks/multi_gpu.sh; done
#
# On a device call: DEADLINE keeps the call inside its limit (the runs that would not fit are listed in
# OUT/skipped.txt), WORK keeps the run directories out of OUT, which gets summary.md, nccl.txt and runs.tar.gz
# (logs and metrics, no traces). A warm machine keeps WORK between calls, so the summary covers them all.
#
# Parts 2 and 3 need N >= 2 (at N=1, --parallel.dp_shard 1 is one plain process; FSDP2 on one GPU is
# --parallel.data_parallel fsdp).
#
# What each step prints is read from the trainer's metrics.jsonl (tokens/s of all ranks, peak GiB per GPU); the
# per-step tokens/s after warm-up are summarised at the end by benchmarks/multi_gpu_summary.py.
set -u
N=${N:-2}
PARTS=${PARTS:-1 2 3 4 5}
part() { [[ " $PARTS " == *" $1 "* ]]; }
OUT=${OUT:-runs/multi-gpu}
# The runs' directories go under WORK; OUT gets the summary and one archive of logs and metrics (a device call
# returns a few files). DEADLINE (seconds from the start) skips the runs that would not finish in time, and says so.
WORK=${WORK:-$OUT/runs}
DEADLINE=${DEADLINE:-100000}
mkdir -p "$OUT" "$WORK"
export PYTHONPATH=${PYTHONPATH:-$PWD} NCCL_NVLS_ENABLE=${NCCL_NVLS_ENABLE:-0}
W1=${W1_ARGS:-"--config configs/w1.toml --steps 30 --train.eval_batches 0 --checkpoint.enabled false --logging.log_every 1 \
    --logging.progress false"}
START=$SECONDS
# The GPUs' SM clock and power every 250 ms while the runs go (read-only queries), summarised per run at the end:
# does a GPU that also runs NCCL clock lower?
nvidia-smi --query-gpu=timestamp,index,clocks.sm,power.draw,utilization.gpu --format=csv,noheader,nounits -lms 250 \
  > "$WORK/clocks.csv" 2>/dev/null &
CLOCKS_PID=$!
run() {  # name, nproc, args...
  local name=$1 nproc=$2; shift 2
  if [[ -n "${ONLY:-}" && " $ONLY " != *" $name "* ]]; then return; fi  # ONLY="name ...": these runs alone
  name=$name${SUFFIX:-}  # SUFFIX=-r2: a second round of the same runs beside the first (one WORK, one summary)
  local left=$((DEADLINE - (SECONDS - START)))
  if ((left < 45)); then echo "== $name skipped: ${left}s left of DEADLINE" | tee -a "$OUT/skipped.txt"; return; fi
  echo "== $name (nproc $nproc) at $((SECONDS - START))s"
  local t0; t0=$(date +%s.%N)
  # shellcheck disable=SC2086  # LAUNCH: how torchrun starts the trainer (a wrapper that binds it to CPUs, below)
  timeout $((left < 900 ? left : 900)) torchrun --nproc-per-node "$nproc" ${LAUNCH:--m elbowroom} train $W1 \
    --out "$WORK/$name" "$@" > "$WORK/$name.log" 2>&1
  echo "   rc=$? in $((SECONDS - START))s: $(tail -1 "$WORK/$name.log" | cut -c1-160)"
  echo "$name $nproc $t0 $(date +%s.%N)" >> "$WORK/times.txt"  # for the clocks below
}
# 1. the link, and single-GPU W1: plain and the planner at 24 GiB (per-GPU budgets below are the same)
if part 1; then
  if [[ -z "${ONLY:-}" || " $ONLY " == *" nccl "* ]]; then
    timeout 120 torchrun --nproc-per-node "$N" benchmarks/nccl_bandwidth.py 2>&1 | tee "$WORK/nccl.txt"
    for ctas in 8 2; do  # the link with as few CTAs as the ddp-ctas runs below give NCCL
      echo "NCCL_MAX_CTAS=$ctas" >> "$WORK/nccl.txt"
      NCCL_MAX_CTAS=$ctas timeout 60 torchrun --nproc-per-node "$N" benchmarks/nccl_bandwidth.py 2>&1 \
        | tee -a "$WORK/nccl.txt"
    done
  fi
  if [[ -z "${ONLY:-}" || " $ONLY " == *" numa "* ]]; then  # the host's NUMA nodes and each GPU's affinity
    { lscpu | grep -i -E "^(model name|socket|numa|core|thread)"; nvidia-smi topo -m; which numactl taskset; } > "$WORK/numa.txt" 2>&1
  fi
  if [[ -z "${ONLY:-}" || " $ONLY " == *" link "* ]]; then  # pinned copies, one GPU alone and all at once
    timeout 120 torchrun --nproc-per-node "$N" benchmarks/host_link.py 2>&1 | grep '^|' | tee "$WORK/link.txt"
  fi
  run single-plain 1 --data.batch_size 4
  run single-budget24 1 --data.batch_size 4 --budget 24GiB --optimizer.param_dtype bfloat16
  # ... its blocks compiled in place, the plan priced on them compiled (profile(compiled=True)), against
  # single-compile below
  run single-budget24-compile 1 --data.batch_size 4 --budget 24GiB --optimizer.param_dtype bfloat16 --train.compile true
fi
# 2. DDP and FSDP2 on N GPUs at N x the single-GPU batch, without and with the memory engines; the profiler trace of
#    steps 20-21 shows communication against backward (elbowroom report OUT/NAME)
B=$((4 * N))
if part 2; then
run ddp "$N" --data.batch_size $B --parallel.dp_replicate "$N" --profile.steps 20-21
run fsdp "$N" --data.batch_size $B --parallel.dp_shard "$N" --profile.steps 20-21
run ddp-bucket100 "$N" --data.batch_size $B --parallel.dp_replicate "$N" --parallel.ddp_bucket_mb 100  # 93% at 25
# Where DDP's last 7% goes (2x H200, 2026-11-28; 93.3% of 2x one GPU with the defaults):
# - NCCL with fewer CTAs, to leave the backward its SMs: slower (8 CTAs 91.6%, 2 CTAs 89.0%)
NCCL_MAX_CTAS=8 run ddp-ctas8 "$N" --data.batch_size $B --parallel.dp_replicate "$N"
NCCL_MAX_CTAS=2 run ddp-ctas2 "$N" --data.batch_size $B --parallel.dp_replicate "$N"
# - NCCL's protocol: for buckets of tens of MiB over NVLink NCCL may pick LL128, whose CTAs spin on flags as the data
#   lands; Simple moves the same bytes with less SM work per byte (not run yet)
NCCL_PROTO=Simple run ddp-proto-simple "$N" --data.batch_size $B --parallel.dp_replicate "$N"
NCCL_PROTO=Simple run ddp-proto-simple-bucket100 "$N" --data.batch_size $B --parallel.dp_replicate "$N" \
  --parallel.ddp_bucket_mb 100
# - the idle compute beside one GPU's (benchmarks/idle_gaps.py on both traces): the compute kernels themselves run
#   longer beside NCCL's (busy 329 against 314 ms), the idle grows by 7 ms only
run single-trace 1 --data.batch_size 4 --profile.steps 20-21
# - a loss read every step (a host-device sync, and under DDP gloo collectives): logging every 10 steps, no change
run single-log10 1 --data.batch_size 4 --steps 60 --logging.log_every 10
run ddp-log10 "$N" --data.batch_size $B --parallel.dp_replicate "$N" --steps 60 --logging.log_every 10
# - bf16 weights with fp32 masters on both (no autocast): half the gradient bytes, 94.8%
run single-bf16 1 --data.batch_size 4 --optimizer.param_dtype bfloat16
run ddp-bf16 "$N" --data.batch_size $B --parallel.dp_replicate "$N" --optimizer.param_dtype bfloat16
# - fp32 weights, gradients all-reduced in bf16 (torch's bf16 hook: half the bytes, two casts): not yet run at 4096
#   tokens (at 1024 on 4 GPUs: 75.3% against 71.7% uncompressed)
run ddp-commbf16 "$N" --data.batch_size $B --parallel.dp_replicate "$N" --parallel.comm_hook bf16
# - the trainer's garbage collection every 50 steps, and DDP without its buffer broadcast: no change
# - gradient accumulation (DDP all-reduces on the last micro-batch only, no_sync before it): the communication per
#   token falls by the number of micro-batches, against one GPU running the same accumulation
run single-plain-acc4 1 --data.batch_size 4 --train.gradient_accumulation_steps 4 --steps 15
run ddp-acc2 "$N" --data.batch_size $B --parallel.dp_replicate "$N" --train.gradient_accumulation_steps 2 --steps 20
run ddp-acc4 "$N" --data.batch_size $B --parallel.dp_replicate "$N" --train.gradient_accumulation_steps 4 --steps 15
# - torch.compile on both: shorter compute beside the same all-reduce bytes. Compiled whole (the nineteenth session)
#   one GPU ran 106.3% of plain and DDP had no step within 100 s; now each block's forward is compiled in place
run single-compile 1 --data.batch_size 4 --train.compile true
run ddp-compile "$N" --data.batch_size $B --parallel.dp_replicate "$N" --train.compile true
# ... and with bf16 weights (DDP's best at one micro-batch: 93.0-94.8%): fewer memory-bound kernels left to slow down
#   beside the all-reduce
run single-bf16-compile 1 --data.batch_size 4 --optimizer.param_dtype bfloat16 --train.compile true
run ddp-bf16-compile "$N" --data.batch_size $B --parallel.dp_replicate "$N" --optimizer.param_dtype bfloat16 \
  --train.compile true
run ddp-gc50 "$N" --data.batch_size $B --parallel.dp_replicate "$N" --train.gc_every 50
run ddp-nobcast "$N" --data.batch_size $B --parallel.dp_replicate "$N" --parallel.ddp_broadcast_buffers false
# - tried and reverted (2026-11-28, 2 and 4 H200s): the backward's cuBLASLt matmuls told to leave 16 or 32 SMs to NCCL
#   (torch's experimental SM carveout): 90.1 / 87.0% of 2x one GPU and 89.1 / 85.3% of 4x, against 93.1 and 91.8%
#   without; cuBLASLt alone 92.4%. The SM clocks under DDP and on one GPU were alike (both at the 700 W cap).
run ddp-engines "$N" --data.batch_size $B --parallel.dp_replicate "$N" --activations.checkpoint full \
  --activations.offload_checkpoint_inputs true --optimizer.offload_fraction 0.5
run fsdp-engines "$N" --data.batch_size $B --parallel.dp_shard "$N" --activations.checkpoint full \
  --activations.offload_checkpoint_inputs true
# the planner at a per-GPU budget (FSDP2: each rank plans its own 1/N of the model states)
run ddp-budget24 "$N" --data.batch_size $B --parallel.dp_replicate "$N" --budget 24GiB \
  --optimizer.param_dtype bfloat16
run fsdp-budget16 "$N" --data.batch_size $B --parallel.dp_shard "$N" --budget 16GiB --optimizer.param_dtype bfloat16 \
  --profile.steps 20-21
run fsdp-budget16-compile "$N" --data.batch_size $B --parallel.dp_shard "$N" --budget 16GiB \
  --optimizer.param_dtype bfloat16 --train.compile true
# ... each unit all-gathering the next two ahead (the traced 16 GiB step waited ~12 ms at its start on the embedding's
#   and block 0's gathers, and ~9 ms five times at the end of its backward, the host in autograd): expected 10-20 ms
#   off a 0.40 s step
run fsdp-budget16-prefetch2 "$N" --data.batch_size $B --parallel.dp_shard "$N" --budget 16GiB \
  --optimizer.param_dtype bfloat16 --parallel.fsdp_prefetch 2
# ... logging every 10 steps (against single-log10): its traced step starts with ~12 ms of FSDP2's host work before
# the first kernel (the embedding unit's pre_forward and all-gather), which a loss read every step leaves exposed
run fsdp-budget16-log10 "$N" --data.batch_size $B --parallel.dp_shard "$N" --budget 16GiB \
  --optimizer.param_dtype bfloat16 --steps 60 --logging.log_every 10
# its plan recomputes every block, 13 of them selectively (2026-11-28, 4 GPUs: 1.58x its step): FSDP2 with selective
# recompute in every block and nothing else, against fsdp-engines (full recompute, inputs offloaded)
run fsdp-selective "$N" --data.batch_size $B --parallel.dp_shard "$N" --activations.checkpoint selective
fi
# 3. FSDP2 with our optimizer offload against FSDP2's CPUOffloadPolicy (peak per GPU in metrics.jsonl)
if part 3; then
#    (bf16 shards with fp32 host masters; each pair with and without clipping, and at the selective / no-recompute
#    point where our peak is below the peer's)
for clip in 1.0 0; do
run "fsdp-our-offload-clip$clip" "$N" --data.batch_size $B --parallel.dp_shard "$N" --optimizer.offload_fraction 1.0 \
  --optimizer.param_dtype bfloat16 --activations.checkpoint full --activations.offload_checkpoint_inputs true \
  --train.max_grad_norm $clip --steps 20
run "fsdp-cpu-offload-policy-clip$clip" "$N" --data.batch_size $B --parallel.dp_shard "$N" \
  --parallel.fsdp_cpu_offload --activations.checkpoint full --train.max_grad_norm $clip --steps 20
# the gradients straight to host buffers during backward (optimizer.offload_gradients), so that with clipping the
# copies run in the backward and only the host step waits for the norm (without it the jobs are held, uncopied,
# until step()): on 4 GPUs, clipped, ours stepped 0.50 s a step (1.68x the policy) where the host's rate would give
# 0.14-0.26 s
# (with the optimizer's timeline in each metrics row, --offload.trace_steps: the summary's host table shows whether
# the step thread computed or waited)
run "fsdp-our-offload-og-clip$clip" "$N" --data.batch_size $B --parallel.dp_shard "$N" \
  --optimizer.offload_fraction 1.0 --optimizer.offload_gradients true --optimizer.param_dtype bfloat16 \
  --activations.checkpoint full --activations.offload_checkpoint_inputs true --train.max_grad_norm $clip --steps 20 \
  --offload.trace_steps true
# ... and with the clip coefficient inside torch's fused kernel (--offload.scale_in_kernel: no scaling pass over
# the host gradients, 28 B a parameter instead of 36; within rounding of torch's clipped step, not bitwise)
run "fsdp-our-offload-og-kscale-clip$clip" "$N" --data.batch_size $B --parallel.dp_shard "$N" \
  --optimizer.offload_fraction 1.0 --optimizer.offload_gradients true --optimizer.param_dtype bfloat16 \
  --activations.checkpoint full --activations.offload_checkpoint_inputs true --train.max_grad_norm $clip --steps 20 \
  --offload.scale_in_kernel true --offload.trace_steps true
# the host step's threads: each rank's share of the cores less two by default (14 of 64 on 4 ranks), beside each
# rank's training, autograd and copy threads
for threads in 12 10; do
run "fsdp-our-offload-og-t$threads-clip$clip" "$N" --data.batch_size $B --parallel.dp_shard "$N" \
  --optimizer.offload_fraction 1.0 --optimizer.offload_gradients true --optimizer.param_dtype bfloat16 \
  --activations.checkpoint full --activations.offload_checkpoint_inputs true --train.max_grad_norm $clip --steps 20 \
  --offload.cpu_threads $threads
done
# each rank bound to its GPU's NUMA node (benchmarks/numa_bind.sh): the host step's threads and the pages they
# first touch (masters, moments, pinned buffers) on the node of the GPU they copy to. Unbound, the clipped host step
# for the same 341M parameters a rank took 0.17 to 0.60 s from run to run; both sides bound
BIND="--no-python benchmarks/numa_bind.sh python3 -m elbowroom"
LAUNCH=$BIND run "fsdp-our-offload-og-numa-clip$clip" "$N" --data.batch_size $B --parallel.dp_shard "$N" \
  --optimizer.offload_fraction 1.0 --optimizer.offload_gradients true --optimizer.param_dtype bfloat16 \
  --activations.checkpoint full --activations.offload_checkpoint_inputs true --train.max_grad_norm $clip --steps 20 \
  --offload.trace_steps true
LAUNCH=$BIND run "fsdp-cpu-offload-policy-numa-clip$clip" "$N" --data.batch_size $B --parallel.dp_shard "$N" \
  --parallel.fsdp_cpu_offload --activations.checkpoint full --train.max_grad_norm $clip --steps 20
# the planner at the policy's own allocated peak (7.55 GiB per GPU on 4 H200s): what `--budget` gives a user who
# asks for that memory, with room to keep some shards' optimizer on the device and shorten the clipped host step
run "fsdp-budget7.5-clip$clip" "$N" --data.batch_size $B --parallel.dp_shard "$N" --budget 7.5GiB \
  --optimizer.param_dtype bfloat16 --train.max_grad_norm $clip --steps 20 --profile.steps 15-16
run "fsdp-our-offload-selective-clip$clip" "$N" --data.batch_size $B --parallel.dp_shard "$N" \
  --optimizer.offload_fraction 1.0 --optimizer.param_dtype bfloat16 --activations.checkpoint selective \
  --train.max_grad_norm $clip --steps 20
run "fsdp-cpu-offload-policy-norecompute-clip$clip" "$N" --data.batch_size $B --parallel.dp_shard "$N" \
  --parallel.fsdp_cpu_offload --train.max_grad_norm $clip --steps 20
done
fi
# 4. TP 2 and PP 2 (8 micro-batches, 1F1B) on the 7B shape, against one GPU running the same 8 micro-batches (fp32
#    AdamW on the device: 108 GB, fits a 141 GB H200); PP's ideal is 2 x one GPU x m / (m + p - 1)
if part 4; then
run 7b-single 1 --model.preset 7b --data.batch_size 1 --train.gradient_accumulation_steps 8 \
  --activations.checkpoint full --steps 6
run 7b-pp2 2 --model.preset 7b --data.batch_size 8 --parallel.pp 2 --parallel.pp_schedule 1f1b \
  --parallel.pp_microbatches 8 --activations.checkpoint full --steps 6
run 7b-tp2 2 --model.preset 7b --data.batch_size 1 --train.gradient_accumulation_steps 8 --parallel.tp 2 \
  --activations.checkpoint full --steps 6 --profile.steps 4-5  # the trace: GPU busy, or waiting for the host?
# ... its blocks compiled in place over their shards: DTensor's per-op host dispatch gone from the blocks
run 7b-tp2-compile 2 --model.preset 7b --data.batch_size 1 --train.gradient_accumulation_steps 8 --parallel.tp 2 \
  --activations.checkpoint full --steps 6 --train.compile true
fi
# 5. gradient compression on DDP: bytes on the wire per step (comm_bytes_per_step), tokens/s, loss after 300 steps
#    (sequences of 1024 tokens, so that 300 steps fit a call and communication weighs more than at 4096)
if part 5; then
  run single-plain-1024 1 --data.batch_size 4 --data.seq_len 1024 --steps 100
  for hook in none bf16 powersgd topk int8; do
    run "ddp-hook-$hook" "$N" --data.batch_size $B --data.seq_len 1024 --parallel.dp_replicate "$N" \
      --parallel.comm_hook $hook --steps 300
  done
fi
cp "$WORK"/nccl.txt "$WORK"/link.txt "$WORK"/numa.txt "$OUT"/ 2>/dev/null
for t in "$WORK"/*/profile/trace.json; do  # each traced run's idle compute, beside its name
  [ -f "$t" ] && { echo "== $(basename "$(dirname "$(dirname "$t")")")"; python3 benchmarks/idle_gaps.py "$t"; }
done > "$OUT/idle_gaps.txt" 2>&1
kill $CLOCKS_PID 2>/dev/null
python3 benchmarks/multi_gpu_summary.py "$WORK" "$N" | tee "$OUT/summary.md"
python3 benchmarks/gpu_clocks.py "$WORK/clocks.csv" "$WORK/times.txt" 2>&1 | tee "$OUT/clocks.md"
tar czf "$OUT/runs.tar.gz" -C "$WORK" --exclude=trace.json --exclude='*.pickle' --exclude='*.pt' --exclude='*.safetensors' .
