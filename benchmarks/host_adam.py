"""Host AdamW rate: torch's fused CPU kernel against elbowroom's one-pass kernel, alone on the host.

    python benchmarks/host_adam.py --numel 268435456 --threads 14,16

Rows (G params/s and the host memory traffic that implies):
- ``torch_fp32``: torch's fused AdamW on fp32 gradients (what the fp32-device-weight path runs): 28 B/param;
- ``torch_bf16_3pass``: bf16 gradients upcast into fp32 scratch, torch's fused AdamW, the master cast to a
  bf16 copy for the way back (the fallback path for bf16 device weights): 40 B/param;
- ``one_pass_bf16``: the compiled one-pass kernel on the same bf16 gradients, writing the bf16 copy: 28 B/param.
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
    args = ap.parse_args()
    n = args.numel
    group = {"lr": 1e-4, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 0.01}
    p = torch.randn(n)
    g32 = torch.randn(n)
    g16 = g32.bfloat16()
    scratch = torch.empty(n)
    out = torch.empty(n, dtype=torch.bfloat16)
    opt = torch.optim.AdamW([p], fused=True, **group)
    kernel = _host_adam.compiled_kernel()
    st = _host_adam.adam_state(opt, p)

    def torch_fp32() -> None:
        p.grad = g32
        opt.step()

    def torch_bf16_3pass() -> None:
        scratch.copy_(g16)
        p.grad = scratch
        opt.step()
        out.copy_(p)

    def one_pass_bf16() -> None:
        st["step"] += 1
        h = _host_adam.hyper_vector(opt.param_groups[0], float(st["step"]), 1.0)
        assert kernel is not None
        kernel(p, g16, st["exp_avg"], st["exp_avg_sq"], out, h, True)

    cases = {"torch_fp32": (torch_fp32, 28), "torch_bf16_3pass": (torch_bf16_3pass, 40)}
    if kernel is not None:
        cases["one_pass_bf16"] = (one_pass_bf16, 28)
    for t in (int(x) for x in args.threads.split(",")):
        torch.set_num_threads(t)
        for name, (fn, nbytes) in cases.items():
            r = _rate(fn, n, args.reps)
            row = {"case": name, "threads": t, "G_params_per_s": round(r, 3), "GB_per_s": round(r * nbytes, 1)}
            print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
