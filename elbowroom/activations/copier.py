"""Copiers for activation offload: how bytes move between the device and the host pool.

Two implementations of one small interface (``copy_out``, ``copy_in``, ``done``, ``wait``,
``current_stream``) that :class:`~elbowroom.activations.offload.OffloadEngine` drives:

- :class:`_CudaCopier`: two side streams (device-to-host, host-to-device), each ordered by events
  against the compute stream; nothing here blocks the host.
- :class:`_CpuCopier`: synchronous copies into a separate host buffer, with events that can report
  "not done" a set number of times, so the CPU tests exercise the engine's deferred bookkeeping.
"""

from __future__ import annotations

from typing import Any

import torch


class _CpuEvent:
    """Stands in for a CUDA event on CPU; ``delay`` > 0 makes it report "not done" that many times."""

    __slots__ = ("left",)

    def __init__(self, delay: int) -> None:
        self.left = delay

    def query(self) -> bool:
        if self.left > 0:
            self.left -= 1
            return False
        return True


class _CpuCopier:
    """Synchronous copies into a separate host buffer: the CPU path of the same bookkeeping."""

    def __init__(self, event_delay: int = 0) -> None:
        self.event_delay = event_delay

    def copy_out(self, dst: torch.Tensor, src: torch.Tensor, after: Any) -> _CpuEvent:
        dst.copy_(src)
        return _CpuEvent(self.event_delay)

    def copy_in(self, dst: torch.Tensor, src: torch.Tensor, after: Any) -> _CpuEvent:
        dst.copy_(src)
        return _CpuEvent(self.event_delay)

    def done(self, ev: _CpuEvent) -> bool:
        return ev.query()

    def wait(self, ev: _CpuEvent | None, stream: Any = None) -> None:
        if ev is not None:
            ev.left = 0

    def current_stream(self) -> None:
        return None


class _CudaCopier:
    """Copies on two side streams: device-to-host and host-to-device, each ordered by events."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.d2h = torch.cuda.Stream(device)
        self.h2d = torch.cuda.Stream(device)

    def current_stream(self) -> torch.cuda.Stream:
        return torch.cuda.current_stream(self.device)

    def copy_out(self, dst: torch.Tensor, src: torch.Tensor, after: torch.cuda.Event | None) -> torch.cuda.Event:
        # STREAM WAIT: the saved tensor was produced by work queued on the compute stream
        self.d2h.wait_stream(self.current_stream())
        if after is not None:
            # STREAM WAIT: the slot's previous content may still be read by a host-to-device copy
            self.d2h.wait_event(after)
        with torch.cuda.stream(self.d2h):
            dst.copy_(src, non_blocking=True)
            return self.d2h.record_event()

    def copy_in(self, dst: torch.Tensor, src: torch.Tensor, after: torch.cuda.Event | None) -> torch.cuda.Event:
        # STREAM WAIT: ``dst`` was just allocated on the compute stream, whose queued work may still be
        # using that memory (the caching allocator reuses blocks in compute-stream order)
        self.h2d.wait_stream(self.current_stream())
        if after is not None:
            # STREAM WAIT: the device-to-host copy that filled the slot must have finished
            self.h2d.wait_event(after)
        with torch.cuda.stream(self.h2d):
            dst.copy_(src, non_blocking=True)
            return self.h2d.record_event()

    def done(self, ev: torch.cuda.Event) -> bool:
        return ev.query()  # non-blocking: no host-device sync

    def wait(self, ev: torch.cuda.Event | None, stream: torch.cuda.Stream | None = None) -> None:
        if ev is not None:
            # STREAM WAIT (no host sync): later work on ``stream`` (the compute stream) runs after ``ev``
            (stream or self.current_stream()).wait_event(ev)
