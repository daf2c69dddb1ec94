"""CPU-offloaded and hybrid optimizer: fp32 master weights and optimizer state in host memory.

``CPUOffloadOptimizer`` wraps a torch optimizer class. The parameters it offloads keep their master
weights and optimizer state on the host and step there with the torch CPU kernel of that class (fused
AdamW by default, one call per bucket of parameters, using torch's intra-op threads); the rest step on the
device with the class's fused device kernel, at the same time.

The pipeline for an offloaded parameter, when ``overlap=True``:

1. backward: a post-accumulate-grad hook fires when the gradient is final (on the last micro-batch only,
   see :meth:`CPUOffloadOptimizer.accumulating`); it records an event on the compute stream and hands the
   gradient to a copy thread once its bucket is complete;
2. the copy thread takes a slot of a bounded pinned staging pool and copies the bucket's gradients into it
   on a D2H stream that waits on that event (a stream wait, never a host synchronize);
3. a step thread waits for that copy (a host wait, on its own thread), applies the step's gradient scale
   (clipping, GradScaler), steps the bucket on the CPU and copies the updated weights back on an H2D stream;
4. ``step()`` waits for the step thread (a host wait for the CPU, not for the device) and makes the compute
   stream wait on the H2D stream, so the next forward reads the new weights.

When the step needs every gradient before any update (gradient clipping, GradScaler, gradients edited
after backward), the CPU steps start in ``step()``; otherwise they start during backward. Which of the two
applies is learned from the first step, or set with :attr:`CPUOffloadOptimizer.step_in_backward`. With
:meth:`CPUOffloadOptimizer.overlap_with_forward`, ``step()`` does not wait at all: each module waits for
its own weights in a forward pre-hook, so the CPU step of the late blocks runs behind the next forward.

A parameter bigger than a bucket (an output head, and on wide models every weight matrix) travels and steps piece
by piece with Adam/AdamW: the copy thread streams its gradient into the staging slots one piece per slot, ahead of
the step thread, which steps each piece, frees its slot and sends the piece's weights back. (A job held at a
closed gate is copied by the step thread itself, through two bucket-sized buffers of its own.)

Host memory per offloaded fp32 parameter (AdamW): 12 bytes (4 master, pinned; 8 moments, pageable), plus
``num_staging_slots`` pinned slots of the largest bucket and two piece buffers; ``offload_gradients`` adds a
pinned host gradient (+4 bytes: 16 in all), so that gradients leave the device at link speed whatever the CPU
step's pace, and accumulate there over micro-batches.

With low-precision device weights (``param_dtype=torch.bfloat16``) the casts run on the device by default
(:attr:`CPUOffloadOptimizer.cast_on_device`): a gradient is upcast there and travels in fp32, an updated
master travels from pinned memory into device scratch and is cast into the parameter there; the host step is
the same fused fp32 kernel as for fp32 weights (28 B of host memory traffic per parameter instead of 40 with
the casts on the host).

On a CPU-only machine the same code runs with the "device" parameters on the CPU: copies are plain copies
and events are ``None``, so the bookkeeping is the same and is what the CPU tests exercise.
"""

from __future__ import annotations

import contextlib
import dataclasses
import inspect
import logging
import math
import queue
import threading
import time
import weakref
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any, ClassVar

import torch
from torch.optim import Optimizer

from elbowroom.optim import _host_adam

__all__ = ["CPUOffloadOptimizer"]

logger = logging.getLogger(__name__)

# param-group keys that describe how an optimizer runs, not what it computes: each inner optimizer keeps
# its own (a fused CPU kernel here, a fused CUDA kernel there)
_IMPL_KEYS = frozenset({"params", "param_names", "fused", "foreach", "capturable", "differentiable"})
# staging views start on this byte boundary (any dtype can view it; DMA likes aligned starts)
_ALIGN = 256
# host gradient norms: float32 within a row of this many elements, float64 across rows (see _host_norm)
_NORM_ROW = 4096


def _align(n: int) -> int:
    return (n + _ALIGN - 1) // _ALIGN * _ALIGN


def _spans(n: int, piece: int) -> list[tuple[int, int]]:
    """``[a, e)`` ranges of ``piece`` elements covering ``n`` (the last one may be shorter)."""
    return [(a, min(n, a + piece)) for a in range(0, n, piece)]


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _accepts(cls: type, name: str) -> bool:
    try:
        return name in inspect.signature(cls).parameters
    except (TypeError, ValueError):
        return False


def _available_host_bytes() -> int | None:
    """MemAvailable from /proc/meminfo, or None where that is unknown."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def _host_norm(t: torch.Tensor) -> torch.Tensor:
    """The 2-norm of a host tensor, accurate to fp32 rounding (a float32 scalar on the CPU).

    torch's CPU ``vector_norm`` accumulates float32 squares in long sequential runs per vector lane: on a
    16.7M-element gradient it comes out ~7e-4 (relative) too small, where the GPU kernel and float64 agree
    to ~1e-7. Norms of rows of ``_NORM_ROW`` elements stay accurate in float32 and are combined in float64,
    at ~3x the cost of the plain kernel and without a float64 copy of the tensor.
    """
    flat = t.detach().reshape(-1)
    n = flat.numel() - flat.numel() % _NORM_ROW
    parts = []
    if n:
        parts.append(torch.linalg.vector_norm(flat[:n].view(-1, _NORM_ROW), dim=1).double())
    if n < flat.numel():
        parts.append(torch.linalg.vector_norm(flat[n:].double()).reshape(1))
    if not parts:
        return torch.zeros((), dtype=torch.float32)
    return torch.linalg.vector_norm(torch.cat(parts)).float()


def _owned(value: Any, device: torch.device) -> Any:
    """A tensor that already lives on ``device`` is copied; others are returned as they are.

    torch's ``Optimizer.load_state_dict`` keeps a state tensor that is already on the right device and
    dtype as it is (``value.to(...)`` returns ``value``): the loaded state would alias the source
    optimizer's, and two optimizers stepping on after a direct ``b.load_state_dict(a.state_dict())`` would
    both advance the same moments and step counts. (Tensors on another device are copied by torch anyway.)
    """
    if isinstance(value, torch.Tensor) and value.device == device:
        return value.clone()
    return value


def _same_value(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        if a is b:
            return True
        if not (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)):
            return False
        if a.device.type != "cpu" or b.device.type != "cpu":
            return False  # comparing device tensors would sync; treat a new tensor as a change
        return a.shape == b.shape and bool(torch.equal(a, b))
    try:
        return bool(a == b)
    except (RuntimeError, ValueError):
        return a is b


# ---------------------------------------------------------------------------------------------- device
class _Streams:
    """The copy streams and events of one CUDA device, or inert stand-ins on CPU (events are None)."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.cuda = device.type == "cuda"
        self.d2h: Any = torch.cuda.Stream(device) if self.cuda else None
        self.h2d: Any = torch.cuda.Stream(device) if self.cuda else None

    def record(self, stream: Any = None) -> Any:
        """An event at the current position of ``stream`` (default: this thread's current stream)."""
        if not self.cuda:
            return None
        ev = torch.cuda.Event()
        ev.record(stream if stream is not None else torch.cuda.current_stream(self.device))
        return ev

    def on(self, stream: Any) -> contextlib.AbstractContextManager:
        return torch.cuda.stream(stream) if self.cuda else contextlib.nullcontext()

    def stream_wait(self, stream: Any, event: Any) -> None:
        if event is not None:
            stream.wait_event(event)  # stream wait (device side): no host synchronize

    @staticmethod
    def host_wait(event: Any) -> None:
        if event is not None:
            event.synchronize()  # host waits for the device: only ever called on a worker thread

    def bind_thread(self) -> None:
        torch.set_grad_enabled(False)
        if self.cuda:
            torch.cuda.set_device(self.device)


class _HostMemory:
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
        t = torch.empty(shape, dtype=dtype)
        n = _nbytes(t)
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
        """Unpin everything (the caller made sure no copy still reads or writes these buffers)."""
        for t in self._registered:
            with contextlib.suppress(Exception):  # at interpreter exit CUDA may already be gone
                torch.cuda.cudart().cudaHostUnregister(t.data_ptr())
        self._registered.clear()


class _Closed(Exception):
    """The optimizer was closed (or collected) while a worker waited for a staging slot: not a failure."""


class _SlotPool:
    """A fixed set of pinned staging slots for gradients on their way to the host (bounded memory)."""

    def __init__(self, slots: list[torch.Tensor]) -> None:
        self._free = list(slots)
        self._cv = threading.Condition()
        self._closed = False

    def acquire(self) -> torch.Tensor:
        """A free slot; raises ``_Closed`` once the pool is closed and none is free."""
        with self._cv:
            while not self._free and not self._closed:
                self._cv.wait()
            if not self._free:
                raise _Closed
            return self._free.pop()

    def release(self, slot: torch.Tensor) -> None:
        with self._cv:
            self._free.append(slot)
            self._cv.notify()

    def close(self) -> None:
        with self._cv:
            self._closed = True
            self._cv.notify_all()


# ------------------------------------------------------------------------------------------- bookkeeping
class _HostParam:
    """One offloaded parameter: its device tensor, its host master and where it stages in a slot."""

    def __init__(
        self, index: int, group: int, param: torch.Tensor, master: torch.Tensor, device_cast: bool = False
    ) -> None:
        self.index = index  # position over all param groups, as in state_dict()
        self.group = group
        self.param = param
        self.master = master  # host, same shape; fp32 with master_weights, else the param's dtype
        self.bucket: _Bucket
        self.offset = 0  # byte offset of its gradient (param dtype) in a staging slot
        self.elem_offset = 0  # element offset of its fp32 upcast in the step thread's scratch
        self.same_dtype = master.dtype == param.dtype
        # casts between the device dtype and the master's run on the device: gradients travel upcast, weights
        # travel as masters and are cast into the parameter there (host traffic: that of same-dtype params)
        self.device_cast = device_cast and not self.same_dtype
        self.stage_dtype = master.dtype if self.device_cast else param.dtype  # of a staged gradient
        # main-thread state of the current step
        self.final = False  # its final gradient was handed over
        self.accumulated = False  # earlier micro-batches sit in the host accumulator (offload_gradients)
        self.in_arrival = False
        self.early = False  # handed over by the hook during backward (before any post-backward edit)
        self.master_stale = self.same_dtype  # re-read the device weights into the master before stepping
        self.grad_ref: torch.Tensor | None = None  # the device grad handed over, to detect later edits
        self.grad_version = -1
        self.norm: torch.Tensor | None = None  # norm of the final grad, computed on the device in the hook
        # step-thread state
        # pinned host gradient in the param's dtype (offload_gradients only): the first copy of a step lands
        # here directly, at link speed; later micro-batches stage in a slot and are added to it
        self.hgrad: torch.Tensor | None = None
        self.hgrad_valid = False  # holds this step's gradient (set by the copy thread, reset after the step)

    def staging(self, slot: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
        """Its region of a staging slot, as a tensor of ``dtype`` (default: a staged gradient's)."""
        dtype = dtype or self.stage_dtype
        n = self.param.numel() * dtype.itemsize
        return slot[self.offset : self.offset + n].view(dtype).view(self.param.shape)


class _Bucket:
    """Consecutive offloaded parameters that travel and step together (one CPU optimizer call)."""

    def __init__(self, params: list[_HostParam], optimizer: Optimizer, group_map: list[int]) -> None:
        self.params = params
        self.optimizer = optimizer
        self.group_map = group_map  # inner param group i -> user param group index
        self.inner_of = {gi: i for i, gi in enumerate(group_map)}
        # Adam/AdamW with low-precision device weights: upcast, step and cast back chunk by chunk (_host_adam)
        self.chunked = _host_adam.supports(optimizer) and any(not hp.same_dtype for hp in params)
        self.arrived: list[tuple[_HostParam, torch.Tensor | None]] = []
        self.arrived_kind = "final"
        self.h2d_event: Any = None
        off = eoff = 0
        for hp in params:
            hp.bucket = self
            hp.offset, hp.elem_offset = off, eoff
            off += _align(hp.param.numel() * max(hp.param.element_size(), hp.stage_dtype.itemsize))
            eoff += _align(hp.param.numel() * 4) // 4
        self.staging_bytes = off
        self.scratch_numel = eoff
        # a parameter bigger than a staging slot travels and steps piece by piece (set by the optimizer)
        self.piece_numel = 0


@dataclasses.dataclass
class _Plan:
    """What the CPU steps of one optimizer step apply, fixed when their gate opens."""

    hyper: list[dict[str, Any]]
    mults: list[torch.Tensor] = dataclasses.field(default_factory=list)  # CPU fp32 scalars, in order
    skip: bool = False
    recopy: dict[int, torch.Tensor | None] = dataclasses.field(default_factory=dict)  # param index -> edited grad
    ready: Any = None  # compute-stream event after which re-copies may read


class _Gate:
    """Holds a step's CPU updates until the values they need are known."""

    def __init__(self) -> None:
        self.plan: _Plan | None = None
        self.open = False


@dataclasses.dataclass
class _Job:
    kind: str  # "accumulate" | "final"
    bucket: _Bucket
    params: list[_HostParam]
    grads: list[torch.Tensor | None]  # device grads (a reference keeps each alive until it is copied)
    fresh: list[bool]
    ready: Any  # compute-stream event: the grads are complete on the device
    staged: list[bool]  # set by the copy thread: this grad went to the slot (not to its host buffer)
    gate: _Gate | None
    refresh: list[_HostParam]
    slot: torch.Tensor | None = None
    copied: Any = None
    # a parameter stepped piece by piece whose pieces the copy thread streams through pool slots: (slot, piece,
    # D2H event) per piece, then None (an exception in place of a piece: the copy failed)
    pieces: queue.SimpleQueue | None = None
    pre_done: bool = False
    finished: bool = False


class _Engine:
    """The copy thread and the step thread of one optimizer."""

    def __init__(
        self,
        streams: _Streams,
        pool: _SlotPool,
        h2d_buffers: list[torch.Tensor],
        scratch: torch.Tensor | None,
        offload_gradients: bool,
        host_memory: _HostMemory,
        cpu_threads: int | None = None,
        chunked: bool = False,
        piece_slots: list[torch.Tensor] | None = None,
    ) -> None:
        self.streams = streams
        self.cpu_threads = cpu_threads
        self.chunked = chunked
        self.pool = pool
        # two pinned buffers of the step thread's own for parameters stepped piece by piece whose pieces it
        # copies itself (outside the pool: the step thread never waits for a slot that only it could free)
        self.piece_slots = piece_slots or []
        self.h2d_buffers = h2d_buffers
        self.h2d_events: list[Any] = [None] * len(h2d_buffers)
        self.h2d_next = 0
        self.scratch = scratch
        self.offload_gradients = offload_gradients
        self.host_memory = host_memory
        self._copy_q: queue.SimpleQueue = queue.SimpleQueue()
        self._step_q: queue.SimpleQueue = queue.SimpleQueue()
        self._cv = threading.Condition()
        self._outstanding = 0
        self._pre_outstanding = 0
        self.error: BaseException | None = None
        # counters, written by one thread each, read by the main thread when idle
        self.cpu_s = 0.0
        self.copy_wait_s = 0.0  # step thread: waiting for D2H copies (the device or the link is behind)
        self.trace: list[tuple[str, int, float, float]] | None = None  # (what, bucket's first index, t0, t1)
        self.d2h_bytes = 0  # copy thread
        self.recopy_bytes = 0  # step thread (re-copies, and the pieces of parameters stepped piece by piece)
        self.h2d_bytes = 0  # step thread
        self._threads = [
            threading.Thread(target=self._copy_loop, name="elbowroom-optim-d2h", daemon=True),
            threading.Thread(target=self._step_loop, name="elbowroom-optim-step", daemon=True),
        ]
        for t in self._threads:
            t.start()

    # ---- main thread
    def submit(self, job: _Job) -> None:
        with self._cv:
            self._outstanding += 1
            self._pre_outstanding += 1
        self._copy_q.put(job)

    def open_gate(self, gate: _Gate, plan: _Plan) -> None:
        gate.plan = plan
        gate.open = True
        self._step_q.put(gate)

    def wait_idle(self) -> None:
        """Host wait until every submitted job is done (its H2D copies are enqueued, not finished)."""
        with self._cv:
            while self._outstanding and self.error is None:
                self._cv.wait()
        self.raise_error()

    def wait_jobs(self, jobs: list[_Job]) -> None:
        """Host wait until these jobs are done (their H2D copies enqueued)."""
        with self._cv:
            while not all(j.finished for j in jobs) and self.error is None:
                self._cv.wait()
        self.raise_error()

    def wait_pre(self) -> None:
        """Host wait until every submitted job went through its pre-gate phase."""
        with self._cv:
            while self._pre_outstanding and self.error is None:
                self._cv.wait()
        self.raise_error()

    def raise_error(self) -> None:
        if self.error is not None:
            raise RuntimeError("the CPUOffloadOptimizer worker failed; the optimizer is unusable") from self.error

    def stop(self) -> None:
        self.pool.close()
        self._copy_q.put(None)
        for t in self._threads:
            if t is not threading.current_thread():
                t.join(timeout=10)

    # ---- worker threads
    def _done(self, job: _Job) -> None:
        if job.slot is not None:
            self.pool.release(job.slot)
            job.slot = None
        with self._cv:
            self._outstanding -= 1
            job.finished = True
            if not job.pre_done:
                job.pre_done = True
                self._pre_outstanding -= 1
            self._cv.notify_all()

    def _pre_done(self, job: _Job) -> None:
        with self._cv:
            job.pre_done = True
            self._pre_outstanding -= 1
            self._cv.notify_all()

    def _fail(self, exc: BaseException, job: _Job) -> None:
        if isinstance(exc, _Closed):  # shutting down (close(), or the optimizer was collected mid-step)
            if not job.finished:
                self._done(job)
            return
        logger.error("CPUOffloadOptimizer worker failed: %r", exc)
        with self._cv:
            if self.error is None:
                self.error = exc
        if not job.finished:  # _post's own finally may have finished it already
            self._done(job)

    def _copy_loop(self) -> None:
        self.streams.bind_thread()
        while True:
            job = self._copy_q.get()
            if job is None:
                self._step_q.put(None)
                return
            if self.error is not None:
                self._done(job)
                continue
            try:
                stream = self._copy(job)
            except BaseException as exc:  # noqa: BLE001 - handed to the main thread, which re-raises it
                self._fail(exc, job)
                continue
            grad = job.grads[0] if stream else None  # read before the hand-over: the step thread drops it
            self._step_q.put(job)
            if grad is not None:
                self._stream_pieces(job, grad)

    def _copy(self, job: _Job) -> bool:
        """Copy a job's gradients into a slot (or their host buffers); True when it is a parameter stepped piece
        by piece whose pieces this thread streams next, once the job is with the step thread."""
        s = self.streams
        pieces = bool(job.bucket.piece_numel)
        stream = pieces and self._streamable(job)
        if pieces:
            job.pieces = queue.SimpleQueue() if stream else None
        # a parameter too big for a slot is copied piece by piece, by this thread after the hand-over or else
        # by the step thread when it steps (the job keeps the device grad referenced until then); only a stale
        # master is re-read here
        todo = [] if pieces else [(i, hp, g) for i, (hp, g) in enumerate(zip(job.params, job.grads)) if g is not None]
        if not todo and not job.refresh:
            return stream
        dests = []
        for i, hp, _ in todo:
            if hp.hgrad is not None and not hp.hgrad_valid:
                dests.append(hp.hgrad)  # offload_gradients, first copy of this step: straight into place
                hp.hgrad_valid = True
            else:
                if job.slot is None:
                    job.slot = self.pool.acquire()  # may block until the step thread frees a slot
                dests.append(hp.staging(job.slot))
                job.staged[i] = True
        with s.on(s.d2h):
            s.stream_wait(s.d2h, job.ready)  # stream wait: copy only once backward has produced the grads
            for (_, _hp, g), dest in zip(todo, dests):
                # in the destination's dtype: an upcast on the device when the casts run there (on this stream,
                # so its memory is reused only after the copy)
                src = g.to(dest.dtype)
                dest.copy_(src, non_blocking=True)
                self.d2h_bytes += _nbytes(src)
                if s.cuda:
                    # lifetime extension: whoever frees the grad (offload_gradients, zero_grad), the caching
                    # allocator reuses its block only after this copy
                    g.record_stream(s.d2h)
            for hp in job.refresh:
                hp.master.copy_(hp.param.detach(), non_blocking=True)
            job.copied = s.record(s.d2h)
        if not pieces:
            # drop our references: the device grads may be freed now (record_stream keeps the copy safe)
            job.grads = [None] * len(job.grads)
        return stream

    @staticmethod
    def _streamable(job: _Job) -> bool:
        """Whether the pieces of a piece-by-piece parameter may go through pool slots: only when the step thread
        takes the job as it arrives (its gate open, the step's plan fixed and neither skipping the step nor
        re-reading this gradient). A job held at a closed gate is sorted with others when the gate opens; its
        pieces in pool slots could then wait behind jobs whose copies need those slots, so the step thread
        copies such a parameter itself, through its own two buffers."""
        gate = job.gate
        if job.kind != "final" or not job.fresh[0] or gate is None or not gate.open:
            return False
        plan = gate.plan  # set before ``open``
        return plan is not None and not plan.skip and job.params[0].index not in plan.recopy

    def _stream_pieces(self, job: _Job, g: torch.Tensor) -> None:
        """Copy a piece-by-piece parameter's gradient into pool slots, one piece per slot, as slots come free:
        the step thread steps and frees them in order behind this thread, so the copies run ahead of the
        steps as far as the pool allows (as whole buckets' copies do)."""
        assert job.pieces is not None
        (hp,) = job.params
        try:
            flat = self._piece_source(g, job.ready)
            for a, e in _spans(hp.param.numel(), job.bucket.piece_numel):
                slot = self.pool.acquire()  # may block until the step thread frees a slot
                dest, ev, nbytes = self._copy_piece(flat, a, e, slot, hp.stage_dtype)
                self.d2h_bytes += nbytes
                job.pieces.put((slot, dest, ev))
        except BaseException as exc:  # noqa: BLE001 - the step thread raises it for this job
            job.pieces.put(exc)
        finally:
            job.pieces.put(None)

    def _piece_source(self, g: torch.Tensor, ready: Any) -> torch.Tensor:
        """A gradient to copy piece by piece, flat, ordered on the copy stream after ``ready``."""
        s = self.streams
        with s.on(s.d2h):
            s.stream_wait(s.d2h, ready)  # stream wait: copy only once backward has produced the grad
            flat = g.reshape(-1)  # a copy only for a non-contiguous grad (on this stream)
            if s.cuda:
                g.record_stream(s.d2h)  # lifetime extension, as for whole buckets
        return flat

    def _copy_piece(
        self, flat: torch.Tensor, a: int, e: int, buf: torch.Tensor, dtype: torch.dtype
    ) -> tuple[torch.Tensor, Any, int]:
        """Copy elements ``[a, e)`` of ``flat`` into the pinned ``buf`` as ``dtype`` on the copy stream: the
        piece, the copy's event and the bytes that crossed."""
        s = self.streams
        dest = buf[: (e - a) * dtype.itemsize].view(dtype)
        with s.on(s.d2h):
            src = flat[a:e].to(dtype)  # upcast on the device when the casts run there
            dest.copy_(src, non_blocking=True)
            return dest, s.record(s.d2h), _nbytes(src)

    def _step_loop(self) -> None:
        self.streams.bind_thread()
        if self.cpu_threads is not None:
            torch.set_num_threads(self.cpu_threads)  # per thread with OpenMP: the training thread keeps its own
        waiting: list[_Job] = []
        while True:
            msg = self._step_q.get()
            if msg is None:
                return
            if isinstance(msg, _Gate):
                # forward order: the next forward needs the first offloaded weights first
                waiting.sort(key=lambda j: j.params[0].index)
                for job in waiting:
                    self._run(self._post, job)
                waiting.clear()
                continue
            job = msg
            if self.error is not None:
                self._done(job)
                continue
            if not self._run(self._pre, job):
                continue
            if job.kind == "accumulate":
                self._done(job)
            elif job.gate is not None and job.gate.open:
                self._run(self._post, job)
            else:
                waiting.append(job)

    def _run(self, fn: Callable[[_Job], None], job: _Job) -> bool:
        try:
            fn(job)
        except BaseException as exc:  # noqa: BLE001 - handed to the main thread, which re-raises it
            self._fail(exc, job)
            return False
        return True

    def _pre(self, job: _Job) -> None:
        """Before the gate: wait for the copy; move grads into host accumulators where they must wait."""
        tw = time.perf_counter()
        self.streams.host_wait(job.copied)  # host wait (this thread) for the bucket's D2H copy
        t0 = time.perf_counter()
        self.copy_wait_s += t0 - tw
        if self.trace is not None:
            self.trace.append(("copied", job.params[0].index, tw, t0))
        if self.offload_gradients and job.slot is not None:
            # later micro-batches: add into the host gradient (the sum torch would form on the device) and
            # free the slot at once, so that a step waiting at its gate never holds slots
            for hp, staged in zip(job.params, job.staged):
                if staged:
                    assert hp.hgrad is not None
                    hp.hgrad.add_(hp.staging(job.slot))
            self.pool.release(job.slot)
            job.slot = None
        self.cpu_s += time.perf_counter() - t0
        self._pre_done(job)

    def _post(self, job: _Job) -> None:
        """After the gate: scale the grads, step the bucket on the CPU, send the weights back."""
        try:
            plan = job.gate.plan
            assert plan is not None
            if not plan.skip:
                self._step_bucket(job, plan)
        finally:
            self._drain_pieces(job)
            for hp in job.params:
                hp.hgrad_valid = False
            self._done(job)

    def _step_bucket(self, job: _Job, plan: _Plan) -> None:
        if job.bucket.piece_numel:
            self._step_pieces(job, plan)
            return
        s = self.streams
        bucket = job.bucket
        fresh = list(job.fresh)
        recopy = [i for i, hp in enumerate(job.params) if hp.index in plan.recopy and hp.hgrad is None]
        if recopy:
            # the device grads were edited after they were handed over (torch's clip_grad_norm_, a
            # GradScaler.unscale_): copy them again, after the compute stream's position at step()
            if job.slot is None:
                job.slot = self.pool.acquire()
            with s.on(s.d2h):
                s.stream_wait(s.d2h, plan.ready)  # stream wait: after the edits
                for i in recopy:
                    hp = job.params[i]
                    g = plan.recopy[hp.index]
                    fresh[i] = g is not None
                    if g is not None:
                        dest = hp.staging(job.slot)
                        src = g.to(dest.dtype)  # as in the first copy
                        dest.copy_(src, non_blocking=True)
                        self.recopy_bytes += _nbytes(src)
                        if s.cuda:
                            g.record_stream(s.d2h)  # lifetime extension, as for the first copy
                ev = s.record(s.d2h)
            s.host_wait(ev)  # host wait (this thread) for the re-copy
        t0 = time.perf_counter()
        chunked = self.chunked and bucket.chunked
        stepped: list[_HostParam] = []
        in_chunks: list[tuple[_HostParam, torch.Tensor]] = []
        for i, hp in enumerate(job.params):
            if hp.hgrad_valid:
                g = hp.hgrad
            elif fresh[i]:
                g = hp.staging(job.slot)
            else:
                hp.master.grad = None
                continue
            stepped.append(hp)
            if chunked and g.dtype != hp.master.dtype:
                in_chunks.append((hp, g))  # upcast, scale, step and cast back chunk by chunk below
                continue
            if g.dtype != hp.master.dtype:
                assert self.scratch is not None
                up = self.scratch[hp.elem_offset : hp.elem_offset + g.numel()].view(g.shape)
                up.copy_(g)
                g = up
            for m in plan.mults:
                g.mul_(m)
            hp.master.grad = g
        if not stepped:
            self.cpu_s += time.perf_counter() - t0
            return
        for inner, gi in zip(bucket.optimizer.param_groups, bucket.group_map):
            inner.update(plan.hyper[gi])
        s.host_wait(bucket.h2d_event)  # host wait (this thread): the last H2D from these masters is done
        buf_i = None
        if any(not hp.same_dtype and not hp.device_cast for hp in stepped):
            buf_i = self.h2d_next
            self.h2d_next = (self.h2d_next + 1) % len(self.h2d_buffers)
            s.host_wait(self.h2d_events[buf_i])  # host wait (this thread): the buffer's last H2D is done
        if in_chunks:
            assert self.scratch is not None
            opt = bucket.optimizer
            for hp, g in in_chunks:
                group = opt.param_groups[bucket.inner_of[hp.group]]
                # the device-dtype copy for the way back, unless the cast runs on the device
                out = None if hp.device_cast else hp.staging(self.h2d_buffers[buf_i], hp.param.dtype)
                _host_adam.step_chunked(opt, group, hp.master, g, out, self.scratch, plan.mults)
        if len(in_chunks) < len(stepped):
            bucket.optimizer.step()  # torch's kernel for the rest (only masters with a .grad step)
        for hp in job.params:
            hp.master.grad = None  # the slot and accumulators are not the masters' grads beyond this step
        t1 = time.perf_counter()
        self.cpu_s += t1 - t0
        if self.trace is not None:
            self.trace.append(("step", job.params[0].index, t0, t1))
        if job.slot is not None:
            self.pool.release(job.slot)  # grads consumed: the copy thread may refill this slot
            job.slot = None
        done = {id(hp) for hp, _ in in_chunks}
        with s.on(s.h2d):
            # stream wait: never overwrite weights the compute stream may still read in this backward
            s.stream_wait(s.h2d, job.ready)
            for hp in stepped:
                if hp.same_dtype:
                    hp.param.detach().copy_(hp.master, non_blocking=True)  # straight from the pinned master
                elif hp.device_cast:
                    # the pinned master to device scratch, cast into the parameter there (memory allocated on
                    # this stream and freed after: reused only by later work of this stream)
                    up = torch.empty(hp.master.shape, dtype=hp.master.dtype, device=hp.param.device)
                    up.copy_(hp.master, non_blocking=True)
                    hp.param.detach().copy_(up)
                    self.h2d_bytes += _nbytes(up) - _nbytes(hp.param)
                else:
                    assert buf_i is not None
                    stage = hp.staging(self.h2d_buffers[buf_i], hp.param.dtype)
                    if id(hp) not in done:
                        stage.copy_(hp.master)  # cast to the device dtype on the CPU: half the bytes to move
                    hp.param.detach().copy_(stage, non_blocking=True)
                self.h2d_bytes += _nbytes(hp.param)
            ev = s.record(s.h2d)
        bucket.h2d_event = ev
        if buf_i is not None:
            self.h2d_events[buf_i] = ev


    def _step_pieces(self, job: _Job, plan: _Plan) -> None:
        """Step a parameter bigger than a staging slot piece by piece (Adam/AdamW, elementwise, so exactly
        as whole), then send each piece of the weights back. The pieces of its gradient arrive in pool slots
        from the copy thread (``job.pieces``), or, for a job held at a closed gate, this thread copies piece
        k+1 into one of its own two buffers while piece k steps from the other. Staging stays bounded by the
        slot size whatever the model's largest parameter (a 32000 x 4096 head's fp32 gradient is 0.5 GB)."""
        s = self.streams
        bucket = job.bucket
        (hp,) = job.params
        streamed = job.pieces is not None
        g, ready = (job.grads[0] if job.fresh[0] else None), job.ready
        if hp.index in plan.recopy:  # edited after it was handed over (clipping by torch, GradScaler.unscale_)
            assert not streamed  # (never streamed: see _Engine._streamable)
            g, ready = plan.recopy[hp.index], plan.ready
        job.grads = [None]
        if g is None and not streamed:
            return
        for inner, gi in zip(bucket.optimizer.param_groups, bucket.group_map):
            inner.update(plan.hyper[gi])
        opt = bucket.optimizer
        group = opt.param_groups[bucket.inner_of[hp.group]]
        host_cast = not hp.same_dtype and not hp.device_cast
        spans = _spans(hp.param.numel(), bucket.piece_numel)
        flat = hp.param.detach().view(-1)
        t0 = time.perf_counter()
        s.host_wait(bucket.h2d_event)  # host wait (this thread): the last H2D from this master is done
        if streamed:
            assert job.pieces is not None
            pieces = self._streamed_pieces(job.pieces, len(spans))
        else:
            assert g is not None
            pieces = self._own_pieces(self._piece_source(g, ready), spans, hp.stage_dtype)
        for k, (a, e) in enumerate(spans):
            tw = time.perf_counter()
            slot, dest, ev = next(pieces)
            s.host_wait(ev)  # host wait (this thread) for this piece's D2H copy
            tc = time.perf_counter()
            self.copy_wait_s += tc - tw
            out = None
            if host_cast:
                buf_i = self.h2d_next
                self.h2d_next = (self.h2d_next + 1) % len(self.h2d_buffers)
                s.host_wait(self.h2d_events[buf_i])  # host wait (this thread): the buffer's last H2D is done
                out = self.h2d_buffers[buf_i][: (e - a) * hp.param.element_size()].view(hp.param.dtype)
            # an fp32 piece steps in one call (scaled in place, no upcast to keep in cache: smaller chunks would
            # only add a fork and join of the step threads per chunk)
            chunk = -(-(e - a) // 64) * 64 if dest.dtype == torch.float32 else None
            _host_adam.step_chunked(
                opt, group, hp.master, dest, out, self.scratch, plan.mults, chunk, span=(a, e), count_step=k == 0
            )
            if self.trace is not None:
                self.trace.append(("piece_wait", hp.index, tw, tc))
                self.trace.append(("piece_step", hp.index, tc, time.perf_counter()))
            if slot is not None:
                self.pool.release(slot)  # read by the step above: the copy thread may refill it
            with s.on(s.h2d):
                # stream wait: never overwrite weights the compute stream may still read in this backward
                s.stream_wait(s.h2d, job.ready)
                master = hp.master.view(-1)[a:e]
                if hp.same_dtype:
                    flat[a:e].copy_(master, non_blocking=True)  # straight from the pinned master
                elif hp.device_cast:
                    up = torch.empty(e - a, dtype=master.dtype, device=flat.device)
                    up.copy_(master, non_blocking=True)
                    flat[a:e].copy_(up)  # cast on the device
                    self.h2d_bytes += _nbytes(up) - (e - a) * flat.element_size()
                else:
                    assert out is not None
                    flat[a:e].copy_(out, non_blocking=True)
                self.h2d_bytes += (e - a) * flat.element_size()
                ev_h2d = s.record(s.h2d)
            if host_cast:
                self.h2d_events[buf_i] = ev_h2d
        bucket.h2d_event = ev_h2d
        t1 = time.perf_counter()
        self.cpu_s += t1 - t0
        if self.trace is not None:
            self.trace.append(("step", hp.index, t0, t1))

    @staticmethod
    def _streamed_pieces(pieces: queue.SimpleQueue, count: int) -> Iterator[tuple[Any, torch.Tensor, Any]]:
        """The copy thread's pieces as it enqueues them: (pool slot, piece, D2H event)."""
        for _ in range(count):
            item = pieces.get()  # blocks until the copy thread has enqueued the next copy
            if item is None:
                raise RuntimeError("the copy thread sent fewer pieces than the parameter has")
            if isinstance(item, BaseException):
                raise item
            yield item

    def _own_pieces(
        self, flat: torch.Tensor, spans: list[tuple[int, int]], dtype: torch.dtype
    ) -> Iterator[tuple[None, torch.Tensor, Any]]:
        """Pieces copied by this thread through its two buffers: piece k+1 is on its way into the other buffer
        (whose piece stepped in the previous round) before piece k is handed out to step."""
        def copy(k: int) -> tuple[None, torch.Tensor, Any]:
            dest, ev, nbytes = self._copy_piece(flat, *spans[k], self.piece_slots[k % 2], dtype)
            self.recopy_bytes += nbytes
            return None, dest, ev

        nxt = copy(0)
        for k in range(len(spans)):
            cur = nxt
            if k + 1 < len(spans):
                nxt = copy(k + 1)
            yield cur

    def _drain_pieces(self, job: _Job) -> None:
        """Free the pool slots of streamed pieces that were not stepped (a skipped step, a failure), waiting
        for the copy thread's last one, so that it never blocks on a slot nobody will free."""
        if job.pieces is None:
            return
        while True:
            item = job.pieces.get()
            if item is None:
                break
            if not isinstance(item, BaseException):
                self.pool.release(item[0])
        job.pieces = None


# ------------------------------------------------------------------------------------------- optimizer
@dataclasses.dataclass
class _ClipRequest:
    coef: torch.Tensor  # clamped clip coefficient, on the device
    total_norm: torch.Tensor
    skip_if_nonfinite: bool


def _select_offloaded(
    params: list[torch.Tensor],
    fraction: float,
    chosen: Callable[[torch.Tensor], bool] | Iterable[torch.Tensor] | None,
) -> set[int]:
    """ids of the trainable params that go to the CPU."""
    trainable = [p for p in params if p.requires_grad]
    if chosen is not None:
        if callable(chosen):
            return {id(p) for p in trainable if chosen(p)}
        ids = {id(p) for p in chosen}
        known = {id(p) for p in params}
        if not ids <= known:
            raise ValueError("offload_params lists tensors that are not parameters of this optimizer")
        return {id(p) for p in trainable if id(p) in ids}
    total = sum(_nbytes(p) for p in trainable)
    limit = fraction * total
    out, taken = set(), 0
    for p in trainable:  # Megatron's rule: offload in parameter order while under the byte budget
        if taken < limit:
            out.add(id(p))
            taken += _nbytes(p)
    return out


class CPUOffloadOptimizer(Optimizer):
    """A torch optimizer whose state (all of it, or a fraction) lives and steps in host memory.

    Example::

        opt = CPUOffloadOptimizer(model.parameters(), torch.optim.AdamW, lr=3e-4, weight_decay=0.1)
        for micro_batches in loader:
            for i, mb in enumerate(micro_batches):
                with opt.accumulating(i < len(micro_batches) - 1):
                    loss_fn(model, mb).backward()
            opt.clip_grad_norm_(1.0)
            opt.step()
            opt.zero_grad()

    Host memory per offloaded fp32 parameter with AdamW: 12 bytes (master weight, two moments), plus a
    bounded pinned staging pool: ``num_staging_slots`` slots of at most ``bucket_bytes`` and two more for
    parameters bigger than that, which Adam/AdamW step piece by piece (elementwise, so exactly as whole;
    other optimizers, and ``offload_gradients``, widen every slot to the largest gradient instead).
    ``offload_gradients=True`` adds a host gradient (4 more bytes per offloaded parameter,
    pinned, allocated at set-up): gradients leave the device at link speed, whatever the pace of the CPU
    step, and later micro-batches are added to it on the host. With ``master_weights=True`` and bf16
    device parameters (or ``param_dtype=torch.bfloat16``, which casts them) the device keeps 2 bytes per
    offloaded parameter and its gradient, the host the same 12 (the master pinned); the casts run on the
    device (:attr:`cast_on_device`), so the host step is the same fused fp32 kernel as for fp32 weights; a
    host gradient is then 2 bytes. This is the configuration that trains the 7B shape at 226 model TFLOP/s
    on one H100 with 40% of the parameters offloaded, at 12.8 host bytes per offloaded parameter.

    Limits: with DDP, gradients are final only after their all-reduce, which the post-accumulate-grad
    hooks do not wait for; use ``overlap=False`` there. A parameter read by backward after its own
    gradient is final (a ``detach()``-ed use) would see the updated weights when the CPU step runs during
    backward; set ``step_in_backward = False`` for such models.

    Args:
        params: parameters or parameter groups, as for any torch optimizer; extra keys in a group are kept
            and passed to the inner optimizers.
        optimizer_class: the torch optimizer class; it must be able to step CPU tensors. Fused kernels are
            used on both sides when the class has them (``fused`` is set unless given).
        offload_fraction: share of the trainable parameter bytes, taken in parameter order, whose state
            lives on the host. 0 keeps everything on the device, 1 offloads everything.
        overlap: copy each gradient to the host as soon as it is final (post-accumulate-grad hooks) and
            start the CPU step as early as the step allows; False does all the work inside ``step()``.
        offload_gradients: free each device gradient of an offloaded parameter as soon as it is copied;
            gradients of later micro-batches accumulate on the host.
        offload_params: which parameters go to the host instead of the first ``offload_fraction``: a
            predicate on a parameter or a collection of parameters. Offloading the last blocks hides the
            CPU step best: their gradients are final first and their weights are needed last.
        master_weights: keep fp32 master weights for low-precision (bf16/fp16) parameters: on the host for
            offloaded ones (the device copy is updated by casting), on the device for the others. The
            masters start from the parameters' current values.
        param_dtype: keep the offloaded weight matrices on the device in this dtype (e.g. ``torch.bfloat16``):
            each one's current (fp32) value becomes its host master, then the device copy is cast in place
            (the same ``Parameter`` object). Vectors (norm weights, biases: tiny, and read by fp32 kernels)
            keep their dtype. An embedding table cast this way returns ``param_dtype`` activations. The
            matrices' device memory, their gradients and their bytes on the link halve; the model must run in
            that dtype or under autocast. Gradients arrive and accumulate over micro-batches in
            ``param_dtype``: under bf16 autocast a matmul weight's gradient is a bf16 value either way, so with
            one micro-batch per step the update is the same; across micro-batches the sum is rounded to bf16.
            Implies ``master_weights``.
        **optimizer_kwargs: passed to ``optimizer_class`` (``lr``, ``betas``, ``weight_decay``...).

    Raises:
        ValueError: a setting outside its range, or an optimizer class that cannot step on the CPU.
        TypeError: ``optimizer_class`` is not a torch optimizer class.
        RuntimeError: host memory is too small, or pinned memory cannot be allocated.
    """

    bucket_bytes: ClassVar[int] = 64 << 20
    """Target gradient bytes of one bucket (one CPU optimizer call, one staging region). With Adam/AdamW a
    parameter bigger than this travels and steps piece by piece, so staging stays within a few buckets; set it
    to the largest parameter's gradient bytes to stage everything whole (on W2 ~7 points of plain faster at the
    median, for ~1.8 more host bytes per offloaded parameter: ``BENCHMARKS.md``)."""
    num_staging_slots: ClassVar[int] = 3
    """Slots in the pinned gradient staging pool: copies of later buckets overlap the step of earlier ones."""
    cpu_threads: ClassVar[int | None] = None
    """Intra-op threads of the CPU step. None: the training thread's count (one per core by default) less
    two, at least one: the training thread (kernel launches), autograd's device thread and the copy thread
    need cores of their own. The step is memory-bound, so two threads fewer cost it little: on the lent
    H100 host (16 cores), 7B hybrid at F=0.4, four runs gave 169 and 202 model TFLOP/s with 16 threads,
    235 and 200 with 14 (CPU step 0.78 s with 16; 0.62 and 0.79 s with 14): noisy, never worse."""

    trace_steps: ClassVar[bool] = False
    """Record a timeline of each step in ``stats()["trace"]`` (for benchmarks): ``(what, first parameter
    index of the bucket, t0, t1)`` in seconds from the previous ``step()`` call, host clock; what is
    ``flush`` (a bucket's final gradients handed over by backward), ``copied`` (the step thread waited for
    that copy), ``step`` (its CPU step), ``fwd_wait`` (a forward pre-hook waited for it), ``step_call``."""
    cast_on_device: ClassVar[bool] = True
    """With low-precision device weights (``param_dtype``), run the casts on the device: each gradient is
    upcast there and travels in fp32, each updated master travels from pinned memory and is cast into the
    parameter there. The host step is then torch's fused kernel on fp32 (28 B of host memory traffic per
    parameter, as for fp32 weights) instead of an upcast, the step and a downcast on the CPU (40 B, or ~30 B
    chunked); the link carries 4 B per parameter each way instead of 2 (10.8 GB each way for 2.7B
    offloaded parameters: ~0.2 s at the link's speed, overlapped). False: casts on the host."""
    device_chunk_numel: ClassVar[int] = 1 << 25
    """Elements per chunk of the device step of fp32 masters kept on the device for low-precision
    parameters (``master_weights``): the fp32 scratch the gradients are upcast into (128 MiB)."""
    chunked_host_step: ClassVar[bool] = True
    """Step Adam/AdamW parameters whose device copy has another dtype (bf16 device weights) chunk by chunk:
    upcast, fused step and cast back while the chunk is in cache (``elbowroom.optim._host_adam``), instead
    of three passes over the whole bucket. Same arithmetic, bitwise."""

    _step_supports_amp_scaling = True  # GradScaler hands us grad_scale / found_inf instead of unscaling

    def __init__(
        self,
        params: Iterable[torch.Tensor] | Iterable[dict[str, Any]],
        optimizer_class: type[Optimizer] = torch.optim.AdamW,
        *,
        offload_fraction: float = 1.0,
        overlap: bool = True,
        offload_gradients: bool = False,
        offload_params: Callable[[torch.Tensor], bool] | Iterable[torch.Tensor] | None = None,
        master_weights: bool = False,
        param_dtype: torch.dtype | None = None,
        **optimizer_kwargs: Any,
    ) -> None:
        if not (isinstance(optimizer_class, type) and issubclass(optimizer_class, Optimizer)):
            raise TypeError(f"optimizer_class must be a torch.optim.Optimizer subclass, got {optimizer_class!r}")
        if isinstance(offload_fraction, bool) or not isinstance(offload_fraction, (int, float)):
            raise ValueError(f"offload_fraction must be a number in [0, 1], got {offload_fraction!r}")
        if not (0.0 <= float(offload_fraction) <= 1.0):
            raise ValueError(f"offload_fraction must be in [0, 1], got {offload_fraction}")
        if offload_params is not None and offload_fraction != 1.0:
            raise ValueError(
                "offload_params chooses the offloaded parameters itself; leave offload_fraction at its default"
            )
        if param_dtype is not None and not (isinstance(param_dtype, torch.dtype) and param_dtype.is_floating_point):
            raise ValueError(
                f"param_dtype must be a floating-point torch.dtype such as torch.bfloat16, got {param_dtype!r}"
            )
        self._ready = False
        self.optimizer_class = optimizer_class
        self.offload_fraction = float(offload_fraction)
        self.overlap = bool(overlap)
        self.offload_gradients = bool(offload_gradients)
        self.param_dtype = param_dtype
        self.master_weights = bool(master_weights) or param_dtype is not None
        self._offload_params = offload_params
        self.sync_gradients = True
        """False while accumulating: the gradients of this backward are not the step's final ones."""
        self.step_in_backward: bool | None = None
        """True: CPU steps start during backward; False: in ``step()``; None: learned from the first step
        (True when that step used no clipping, no GradScaler and did not edit gradients after backward)."""

        groups = list(params)
        if not groups:
            raise ValueError("optimizer got an empty parameter list")
        if not isinstance(groups[0], dict):
            groups = [{"params": groups}]
        groups = [dict(g) for g in groups]
        for g in groups:
            g["params"] = list(g["params"]) if not isinstance(g["params"], torch.Tensor) else [g["params"]]
        raw = [p[1] if isinstance(p, tuple) else p for g in groups for p in g["params"]]  # (name, param) too
        devices = {p.device for p in raw}
        if len(devices) != 1:
            raise ValueError(f"all parameters must be on one device, got {sorted(map(str, devices))}")
        self.device = devices.pop()

        self._cpu_kwargs, self._dev_kwargs, defaults, state_ratio = self._probe_kwargs(optimizer_kwargs)
        self._user_kwargs = dict(optimizer_kwargs)
        super().__init__(groups, defaults)
        all_params = [p for g in self.param_groups for p in g["params"]]

        self._streams = _Streams(self.device)
        self._host = _HostMemory(pin=self._streams.cuda)
        self._hps: list[_HostParam] = []
        self._hp_of: dict[torch.Tensor, _HostParam] = {}
        self._buckets: list[_Bucket] = []
        self._dev_opt: Optimizer | None = None
        self._dev_group_map: list[int] = []
        self._dev_params: list[torch.Tensor] = []
        self._dev_masters: dict[torch.Tensor, torch.Tensor] = {}
        self._hooks: list[Any] = []
        self._gate: _Gate | None = None
        self._hook_hyper: list[dict[str, Any]] | None = None
        self._clip: _ClipRequest | None = None
        self._learning: dict[str, bool] = {}
        self._stats: dict[str, Any] = {"steps": 0}
        self._marks = (0.0, 0, 0, 0.0)  # engine counters at the end of the last step
        self._trace_t0: float | None = None
        self._state_ratio = state_ratio
        self._engine: _Engine | None = None
        self._lazy = False  # set by overlap_with_forward()
        self._held: list[_Job] = []  # lazy + deferred: final jobs submitted in forward order at step()
        self._step_jobs: list[_Job] = []  # final jobs of the current step
        self._inflight: dict[_Bucket, list[_Job]] = {}  # lazy: last step's jobs not yet waited for
        self._lazy_wait_s = 0.0
        self._warned_unawaited = False

        offloaded = _select_offloaded(all_params, self.offload_fraction, offload_params)
        self._check_host_memory(all_params, offloaded)
        for gi, group in enumerate(self.param_groups):
            self._place(gi, group["params"], offloaded)
        self._build_engine()
        self._finalizer = weakref.finalize(self, CPUOffloadOptimizer._shutdown, self._engine, self._hooks, self._host)
        self._ready = True
        n_off = sum(hp.param.numel() for hp in self._hps)
        n_all = sum(p.numel() for p in all_params)
        logger.info(
            "CPUOffloadOptimizer: %d of %d parameters (%.1f%% of elements) on the host, %d buckets, %.2f GiB pinned",
            len(self._hps),
            len(all_params),
            100 * n_off / max(n_all, 1),
            len(self._buckets),
            self._host.pinned_bytes / 2**30,
        )

    # ------------------------------------------------------------------------------------ set-up
    def _probe_kwargs(self, kwargs: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any], dict[str, Any], float]:
        """Check that the class steps on the CPU; choose fused kernels; return the class defaults."""
        cls = self.optimizer_class
        master_dtype = torch.float32
        has_fused = _accepts(cls, "fused")
        candidates = [kwargs]
        if has_fused and "fused" not in kwargs:
            candidates = [{**kwargs, "fused": True}, kwargs]
        last_exc: BaseException | None = None
        for cand in candidates:
            probe = torch.zeros(8, dtype=master_dtype, requires_grad=True)
            if cand is kwargs:
                opt = cls([probe], **cand)  # a bad keyword or value raises here, with the class's own message
            else:
                try:  # the fused=True we add ourselves: on failure fall back to the class's default
                    opt = cls([probe], **cand)
                except (RuntimeError, ValueError, TypeError) as exc:
                    last_exc = exc
                    continue
            probe.grad = torch.full_like(probe, 1e-3)
            try:
                opt.step()
            except Exception as exc:  # noqa: BLE001 - any failure means: not runnable on the CPU this way
                last_exc = exc
                continue
            st = opt.state.get(probe, {})
            ratio = sum(v.numel() for v in st.values() if isinstance(v, torch.Tensor) and v.numel() == 8) / 8
            dev_kwargs = dict(kwargs)
            if self.device.type == "cpu":
                dev_kwargs = dict(cand)  # the "device" is the CPU itself: same kernel as the host part
            elif has_fused and "fused" not in kwargs:
                dev_kwargs["fused"] = True  # falls back below if the class has no fused kernel there
            defaults = dict(opt.defaults)
            return dict(cand), dev_kwargs, defaults, ratio
        raise ValueError(
            f"{cls.__name__} cannot step CPU tensors ({type(last_exc).__name__}: {last_exc}); offloading needs "
            "an optimizer class with a CPU implementation, e.g. torch.optim.AdamW, Adam or SGD"
        ) from last_exc

    def _check_host_memory(self, params: list[torch.Tensor], offloaded: set[int]) -> None:
        numel = sum(p.numel() for p in params if id(p) in offloaded)
        if not numel:
            return
        per_param = 4 * (1 + self._state_ratio) + (4 if self.offload_gradients else 0)
        need = numel * per_param + (self.num_staging_slots + 2) * self.bucket_bytes
        avail = _available_host_bytes()
        if avail is not None and need > avail:
            raise RuntimeError(
                f"CPUOffloadOptimizer needs about {need / 2**30:.1f} GiB of host memory for {numel / 1e9:.2f}B "
                f"offloaded parameters ({per_param:.0f} B each), but only {avail / 2**30:.1f} GiB is available; "
                "lower offload_fraction or free host memory"
            )

    def _place(self, gi: int, params: list[torch.Tensor], offloaded: set[int]) -> None:
        """Give each parameter of user group ``gi`` its home: a host bucket or the device optimizer."""
        base = sum(len(g["params"]) for g in self.param_groups[:gi])
        host: list[_HostParam] = []
        dev: list[torch.Tensor] = []
        for j, p in enumerate(params):
            if id(p) in offloaded:
                mdtype = torch.float32 if (self.master_weights and p.is_floating_point()) else p.dtype
                pd = self.param_dtype
                cast = pd is not None and p.is_floating_point() and p.dim() >= 2 and p.dtype != pd
                same = mdtype == p.dtype and not cast
                # the master is pinned where it is the H2D source: dtypes match, or casts run on the device;
                # else a bf16 copy travels from a pinned staging buffer
                master = self._host.empty(p.shape, mdtype, pinned=same or self.cast_on_device)
                if not same:
                    with torch.no_grad():
                        master.copy_(p.detach())  # host-device sync, at set-up only
                if cast:
                    self._cast_param(p)  # the master took the full-precision value first
                hp = _HostParam(base + j, gi, p, master, device_cast=self.cast_on_device)
                if self.offload_gradients:
                    # gradients leave the device at link speed, whatever the CPU step's pace: +4 B/param
                    hp.hgrad = self._host.empty(p.shape, p.dtype, pinned=True)
                host.append(hp)
            else:
                dev.append(p)
        if dev:
            self._add_device_params(gi, dev)
        if host:
            self._hps.extend(host)
            self._hps.sort(key=lambda h: h.index)
            for hp in host:
                self._hp_of[hp.param] = hp
            self._make_buckets(host)

    def _cast_param(self, p: torch.Tensor) -> None:
        """Keep only a ``param_dtype`` copy of an offloaded parameter on the device (same Parameter object,
        so modules, hooks and the caller's references stay valid)."""
        assert self.param_dtype is not None
        with torch.no_grad():
            p.data = p.data.to(self.param_dtype)
            if p.grad is not None:
                p.grad = p.grad.to(self.param_dtype)

    def _add_device_params(self, gi: int, params: list[torch.Tensor]) -> None:
        inner_params = []
        for p in params:
            if self.master_weights and p.is_floating_point() and p.dtype != torch.float32:
                m = p.detach().float()
                self._dev_masters[p] = m
                inner_params.append(m)
            else:
                inner_params.append(p)
        self._dev_params.extend(params)
        group = {**self._hyper_of(gi), "params": inner_params}
        if self._dev_opt is None:
            try:
                self._dev_opt = self.optimizer_class([group], **self._dev_kwargs)
            except (RuntimeError, ValueError) as exc:
                if "fused" in self._user_kwargs or "fused" not in self._dev_kwargs:
                    raise
                logger.info(
                    "%s has no fused kernel for %s (%s); using its default",
                    self.optimizer_class.__name__,
                    self.device,
                    exc,
                )
                self._dev_kwargs.pop("fused")
                self._dev_opt = self.optimizer_class([group], **self._dev_kwargs)
        else:
            self._dev_opt.add_param_group(group)
        self._dev_group_map.append(gi)

    def _make_buckets(self, host: list[_HostParam]) -> None:
        # gradients become final roughly in reverse parameter order: bucket from the end
        ordered = sorted(host, key=lambda h: h.index, reverse=True)
        chunk: list[_HostParam] = []
        size = 0
        for hp in ordered:
            n = _align(_nbytes(hp.param))
            if chunk and size + n > self.bucket_bytes:
                self._buckets.append(self._new_bucket(chunk))
                chunk, size = [], 0
            chunk.append(hp)
            size += n
        if chunk:
            self._buckets.append(self._new_bucket(chunk))
        for hp in host:
            if hp.param.requires_grad and self.overlap:
                self._hooks.append(hp.param.register_post_accumulate_grad_hook(_grad_hook(self, hp)))

    def _new_bucket(self, hps: list[_HostParam]) -> _Bucket:
        by_group: dict[int, list[torch.Tensor]] = {}
        for hp in hps:
            by_group.setdefault(hp.group, []).append(hp.master)
        group_map = sorted(by_group)
        inner = [{**self._hyper_of(gi), "params": by_group[gi]} for gi in group_map]
        opt = self.optimizer_class(inner, **self._cpu_kwargs)
        # inner groups list masters in group order; keep hps in the same order for state routing
        order = {id(m): k for k, m in enumerate(m for g in opt.param_groups for m in g["params"])}
        hps = sorted(hps, key=lambda h: order[id(h.master)])
        return _Bucket(hps, opt, group_map)

    def _build_engine(self) -> None:
        # a bucket stages within bucket_bytes; a parameter alone bigger than that travels and steps piece by
        # piece where its optimizer allows (Adam/AdamW, gradients not kept on the host, a contiguous
        # parameter), one piece per slot of that size (plus two of the step thread's own for jobs held at a
        # closed gate: see _Engine._streamable), else it widens every slot
        piece_bytes = _align(self.bucket_bytes)
        for b in self._buckets:
            b.piece_numel = self._piece_numel(b)
        whole = [b.staging_bytes for b in self._buckets if not b.piece_numel]
        pieces = any(b.piece_numel for b in self._buckets)
        # the pool's slots also carry pieces, which the copy thread streams into them ahead of the step
        slot_bytes = max([*whole, piece_bytes if pieces else 0], default=0)
        slots = [self._host.empty(slot_bytes, torch.uint8, pinned=True) for _ in range(self.num_staging_slots)]
        piece_slots = [self._host.empty(piece_bytes, torch.uint8, pinned=True) for _ in range(2)] if pieces else []
        needs_cast = any(not hp.same_dtype and not hp.device_cast for hp in self._hps)
        h2d = [self._host.empty(slot_bytes, torch.uint8, pinned=True) for _ in range(2)] if needs_cast else []
        # fp32 scratch for host gradients of another dtype than their master (casts on the host, or bf16 host
        # gradients under offload_gradients): one chunk when those buckets step chunk by chunk, else room for a
        # bucket's upcast. None when every gradient reaches the host in its master's dtype (casts on the device)
        cast = [h for h in self._hps if h.master.dtype != (h.hgrad.dtype if h.hgrad is not None else h.stage_dtype)]
        scratch = None
        if cast:
            if self.chunked_host_step and all(hp.bucket.chunked for hp in cast):
                numel = min(_host_adam.CHUNK_NUMEL, max(hp.param.numel() for hp in cast))
            else:
                numel = max(b.scratch_numel for b in self._buckets)
            scratch = self._host.empty(numel, torch.float32, pinned=False)
        self._slot_bytes = slot_bytes if self._buckets else 0
        self._staging_bytes = (
            slot_bytes * (self.num_staging_slots + len(h2d)) + piece_bytes * len(piece_slots)
        )
        self._engine = _Engine(
            self._streams,
            _SlotPool(slots),
            h2d,
            scratch,
            self.offload_gradients,
            self._host,
            self._cpu_threads(),
            chunked=self.chunked_host_step and any(b.chunked for b in self._buckets),
            piece_slots=piece_slots,
        )
        if self.trace_steps:
            self._engine.trace = []

    def _piece_numel(self, b: _Bucket) -> int:
        """Elements per piece if bucket ``b`` steps piece by piece (0: it stages whole): one parameter bigger
        than ``bucket_bytes``, stepped by Adam/AdamW (elementwise, so pieces step exactly as the whole),
        contiguous, its gradient not kept on the host (``offload_gradients`` accumulates it whole)."""
        hp = b.params[0]
        piece_bytes = _align(self.bucket_bytes)
        if (
            b.staging_bytes <= piece_bytes
            or len(b.params) != 1
            or self.offload_gradients
            or not _host_adam.supports(b.optimizer)
            or not hp.param.is_contiguous()
        ):
            return 0
        itemsize = max(hp.param.element_size(), hp.stage_dtype.itemsize)
        return max(64, piece_bytes // itemsize // 64 * 64)

    def _cpu_threads(self) -> int:
        if self.cpu_threads is not None:
            return max(1, int(self.cpu_threads))
        return max(1, torch.get_num_threads() - 2)  # read on the constructing (training) thread

    @staticmethod
    def _shutdown(engine: _Engine | None, hooks: list[Any], host: _HostMemory) -> None:
        for h in hooks:
            h.remove()
        hooks.clear()
        if engine is not None:
            engine.stop()
            if engine.streams.cuda:
                with contextlib.suppress(Exception):  # at interpreter exit CUDA may already be torn down
                    # host-device sync: no copy may still read or write the memory unpinned below
                    torch.cuda.synchronize(engine.streams.device)
        host.release()

    def close(self) -> None:
        """Stop the worker threads, remove the hooks and unpin host memory; the optimizer is unusable after."""
        self._finalizer()

    # ------------------------------------------------------------------------------------ user API
    @contextlib.contextmanager
    def accumulating(self, enabled: bool = True) -> Iterator[None]:
        """Mark the backward passes inside as non-final micro-batches of gradient accumulation.

        Gradients stay on the device and accumulate there as usual (on the host with
        ``offload_gradients=True``); nothing is copied for the CPU step until a backward outside this
        context. Equivalent to setting ``opt.sync_gradients = not enabled`` around them.

        Args:
            enabled: False makes the context a no-op, for ``with opt.accumulating(i < n - 1):`` loops.
        """
        prev = self.sync_gradients
        self.sync_gradients = not enabled
        try:
            yield
        finally:
            self.sync_gradients = prev

    def _hyper_of(self, gi: int) -> dict[str, Any]:
        return {k: v for k, v in self.param_groups[gi].items() if k not in _IMPL_KEYS}

    def _hyper(self) -> list[dict[str, Any]]:
        return [self._hyper_of(gi) for gi in range(len(self.param_groups))]

    def _engine_(self) -> _Engine:
        assert self._engine is not None
        return self._engine

    def _on_grad(self, hp: _HostParam, kind: str, grad: torch.Tensor | None, early: bool = False) -> None:
        """Hand one gradient over (called by the hook during backward, or by step() for the rest)."""
        p = hp.param
        if self._inflight and hp.bucket in self._inflight:
            # lazy mode: a gradient of a parameter whose last update no forward pre-hook waited for; it was
            # read outside its module's forward (a functional use) without wait_for()
            if not self._warned_unawaited:
                self._warned_unawaited = True
                logger.warning(
                    "CPUOffloadOptimizer: parameter %d was used outside the forward of its module before its "
                    "update landed (overlap_with_forward); call opt.wait_for(params) before such uses",
                    hp.index,
                )
            self._await([hp.bucket])
        if kind == "final":
            if hp.final:
                raise RuntimeError(
                    f"the gradient of parameter {hp.index} became final twice before step(): wrap the "
                    "backward passes of all but the last micro-batch in `with opt.accumulating():` (or set "
                    "opt.sync_gradients = False for them)"
                )
            hp.final = True
            self._open_step()
            if grad is not None and not self.offload_gradients:
                # lifetime extension until the end of step(): the reference detects edits after backward
                hp.grad_ref, hp.grad_version = grad, grad._version
                hp.early = early
        else:
            hp.accumulated = True
        if grad is not None and self.offload_gradients:
            # the optimizer owns the grad from here until its copy is enqueued (lifetime extension)
            p.grad = None
            if kind == "final" and not hp.accumulated and self.step_in_backward is not True:
                with torch.no_grad():
                    hp.norm = torch.linalg.vector_norm(grad)  # on the device, as the grads finish: no sync
        b = hp.bucket
        if b.arrived and (b.arrived_kind != kind or hp.in_arrival):
            self._flush(b)
        hp.in_arrival = True
        b.arrived.append((hp, grad))
        b.arrived_kind = kind
        if len(b.arrived) == len(b.params):
            self._flush(b)

    def _flush(self, b: _Bucket) -> None:
        if not b.arrived:
            return
        items, b.arrived = b.arrived, []
        kind = b.arrived_kind
        refresh = []
        for hp, _ in items:
            hp.in_arrival = False
            if kind == "final" and hp.master_stale:
                refresh.append(hp)
                hp.master_stale = False
        job = _Job(
            kind=kind,
            bucket=b,
            params=[hp for hp, _ in items],
            grads=[g for _, g in items],
            fresh=[g is not None for _, g in items],
            ready=self._streams.record(),  # the grads are complete at this point of the compute stream
            gate=self._gate if kind == "final" else None,
            refresh=refresh,
            staged=[False] * len(items),
        )
        if kind == "final":
            self._step_jobs.append(job)
            trace = self._engine_().trace
            if trace is not None:
                now = time.perf_counter()
                trace.append(("flush", job.params[0].index, now, now))
            if self._lazy and not self.offload_gradients and not (job.gate is not None and job.gate.open):
                self._held.append(job)  # copied at step() in forward order (see overlap_with_forward)
                return
        self._engine_().submit(job)

    def _open_step(self) -> None:
        if self._gate is not None:
            return
        self._gate = _Gate()
        self._hook_hyper = self._hyper()
        if self.step_in_backward is True and self.overlap:
            self._engine_().open_gate(self._gate, _Plan(hyper=self._hook_hyper))

    def _collect(self) -> None:
        """Hand over every final gradient the hooks did not see, and flush partial buckets."""
        if not self.sync_gradients:
            logger.warning("step() called inside accumulating(): treating the gradients as final")
        for hp in self._hps:
            if hp.final:
                continue
            g = hp.param.grad
            if g is not None:
                self._on_grad(hp, "final", g)
            elif hp.accumulated:
                self._on_grad(hp, "final", None)
        for b in self._buckets:
            self._flush(b)

    @torch.no_grad()
    def clip_grad_norm_(
        self,
        max_norm: float,
        norm_type: float = 2.0,
        *,
        error_if_nonfinite: bool = False,
        skip_if_nonfinite: bool = False,
    ) -> torch.Tensor:
        """Clip all gradients of this optimizer by their global norm, as torch.nn.utils.clip_grad_norm_.

        Call it after the last backward and before ``step()`` (after ``scaler.unscale_(opt)`` when a
        GradScaler is used). Norms come from the device (offloaded gradients freed by
        ``offload_gradients=True`` had theirs taken on the device as they finished; host-accumulated ones
        are taken on the host). The device gradients of parameters that step on the device are scaled
        here; offloaded gradients are scaled on the host right before their CPU step (their device copies,
        if kept, are left as they are).

        Args:
            max_norm: the largest allowed global norm.
            norm_type: the p of the p-norm (``inf`` for the max norm); 2 only with ``offload_gradients``.
            error_if_nonfinite: raise if the total norm is nan or inf (a host-device sync).
            skip_if_nonfinite: make the coming ``step()`` skip the update when the norm is not finite.

        Returns:
            The total norm of the gradients before clipping (a device tensor).
        """
        norm_type = float(norm_type)
        if self.step_in_backward is True and self.overlap:
            raise RuntimeError(
                "clip_grad_norm_ after CPU steps started during backward; set opt.step_in_backward = False "
                "(or leave it None so that the first step decides)"
            )
        self._learning["global"] = True
        self._collect()
        entries: list[tuple[int, torch.Tensor]] = []  # (param index, norm)
        dev_grads: dict[tuple[torch.device, torch.dtype], list[tuple[int, torch.Tensor]]] = {}
        host_waited = False
        idx = 0
        for group in self.param_groups:
            for p in group["params"]:
                hp = self._hp_of.get(p)
                if hp is not None and self.offload_gradients and hp.final:
                    if norm_type != 2.0:
                        raise ValueError("with offload_gradients=True, clip_grad_norm_ supports norm_type=2 only")
                    if hp.norm is not None:
                        entries.append((idx, hp.norm))
                    else:
                        if not host_waited:
                            self._engine_().wait_pre()  # host wait: accumulated grads are on the host
                            host_waited = True
                        if hp.hgrad is not None and hp.hgrad_valid:
                            # a host norm back to the device: a tiny copy from pageable memory (syncs)
                            entries.append((idx, _host_norm(hp.hgrad).to(self.device)))
                elif p.grad is not None:
                    dev_grads.setdefault((p.grad.device, p.grad.dtype), []).append((idx, p.grad))
                idx += 1
        for items in dev_grads.values():
            norms = torch._foreach_norm([g for _, g in items], norm_type)
            entries.extend(zip([i for i, _ in items], norms))
        if not entries:
            total = torch.zeros((), device=self.device)
        else:
            entries.sort(key=lambda e: e[0])
            total = torch.linalg.vector_norm(torch.stack([n.to(self.device) for _, n in entries]), norm_type)
        if error_if_nonfinite and bool(torch.logical_or(total.isnan(), total.isinf())):  # host-device sync
            raise RuntimeError(
                f"The total norm of order {norm_type} for gradients is non-finite, so it cannot be clipped."
            )
        coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
        resident: dict[tuple[torch.device, torch.dtype], list[torch.Tensor]] = {}
        for p in self._dev_params:
            if p.grad is not None:
                resident.setdefault((p.grad.device, p.grad.dtype), []).append(p.grad)
        for grads in resident.values():
            torch._foreach_mul_(grads, coef.to(grads[0].device))
        self._clip = _ClipRequest(coef=coef, total_norm=total, skip_if_nonfinite=skip_if_nonfinite)
        return total

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:  # type: ignore[override]
        """Update all parameters: offloaded ones on the CPU, the others on the device, at the same time.

        Args:
            closure: re-evaluates the model and returns the loss (its backward runs inside this call).

        Returns:
            The closure's loss, or None.
        """
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        engine = self._engine_()
        engine.raise_error()
        t_start = time.perf_counter()
        self._collect()
        self._open_step()
        gate = self._gate
        assert gate is not None
        eager = gate.open  # the CPU steps already run with the values fixed at the first hook

        # --- what this step applies: GradScaler's scale and inf check, the clip coefficient
        grad_scale = getattr(self, "grad_scale", None)
        found_inf = getattr(self, "found_inf", None)
        scaler = grad_scale is not None or found_inf is not None
        if scaler and self.offload_gradients and self._hps:
            raise ValueError(
                "GradScaler cannot check gradients that offload_gradients=True moved off the device; use bf16 "
                "autocast without a scaler, or offload_gradients=False"
            )
        skip = False
        mults: list[torch.Tensor] = []
        dev_mults: list[torch.Tensor] = []
        if found_inf is not None:
            skip = bool(found_inf.item() if isinstance(found_inf, torch.Tensor) else found_inf)  # host-device sync
        if grad_scale is not None:  # gradients still scaled (GradScaler's fused-optimizer contract)
            inv = grad_scale.double().reciprocal().float()
            dev_mults.append(inv)
            mults.append(inv.to("cpu"))  # host-device sync
        clip = self._clip
        if clip is not None:
            mults.append(clip.coef.to("cpu"))  # host-device sync: the CPU step needs the coefficient
            if clip.skip_if_nonfinite and not math.isfinite(float(clip.total_norm)):  # synced just above
                skip = True
        hyper = self._hyper()
        changed: dict[int, torch.Tensor | None] = {}
        if not self.offload_gradients:
            unscaled_in_place = found_inf is not None and grad_scale is None  # scaler.unscale_(opt) ran
            for hp in self._hps:
                if hp.final and hp.grad_ref is not None:
                    g = hp.param.grad
                    if (unscaled_in_place and hp.early) or g is not hp.grad_ref or g._version != hp.grad_version:
                        changed[hp.index] = g  # a reference: zero_grad() may drop .grad before the re-copy
        hyper_changed = self._hook_hyper is not None and not all(
            a.keys() == b.keys() and all(_same_value(a[k], b[k]) for k in a) for a, b in zip(hyper, self._hook_hyper)
        )
        if scaler:
            self._learning["global"] = True
        if changed or hyper_changed:
            self._learning["edited"] = True

        if eager:
            problems = [
                name
                for name, bad in (
                    ("clip_grad_norm_", clip is not None),
                    ("a GradScaler", scaler),
                    ("gradients edited after backward", bool(changed)),
                    ("hyperparameters changed after backward", hyper_changed),
                )
                if bad
            ]
            if problems:
                engine.wait_idle()
                raise RuntimeError(
                    f"this step used {', '.join(problems)}, but its CPU updates already ran during backward; "
                    "set opt.step_in_backward = False for steps that need every gradient before any update"
                )
        else:
            plan = _Plan(
                hyper=hyper,
                mults=mults,
                skip=skip,
                recopy=changed,
                ready=self._streams.record() if changed else None,
            )
            engine.open_gate(gate, plan)  # the CPU steps start now, while the device steps below
            held, self._held = self._held, []
            for job in sorted(held, key=lambda j: j.params[0].index):  # forward order
                engine.submit(job)

        # --- the device part, on the compute stream, concurrent with the CPU steps
        if self._dev_opt is not None and not skip:
            grads: dict[tuple[torch.device, torch.dtype], list[torch.Tensor]] = {}
            for p in self._dev_params:
                if p.grad is not None:
                    grads.setdefault((p.grad.device, p.grad.dtype), []).append(p.grad)
            for m in dev_mults:
                for gs in grads.values():
                    torch._foreach_mul_(gs, m.to(gs[0].device))
            for inner, gi in zip(self._dev_opt.param_groups, self._dev_group_map):
                inner.update(hyper[gi])
            if self._dev_masters and _host_adam.supports(self._dev_opt):
                self._step_device_masters()  # chunk by chunk: no fp32 copy of every gradient at once
            else:
                for p, m in self._dev_masters.items():
                    m.grad = None if p.grad is None else p.grad.float()
            self._dev_opt.step()  # the device parameters without masters (masters without .grad are skipped)
            for p, m in self._dev_masters.items():
                if m.grad is not None:
                    m.grad = None
                    p.detach().copy_(m)

        jobs, self._step_jobs = self._step_jobs, []
        wait_s: float | None = None
        if self._lazy:
            # return now: each module waits for its own buckets in a forward pre-hook (overlap_with_forward)
            for b in list(self._inflight):
                self._inflight[b] = [j for j in self._inflight[b] if not j.finished]
            for job in jobs:
                self._inflight.setdefault(job.bucket, []).append(job)
        else:
            t_wait = time.perf_counter()
            engine.wait_idle()  # host wait for the CPU steps (their H2D copies are enqueued, maybe not done)
            wait_s = time.perf_counter() - t_wait
            if self._streams.cuda:
                # stream wait: later work on the compute stream (the next forward) reads the new weights
                torch.cuda.current_stream(self.device).wait_stream(self._streams.h2d)

        self._end_step()
        self._record_stats(skip, wait_s, t_start)
        return loss

    def _record_stats(self, skip: bool, wait_s: float | None, t_start: float) -> None:
        engine = self._engine_()
        if wait_s is None:  # lazy: what forward pre-hooks waited since the last step (one step behind)
            wait_s, self._lazy_wait_s = self._lazy_wait_s, 0.0
        # per-step numbers count from the end of the last step: CPU steps may run during backward
        cpu0, d2h0, h2d0, cw0 = self._marks
        self._marks = (engine.cpu_s, engine.d2h_bytes + engine.recopy_bytes, engine.h2d_bytes, engine.copy_wait_s)
        cpu_s = engine.cpu_s - cpu0
        if engine.trace is not None:
            now = time.perf_counter()
            events, engine.trace = engine.trace, []  # the step thread appends to the new list from here
            events.append(("step_call", -1, t_start, now))
            base = self._trace_t0 if self._trace_t0 is not None else t_start
            self._trace_t0 = t_start
            self._stats["trace"] = [(w, i, round(a - base, 5), round(b - base, 5)) for w, i, a, b in events]
        self._stats.update(
            copy_wait_s=engine.copy_wait_s - cw0,
            chunked=engine.chunked,
            steps=self._stats["steps"] + 1,
            skipped=skip,
            cpu_step_s=cpu_s,
            cpu_wait_s=wait_s,
            step_call_s=time.perf_counter() - t_start,
            hidden_fraction=(max(0.0, 1.0 - wait_s / cpu_s) if cpu_s > 0 else 1.0),
            d2h_bytes=engine.d2h_bytes + engine.recopy_bytes - d2h0,
            h2d_bytes=engine.h2d_bytes - h2d0,
        )

    def _end_step(self) -> None:
        for hp in self._hps:
            hp.final = hp.accumulated = hp.early = False
            hp.grad_ref = hp.norm = None
        self._gate = None
        self._hook_hyper = None
        self._clip = None
        if self.step_in_backward is None and self.overlap and self._hps:
            self.step_in_backward = not (self._learning.get("global") or self._learning.get("edited"))
            logger.info(
                "CPUOffloadOptimizer: CPU steps will start %s",
                "during backward" if self.step_in_backward else "in step() (the step needs all gradients first)",
            )
        self._learning.clear()
        if not self._lazy:
            self._link_state()  # lazy: the CPU steps still run; state_dict() links after waiting

    def _settle(self) -> None:
        """Wait for all CPU work; later work on the compute stream sees the updated weights."""
        self._engine_().wait_idle()  # host wait for the CPU steps
        self._inflight.clear()
        if self._streams.cuda:
            torch.cuda.current_stream(self.device).wait_stream(self._streams.h2d)  # stream wait

    def _await(self, buckets: list[_Bucket]) -> None:
        """Forward pre-hook of the lazy mode: this module's offloaded weights must have landed."""
        jobs = [j for b in buckets for j in self._inflight.pop(b, ())]
        if not jobs:
            return
        t0 = time.perf_counter()
        engine = self._engine_()
        engine.wait_jobs(jobs)  # host wait for these buckets' CPU steps (not a device sync)
        t1 = time.perf_counter()
        self._lazy_wait_s += t1 - t0
        if engine.trace is not None:
            engine.trace.append(("fwd_wait", jobs[0].params[0].index, t0, t1))
        if self._streams.cuda:
            cur = torch.cuda.current_stream(self.device)
            for b in buckets:
                if b.h2d_event is not None:
                    cur.wait_event(b.h2d_event)  # stream wait: the forward reads the weights after their copy

    def _step_device_masters(self) -> None:
        """Adam(W) on the device's fp32 masters of low-precision parameters, chunk by chunk: upcast a chunk
        of the gradient into scratch, torch's fused step on that chunk, cast the master chunk into the
        parameter. The same arithmetic as torch's fused step on whole upcast gradients (elementwise,
        bitwise), but the fp32 gradients never exist whole: on the 7B hybrid with half of the parameters
        on the device that would be 13.5 GB at the end of every step."""
        assert self._dev_opt is not None
        group_of = {id(m): g for g in self._dev_opt.param_groups for m in g["params"]}
        chunk = self.device_chunk_numel
        scratch: dict[torch.device, torch.Tensor] = {}  # one chunk per device, freed after the step
        for p, m in self._dev_masters.items():
            if p.grad is None:
                continue
            if m.device not in scratch:
                largest = max(min(chunk, q.numel()) for q in self._dev_masters.values() if q.device == m.device)
                scratch[m.device] = torch.empty(largest, dtype=torch.float32, device=m.device)
            g = p.grad if p.grad.is_contiguous() else p.grad.contiguous()
            out = p.detach()
            contiguous = out.is_contiguous()
            _host_adam.step_chunked(
                self._dev_opt, group_of[id(m)], m, g, out if contiguous else None, scratch[m.device], [], chunk
            )
            if not contiguous:
                out.copy_(m)

    def overlap_with_forward(self, model: torch.nn.Module) -> None:
        """Let ``step()`` return before the CPU updates land; each module waits for its own weights.

        Every module of ``model`` that owns offloaded parameters gets a forward pre-hook that waits (on
        the host, then with a stream wait) for the CPU step of exactly those parameters, and steps that
        need all gradients first (clipping, GradScaler) copy and step the buckets in forward order. So
        the CPU step of the late blocks runs behind the next forward of the early ones: offload the late
        blocks (``offload_params=last_fraction(...)``) for this to pay.

        Anything that reads offloaded weights outside the forward of the module that owns them (a fused
        head + loss that takes the head's weight, a functional use of a tied weight, saving
        ``model.state_dict()``, evaluation code that bypasses ``forward``) must call :meth:`wait_for` (those
        weights) or :meth:`wait_for_weights` (all) first; a gradient that arrives for an update no forward
        waited for is logged once and waited for then. ``state_dict()``, ``load_state_dict()``
        and ``zero_grad(set_to_none=False)`` wait by themselves. The numbers of :meth:`stats` lag one
        step. Without ``offload_gradients``, gradients of offloaded parameters stay on the device until
        their copy (which may now run into the next forward).

        Args:
            model: the module whose forward uses this optimizer's parameters.

        Raises:
            ValueError: an offloaded parameter is not owned by any module of ``model``.
        """
        owned: set[int] = set()
        for mod in model.modules():
            buckets: list[_Bucket] = []
            for p in mod.parameters(recurse=False):
                hp = self._hp_of.get(p)
                if hp is not None:
                    owned.add(id(p))
                    if hp.bucket not in buckets:
                        buckets.append(hp.bucket)
            if buckets:
                self._hooks.append(mod.register_forward_pre_hook(_forward_hook(self, buckets)))
        missing = [hp.index for hp in self._hps if id(hp.param) not in owned]
        if missing:
            raise ValueError(f"offloaded parameters {missing[:8]} are not parameters of the given model")
        self._lazy = True

    def reload_weights(self) -> None:
        """Re-read the offloaded master weights from the device parameters.

        Call it after changing the weights outside the optimizer once training started (loading a model
        checkpoint without ``load_state_dict``, an EMA swap); otherwise the next CPU step would write the
        old masters back. (Before the first step, and after ``load_state_dict``, this happens by itself.)
        """
        self._settle()
        for hp in self._hps:
            if hp.same_dtype:
                hp.master_stale = True  # copied in the next step, on the D2H stream
            else:
                hp.master.copy_(hp.param.detach())  # host-device sync; fp32 masters from low-precision weights
        for p, m in self._dev_masters.items():
            m.copy_(p.detach())

    def wait_for(self, params: torch.Tensor | Iterable[torch.Tensor]) -> None:
        """Wait until these offloaded weights are updated (with :meth:`overlap_with_forward`), and order the
        current stream after their copies: call it before reading a weight outside its module's forward,
        e.g. the head weight of a fused linear + cross-entropy. Parameters that are not offloaded are
        ignored.

        Args:
            params: a parameter or parameters of this optimizer.
        """
        if isinstance(params, torch.Tensor):
            params = [params]
        buckets: list[_Bucket] = []
        for p in params:
            hp = self._hp_of.get(p)
            if hp is not None and hp.bucket not in buckets:
                buckets.append(hp.bucket)
        if buckets and self._inflight:
            self._await(buckets)

    def wait_for_weights(self) -> None:
        """Wait until every offloaded weight is updated (only needed with :meth:`overlap_with_forward`)."""
        t0 = time.perf_counter()
        self._settle()
        self._lazy_wait_s += time.perf_counter() - t0

    def _link_state(self) -> None:
        """Point ``self.state[p]`` at the inner optimizers' state (the same dicts, no copies)."""
        for hp in self._hps:
            st = hp.bucket.optimizer.state.get(hp.master)
            if st:
                self.state[hp.param] = st
        if self._dev_opt is not None:
            for p in self._dev_params:
                st = self._dev_opt.state.get(self._dev_masters.get(p, p))
                if st:
                    self.state[p] = st

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Reset the gradients of the device parameters and the host accumulators.

        Args:
            set_to_none: free the gradients instead of zeroing them (as torch's default).
        """
        if self._ready:
            pending = bool(self._held) or any(hp.accumulated or hp.in_arrival for hp in self._hps)
            if not self._lazy or not set_to_none or pending:
                # (lazy mode, the usual case: in-flight copies own references to the grads they read and
                # record_stream protects their memory, so dropping .grad here needs no wait)
                self._settle()
                for b in self._buckets:
                    for hp, _ in b.arrived:
                        hp.in_arrival = False
                    b.arrived = []
                self._held, self._step_jobs = [], []
                for hp in self._hps:
                    hp.hgrad_valid = False  # discard gradients accumulated on the host
            for hp in self._hps:
                hp.final = hp.accumulated = hp.early = False
                hp.grad_ref = hp.norm = None
            self._gate = None
        super().zero_grad(set_to_none=set_to_none)

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """Add a parameter group; its parameters are placed by ``offload_params`` or by the fraction rule
        applied to the new group alone.

        Args:
            param_group: the group, as for any torch optimizer.
        """
        if getattr(self, "_lazy", False):
            raise ValueError("add_param_group after overlap_with_forward: add all groups first")
        super().add_param_group(param_group)
        if not getattr(self, "_ready", False):
            return  # during __init__: placement happens once all groups are known
        self._settle()
        gi = len(self.param_groups) - 1
        params = self.param_groups[gi]["params"]
        offloaded = _select_offloaded(params, self.offload_fraction, self._offload_params)
        n_buckets = len(self._buckets)
        self._place(gi, params, offloaded)
        new = self._buckets[n_buckets:]
        for b in new:
            b.piece_numel = self._piece_numel(b) if self._engine_().piece_slots else 0
        if any(b.staging_bytes > self._slot_bytes and not b.piece_numel for b in new):
            raise ValueError(
                "a parameter of the new group needs a bigger staging slot than the optimizer allocated; pass "
                "it in the constructor instead"
            )
        if any(not hp.same_dtype for b in new for hp in b.params) and not self._engine_().h2d_buffers:
            raise ValueError("master_weights for a new low-precision group: pass it in the constructor instead")

    # ------------------------------------------------------------------------------------ state dict
    def state_dict(self) -> dict[str, Any]:
        """The optimizer state in torch's layout: state keyed by parameter index, tensors where they live.

        Host state stays on the CPU (a checkpoint of a 7B model does not pass through the device). With
        ``master_weights``, each low-precision parameter's entry also holds its fp32 ``master_weight``.

        Returns:
            ``{"state": {index: {...}}, "param_groups": [...]}``, loadable by this class or by
            ``optimizer_class`` itself.
        """
        self._settle()
        self._link_state()
        sd = super().state_dict()
        if self.master_weights:
            index = {id(p): i for i, p in enumerate(p for g in self.param_groups for p in g["params"])}
            masters = {id(hp.param): hp.master for hp in self._hps if not hp.same_dtype}
            masters.update({id(p): m for p, m in self._dev_masters.items()})
            for pid, m in masters.items():
                i = index[pid]
                if i in sd["state"]:  # stepped at least once; before that the parameter is the master
                    sd["state"][i] = {**sd["state"][i], "master_weight": m}
        return sd

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore a state saved by this class (any offload fraction) or by ``optimizer_class``.

        Host-resident entries are moved to the host, device-resident ones to the device, always as copies:
        the optimizer never shares state tensors with ``state_dict`` (so a source optimizer may keep
        stepping). Master weights are re-read from the device parameters at the next step (or taken from
        ``master_weight`` entries).

        Args:
            state_dict: as returned by :meth:`state_dict`.
        """
        self._settle()
        saved_groups = state_dict["param_groups"]
        if len(saved_groups) != len(self.param_groups):
            raise ValueError("loaded state dict has a different number of parameter groups")
        for g, sg in zip(self.param_groups, saved_groups):
            if len(g["params"]) != len(sg["params"]):
                raise ValueError(
                    "loaded state dict contains a parameter group that doesn't match the size of optimizer's group"
                )
        for g, sg in zip(self.param_groups, saved_groups):
            for k, v in sg.items():
                if k not in ("params", "param_names"):
                    g[k] = v
        by_param: dict[torch.Tensor, dict[str, Any]] = {}
        for g, sg in zip(self.param_groups, saved_groups):
            for p, key in zip(g["params"], sg["params"]):
                if key in state_dict["state"]:
                    by_param[p] = dict(state_dict["state"][key])

        def load_inner(
            opt: Optimizer,
            group_map: list[int],
            inner_of: Callable[[torch.Tensor], torch.Tensor],
            outer_of: dict[int, torch.Tensor],
        ) -> None:
            groups, state, k = [], {}, 0
            for inner, gi in zip(opt.param_groups, group_map):
                ids = []
                for m in inner["params"]:
                    p = outer_of[id(m)]
                    st = by_param.get(p)
                    if st is not None:
                        mw = st.pop("master_weight", None)
                        if mw is not None and inner_of(p) is not p:
                            inner_of(p).copy_(mw)
                            hp = self._hp_of.get(p)
                            if hp is not None:
                                hp.master_stale = False
                        if st:
                            # own copies: loading must not alias the source optimizer's state
                            dev = inner_of(p).device
                            state[k] = {kk: _owned(vv, dev) for kk, vv in st.items()}
                    ids.append(k)
                    k += 1
                keep = {kk: vv for kk, vv in inner.items() if kk in _IMPL_KEYS and kk != "params"}
                groups.append({**self._hyper_of(gi), **keep, "params": ids})
            opt.state.clear()
            opt.load_state_dict({"state": state, "param_groups": groups})

        for hp in self._hps:
            hp.master_stale = hp.same_dtype
        for b in self._buckets:
            outer = {id(hp.master): hp.param for hp in b.params}
            load_inner(b.optimizer, b.group_map, lambda p: self._hp_of[p].master, outer)
        if self._dev_opt is not None:
            outer = {id(self._dev_masters.get(p, p)): p for p in self._dev_params}
            load_inner(self._dev_opt, self._dev_group_map, lambda p: self._dev_masters.get(p, p), outer)
        self.state.clear()
        self._link_state()

    # ------------------------------------------------------------------------------------ stats
    def stats(self) -> dict[str, Any]:
        """Numbers for benchmarks and logs: placement, host memory, and the last step's CPU timing.

        Returns:
            A dict: ``offloaded_params``, ``offloaded_numel``, ``device_numel``, ``host_bytes`` (masters,
            host optimizer state, staging, accumulators), ``pinned_bytes``, ``host_bytes_per_offloaded_param``,
            ``staging_bytes`` and ``scratch_bytes`` (the bounded buffers),
            ``cpu_step_s`` (CPU time of the last step's host work), ``cpu_wait_s`` (time ``step()`` waited for
            it), ``hidden_fraction`` (1 - wait / CPU time: the share that ran behind other work),
            ``d2h_bytes``/``h2d_bytes`` of the last step, ``step_in_backward``, ``steps``.
        """
        engine = self._engine_()
        state_bytes = 0
        for b in self._buckets:
            for st in b.optimizer.state.values():
                state_bytes += sum(_nbytes(v) for v in st.values() if isinstance(v, torch.Tensor))
        off = sum(hp.param.numel() for hp in self._hps)
        host_bytes = self._host.pinned_bytes + self._host.pageable_bytes + state_bytes
        out = {
            "offloaded_params": len(self._hps),
            "offloaded_numel": off,
            "device_numel": sum(p.numel() for p in self._dev_params),
            "host_bytes": host_bytes,
            "pinned_bytes": self._host.pinned_bytes,
            "host_bytes_per_offloaded_param": host_bytes / off if off else 0.0,
            "staging_bytes": self._staging_bytes,
            "scratch_bytes": _nbytes(engine.scratch) if engine.scratch is not None else 0,
            "step_in_backward": self.step_in_backward,
            "cpu_threads": engine.cpu_threads,
        }
        out.update(self._stats)
        return out


def _forward_hook(opt: CPUOffloadOptimizer, buckets: list[_Bucket]) -> Callable[..., None]:
    ref = weakref.ref(opt)  # a module's hook must not keep the optimizer alive

    def hook(module: torch.nn.Module, args: Any) -> None:
        o = ref()
        if o is not None and o._inflight:
            o._await(buckets)

    return hook


def _grad_hook(opt: CPUOffloadOptimizer, hp: _HostParam) -> Callable[[torch.Tensor], None]:
    ref = weakref.ref(opt)  # the parameter's hook must not keep the optimizer alive

    def hook(param: torch.Tensor) -> None:
        o = ref()
        if o is None or param.grad is None:
            return
        if o.sync_gradients:
            o._on_grad(hp, "final", param.grad, early=True)
        elif o.offload_gradients:
            o._on_grad(hp, "accumulate", param.grad)

    return hook
