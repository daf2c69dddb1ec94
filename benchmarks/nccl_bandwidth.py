"""NCCL all-reduce bus bandwidth between the GPUs of one host, to know the link before reading scaling figures.

    torchrun --nproc-per-node 2 benchmarks/nccl_bandwidth.py            # prints one table row per size

Bus bandwidth as nccl-tests defines it for all-reduce: ``bytes / time * 2 (n - 1) / n``, the rate each link must
carry; NVLink on H100/H200 reaches a few hundred GB/s, PCIe a few tens.
"""

from __future__ import annotations

import os
import time

import torch
import torch.distributed as dist


def main() -> None:
    dist.init_process_group("nccl")
    rank, n = dist.get_rank(), dist.get_world_size()
    torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", rank)))
    if rank == 0:
        print(f"| bytes | ms | algorithm GB/s | bus GB/s |   ({n} GPUs, {torch.cuda.get_device_name()})")
        print("|---|---|---|---|")
    for mib in (1, 16, 64, 256, 1024):
        x = torch.ones(mib << 18, device="cuda")  # fp32: mib MiB
        for _ in range(3):
            dist.all_reduce(x)
        torch.cuda.synchronize()
        iters = 10
        t0 = time.perf_counter()
        for _ in range(iters):
            dist.all_reduce(x)
        torch.cuda.synchronize()
        dt = (time.perf_counter() - t0) / iters
        algo = x.numel() * 4 / dt
        if rank == 0:
            print(f"| {mib} MiB | {dt * 1e3:.3f} | {algo / 1e9:.1f} | {algo * 2 * (n - 1) / n / 1e9:.1f} |")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
