"""The device table: what the planner assumes about a GPU it has not measured.

Every rate is an *achievable* one, not the data-sheet peak: "data-sheet x efficiency", where the efficiency
is what we measured on the lent H100 (bf16 matmul 779 of 989 TFLOP/s = 0.79; HBM ~2.6 of 3.35 TB/s = 0.78;
pinned copies 55 of 64 GB/s on PCIe 5 x16 = 0.86 each way alone, 45 at once) carried over to the other
parts, which share the architecture (A100, H200) or the link (PCIe 4 on A100, L4, RTX 4090: 32 GB/s raw,
~25 alone and ~20 at once measured on such hosts in public reports). Where a part is power-limited (L4,
72 W) the matmul efficiency is taken lower. ``measure_machine`` (``elbowroom.plan.machine``) replaces these
numbers with measured ones on the machine itself; the table is for planning ahead of time (the analytic
profile) and for tests.

Host-side numbers (host AdamW rate, host memory) belong to the host, not the GPU: the table carries the
rate measured on the lent H100 host, and host memory defaults to this machine's physical memory (pass
``host_memory_bytes`` to plan for another host).
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
from collections.abc import Iterator
from typing import Any

from elbowroom.plan.types import MachineProfile

__all__ = ["ALIASES", "DEVICES", "get_device", "host_memory_bytes"]

_GIB = 1 << 30
_MIB = 1 << 20

# Host fused AdamW on fp32 masters, a property of the host, not of the GPU: 3 G params/s for the PCIe 4 hosts of the
# A100/L4/RTX 4090 entries (not measured here; a conservative server figure). The H100/H200 SXM hosts measure 3.7-4.4
# beside the optimizer's own copies (the lent H100's, ``measure_machine``, BENCHMARKS.md 2026-11-24 fifth session);
# at 3 the analytic H100 profile priced W1's plans 1.2-1.45x the measured profile's, at 4 within 0.92-1.18.
_HOST_ADAM = 3e9
_HOST_ADAM_SXM = 4e9
# PCIe 4 x16 (A100, L4, RTX 4090): 32 GB/s raw; ~25 each way alone and ~20 each way at once achievable.
_PCIE4 = {"h2d_bandwidth": 25e9, "d2h_bandwidth": 25e9, "duplex_bandwidth": 20e9}
# PCIe 5 x16 (H100 / H200 SXM hosts): 55 each way alone, 45 at once, measured on the lent H100.
_PCIE5 = {"h2d_bandwidth": 55e9, "d2h_bandwidth": 55e9, "duplex_bandwidth": 45e9}

DEVICES: dict[str, MachineProfile] = {
    # measured on the lent H100 (DESIGN.md): bf16 matmul 779 TFLOP/s (data sheet 989 dense), HBM3 3.35 TB/s
    # data sheet x 0.78 = 2.6 TB/s; 81559 MiB is what the driver reports
    "h100-80gb": MachineProfile(
        name="h100-80gb", device_memory_bytes=81_559 * _MIB, matmul_flops=779e12, memory_bandwidth=2.6e12,
        host_adam_params_per_s=_HOST_ADAM_SXM, host_memory_bytes=0, **_PCIE5,
    ),
    # same GH100 die and 700 W as the H100 SXM, so the H100's measured matmul rate; HBM3e 4.8 TB/s x 0.78
    "h200": MachineProfile(
        name="h200", device_memory_bytes=143_771 * _MIB, matmul_flops=779e12, memory_bandwidth=3.74e12,
        host_adam_params_per_s=_HOST_ADAM_SXM, host_memory_bytes=0, **_PCIE5,
    ),
    # A100 SXM: bf16 dense 312 TFLOP/s x 0.8 (cuBLAS reaches ~250 on large GEMMs); HBM2 1.555 TB/s x 0.8
    "a100-40gb": MachineProfile(
        name="a100-40gb", device_memory_bytes=40_960 * _MIB, matmul_flops=250e12, memory_bandwidth=1.24e12,
        host_adam_params_per_s=_HOST_ADAM, host_memory_bytes=0, **_PCIE4,
    ),
    # A100 80GB SXM: same compute; HBM2e 2.039 TB/s x 0.8
    "a100-80gb": MachineProfile(
        name="a100-80gb", device_memory_bytes=81_920 * _MIB, matmul_flops=250e12, memory_bandwidth=1.63e12,
        host_adam_params_per_s=_HOST_ADAM, host_memory_bytes=0, **_PCIE4,
    ),
    # L4: bf16 dense 121 TFLOP/s x 0.6 (72 W power cap throttles long GEMMs); GDDR6 300 GB/s x 0.8
    "l4-24gb": MachineProfile(
        name="l4-24gb", device_memory_bytes=23_034 * _MIB, matmul_flops=72e12, memory_bandwidth=240e9,
        host_adam_params_per_s=_HOST_ADAM, host_memory_bytes=0, **_PCIE4,
    ),
    # RTX 4090: bf16 dense with fp32 accumulate 165 TFLOP/s x 0.8; GDDR6X 1008 GB/s x 0.8
    "rtx4090-24gb": MachineProfile(
        name="rtx4090-24gb", device_memory_bytes=24_564 * _MIB, matmul_flops=132e12, memory_bandwidth=806e9,
        host_adam_params_per_s=_HOST_ADAM, host_memory_bytes=0, **_PCIE4,
    ),
    # a CPU "device": no link (the host is the device), a modest placeholder matmul rate (measure_machine
    # measures the real one); device memory is host memory (filled in by get_device)
    "cpu": MachineProfile(
        name="cpu", device_memory_bytes=0, matmul_flops=100e9, memory_bandwidth=20e9, h2d_bandwidth=0.0,
        d2h_bandwidth=0.0, duplex_bandwidth=0.0, host_adam_params_per_s=1e9, host_memory_bytes=0,
        pinned_alloc_s_per_gib=0.0,
    ),
}
"""Known devices by name. Names are ``<part>-<memory>`` in lower case, as users type them (``--device h100-80gb``)."""

ALIASES = {"h100": "h100-80gb", "h200-141gb": "h200", "a100": "a100-80gb", "l4": "l4-24gb", "rtx4090": "rtx4090-24gb",
           "4090": "rtx4090-24gb"}
"""Short names :func:`get_device` accepts for the table's devices."""


def host_memory_bytes() -> int:
    """Physical memory of this host (0 where the OS does not say)."""
    try:
        return int(os.sysconf("SC_PHYS_PAGES")) * int(os.sysconf("SC_PAGE_SIZE"))
    except (ValueError, OSError, AttributeError):
        return 0


def get_device(name: str, *, host_memory: int | None = None) -> MachineProfile:
    """The table's profile of device ``name``.

    Args:
        name: a key of :data:`DEVICES` (``h100-80gb``, ``h200``, ``a100-40gb``, ``a100-80gb``, ``l4-24gb``,
            ``rtx4090-24gb``, ``cpu``), case-insensitive; short aliases such as ``h100`` are accepted.
        host_memory: bytes of host memory to plan with; None uses this machine's physical memory.

    Returns:
        The :class:`MachineProfile` (``source="table"``).

    Raises:
        ValueError: for an unknown name, listing the known ones.
    """
    key = name.strip().lower()
    key = ALIASES.get(key, key)
    if key not in DEVICES:
        raise ValueError(
            f"unknown device {name!r}; known devices: {', '.join(DEVICES)} (or measure this one with "
            "elbowroom.plan.measure_machine)"
        )
    host = host_memory_bytes() if host_memory is None else int(host_memory)
    prof = dataclasses.replace(DEVICES[key], host_memory_bytes=host)
    if key == "cpu":
        prof = dataclasses.replace(prof, device_memory_bytes=host)
    return prof


def allocator_settings_setter() -> Any:
    """The function that changes the CUDA caching allocator's settings at run time, or None (older torch).

    torch 2.9+ has ``torch._C._accelerator_setAllocatorSettings``; ``torch.cuda.memory._set_allocator_settings``
    before it (still there, with a FutureWarning).
    """
    import torch

    setter = getattr(torch._C, "_accelerator_setAllocatorSettings", None)
    if setter is None:
        setter = getattr(torch.cuda.memory, "_set_allocator_settings", None)
    return setter


def expandable_segments_on() -> bool | None:
    """Whether the CUDA caching allocator runs with ``expandable_segments:True`` now (the environment's
    ``PYTORCH_CUDA_ALLOC_CONF`` as torch parsed it, or a run-time setting); None when this torch cannot say.

    Torch 2.11 can set the option at run time but has no getter. There a fresh 4 MiB block is
    allocated on the current CUDA device (after ``empty_cache``, so that it opens a segment of the current
    setting) and the allocator's snapshot says whether its segment is expandable.
    """
    import torch

    getter = getattr(torch._C, "_accelerator_getAllocatorSettings", None)
    if getter is not None:
        return "expandable_segments:true" in str(getter()).replace(" ", "").lower()
    if not torch.cuda.is_available():
        return None
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    x = torch.empty(4 << 20, dtype=torch.uint8, device="cuda")  # large pool: the small one is never expandable
    try:
        return segment_is_expandable(torch.cuda.memory._snapshot().get("segments", []), x.data_ptr())
    finally:
        del x
        torch.cuda.empty_cache()


@contextlib.contextmanager
def expandable_segments(on: bool) -> Iterator[bool]:
    """Run the block with the CUDA caching allocator's ``expandable_segments`` set to ``on``, from an empty cache,
    and give the process's setting back after it (and empty the cache again, so that no segment of the borrowed
    setting outlives it). Yields whether the setting is ``on`` inside: False when this torch cannot tell or cannot
    switch it at run time.

    What a measure of one setting needs: a process that runs with the other (the environment's
    ``PYTORCH_CUDA_ALLOC_CONF``, or an earlier plan's choice) would otherwise measure that one. The 7B shape planned
    again in a process whose first plan had switched expandable segments on measured the defaults' margin as 0.35
    GiB, chose the defaults on it and, still running expandable segments, ran out of memory holding 1.96 GiB beyond
    its tensors (``BENCHMARKS.md``, twenty-sixth session)."""
    import torch

    if not torch.cuda.is_available():
        yield False
        return
    was, setter = expandable_segments_on(), allocator_settings_setter()
    if was is None or (was != on and setter is None):
        yield False
        return
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    if was != on:
        setter(f"expandable_segments:{on}")
    try:
        yield True
    finally:
        if was != on:
            torch.cuda.synchronize()
            setter(f"expandable_segments:{was}")
        torch.cuda.empty_cache()


def segment_is_expandable(segments: list[dict[str, Any]], address: int) -> bool | None:
    """Whether the allocator segment holding ``address`` is expandable, from a snapshot's ``segments``; None when
    no segment holds it or the snapshot does not say."""
    for seg in segments:
        start = int(seg.get("address", -1))
        if start <= address < start + int(seg.get("total_size", 0)):
            flag = seg.get("is_expandable")
            return None if flag is None else bool(flag)
    return None
