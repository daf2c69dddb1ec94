"""The copy thread and the step thread of one CPU-offloaded optimizer, and the jobs they pass along.

The pipeline for an offloaded bucket, when gradients are handed over during backward:

1. the training thread (a post-accumulate-grad hook, or ``step()`` for the rest) records an event on the
   compute stream and hands a :class:`Job` to the engine (``submit``) once its bucket's gradients are all final;
2. the copy thread takes a slot of the bounded pinned staging pool and copies the bucket's gradients into it
   on the D2H stream, which waits on that event (a stream wait, never a host synchronize); a parameter bigger
   than a slot is streamed piece by piece into slots, ahead of the step thread;
3. the step thread waits for the copy (a host wait, on its own thread); before the job's :class:`Gate` opens
   it only adds later micro-batches into host gradients, after it applies the step's gradient scale
   (clipping, GradScaler), steps the bucket on the CPU (:mod:`elbowroom.optim.host_step`) and copies the
   updated weights back on the H2D stream;
4. the training thread waits for jobs (``wait_idle``, ``wait_jobs``: host waits for the CPU, not the device)
   and then makes its stream wait on the H2D stream.

Which thread owns what (the rule the code follows; a reader checking a change should check it here):

- **Training thread only**: the optimizer facade's bookkeeping (``HostParam.final``, ``accumulated``,
  ``in_arrival``, ``grad_ref``, ``norm``, ``master_stale``; buckets' ``arrived``), building jobs, opening
  gates, ``HostMemory`` (allocations at set-up, release after ``stop``).
- **Handed over with a job** (a single owner at a time; the hand-over is a queue or the engine's condition
  variable, both of which order memory): a job's fields and its staging slot, and for its parameters the host
  master and the inner optimizer's state. The copy thread owns them from ``submit`` until it puts the job on
  the step queue, the step thread until the job is done. The training thread touches them only when no job of
  theirs is outstanding: after ``wait_idle``/``wait_jobs`` (``state_dict``, ``reload_weights``, the lazy
  mode's hand-over of a bucket that still has jobs in flight).
- **A host gradient** (``offload_gradients``: ``hgrad``, ``hgrad_valid``) passes along the jobs of its
  parameter in order: the copy thread sets it with the step's first copy (straight into it, on the D2H
  stream, ahead of every later copy of that parameter), the step thread adds the later micro-batches in
  ``_pre`` (each after waiting for its copy) and resets it after the step. The training thread reads it after
  ``wait_pre`` while the step's gate is closed (``clip_grad_norm_``: nothing steps then) and resets it only
  after ``wait_idle`` (``zero_grad``).
- **Step thread only**: the H2D staging buffers and their events (``h2d_next``, ``h2d_events``), the piece
  buffers, the fp32 scratch, ``Bucket.h2d_event`` (read by the training thread after ``wait_jobs``).
- **Written once, then read**: a gate's ``plan`` is set before its ``open`` flag, by the training thread,
  before the gate goes on the step queue; ``error`` is set once, under the condition variable.
- **Under a lock**: the job counts and ``finished``/``pre_done`` flags (the condition variable ``_cv``); the
  traffic and time counters, the per-bucket state sizes and the trace (``_stats_lock``: any thread adds, the
  training thread reads a consistent snapshot whenever it likes, also while steps run); the slot pool's free
  list (its own lock).

Shutdown: ``stop`` closes the slot pool (a worker blocked on it gives up its job), sends the end marker down
both queues and joins both threads, raising ``RuntimeError`` naming a thread that is still alive after the
timeout; the caller releases pinned memory only after ``stop`` returned.
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import queue
import sys
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

from elbowroom.optim.buffers import Closed, HostMemory, SlotPool, Streams, nbytes, piece_spans
from elbowroom.optim.config import CPUOffloadConfig, default_step_threads
from elbowroom.optim.host_step import HostStep
from elbowroom.optim.stream_step import DeviceStep

if TYPE_CHECKING:
    from elbowroom.optim.placement import Bucket, HostParam, Staging

__all__ = ["Engine", "Gate", "Job", "StepPlan", "finalize", "shutdown"]

logger = logging.getLogger(__name__)

_serial = itertools.count()  # names the threads of each engine apart ("elbowroom-optim-step-3")

@dataclasses.dataclass
class StepPlan:
    """What the CPU steps of one optimizer step apply, fixed when their gate opens."""

    hyper: list[dict[str, Any]]
    mults: list[torch.Tensor] = dataclasses.field(default_factory=list)  # CPU fp32 scalars, in order
    skip: bool = False
    recopy: dict[int, torch.Tensor | None] = dataclasses.field(default_factory=dict)
    """Param index -> its gradient as edited after the hand-over (None: dropped). The step thread sets each value
    to None once it has read it: a finished step's plan must not keep device gradients alive (under DDP they are
    views of its buckets, and DDP's rebuilt buckets at step 2 then came on top of the old ones)."""
    ready: Any = None  # compute-stream event after which re-copies may read


class Gate:
    """Holds a step's CPU updates until the values they need are known."""

    def __init__(self) -> None:
        self.plan: StepPlan | None = None
        self.open = False


@dataclasses.dataclass
class Job:
    """The gradients of one bucket (or part of one) on their way to the host, and what happens to them there."""

    kind: str  # "accumulate" | "final"
    bucket: Bucket
    params: list[HostParam]
    grads: list[torch.Tensor | None]  # device grads (a reference keeps each alive until it is copied)
    fresh: list[bool]
    ready: Any  # compute-stream event: the grads are complete on the device
    staged: list[bool]  # set by the copy thread: this grad went to the slot (not to its host buffer)
    gate: Gate | None
    refresh: list[HostParam]
    slot: torch.Tensor | None = None
    copied: Any = None
    # a parameter stepped piece by piece whose pieces the copy thread streams through pool slots: (slot, piece,
    # D2H event) per piece, then None (an exception in place of a piece: the copy failed)
    pieces: queue.SimpleQueue | None = None
    pre_done: bool = False
    finished: bool = False


class Engine(HostStep, DeviceStep):
    """The copy thread and the step thread of one optimizer (see the module docstring for who owns what).

    Args:
        streams: the device's copy streams.
        staging: the pinned buffers the placement allocated (slots, piece buffers, H2D buffers, scratch).
        config: the optimizer's settings (host gradients, step threads, chunk size, tracing).
    """

    def __init__(self, streams: Streams, staging: Staging, config: CPUOffloadConfig) -> None:
        self.streams = streams
        # intra-op threads of the step thread: by default this process's cores less two (the training thread,
        # autograd's device thread and the copy thread need cores of their own)
        self.cpu_threads = config.cpu_threads or default_step_threads()
        self.chunked = staging.chunked
        self.scale_in_kernel = config.scale_in_kernel
        self.host_chunk_numel = config.host_chunk_numel
        self.pool = SlotPool(staging.slots)
        # two pinned buffers of the step thread's own for parameters stepped piece by piece whose pieces it
        # copies itself (outside the pool: the step thread never waits for a slot that only it could free)
        self.piece_slots = staging.piece_slots
        self.h2d_buffers = staging.h2d
        self.h2d_events: list[Any] = [None] * len(staging.h2d)  # step thread only
        self.h2d_next = 0  # step thread only
        self.scratch = staging.scratch  # step thread only
        # streamed parameters: the device ring they step through, and each slot's last copy back (step thread only)
        self.stream_ring = staging.stream_ring
        self.stream_events: list[Any] = [None] * len(staging.stream_ring)
        self.stream_next = 0
        self.offload_gradients = config.offload_gradients
        # offload_gradients: several jobs wait at once; step the one the next forward needs first (_next_ready)
        self.needed_first = config.offload_gradients and config.step_order == "needed_first"
        self._copy_q: queue.SimpleQueue = queue.SimpleQueue()
        self._step_q: queue.SimpleQueue = queue.SimpleQueue()
        self._cv = threading.Condition()  # guards the two counts below and each job's pre_done / finished
        self._outstanding = 0
        self._pre_outstanding = 0
        self.error: BaseException | None = None  # set once, under _cv
        self._stopped = False  # set by stop(), under _cv: no new work from then on
        # traffic and time counters, per-bucket state sizes and the trace: any thread adds, under this lock
        self._stats_lock = threading.Lock()
        self._counters: dict[str, float] = {"cpu_s": 0.0, "copy_wait_s": 0.0}  # seconds
        self._counters.update(d2h_bytes=0, recopy_bytes=0, h2d_bytes=0)  # ints
        self._state_bytes: dict[int, int] = {}  # id(bucket) -> bytes of its inner optimizer's state
        self._trace: list[tuple[str, int, float, float]] | None = [] if config.trace_steps else None
        n = next(_serial)
        self.threads = (
            threading.Thread(target=self._copy_loop, name=f"elbowroom-optim-d2h-{n}", daemon=True),
            threading.Thread(target=self._step_loop, name=f"elbowroom-optim-step-{n}", daemon=True),
        )
        for t in self.threads:
            t.start()

    # ---- any thread: counters and the trace
    def count(self, **amounts: float) -> None:
        """Add to the traffic and time counters (``cpu_s``, ``copy_wait_s``, ``d2h_bytes``, ``recopy_bytes``,
        ``h2d_bytes``)."""
        with self._stats_lock:
            for k, v in amounts.items():
                self._counters[k] += v

    def counters(self) -> dict[str, float]:
        """A consistent snapshot of the counters since the engine started.

        Returns:
            ``{"cpu_s", "copy_wait_s", "d2h_bytes", "recopy_bytes", "h2d_bytes"}`` (bytes as ints).
        """
        with self._stats_lock:
            return dict(self._counters)

    def note(self, what: str, index: int, t0: float, t1: float) -> None:
        """Add an event to the trace (a no-op unless tracing)."""
        with self._stats_lock:
            if self._trace is not None:
                self._trace.append((what, index, t0, t1))

    def take_trace(self) -> list[tuple[str, int, float, float]] | None:
        """The events noted since the last call (None unless tracing); later events go to a new list."""
        with self._stats_lock:
            if self._trace is None:
                return None
            events, self._trace = self._trace, []
        return events

    def note_state(self, bucket: Bucket) -> None:
        """Record the bytes of a bucket's inner optimizer state (by its owner: the step thread after a step,
        the training thread when idle)."""
        # (a streamed bucket's moments are the pinned buffers the host memory counts already: not twice)
        pinned = {id(t) for hp in bucket.params if hp.stream_state is not None for t in hp.stream_state}
        n = sum(nbytes(v) for st in bucket.optimizer.state.values() for v in st.values()
                if isinstance(v, torch.Tensor) and id(v) not in pinned)
        with self._stats_lock:
            self._state_bytes[id(bucket)] = n

    def state_bytes(self) -> int:
        """Bytes of host optimizer state over all buckets, as last recorded."""
        with self._stats_lock:
            return sum(self._state_bytes.values())

    # ---- training thread
    def submit(self, job: Job) -> None:
        """Hand a job to the copy thread (it owns the job, and its parameters' host buffers, from here).

        Raises:
            RuntimeError: the engine was stopped (the optimizer was closed).
        """
        with self._cv:
            if self._stopped:
                raise RuntimeError("the CPUOffloadOptimizer was closed; build a new one to keep training")
            self._outstanding += 1
            self._pre_outstanding += 1
        if job.bucket.streamed and not job.refresh and not job.bucket.piece_numel:
            # nothing to copy (its gradients stay on the device, where it steps): straight to the step thread. In
            # the copy queue it waited behind host-stepped jobs whose copies wait for staging slots, which only the
            # host's steps free without offload_gradients: the 7B shape's streamed states then went up only after
            # every host step, and its step took 2.2x its prediction (H100, BENCHMARKS.md)
            self._step_q.put(job)
            return
        self._copy_q.put(job)

    def open_gate(self, gate: Gate, plan: StepPlan) -> None:
        """Fix the values a step's CPU updates apply and let them run (jobs held at the gate, in forward order)."""
        gate.plan = plan  # written once, before ``open``: a worker that sees ``open`` sees the plan
        gate.open = True
        self._step_q.put(gate)

    def wait_idle(self) -> None:
        """Host wait until every submitted job is done (its H2D copies are enqueued, not finished); the waits
        return at once once the engine is stopped."""
        with self._cv:
            while self._outstanding and self.error is None and not self._stopped:
                self._cv.wait()
        self.raise_error()

    def wait_jobs(self, jobs: list[Job]) -> None:
        """Host wait until these jobs are done (their H2D copies enqueued)."""
        with self._cv:
            while not all(j.finished for j in jobs) and self.error is None and not self._stopped:
                self._cv.wait()
        self.raise_error()

    def wait_pre(self) -> None:
        """Host wait until every submitted job went through its pre-gate phase."""
        with self._cv:
            while self._pre_outstanding and self.error is None and not self._stopped:
                self._cv.wait()
        self.raise_error()

    def unfinished(self, jobs: list[Job]) -> list[Job]:
        """The jobs of ``jobs`` that are not done yet (read under the lock that guards ``finished``)."""
        with self._cv:
            return [j for j in jobs if not j.finished]

    def raise_error(self) -> None:
        """Raise the first worker failure (with its cause) if there was one: named in the message, and a device
        out-of-memory in a worker (its device scratch, under a capped allocator) as ``torch.OutOfMemoryError``, so
        that what guards a step against running out of memory (the trainer's re-plan) sees it as one."""
        e = self.error
        if e is not None:
            text = (f"the CPUOffloadOptimizer worker failed ({type(e).__name__}: {str(e)[:300]}); "
                    "the optimizer is unusable")
            if isinstance(e, torch.OutOfMemoryError):
                raise torch.OutOfMemoryError(text) from e
            raise RuntimeError(text) from e

    def stop(self, timeout: float) -> None:
        """Stop both worker threads and join them (idempotent: a second call joins again).

        Args:
            timeout: seconds to wait for each thread.

        Raises:
            RuntimeError: a thread is still alive after ``timeout`` (named in the message); its buffers must not
                be released.
        """
        with self._cv:
            self._stopped = True
            self._cv.notify_all()  # a training-thread wait returns: nothing it waits for will finish now
        self.pool.close()  # a worker blocked on a slot gives up its job (Closed)
        self._copy_q.put(None)  # the copy thread passes the end marker on to the step thread
        stuck = []
        for t in self.threads:
            if t is threading.current_thread():
                continue  # (the caller hands the shutdown to another thread in this case)
            t.join(timeout)
            if t.is_alive():
                stuck.append(t.name)
        if stuck:
            raise RuntimeError(
                f"CPUOffloadOptimizer: worker thread {', '.join(stuck)} did not finish within {timeout:g} s of "
                "close(); its host memory stays pinned. Call close() again to retry, or raise "
                "CPUOffloadConfig.join_timeout_s if CPU steps are that long."
            )

    # ---- worker threads
    def _done(self, job: Job) -> None:
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

    def _pre_done(self, job: Job) -> None:
        with self._cv:
            job.pre_done = True
            self._pre_outstanding -= 1
            self._cv.notify_all()

    def _fail(self, exc: BaseException, job: Job) -> None:
        if isinstance(exc, Closed):  # shutting down (close(), or the optimizer was collected mid-step)
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

    def _copy(self, job: Job) -> bool:
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
        # a streamed bucket's gradients stay on the device, where it steps (stream_step)
        keep = pieces or job.bucket.streamed
        todo = [] if keep else [(i, hp, g) for i, (hp, g) in enumerate(zip(job.params, job.grads)) if g is not None]
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
                # in the destination's dtype: an upcast on the device when the casts run there (through this
                # stream's cast buffer, a chunk at a time: Streams.copy_cast)
                self.count(d2h_bytes=s.copy_cast(dest, g))
                if s.cuda:
                    # lifetime extension: whoever frees the grad (offload_gradients, zero_grad), the caching
                    # allocator reuses its block only after this copy
                    g.record_stream(s.d2h)
            for hp in job.refresh:
                hp.master.copy_(hp.param.detach(), non_blocking=True)
            job.copied = s.record(s.d2h)
        if not keep:
            # drop our references: the device grads may be freed now (record_stream keeps the copy safe)
            job.grads = [None] * len(job.grads)
        return stream

    @staticmethod
    def _streamable(job: Job) -> bool:
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

    def _stream_pieces(self, job: Job, g: torch.Tensor) -> None:
        """Copy a piece-by-piece parameter's gradient into pool slots, one piece per slot, as slots come free:
        the step thread steps and frees them in order behind this thread, so the copies run ahead of the
        steps as far as the pool allows (as whole buckets' copies do)."""
        assert job.pieces is not None
        (hp,) = job.params
        try:
            flat = self._piece_source(g, job.ready)
            for a, e in piece_spans(hp.param.numel(), job.bucket.piece_numel):
                slot = self.pool.acquire()  # may block until the step thread frees a slot
                dest, ev, n = self._copy_piece(flat, a, e, slot, hp.stage_dtype)
                self.count(d2h_bytes=n)
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
            moved = s.copy_cast(dest, flat[a:e])  # upcast on the device when the casts run there
            return dest, s.record(s.d2h), moved

    def _step_loop(self) -> None:
        self.streams.bind_thread()
        torch.set_num_threads(self.cpu_threads)  # per thread with OpenMP: the training thread keeps its own
        waiting: list[Job] = []
        # offload_gradients with step_order "needed_first": final jobs whose gate is open and whose gradients are on
        # the host, stepped earliest needed first (see _next_ready)
        ready: list[Job] = []
        later: Job | None = None  # a job taken off the queue whose copy had not landed while others were ready
        while True:
            if later is not None:
                msg, later = later, None
            elif ready:
                try:
                    msg = self._step_q.get_nowait()
                except queue.Empty:
                    self._run(self._post, self._next_ready(ready))
                    continue
            else:
                msg = self._step_q.get()
            if ready and isinstance(msg, Job) and not self.streams.done(msg.copied):
                # the backward has not produced this one's gradients yet (hooks run ahead of the device): step what
                # is on the host meanwhile instead of waiting for its copy
                later = msg
                self._run(self._post, self._next_ready(ready))
                continue
            if msg is None:
                for job in ready:  # shutting down: nothing steps any more, but every job is accounted for
                    self._done(job)
                return
            if isinstance(msg, Gate):
                # streamed ones first (they only enqueue device work: the link steps them while the host steps the
                # others), then forward order: the next forward needs the first offloaded weights first
                waiting.sort(key=lambda j: (not j.bucket.streamed, j.params[0].index))
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
                if self.needed_first and not job.bucket.streamed:  # streamed: enqueued at once, the link does it
                    ready.append(job)
                else:
                    self._run(self._post, job)
            else:
                waiting.append(job)

    @staticmethod
    def _next_ready(ready: list[Job]) -> Job:
        """The ready job the next forward needs first (the lowest parameter index: forward order), taken out of
        ``ready``.

        With ``offload_gradients`` every gradient reaches the host at link speed, ahead of the CPU steps, so several
        jobs are ready at once: stepping the one needed first (earliest deadline first) lets the next forward start
        once the first offloaded weights are back and go on as the rest land, where arrival order (late blocks
        first) steps the first blocks last and holds the whole forward until every update is done (W1 at 8 GiB:
        75-81% of plain against 58-64% in arrival order, one call). A job whose copy has not landed is never waited
        for while others are ready (the first version did, and ran at 55-58%). Without ``offload_gradients`` the
        staging slots pace the copies, so jobs arrive about one at a time and are stepped as they come. The order
        between buckets changes no value: each bucket steps on its own gradients.
        """
        i = min(range(len(ready)), key=lambda k: ready[k].params[0].index)
        return ready.pop(i)

    def _run(self, fn: Callable[[Job], None], job: Job) -> bool:
        try:
            fn(job)
        except BaseException as exc:  # noqa: BLE001 - handed to the main thread, which re-raises it
            self._fail(exc, job)
            return False
        return True

    def _pre(self, job: Job) -> None:
        """Before the gate: wait for the copy; move grads into host accumulators where they must wait."""
        tw = time.perf_counter()
        self.streams.host_wait(job.copied)  # host wait (this thread) for the bucket's D2H copy
        t0 = time.perf_counter()
        self.count(copy_wait_s=t0 - tw)
        self.note("copied", job.params[0].index, tw, t0)
        if self.offload_gradients and job.slot is not None:
            # later micro-batches: add into the host gradient (the sum torch would form on the device) and
            # free the slot at once, so that a step waiting at its gate never holds slots
            for hp, staged in zip(job.params, job.staged):
                if staged:
                    assert hp.hgrad is not None
                    hp.hgrad.add_(hp.staging(job.slot))
            self.pool.release(job.slot)
            job.slot = None
        self.count(cpu_s=time.perf_counter() - t0)
        self._pre_done(job)

    def _post(self, job: Job) -> None:
        """After the gate: scale the grads, step the bucket on the CPU, send the weights back."""
        try:
            plan = job.gate.plan
            assert plan is not None
            if not plan.skip:
                if job.bucket.streamed:
                    self._step_streamed(job, plan)
                else:
                    self._step_bucket(job, plan)
                self.note_state(job.bucket)  # the step thread owns the bucket's state here
        finally:
            self._drain_pieces(job)
            for hp in job.params:
                hp.hgrad_valid = False  # consumed; the job (and with it this flag) goes back to the training thread
            self._done(job)


# ---------------------------------------------------------------------------------------------- shutdown
def _interpreter_exiting() -> bool:
    """Whether Python is shutting down: atexit handlers (the finalizers of live objects) run after the main
    thread stopped, and then the interpreter finalizes."""
    return sys.is_finalizing() or not threading.main_thread().is_alive()


def shutdown(engine: Engine, hooks: list[Any], host: HostMemory, timeout: float) -> None:
    """Remove the hooks, stop and join the worker threads, then unpin host memory (in this order)."""
    for h in hooks:
        h.remove()
    hooks.clear()
    engine.stop(timeout)  # raises, naming a stuck thread: its pinned memory is then kept
    if engine.streams.cuda:
        # host-device sync: no copy may still read or write the memory unpinned below
        torch.cuda.synchronize(engine.streams.device)
    host.release()


def finalize(engine: Engine, hooks: list[Any], host: HostMemory, timeout: float) -> None:
    """The optimizer was collected, or the interpreter exits, without ``close()``: shut down as ``close()`` does.

    Errors propagate (gc reports them as unraisable, the exit handler prints them), except at interpreter exit,
    where CUDA or the threads may be torn down already: only those are swallowed.
    """
    if threading.current_thread() in engine.threads:
        # collected on one of its own worker threads (gc runs wherever an allocation triggers it): a thread
        # cannot join itself, so a fresh one shuts down once this one has returned to its loop
        threading.Thread(
            target=finalize, args=(engine, hooks, host, timeout), name="elbowroom-optim-close", daemon=True
        ).start()
        return
    try:
        shutdown(engine, hooks, host, timeout)
    except Exception:
        if not _interpreter_exiting():
            raise
        logger.debug("CPUOffloadOptimizer shutdown at interpreter exit failed", exc_info=True)
