"""The host pool of activation offload: exact-size slots carved from a few large host chunks.

Pinned memory costs ~0.5 s per GiB to allocate, so the pool grows only while the first step runs and
hands the same slots out again every step after; host memory is never returned.
"""

from __future__ import annotations

import logging
import threading
from typing import Any

import torch

logger = logging.getLogger(__name__)

_ALIGN = 512  # slot alignment inside a host chunk (bytes)
_DEFAULT_CHUNK_BYTES = 256 << 20  # a power of two: torch's pinned allocator rounds sizes up to one


def _next_pow2(n: int) -> int:
    return 1 << max(0, n - 1).bit_length()


class _Slot:
    __slots__ = ("buf", "nbytes", "last_read")

    def __init__(self, buf: torch.Tensor) -> None:
        self.buf = buf
        self.nbytes = buf.numel()
        self.last_read: Any = None  # event of the last host-to-device copy out of this slot


class _HostPool:
    """Exact-size slots carved from a few large host chunks; freed slots are reused by size.

    With the same shapes every step, step 2 onward finds every slot it needs in the free lists and
    allocates nothing. Host memory is never returned: the pool is as large as the largest step.
    """

    def __init__(self, pin: bool, limit: int | None, chunk_bytes: int) -> None:
        self.pin = pin
        self.limit = limit
        self.chunk_bytes = chunk_bytes
        self.free: dict[int, list[_Slot]] = {}
        self.chunk: torch.Tensor | None = None
        self.chunk_off = 0
        self.reserved_bytes = 0  # host bytes allocated
        self.in_use_bytes = 0  # bytes of slots handed out and not yet returned
        self.allocations = 0  # host allocations made (each one a cudaHostAlloc when pinned)
        self.lock = threading.Lock()  # slots come back from autograd's threads

    def reserve(self, nbytes: int) -> None:
        with self.lock:
            if self.chunk is None or self.chunk.numel() - self.chunk_off < nbytes:
                self._grow(nbytes, nbytes)

    def acquire(self, nbytes: int) -> _Slot:
        with self.lock:
            lst = self.free.get(nbytes)
            if lst:
                slot = lst.pop()
            else:
                slot = self._carve(nbytes)
            self.in_use_bytes += slot.nbytes
            return slot

    def release(self, slot: _Slot) -> None:
        with self.lock:
            self.in_use_bytes -= slot.nbytes
            self.free.setdefault(slot.nbytes, []).append(slot)

    def _carve(self, nbytes: int) -> _Slot:
        if self.chunk is None or self.chunk.numel() - self.chunk_off < nbytes:
            room = None if self.limit is None else self.limit - self.reserved_bytes
            if room is not None and room < nbytes:
                # no room for a new chunk: a larger free slot will do (shapes changed between steps)
                sizes = [s for s, lst in self.free.items() if lst and s >= nbytes]
                if sizes:
                    return self.free[min(sizes)].pop()
                need = self.in_use_bytes + nbytes
                raise ValueError(
                    f"activation offload needs at least {need} bytes ({need / 2**30:.2f} GiB) of host memory "
                    f"for the tensors saved so far, above host_memory_limit_bytes={self.limit} "
                    f"({self.limit / 2**30:.2f} GiB); raise host_memory_limit_bytes, lower offload_ratio, "
                    "or offload only the inputs of checkpointed blocks"
                )
            self._grow(nbytes, max(self.chunk_bytes, _next_pow2(nbytes)), room)
        buf = self.chunk[self.chunk_off : self.chunk_off + nbytes]
        self.chunk_off += -(-nbytes // _ALIGN) * _ALIGN
        return _Slot(buf)

    def _grow(self, nbytes: int, size: int, room: int | None = None) -> None:
        if room is None and self.limit is not None:
            room = self.limit - self.reserved_bytes
        if room is not None:
            if room < nbytes:
                raise ValueError(
                    f"activation offload needs {nbytes} more bytes of host memory, above "
                    f"host_memory_limit_bytes={self.limit}; raise the limit"
                )
            if size > room:
                # torch's pinned allocator rounds up to a power of two: ask for one that fits
                size = max(nbytes, 1 << (room.bit_length() - 1))
        # HOST ALLOCATION (and, for pinned memory, possibly a device sync inside cudaHostAlloc): slow,
        # ~0.5 s per GiB pinned; it happens while the first step runs, never after for fixed shapes
        self.chunk = torch.empty(size, dtype=torch.uint8, pin_memory=self.pin)
        self.chunk_off = 0
        self.reserved_bytes += size
        self.allocations += 1
        logger.debug("offload host pool: +%d bytes (%d in %d allocations)", size, self.reserved_bytes,
                     self.allocations)
