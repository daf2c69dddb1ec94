"""Measured bf16 matmul and attention rates by shape on this GPU: the data behind the analytic profile's shape model
(``elbowroom.plan.devices.matmul_seconds``).

    python3 benchmarks/matmul_shapes.py [--json OUT.jsonl]

For each reference workload (``elbowroom.models.workloads``) every linear layer of a block is timed as the three
GEMMs a training step runs (forward ``x W^T``, the input's gradient ``dy W``, the weight's gradient ``dy^T x``),
plus its causal attention forward and backward (``F.scaled_dot_product_attention``, flash). A sweep of square and
skinny shapes goes beside them. Each line: the op, its shape, FLOPs (attention counted as torch's FLOP counter
counts it: without the causal mask's saving), the time of one run (the median over ``--iters`` windows of
back-to-back runs on CUDA events) and TFLOP/s.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from elbowroom.models import ModelConfig  # noqa: E402
from elbowroom.models.workloads import WORKLOADS  # noqa: E402


def timed(fn, iters: int) -> float:
    """Seconds of one ``fn``: the median over ``iters`` windows, each of enough back-to-back runs to fill 2 ms of
    the GPU (the host launches ahead, as in a training step; one run between two events also timed the host's
    launch of a small kernel: 33 us for any GEMM up to 1536 cubed)."""
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    reps = max(1, min(200, int(2e-3 / max(time.perf_counter() - t0, 1e-6))))
    out = []
    for _ in range(iters):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        for _ in range(reps):
            fn()
        b.record()
        b.synchronize()
        out.append(a.elapsed_time(b) / 1e3 / reps)
    return statistics.median(out)


def gemm(m: int, n: int, k: int, iters: int) -> float:
    """Seconds of one (m, k) x (k, n) bf16 matmul."""
    a = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(k, n, device="cuda", dtype=torch.bfloat16)
    return timed(lambda: a @ b, iters)


def attention(b: int, h: int, s: int, d: int, iters: int) -> tuple[float, float]:
    """Seconds of causal flash attention forward, and of its backward."""
    q, k, v = (torch.randn(b, h, s, d, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
    fwd = timed(lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True), iters)
    out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    g = torch.randn_like(out)
    bwd = timed(lambda: torch.autograd.grad(out, (q, k, v), g, retain_graph=True), iters)
    return fwd, bwd


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    rows = []

    def add(op: str, shape: tuple, flops: float, s: float, workload: str = "") -> None:
        row = {"op": op, "shape": list(shape), "flops": flops, "s": s, "tflops": flops / s / 1e12,
               "workload": workload, "device": torch.cuda.get_device_name()}
        rows.append(row)
        print(json.dumps(row), flush=True)

    seen = set()
    for wname, w in WORKLOADS.items():
        if wname == "smoke":
            continue
        cfg = ModelConfig.from_preset(w.preset)
        t = w.batch_size * w.seq_len
        linears = [(cfg.dim, 3 * cfg.dim), (cfg.dim, cfg.dim)]
        linears += ([(cfg.dim, 2 * cfg.ffn_dim), (cfg.ffn_dim, cfg.dim)] if cfg.arch == "llama"
                    else [(cfg.dim, cfg.ffn_dim), (cfg.ffn_dim, cfg.dim)])
        linears.append((cfg.dim, cfg.vocab_size))  # the head
        for fin, fout in linears:
            for op, (m, n, k) in (("fwd", (t, fout, fin)), ("dx", (t, fin, fout)), ("dw", (fout, fin, t))):
                if (m, n, k) in seen:
                    continue
                seen.add((m, n, k))
                add(f"mm_{op}", (m, n, k), 2.0 * m * n * k, gemm(m, n, k, a.iters), wname)
        hd = cfg.dim // cfg.n_heads
        key = (w.batch_size, cfg.n_heads, w.seq_len, hd)
        if key not in seen:
            seen.add(key)
            f, b = attention(*key, a.iters)
            per = 2.0 * w.batch_size * cfg.n_heads * w.seq_len * w.seq_len * hd  # one of its matmuls, no mask saving
            add("attn_fwd", key, 2 * per, f, wname)
            add("attn_bwd", key, 4 * per, b, wname)
    for n in (512, 1024, 1536, 2048, 3072, 4096, 6144, 8192):
        add("mm_square", (n, n, n), 2.0 * n**3, gemm(n, n, n, a.iters))
    for m in (1024, 4096, 16384):
        for n in (1600, 2048, 4096):
            for k in (1600, 2048, 4096, 8192):
                if (m, n, k) not in seen:
                    add("mm_sweep", (m, n, k), 2.0 * m * n * k, gemm(m, n, k, a.iters))
    for hd in (64, 128):
        for s in (1024, 2048, 4096):
            b = max(1, 8192 // s)
            h = 2048 // hd
            f, bw = attention(b, h, s, hd, a.iters)
            per = 2.0 * b * h * s * s * hd
            add("attn_sweep_fwd", (b, h, s, hd), 2 * per, f)
            add("attn_sweep_bwd", (b, h, s, hd), 4 * per, bw)
    if a.json:
        Path(a.json).write_text("".join(json.dumps(r) + "\n" for r in rows))


if __name__ == "__main__":
    main()
