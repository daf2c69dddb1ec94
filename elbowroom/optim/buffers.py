"""Host buffers and copy streams of the CPU-offloaded optimizer: pinned memory, the staging slot pool, streams.

``HostMemory`` counts (and on CUDA page-locks) every host buffer the optimizer allocates; ``SlotPool`` is the
bounded set of pinned staging slots gradients cross the link in; ``Streams`` holds the D2H and H2D copy streams
of one device, or inert stand-ins on a CPU-only machine (copies are plain copies and events are ``None``, so
the bookkeeping above them is the same and is what the CPU tests exercise).

Thread safety: ``SlotPool`` is shared by the copy thread and the step thread and guards its free list with its
own condition variable. ``HostMemory`` allocates on the training thread at set-up and is released by whoever
shuts the optimizer down, after the worker threads are joined. ``Streams`` holds one mutable thing, the copy
streams' cast buffers, behind a lock (both worker threads cast on the device-to-host stream).
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Sequence
from typing import Any

import torch

# staging views start on this byte boundary (any dtype can view it; DMA likes aligned starts)
_ALIGN = 256


def align(n: int) -> int:
    """``n`` rounded up to the staging alignment (256 bytes)."""
    return (n + _ALIGN - 1) // _ALIGN * _ALIGN


def piece_spans(n: int, piece: int) -> list[tuple[int, int]]:
    """``[a, e)`` ranges of ``piece`` elements covering ``n`` (the last one may be shorter)."""
    return [(a, min(n, a + piece)) for a in range(0, n, piece)]


def nbytes(t: torch.Tensor) -> int:
    """Bytes of a tensor's elements."""
    return t.numel() * t.element_size()


def cast_through(dst: torch.Tensor, src: torch.Tensor, scratch: torch.Tensor, non_blocking: bool = False) -> int:
    """``dst.copy_(src)`` where the two differ in dtype and one of them is on the host, through ``scratch`` (a flat
    buffer on the device of the dtype that crosses the link) a chunk at a time: the chunk's copy and cast, then the
    next. On one stream each chunk's work runs after the previous chunk's, so one buffer serves every chunk. Returns
    the bytes that crossed the link (``scratch``'s dtype)."""
    d, s = dst.view(-1), src.reshape(-1)
    n, k = s.numel(), scratch.numel()
    for a in range(0, n, k):
        e = min(n, a + k)
        scratch[: e - a].copy_(s[a:e], non_blocking=non_blocking)
        d[a:e].copy_(scratch[: e - a], non_blocking=non_blocking)
    return n * scratch.element_size()


class Streams:
    """The copy streams and events of one CUDA device, or inert stand-ins on CPU (events are None)."""

    def __init__(self, device: torch.device, cast_chunk_bytes: int = 64 << 20) -> None:
        self.device = device
        self.cast_chunk_bytes = cast_chunk_bytes  # each copy stream's cast buffer (copy_cast)
        self.cuda = device.type == "cuda"
        self.d2h: Any = torch.cuda.Stream(device) if self.cuda else None
        self.h2d: Any = torch.cuda.Stream(device) if self.cuda else None
        # the streamed parameters' state, up and back (stream_step): streams of their own, so that the host-stepped
        # buckets' gradients and weights do not queue behind it (on one stream the link carried one, then the other)
        self.state_h2d: Any = torch.cuda.Stream(device) if self.cuda else None
        self.state_d2h: Any = torch.cuda.Stream(device) if self.cuda else None
        self._casts: dict[int, torch.Tensor] = {}  # stream -> its cast buffer (copy_cast), made on first use
        self._cast_lock = threading.Lock()

    def copy_cast(self, dst: torch.Tensor, src: torch.Tensor) -> int:
        """``dst.copy_(src)`` across the link and across dtypes, the cast on the device, queued on this thread's
        current stream (a copy stream); the bytes that crossed. The cast goes through the stream's buffer of
        ``cast_chunk_bytes`` (:func:`cast_through`), so the copy streams allocate nothing else: casting whole
        tensors left each copy stream's pool holding an fp32 copy of the largest tensor it ever cast, which the
        compute stream cannot reuse (the 7B shape: 0.49 GiB on each of two streams, beside a compute stream
        retrying its allocations at the budget; ``BENCHMARKS.md``). On CPU the same chunks, one buffer for the
        stand-in streams."""
        # what crosses the link: the host's side, the wider of the two (fp32 masters and gradients, bf16 weights)
        dtype = src.dtype if src.element_size() >= dst.element_size() else dst.dtype
        if dst.dtype == src.dtype or not dst.is_contiguous():
            dst.copy_(src.to(dtype), non_blocking=self.cuda)
            return src.numel() * dtype.itemsize
        key = torch.cuda.current_stream(self.device).cuda_stream if self.cuda else 0
        with self._cast_lock:  # the chunks of one tensor are queued together: the buffer is the stream's
            buf = self._casts.get(key)
            if buf is None:
                # allocated on the copy stream: its pool holds this buffer and nothing more
                buf = self._casts[key] = torch.empty(self.cast_chunk_bytes, dtype=torch.uint8, device=self.device)
            return cast_through(dst, src, buf.view(dtype), non_blocking=self.cuda)

    def after_updates(self) -> None:
        """Order later work of this thread's current stream after every weight update enqueued so far (a stream
        wait; a no-op on CPU)."""
        if self.cuda:
            cur = torch.cuda.current_stream(self.device)
            cur.wait_stream(self.h2d)
            cur.wait_stream(self.state_h2d)

    def sync_updates(self) -> None:
        """Host wait until every weight update enqueued so far has landed (a no-op on CPU)."""
        if self.cuda:
            self.h2d.synchronize()
            self.state_h2d.synchronize()

    def record(self, stream: Any = None) -> Any:
        """An event at the current position of ``stream`` (default: this thread's current stream)."""
        if not self.cuda:
            return None
        ev = torch.cuda.Event()
        ev.record(stream if stream is not None else torch.cuda.current_stream(self.device))
        return ev

    def on(self, stream: Any) -> contextlib.AbstractContextManager:
        """Make ``stream`` this thread's current stream inside the block (a no-op on CPU)."""
        return torch.cuda.stream(stream) if self.cuda else contextlib.nullcontext()

    def stream_wait(self, stream: Any, event: Any) -> None:
        """Order later work of ``stream`` after ``event`` (device side)."""
        if event is not None:
            stream.wait_event(event)  # stream wait (device side): no host synchronize

    @staticmethod
    def host_wait(event: Any) -> None:
        """Block this (worker) thread until ``event`` completed."""
        if event is not None:
            event.synchronize()  # host waits for the device: only ever called on a worker thread

    @staticmethod
    def done(event: Any) -> bool:
        """Whether ``event`` completed (a query, no wait; None, as on a CPU-only machine, has)."""
        return event is None or bool(event.query())

    def bind_thread(self) -> None:
        """Set up a worker thread: no autograd, this device current."""
        torch.set_grad_enabled(False)
        if self.cuda:
            torch.cuda.set_device(self.device)


class HostMemory:
    """Host buffers of the optimizer, counted; on CUDA pinned ones are page-locked at their exact size.

    ``torch.empty(..., pin_memory=True)`` goes through the caching host allocator, which rounds every
    block up to a power of two (a 20 GiB master copy would pin 32 GiB); ``cudaHostRegister`` on a plain
    allocation pins exactly what is asked for.
    """

    def __init__(self, pin: bool) -> None:
        self.pin = pin
        self.pinned_bytes = 0
        self.pageable_bytes = 0
        self._registered: list[torch.Tensor] = []  # keeps each registered base alive while registered

    def empty(self, shape: Sequence[int] | int, dtype: torch.dtype, *, pinned: bool) -> torch.Tensor:
        """A new host tensor, page-locked if ``pinned`` and on a CUDA machine, counted either way.

        Args:
            shape: its shape.
            dtype: its dtype.
            pinned: page-lock it (the source or destination of asynchronous copies).

        Returns:
            The tensor (uninitialised).

        Raises:
            RuntimeError: the memory could not be page-locked.
        """
        t = torch.empty(shape, dtype=dtype)
        n = nbytes(t)
        if pinned and self.pin and n > 0:
            err = torch.cuda.cudart().cudaHostRegister(t.data_ptr(), n, 0)
            code = int(getattr(err, "value", err))
            if code != 0:
                raise RuntimeError(
                    f"CPUOffloadOptimizer could not pin {n / 2**30:.2f} GiB of host memory (cudaHostRegister "
                    f"error {code}; {self.pinned_bytes / 2**30:.2f} GiB pinned so far). Free host memory, raise "
                    "the locked-memory limit (ulimit -l), or offload fewer parameters (lower offload_fraction)."
                )
            self._registered.append(t)
            self.pinned_bytes += n
        else:
            self.pageable_bytes += n
        return t

    def release(self) -> None:
        """Unpin everything. The caller makes sure that no thread and no copy still reads or writes these
        buffers (the optimizer joins its worker threads and synchronizes the device first)."""
        registered, self._registered = self._registered, []
        for t in registered:
            torch.cuda.cudart().cudaHostUnregister(t.data_ptr())  # the tensor itself is freed with its last use


class Closed(Exception):
    """The optimizer was closed (or collected) while a worker waited for a staging slot: not a failure."""


class SlotPool:
    """A fixed set of pinned staging slots for gradients on their way to the host (bounded memory)."""

    def __init__(self, slots: list[torch.Tensor]) -> None:
        self.count = len(slots)
        self.slot_bytes = max((nbytes(t) for t in slots), default=0)
        self._free = list(slots)
        self._cv = threading.Condition()
        self._closed = False

    def acquire(self) -> torch.Tensor:
        """A free slot; raises ``Closed`` once the pool is closed and none is free."""
        with self._cv:
            while not self._free and not self._closed:
                self._cv.wait()
            if not self._free:
                raise Closed
            return self._free.pop()

    def release(self, slot: torch.Tensor) -> None:
        """Give a slot back (its contents were read) and wake one waiter."""
        with self._cv:
            self._free.append(slot)
            self._cv.notify()

    def close(self) -> None:
        """Wake every waiter: ``acquire`` raises ``Closed`` from now on when no slot is free."""
        with self._cv:
            self._closed = True
            self._cv.notify_all()

