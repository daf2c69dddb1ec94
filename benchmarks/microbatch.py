"""GPU time of one training micro-batch (forward + backward, no optimizer step) of a reference model.

    python benchmarks/microbatch.py --preset 7b --seq 4096 --variants bf16,bf16+compile,amp,bf16+ckpt

What the optimizer-offload figures sit on: at gradient accumulation 8 the step is eight of these plus
whatever of the CPU step does not hide, so this is the floor of that workload. Each variant builds the
model afresh and prints, per micro-batch, the median GPU time (CUDA events, warm-up dropped), model
TFLOP/s, the peak memory above the parameters and gradients (what activations and workspaces take) and,
with ``--profile``, how the kernel time splits into matmul, attention and the rest.

Variants (joined with ``+``):
- ``bf16``: parameters and gradients in bf16, no autocast; ``amp``: fp32 parameters, bf16 autocast
  (its weight cache on, as a training step would run it).
- ``mix``: the hybrid optimizer's layout under autocast: the late half of the blocks and the head in bf16,
  the rest fp32.
- ``unfused``: SwiGLU as chunk, silu and mul instead of the fused kernel (``fused_swiglu = False``).
- ``compile``: each block compiled on its own (``nn.Module.compile``), as torchtitan does.
- ``ckpt``: every block recomputed in backward (elbowroom's per-block policy); ``ckptK``: the first K.
- ``sel``: every block selective (matmul and attention outputs kept, the rest recomputed).
The head and loss always run fused (``linear_cross_entropy``), as in the 7B offload rows.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections import defaultdict
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from elbowroom.activations import BlockPolicy, apply_block_policies  # noqa: E402
from elbowroom.models import ModelConfig, build_model, flops_per_token  # noqa: E402
from elbowroom.ops.linear_cross_entropy import linear_cross_entropy  # noqa: E402


def _category(kernel: str) -> str:
    k = kernel.lower()
    if any(s in k for s in ("gemm", "xmma", "cutlass", "nvjet", "cublas", "sm90_")):
        return "matmul"
    if "flash" in k or "fmha" in k or "attention" in k:
        return "attention"
    return "other"


def run(variant: str, args: argparse.Namespace) -> dict:
    parts = set(variant.split("+"))
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    torch.manual_seed(0)
    cfg = ModelConfig.from_preset(args.preset, max_seq_len=args.seq, n_layers=args.layers or None)
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    model = build_model(cfg, device=dev)
    bf16 = "bf16" in parts
    if bf16:
        model.to(torch.bfloat16)
    elif "mix" in parts:  # the hybrid optimizer's layout: the late half (and the head) in bf16, the rest fp32
        for blk in list(model.blocks)[len(model.blocks) // 2 :]:
            blk.to(torch.bfloat16)
        model.norm.to(torch.bfloat16)
        model.output.to(torch.bfloat16)
    n = len(model.blocks)
    k = next((int(p[4:]) for p in parts if p.startswith("ckpt") and p[4:].isdigit()), n if "ckpt" in parts else 0)
    k = min(k, n)
    rest = BlockPolicy("selective") if "sel" in parts else BlockPolicy("none")
    if k or "sel" in parts:
        apply_block_policies(model, [BlockPolicy("full")] * k + [rest] * (n - k))
    if "unfused" in parts:
        for blk in model.blocks:
            blk.fused_swiglu = False
    if "compile" in parts:
        for blk in model.blocks:
            blk.compile()
    idx = torch.randint(0, cfg.vocab_size, (1, args.seq), device=dev)
    tgt = torch.randint(0, cfg.vocab_size, (1, args.seq), device=dev)
    amp = torch.autocast(dev, dtype=torch.bfloat16, enabled=not bf16)

    def micro_batch() -> None:
        with amp:
            h = model.hidden_states(idx)
            loss = linear_cross_entropy(h, model.output.weight, tgt)
        loss.backward()

    for _ in range(args.warmup):
        micro_batch()
    if dev == "cpu":  # a smoke run of the harness itself: wall time, no memory figures
        t0 = time.perf_counter()
        micro_batch()
        return {"variant": variant, "layers": n, "ms": round(1e3 * (time.perf_counter() - t0), 1)}
    torch.cuda.synchronize()
    states = torch.cuda.memory_allocated()  # parameters and their gradients (kept between micro-batches)
    torch.cuda.reset_peak_memory_stats()
    times = []
    for _ in range(args.iters):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        micro_batch()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) / 1e3)
    s = statistics.median(times)
    row = {
        "variant": variant,
        "layers": n,
        "ms": round(1e3 * s, 1),
        "tflops": round(args.seq * flops_per_token(cfg, args.seq) / s / 1e12, 1),
        "states_GiB": round(states / 2**30, 2),
        "activation_peak_GiB": round((torch.cuda.max_memory_allocated() - states) / 2**30, 2),
    }
    if args.profile:
        from torch.profiler import ProfilerActivity, profile

        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            micro_batch()
            torch.cuda.synchronize()
        split: dict[str, float] = defaultdict(float)
        for e in prof.key_averages():
            t = getattr(e, "device_time_total", None) or getattr(e, "cuda_time_total", 0.0)
            if e.device_type == torch.autograd.DeviceType.CUDA or t and not e.cpu_children:
                split[_category(e.key)] += t / 1e3
        row["kernel_ms"] = {c: round(v, 1) for c, v in sorted(split.items())}
        top = sorted(
            (e for e in prof.key_averages() if _category(e.key) == "other"),
            key=lambda e: -(getattr(e, "device_time_total", 0.0) or 0.0),
        )[:12]
        row["top_other"] = [(e.key[:60], round((getattr(e, "device_time_total", 0.0) or 0.0) / 1e3, 1)) for e in top]
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="7b")
    ap.add_argument("--seq", type=int, default=4096)
    ap.add_argument("--layers", type=int, default=0, help="override the preset's layer count (0: keep)")
    ap.add_argument("--variants", default="bf16,bf16+compile,amp")
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--iters", type=int, default=6)
    ap.add_argument("--profile", action="store_true")
    args = ap.parse_args()
    device = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    print(f"# {device}, torch {torch.__version__}", flush=True)
    for v in args.variants.split(","):
        try:
            row = run(v, args)
        except torch.OutOfMemoryError:
            row = {"variant": v, "error": "OOM"}
        print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
