"""The offloaded optimizer step alone: host-stepped against streamed (host state stepped on the device) and both.

    python benchmarks/stream_step.py --params 1.2e9 --shapes 4096x11008

Builds bf16 device weights of the given shape until ``--params`` elements, with fp32 masters and AdamW on the host
(``CPUOffloadOptimizer(param_dtype=bfloat16)``), gives them gradients, and times ``step()`` (it waits for every
update) with a share of the tensors streamed (``stream_params``): 0 (all on the host), the given ``--shares`` and 1.
Prints one JSON row per share: seconds per step (median of ``--reps``), G params/s, and what the link carried.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from elbowroom.optim import CPUOffloadConfig, CPUOffloadOptimizer
from elbowroom.optim.stats import trace_summary


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--params", type=float, default=1.2e9)
    ap.add_argument("--shapes", default="4096x11008")
    ap.add_argument("--shares", default="0,0.25,0.5,0.75,1")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--slot-numel", type=int, default=CPUOffloadConfig().stream_slot_numel)
    ap.add_argument("--slots", type=int, default=CPUOffloadConfig().stream_slots)
    ap.add_argument("--no-clip", action="store_true",
                    help="skip clip_grad_norm_: the jobs then go in the order step() hands them over (the host's "
                         "first), where a backward hands the late (streamed) ones over first")
    ap.add_argument("--bucket-mb", type=int, default=CPUOffloadConfig().bucket_bytes >> 20,
                    help="gradient bytes of one bucket (one staging slot, one CPU optimizer call)")
    ap.add_argument("--staging-slots", type=int, default=CPUOffloadConfig().num_staging_slots)
    ap.add_argument("--trace", action="store_true",
                    help="add the last step's timeline per kind of event (copies waited for, CPU steps, streams): "
                         "count, busy seconds, first start and last end, from CPUOffloadConfig.trace_steps")
    args = ap.parse_args()
    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    rows, cols = (int(x) for x in args.shapes.split("x"))
    count = max(1, int(args.params // (rows * cols)))
    params = [torch.nn.Parameter(torch.randn(rows, cols, device=dev) * 0.02) for _ in range(count)]
    numel = count * rows * cols
    for share in (float(x) for x in args.shares.split(",")):
        # the late tensors stream (their gradients are final first in a real backward)
        k = round(share * count)
        streamed = params[count - k :] if k else []
        opt = CPUOffloadOptimizer(
            params, torch.optim.AdamW, lr=1e-4, weight_decay=0.1, param_dtype=torch.bfloat16, stream_params=streamed,
            config=CPUOffloadConfig(stream_slot_numel=args.slot_numel, stream_slots=args.slots,
                                    bucket_bytes=args.bucket_mb << 20, num_staging_slots=args.staging_slots,
                                    trace_steps=args.trace),
        )
        times = []
        for i in range(args.reps + 1):
            for p in params:
                p.grad = torch.randn_like(p) * 1e-3
            if dev.type == "cuda":
                torch.cuda.synchronize()
            t0 = time.perf_counter()
            if not args.no_clip:
                opt.clip_grad_norm_(1e9)  # the gate: every job waits for step(), then streamed ones go first
            opt.step()
            if dev.type == "cuda":
                torch.cuda.synchronize()
            if i:  # the first step allocates and first-touches the state
                times.append(time.perf_counter() - t0)
            opt.zero_grad()
        st = opt.stats()
        opt.close()
        s = statistics.median(times)
        trace = trace_summary(st.get("trace", []))
        print(json.dumps({
            "share_streamed": share, "tensors_streamed": k, "params": numel, "step_s": round(s, 4),
            "g_params_per_s": round(numel / s / 1e9, 2), "steps_s": [round(t, 4) for t in times],
            "h2d_gb": round(st["h2d_bytes"] / 1e9, 2), "d2h_gb": round(st["d2h_bytes"] / 1e9, 2),
            "cpu_step_s": round(st.get("cpu_step_s", 0.0), 4), "device": str(dev),
            "bucket_mb": args.bucket_mb, "staging_slots": args.staging_slots, "clip": not args.no_clip,
            **({"trace": trace} if args.trace else {}),
        }), flush=True)


if __name__ == "__main__":
    main()
