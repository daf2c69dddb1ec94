"""The step thread's CPU step of one bucket: scale the gradients, step on the host, send the weights back.

A bucket whose gradients arrived in a staging slot (or in host gradients, with ``offload_gradients``) steps
with one call of its inner torch optimizer; low-precision buckets upcast, step and cast back chunk by chunk
(``elbowroom.optim._host_adam``). A parameter bigger than a slot (an output head, and on wide models every
weight matrix) steps piece by piece with Adam/AdamW, elementwise and so exactly as whole: its pieces arrive in
pool slots streamed by the copy thread, or, for a job held at a closed gate, the step thread copies them itself
through two buffers of its own (piece k+1 on its way while piece k steps). Staging stays bounded by the slot
size whatever the model's largest parameter (a 32000 x 4096 head's fp32 gradient is 0.5 GB).

:class:`HostStep` is the step-thread half of :class:`elbowroom.optim.engine.Engine` (a mixin: it uses the
engine's streams, slot pool, H2D buffers, scratch, ``_piece_source``/``_copy_piece`` and counters). Everything
here runs on the step thread, which owns the job, its slot, the H2D buffers and the scratch while it runs.
"""

from __future__ import annotations

import queue
import time
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import torch

from elbowroom.optim import _host_adam
from elbowroom.optim.buffers import SlotPool, Streams, nbytes, piece_spans

if TYPE_CHECKING:
    from elbowroom.optim.engine import Job, StepPlan
    from elbowroom.optim.placement import HostParam

__all__ = ["HostStep"]


class HostStep:
    """The CPU step of buckets and of piece-by-piece parameters (mixed into the engine, on its step thread)."""

    # set by Engine.__init__
    streams: Streams
    pool: SlotPool
    chunked: bool
    scale_in_kernel: bool
    host_chunk_numel: int | None
    piece_slots: list[torch.Tensor]
    h2d_buffers: list[torch.Tensor]
    h2d_events: list[Any]
    h2d_next: int
    scratch: torch.Tensor | None

    def _step_bucket(self, job: Job, plan: StepPlan) -> None:
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
                        self.count(recopy_bytes=s.copy_cast(dest, g))  # as in the first copy
                        if s.cuda:
                            g.record_stream(s.d2h)  # lifetime extension, as for the first copy
                ev = s.record(s.d2h)
            s.host_wait(ev)  # host wait (this thread) for the re-copy
        for hp in job.params:  # read (or not needed: a host gradient): the plan must not keep the device grad alive
            if hp.index in plan.recopy:
                plan.recopy[hp.index] = None
        t0 = time.perf_counter()
        chunked = self.chunked and bucket.chunked
        # CPUOffloadConfig.scale_in_kernel: the clip coefficient goes into torch's fused kernel, not a pass of its own
        in_kernel = self.scale_in_kernel and bool(plan.mults) and _host_adam.supports(bucket.optimizer)
        stepped: list[HostParam] = []
        in_chunks: list[tuple[HostParam, torch.Tensor]] = []
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
            if not in_kernel:
                for m in plan.mults:
                    g.mul_(m)
            hp.master.grad = g
        if not stepped:
            self.count(cpu_s=time.perf_counter() - t0)
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
                _host_adam.step_chunked(opt, group, hp.master, g, out, self.scratch, plan.mults, self.host_chunk_numel,
                                        in_kernel=in_kernel)
        if len(in_chunks) < len(stepped):  # torch's kernel for the rest (only masters with a .grad step)
            if in_kernel:
                _host_adam.step_scaled(bucket.optimizer, plan.mults)
            else:
                bucket.optimizer.step()
        for hp in job.params:
            hp.master.grad = None  # the slot and accumulators are not the masters' grads beyond this step
        t1 = time.perf_counter()
        self.count(cpu_s=t1 - t0)
        self.note("step", job.params[0].index, t0, t1)
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
                    # the pinned master into the stream's cast buffer and cast into the parameter there, a chunk
                    # at a time (Streams.copy_cast: the stream allocates nothing per tensor)
                    moved = s.copy_cast(hp.param.detach(), hp.master)
                    self.count(h2d_bytes=moved - nbytes(hp.param))
                else:
                    assert buf_i is not None
                    stage = hp.staging(self.h2d_buffers[buf_i], hp.param.dtype)
                    if id(hp) not in done:
                        stage.copy_(hp.master)  # cast to the device dtype on the CPU: half the bytes to move
                    hp.param.detach().copy_(stage, non_blocking=True)
                self.count(h2d_bytes=nbytes(hp.param))
            ev = s.record(s.h2d)
        bucket.h2d_event = ev
        if buf_i is not None:
            self.h2d_events[buf_i] = ev


    def _step_pieces(self, job: Job, plan: StepPlan) -> None:
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
            assert not streamed  # (never streamed: see Engine._streamable)
            g, ready = plan.recopy[hp.index], plan.ready
            plan.recopy[hp.index] = None  # read once (held here while its pieces copy)
        job.grads = [None]
        if g is None and not streamed:
            return
        for inner, gi in zip(bucket.optimizer.param_groups, bucket.group_map):
            inner.update(plan.hyper[gi])
        opt = bucket.optimizer
        group = opt.param_groups[bucket.inner_of[hp.group]]
        host_cast = not hp.same_dtype and not hp.device_cast
        spans = piece_spans(hp.param.numel(), bucket.piece_numel)
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
            self.count(copy_wait_s=tc - tw)
            out = None
            if host_cast:
                buf_i = self.h2d_next
                self.h2d_next = (self.h2d_next + 1) % len(self.h2d_buffers)
                s.host_wait(self.h2d_events[buf_i])  # host wait (this thread): the buffer's last H2D is done
                out = self.h2d_buffers[buf_i][: (e - a) * hp.param.element_size()].view(hp.param.dtype)
            # an fp32 piece steps in one call (scaled in place, no upcast to keep in cache: smaller chunks would
            # only add a fork and join of the step threads per chunk)
            chunk = -(-(e - a) // 64) * 64 if dest.dtype == torch.float32 else self.host_chunk_numel
            _host_adam.step_chunked(
                opt, group, hp.master, dest, out, self.scratch, plan.mults, chunk, span=(a, e), count_step=k == 0,
                in_kernel=self.scale_in_kernel and bool(plan.mults),
            )
            self.note("piece_wait", hp.index, tw, tc)
            self.note("piece_step", hp.index, tc, time.perf_counter())
            if slot is not None:
                self.pool.release(slot)  # read by the step above: the copy thread may refill it
            with s.on(s.h2d):
                # stream wait: never overwrite weights the compute stream may still read in this backward
                s.stream_wait(s.h2d, job.ready)
                master = hp.master.view(-1)[a:e]
                if hp.same_dtype:
                    flat[a:e].copy_(master, non_blocking=True)  # straight from the pinned master
                elif hp.device_cast:
                    moved = s.copy_cast(flat[a:e], master)  # cast on the device, through the stream's buffer
                    self.count(h2d_bytes=moved - (e - a) * flat.element_size())
                else:
                    assert out is not None
                    flat[a:e].copy_(out, non_blocking=True)
                self.count(h2d_bytes=(e - a) * flat.element_size())
                ev_h2d = s.record(s.h2d)
            if host_cast:
                self.h2d_events[buf_i] = ev_h2d
        bucket.h2d_event = ev_h2d
        t1 = time.perf_counter()
        self.count(cpu_s=t1 - t0)
        self.note("step", hp.index, t0, t1)

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
            dest, ev, n = self._copy_piece(flat, *spans[k], self.piece_slots[k % 2], dtype)
            self.count(recopy_bytes=n)
            return None, dest, ev

        nxt = copy(0)
        for k in range(len(spans)):
            cur = nxt
            if k + 1 < len(spans):
                nxt = copy(k + 1)
            yield cur

    def _drain_pieces(self, job: Job) -> None:
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
