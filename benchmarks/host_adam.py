"""Host AdamW rate: torch's fused CPU kernel against elbowroom's one-pass kernel, alone on the host.

    python benchmarks/host_adam.py --numel 268435456 --threads 14,16

Rows (G params/s and the host memory traffic that implies):
- ``torch_fp32``: torch's fused AdamW on fp32 gradients (what the fp32-device-weight path runs): 28 B/param;
- ``torch_bf16_3pass``: bf16 gradients upcast into fp32 scratch, torch's fused AdamW, the master cast to a
  bf16 copy for the way back (the fallback path for bf16 device weights): 40 B/param;
- ``chunked_bf16_<K>``: the same three steps chunk by chunk (K elements), each chunk still in cache for
  the next op (``elbowroom.optim._host_adam.step_chunked``): ~30 B/param of memory traffic;
- ``torch_fp32_scaled``: a clipped fp32 gradient, scaled over the whole tensor and then stepped: 36 B/param;
- ``chunked_fp32_scaled_<K>``: the same chunk by chunk, the scaled chunk still in cache for the step: 28 B/param.
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from elbowroom.optim import _host_adam


def _rate(fn, numel: int, reps: int) -> float:
    fn()  # warm-up (first touch, compile)
    best = float("inf")
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return numel / best / 1e9


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--numel", type=int, default=1 << 28)
    ap.add_argument("--threads", default=str(torch.get_num_threads()))
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--chunks", default="262144,1048576,2097152,4194304,8388608")
    args = ap.parse_args()
    n = args.numel
    group = {"lr": 1e-4, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 0.01}
    p = torch.randn(n)
    g32 = torch.randn(n)
    g16 = g32.bfloat16()
    scratch = torch.empty(n)
    out = torch.empty(n, dtype=torch.bfloat16)
    opt = torch.optim.AdamW([p], fused=True, **group)
    chunks = [int(c) for c in args.chunks.split(",")]

    def torch_fp32() -> None:
        p.grad = g32
        opt.step()

    def torch_bf16_3pass() -> None:
        scratch.copy_(g16)
        p.grad = scratch
        opt.step()
        out.copy_(p)

    coef = torch.tensor(0.999)  # a clipping coefficient (the gradient shrinks a little per call: harmless here)

    def torch_fp32_scaled() -> None:
        g32.mul_(coef)
        p.grad = g32
        opt.step()

    cases = {"torch_fp32": (torch_fp32, 28), "torch_bf16_3pass": (torch_bf16_3pass, 40),
             "torch_fp32_scaled": (torch_fp32_scaled, 36)}
    for c in chunks:
        cases[f"chunked_bf16_{c}"] = (
            lambda c=c: _host_adam.step_chunked(opt, opt.param_groups[0], p, g16, out, scratch, [], chunk=c),
            30,
        )
        cases[f"chunked_fp32_scaled_{c}"] = (
            lambda c=c: _host_adam.step_chunked(opt, opt.param_groups[0], p, g32, None, None, [coef], chunk=c),
            28,
        )
    for t in (int(x) for x in args.threads.split(",")):
        torch.set_num_threads(t)
        for name, (fn, nbytes) in cases.items():
            r = _rate(fn, n, args.reps)
            row = {"case": name, "threads": t, "G_params_per_s": round(r, 3), "GB_per_s": round(r * nbytes, 1)}
            print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
