"""Pinned host <-> GPU copy rates with one GPU copying and with every GPU of the host copying at once.

    torchrun --nproc-per-node 4 benchmarks/host_link.py          # one table row per case, printed by rank 0

The planner prices activation and optimizer copies at the link rate the machine profile measured from one process
(``elbowroom.plan.machine``). Under data parallel every rank copies at the same time: if the GPUs share a PCIe
switch, or the host's memory cannot feed them all, each rank's rate is lower than that. Cases: host to device,
device to host, both ways at once (two streams), each with rank 0 alone and with all ranks together. A gloo group
holds the ranks in step (barriers only; nothing is reduced over NCCL).
"""

from __future__ import annotations

import os
import time

import torch
import torch.distributed as dist

GIB = 1 << 30


def _rate(rank: int, active: bool, kind: str, host: torch.Tensor, dev: torch.Tensor,
          host2: torch.Tensor, dev2: torch.Tensor, iters: int = 8) -> float:
    """GB/s this rank moved (0 when not active), timed between two barriers."""
    s1, s2 = torch.cuda.Stream(), torch.cuda.Stream()
    dist.barrier()
    t0 = time.perf_counter()
    moved = 0
    if active:
        for _ in range(iters):
            if kind in ("h2d", "both"):
                with torch.cuda.stream(s1):
                    dev.copy_(host, non_blocking=True)
                moved += host.numel()
            if kind in ("d2h", "both"):
                with torch.cuda.stream(s2):
                    host2.copy_(dev2, non_blocking=True)
                moved += host2.numel()
        s1.synchronize()
        s2.synchronize()
    dt = time.perf_counter() - t0
    dist.barrier()
    return moved / dt / 1e9 if active else 0.0


def main() -> None:
    dist.init_process_group("gloo")
    rank, n = dist.get_rank(), dist.get_world_size()
    torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", rank)))
    host = torch.empty(GIB, dtype=torch.uint8, pin_memory=True)
    host2 = torch.empty(GIB, dtype=torch.uint8, pin_memory=True)
    dev = torch.empty(GIB, dtype=torch.uint8, device="cuda")
    dev2 = torch.empty(GIB, dtype=torch.uint8, device="cuda")
    for kind in ("h2d", "d2h", "both"):  # warm-up
        _rate(rank, True, kind, host, dev, host2, dev2, iters=1)
    if rank == 0:
        name = torch.cuda.get_device_name()
        print(f"| copy | rank 0 alone GB/s | all {n} at once: GB/s per rank (min / mean) |   ({name})")
        print("|---|---|---|")
    for kind in ("h2d", "d2h", "both"):
        alone = _rate(rank, rank == 0, kind, host, dev, host2, dev2)
        together = torch.tensor([_rate(rank, True, kind, host, dev, host2, dev2)])
        rates = [torch.zeros(1) for _ in range(n)]
        dist.all_gather(rates, together)
        r = [float(x) for x in rates]
        if rank == 0:
            label = "both ways (sum)" if kind == "both" else kind
            print(f"| {label} | {alone:.1f} | {min(r):.1f} / {sum(r) / n:.1f} |")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
