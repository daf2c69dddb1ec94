"""Measure the machine the planner plans for: matmul rate, link bandwidth, host optimizer rate.

:func:`measure_machine` takes about ten seconds on a GPU (a few large bf16 matmuls, pinned copies of
256 MiB each way alone and both at once, a device-to-device copy for memory bandwidth, a pinned
allocation, torch's fused CPU AdamW over ~50M fp32 parameters) and caches the result as JSON, keyed by the
device name and the torch version, in ``cache_dir`` (the CLI passes ``~/.cache/elbowroom``; the library reads
no environment variable and writes nowhere unless given a directory). On a CPU it measures the matmul rate,
a copy's memory bandwidth and the AdamW rate, and reports no link.

Every measurement synchronises the device before and after (host-device syncs, on purpose: these are
wall-clock rates), and takes the best of a few repeats, since the planner wants what the hardware can do,
not what a noisy first call did.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import re
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from elbowroom.optim.config import default_step_threads
from elbowroom.plan.devices import host_memory_bytes
from elbowroom.plan.host_pipeline import OPTIMIZER_LINK_BYTES_PER_PARAM
from elbowroom.plan.types import MachineProfile

__all__ = ["measure_machine", "measure_shared_link", "machine_for"]

logger = logging.getLogger(__name__)

_GIB = 1 << 30


def _best_time(fn: Callable[[], None], sync: Callable[[], None], repeats: int,
               start: Callable[[], None] | None = None) -> float:
    """Shortest wall time of ``repeats`` calls of ``fn`` (after one warm-up), each bracketed by ``sync``; ``start``
    runs before each timed call, untimed (a barrier that starts every rank at once)."""
    fn()
    sync()
    best = float("inf")
    for _ in range(repeats):
        sync()
        if start is not None:
            start()
        t0 = time.perf_counter()
        fn()
        sync()
        best = min(best, time.perf_counter() - t0)
    return best


_CACHE_VERSION = 3
"""Bumped when a measurement changes meaning: 2 measures host AdamW on the optimizer's own thread count (1 took
torch's count, which a DataLoader's pinning thread may have set to 1); 3 measures it beside the optimizer's own
copies (2 kept the link full both ways, and read 0.75-0.8 of the rate training reaches)."""


def _cache_path(cache_dir: str | Path, name: str) -> Path:
    safe = re.sub(r"[^A-Za-z0-9._-]+", "_", f"{name}-torch{torch.__version__}")
    return Path(cache_dir) / f"machine-v{_CACHE_VERSION}-{safe}.json"


HOST_ADAM_REPEATS = 9
"""Timed host AdamW steps in a measurement (their median counts), more than the other measurements' repeats: one
step of 50M parameters takes 10-20 ms, and with 3 two fits of one W1 call on an H200 read 4.50 and 3.65 G params/s
where the host stepped 3.8-4.0 in training (``BENCHMARKS.md``, twenty-second session)."""


def _host_adam_rate(numel: int, repeats: int, busy_link: Callable[[], None] | None = None) -> float:
    """Parameters per second of torch's fused AdamW on fp32 CPU tensors (what the host optimizer runs).

    In training the host step shares host memory with the link's copies both ways, and ran 20-50% slower than
    alone on the lent H100's host (3.4-4.1 against 4.7-6.1 G params/s): with ``busy_link`` (which enqueues the
    optimizer's own copies of the measured parameters, both ways, on the device's copy engines) the rate is taken
    under that load, and as the median of the repeats, not the best.
    """
    p = torch.nn.Parameter(torch.zeros(numel))
    p.grad = torch.full((numel,), 1e-3)
    opt = torch.optim.AdamW([p], lr=1e-4, fused=True)
    before = torch.get_num_threads()
    torch.set_num_threads(default_step_threads())  # as many as the optimizer's step thread runs on
    try:
        opt.step()  # warm-up: state allocated
        times = []
        for _ in range(repeats):
            if busy_link is not None:
                busy_link()  # enqueues copies that run (on the copy engines) while the step below runs on the host
            t0 = time.perf_counter()
            opt.step()
            times.append(time.perf_counter() - t0)
    finally:
        torch.set_num_threads(before)
    return numel / statistics.median(times)


def measure_machine(
    device: str | torch.device = "cuda",
    *,
    cache_dir: str | Path | None = None,
    refresh: bool = False,
    matmul_size: int | None = None,
    copy_bytes: int = 256 << 20,
    adam_numel: int = 50_000_000,
    repeats: int = 3,
) -> MachineProfile:
    """Measure ``device`` and its link to the host (or read the cached measurement).

    Args:
        device: a CUDA device (``"cuda"``, ``"cuda:1"``) or ``"cpu"``.
        cache_dir: directory for the JSON cache (``machine-<device name>-torch<version>.json``); None
            neither reads nor writes a cache.
        refresh: measure again even if a cached result exists (and overwrite it).
        matmul_size: side of the square matmuls (default 8192 on CUDA, 1024 on CPU).
        copy_bytes: size of each pinned copy and of the device copy.
        adam_numel: parameters in the host AdamW measurement (50M, as a block of a large model).
        repeats: timed repeats per measurement (the best one counts; the host AdamW step takes the median of
            at least :data:`HOST_ADAM_REPEATS`).

    Returns:
        A :class:`MachineProfile` with ``source="measured"``.

    Raises:
        ValueError: for a device type other than cuda or cpu, or CUDA requested where there is none.
    """
    dev = torch.device(device)
    if dev.type not in ("cuda", "cpu"):
        raise ValueError(f"measure_machine measures a cuda or cpu device, got {dev}")
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ValueError("measure_machine(device='cuda') needs a CUDA device; use device='cpu' or "
                         "elbowroom.plan.get_device(name) for the table's numbers")
    name = torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu"
    path = _cache_path(cache_dir, name) if cache_dir is not None else None
    if path is not None and path.exists() and not refresh:
        try:
            prof = MachineProfile(**json.loads(path.read_text()))
            logger.info("machine %s (cached in %s)", describe(prof), path)
            return prof
        except (ValueError, TypeError) as e:  # a cache from another version of the type: measure again
            logger.info("ignoring machine cache %s: %s", path, e)
    prof = _measure_cuda(dev, name, matmul_size or 8192, copy_bytes, adam_numel, repeats) if dev.type == "cuda" \
        else _measure_cpu(matmul_size or 1024, copy_bytes, min(adam_numel, 8_000_000), repeats)
    logger.info("machine %s (measured)", describe(prof))
    if path is not None:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(dataclasses.asdict(prof), indent=1))
    return prof


def describe(m: MachineProfile) -> str:
    """One line of what the planner prices with: matmul rate, link each way and both at once, host AdamW rate."""
    threads = default_step_threads()
    return (f"{m.name}: matmul {m.matmul_flops / 1e12:.1f} TFLOP/s, memory {m.memory_bandwidth / 1e9:.0f} GB/s, "
            f"link {m.h2d_bandwidth / 1e9:.1f} GB/s to the device, {m.d2h_bandwidth / 1e9:.1f} from it, "
            f"{m.duplex_bandwidth / 1e9:.1f} each way at once; "
            f"host AdamW {m.host_adam_params_per_s / 1e9:.2f} G params/s on {threads} "
            f"thread{'' if threads == 1 else 's'}")


def _measure_cpu(n: int, copy_bytes: int, adam_numel: int, repeats: int) -> MachineProfile:
    g = torch.Generator().manual_seed(0)  # (not the global RNG: a measurement leaves the caller's draws alone)
    a = torch.randn(n, n, generator=g)
    b = torch.randn(n, n, generator=g)
    t = _best_time(lambda: torch.mm(a, b), lambda: None, repeats)
    src = torch.empty(copy_bytes // 4)
    dst = torch.empty_like(src)
    t_copy = _best_time(lambda: dst.copy_(src), lambda: None, repeats)
    host = host_memory_bytes()
    return MachineProfile(
        name="cpu", device_memory_bytes=host, matmul_flops=2 * n**3 / t, memory_bandwidth=2 * copy_bytes / t_copy,
        h2d_bandwidth=0.0, d2h_bandwidth=0.0, duplex_bandwidth=0.0,
        host_adam_params_per_s=_host_adam_rate(adam_numel, max(repeats, HOST_ADAM_REPEATS)),
        host_memory_bytes=host,
        pinned_alloc_s_per_gib=0.0, source="measured",
    )


def _cuda_matmul_rate(dev: torch.device, n: int, repeats: int, sync: Callable[[], None]) -> float:
    g = torch.Generator(device=dev).manual_seed(0)  # (not the device's global RNG)
    a = torch.randn(n, n, device=dev, dtype=torch.bfloat16, generator=g)
    b = torch.randn(n, n, device=dev, dtype=torch.bfloat16, generator=g)
    iters = 10

    def matmuls() -> None:
        for _ in range(iters):
            torch.mm(a, b)

    return 2 * n**3 * iters / _best_time(matmuls, sync, repeats)


def _cuda_copy_rates(dev: torch.device, copy_bytes: int, repeats: int,
                     sync: Callable[[], None]) -> tuple[float, float, float, float, float]:
    """Device memory bandwidth, pinned H2D and D2H alone, each way at once, pinned allocation s/GiB."""
    numel = copy_bytes // 4
    dsrc = torch.empty(numel, device=dev)
    ddst = torch.empty_like(dsrc)
    # a device-to-device copy reads and writes every byte
    memory_bandwidth = 2 * copy_bytes / _best_time(lambda: ddst.copy_(dsrc), sync, repeats)

    t0 = time.perf_counter()
    h_in = torch.empty(numel, pin_memory=True)
    pinned_alloc_s_per_gib = (time.perf_counter() - t0) * _GIB / copy_bytes
    h_out = torch.empty(numel, pin_memory=True)
    up, down = torch.cuda.Stream(dev), torch.cuda.Stream(dev)

    def h2d() -> None:
        ddst.copy_(h_in, non_blocking=True)

    def d2h() -> None:
        h_out.copy_(dsrc, non_blocking=True)

    def both() -> None:
        # each direction on its own stream so that the two copy engines run at once; the sync after
        # (in _best_time) waits for the whole device, both streams included
        with torch.cuda.stream(up):
            h2d()
        with torch.cuda.stream(down):
            d2h()

    h2d_bw = copy_bytes / _best_time(h2d, sync, repeats)
    d2h_bw = copy_bytes / _best_time(d2h, sync, repeats)
    duplex_bw = copy_bytes / _best_time(both, sync, repeats)
    return memory_bandwidth, h2d_bw, d2h_bw, duplex_bw, pinned_alloc_s_per_gib


def _measure_cuda(dev: torch.device, name: str, n: int, copy_bytes: int, adam_numel: int,
                  repeats: int) -> MachineProfile:
    def sync() -> None:
        torch.cuda.synchronize(dev)  # host-device sync: these are wall-clock rates

    with torch.cuda.device(dev):
        matmul_flops = _cuda_matmul_rate(dev, n, repeats, sync)
        memory_bandwidth, h2d_bw, d2h_bw, duplex_bw, alloc_s = _cuda_copy_rates(dev, copy_bytes, repeats, sync)
        total = torch.cuda.get_device_properties(dev).total_memory
        # copies both ways while the host AdamW runs, as in training: the optimizer's own traffic, each stepped
        # parameter's fp32 gradient out and fp32 master back (OPTIMIZER_LINK_BYTES_PER_PARAM each way). A link kept
        # full both ways for the whole step took ~25% more of the host's memory bandwidth than training does: the
        # rate so measured was 0.75-0.8 of the host step's in training (W1 and GPT-2-XL on the H100, 9 plans)
        numel = copy_bytes // 4
        h_in, h_out = torch.empty(numel, pin_memory=True), torch.empty(numel, pin_memory=True)
        d_in, d_out = torch.empty(numel, device=dev), torch.empty(numel, device=dev)
        up, down = torch.cuda.Stream(dev), torch.cuda.Stream(dev)
        copies = max(1, math.ceil(OPTIMIZER_LINK_BYTES_PER_PARAM * adam_numel / copy_bytes))

        def busy_link() -> None:
            sync()  # host-device sync: the previous repeat's copies are done
            for _ in range(copies):
                with torch.cuda.stream(up):
                    d_in.copy_(h_in, non_blocking=True)
                with torch.cuda.stream(down):
                    h_out.copy_(d_out, non_blocking=True)

        host_adam = _host_adam_rate(adam_numel, max(repeats, HOST_ADAM_REPEATS), busy_link)
        sync()

    return MachineProfile(
        name=name, device_memory_bytes=int(total), matmul_flops=matmul_flops, memory_bandwidth=memory_bandwidth,
        h2d_bandwidth=h2d_bw, d2h_bandwidth=d2h_bw, duplex_bandwidth=duplex_bw,
        host_adam_params_per_s=host_adam, host_memory_bytes=host_memory_bytes(),
        pinned_alloc_s_per_gib=alloc_s, source="measured",
    )


def measure_shared_link(device: str | torch.device, *, copy_bytes: int = 256 << 20, repeats: int = 3,
                        group: Any = None) -> tuple[float, float, float]:
    """This host's link as each rank of ``group`` sees it while every rank copies at once: the rates (bytes/s) of
    pinned copies to the device, from it, and each way with both running, the slowest rank's of each.

    A collective: every rank of ``group`` (default: the whole world) must call it, each on its own GPU. Data-parallel
    ranks copy at the same time (activations, optimizer traffic), and the GPUs of one host need not each have a
    link of their own: on the lent 4-GPU H200 host, 55 GB/s each way for one GPU alone fell to 40 to the device and
    33 from it per GPU with all four copying, and to 21 each way with both ways busy (``benchmarks/host_link.py``).
    Each measurement starts after a barrier, so that all ranks copy together; the best of ``repeats`` counts.

    Raises:
        ValueError: ``device`` is not a CUDA device, or the process group is not initialised.
    """
    import torch.distributed as dist

    dev = torch.device(device)
    if dev.type != "cuda" or not torch.cuda.is_available():
        raise ValueError(f"measure_shared_link measures a CUDA device's link, got {dev}")
    if not dist.is_available() or not dist.is_initialized():
        raise ValueError("measure_shared_link is a collective: initialise the process group first")
    numel = copy_bytes // 4
    with torch.cuda.device(dev):
        d_in, d_out = torch.empty(numel, device=dev), torch.empty(numel, device=dev)
        h_in, h_out = torch.empty(numel, pin_memory=True), torch.empty(numel, pin_memory=True)
        up, down = torch.cuda.Stream(dev), torch.cuda.Stream(dev)

        def h2d() -> None:
            with torch.cuda.stream(up):
                d_in.copy_(h_in, non_blocking=True)

        def d2h() -> None:
            with torch.cuda.stream(down):
                h_out.copy_(d_out, non_blocking=True)

        def both() -> None:
            h2d()
            d2h()

        def sync() -> None:
            torch.cuda.synchronize(dev)  # host-device sync: wall-clock rates

        # every timed repeat starts after a barrier (untimed), so that all ranks copy at once
        rates = [copy_bytes / _best_time(fn, sync, repeats, start=lambda: dist.barrier(group))
                 for fn in (h2d, d2h, both)]
    everyone: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(everyone, rates, group=group)
    h2d_bw, d2h_bw, duplex_bw = (min(r[i] for r in everyone) for i in range(3))
    logger.info("link with every rank copying: %.1f GB/s to the device, %.1f from it, %.1f each way at once "
                "(slowest of %d ranks)", h2d_bw / 1e9, d2h_bw / 1e9, duplex_bw / 1e9, len(everyone))
    return h2d_bw, d2h_bw, duplex_bw


def machine_for(device: str | torch.device, *, cache_dir: str | Path | None = None) -> MachineProfile:
    """The profile :func:`elbowroom.plan.profiler` uses when given no machine: measured for a CUDA or CPU
    device (cached in ``cache_dir`` when given).

    Args:
        device: the device the model lives on.
        cache_dir: see :func:`measure_machine`.

    Returns:
        The measured :class:`MachineProfile`.
    """
    return measure_machine(device, cache_dir=cache_dir)
