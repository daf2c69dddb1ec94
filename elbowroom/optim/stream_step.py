"""The device step of streamed parameters: host state, stepped on the device (``stream_params``).

A streamed parameter keeps its fp32 master and Adam moments in pinned host memory, like any offloaded parameter,
but its step runs where its gradient already is. For each slot of at most ``stream_slot_numel`` elements (a chunk of
a bigger parameter, or several smaller ones packed together and stepped by one fused call), on the H2D stream: the
master and both moments come up into a slot of a small device ring, the gradient (still on the device) is upcast
into the same slot and scaled, torch's fused Adam(W) kernel steps the slot, and the new master is cast into the
device parameter; then, on the D2H stream, the master and moments go back to the host (two streams of their own,
beside the host-stepped buckets' copies). Every wait is a stream wait: the step thread only enqueues, the link does
the work.

Per parameter and step that is 12 bytes up and 12 down (fp32 master, exp_avg, exp_avg_sq), no gradient on the
link and no host CPU work, where a host-stepped parameter moves 4 bytes each way and costs the host's AdamW
(3-5 G params/s on the lent H100's host, and half that on a bad run). At 45 GB/s each way a link streams about
3.7 G params/s: a second optimizer beside the host's, whose pace does not depend on the host's memory bandwidth.

Orderings (all on the device):
- a slot is refilled only after its previous contents went back (the H2D stream waits for the slot's D2H event);
- a bucket's state comes up only after its previous step's state went back (``Bucket.d2h_event``);
- the gradient is read only after backward produced it (``Job.ready``, or the step's ``ready`` for a re-read
  gradient edited after its hand-over), and kept referenced (``Bucket.held_grads``) until the compute stream waits
  for the weights the step wrote, after which it is freed there;
- the next forward reads the weights after ``Bucket.h2d_event`` (as for host-stepped buckets);
- a host reader of the state (``state_dict``, ``load_state_dict``, ``reload_weights``) waits for
  ``Bucket.d2h_event`` first (``Handover.settle``).

The arithmetic is torch's fused kernel, elementwise over the chunk, so a streamed parameter steps exactly as torch's
fused AdamW on the same device would.
"""

from __future__ import annotations

import dataclasses
import time
from typing import TYPE_CHECKING, Any

import torch

from elbowroom.optim import _host_adam

if TYPE_CHECKING:
    from elbowroom.optim.buffers import Streams
    from elbowroom.optim.engine import Job, StepPlan
    from elbowroom.optim.placement import HostParam

__all__ = ["DeviceStep", "stream_state"]


def stream_state(optimizer: torch.optim.Optimizer, hp: HostParam) -> dict[str, Any]:
    """The parameter's Adam state in torch's layout with its moments in the pinned buffers set aside for them (step
    thread): created as zeros at the first step, and moved into those buffers after ``load_state_dict`` put
    pageable copies there (an asynchronous copy needs pinned memory)."""
    st = optimizer.state[hp.master]
    assert hp.stream_state is not None
    m, v = hp.stream_state
    if not st:
        st["step"] = torch.tensor(0.0, dtype=torch.float32)
        st["exp_avg"], st["exp_avg_sq"] = m.zero_(), v.zero_()
    for key, buf in (("exp_avg", m), ("exp_avg_sq", v)):
        if st[key] is not buf:
            buf.copy_(st[key].reshape(buf.shape))
            st[key] = buf
    return st


class DeviceStep:
    """The device step of streamed buckets (mixed into the engine, on its step thread, which owns the ring)."""

    # set by Engine.__init__
    streams: Streams
    stream_ring: list[torch.Tensor]
    stream_events: list[Any]
    stream_next: int

    def _step_streamed(self, job: Job, plan: StepPlan) -> None:
        s = self.streams
        bucket = job.bucket
        opt = bucket.optimizer
        for inner, gi in zip(opt.param_groups, bucket.group_map):
            inner.update(plan.hyper[gi])
        t0 = time.perf_counter()
        mults = [float(m) for m in plan.mults]  # CPU scalars: no sync
        slot = self.stream_ring[0].numel() // 4
        moved = 0
        with s.on(s.state_h2d):
            s.stream_wait(s.state_h2d, bucket.d2h_event)  # its state went back after the last step
            s.stream_wait(s.state_h2d, job.copied)  # a stale master re-read from the device (copy thread)
            pack: list[_Span] = []  # small parameters of one inner group, packed into one slot and one fused call
            for i, hp in enumerate(job.params):
                if hp.index in plan.recopy:
                    grad, ready = plan.recopy[hp.index], plan.ready  # edited after its hand-over: the edited one
                    plan.recopy[hp.index] = None  # read once (held here while it steps)
                else:
                    grad, ready = job.grads[i], job.ready
                job.grads[i] = None
                if grad is None:
                    continue  # no gradient this step: no update, as torch
                st = stream_state(opt, hp)
                st["step"] += 1
                flat = [t.view(-1) for t in (hp.master, st["exp_avg"], st["exp_avg_sq"])]
                g, param = grad.detach().reshape(-1), hp.param.detach().view(-1)
                n = param.numel()
                if pack and (sum(x.numel for x in pack) + n > slot or pack[0].group != hp.group):
                    moved += self._step_pack(pack, opt, bucket.inner_of, mults)
                    pack = []
                if n > slot:  # alone, chunk by chunk
                    for a in range(0, n, slot):
                        e = min(n, a + slot)
                        span = _Span(hp.group, [t[a:e] for t in flat], g[a:e], param[a:e], ready, float(st["step"]))
                        moved += self._step_pack([span], opt, bucket.inner_of, mults)
                else:
                    pack.append(_Span(hp.group, flat, g, param, ready, float(st["step"])))
                if s.cuda:
                    # read on this stream: kept until the compute stream waits for these reads, then freed there
                    # (Handover.release_grads). record_stream instead left the memory unusable to the compute stream
                    # until the link had caught up: 0.9-1.1 GiB reserved beyond the allocated
                    bucket.held_grads.append(grad)
            if pack:
                moved += self._step_pack(pack, opt, bucket.inner_of, mults)
        bucket.h2d_event = s.record(s.state_h2d)  # the next forward reads the weights after this
        bucket.d2h_event = s.record(s.state_d2h)
        t1 = time.perf_counter()
        self.count(h2d_bytes=moved, d2h_bytes=moved)
        self.note("stream", job.params[0].index, t0, t1)

    def _step_pack(self, pack: list[_Span], opt: torch.optim.Optimizer, inner_of: dict[int, int],
                   mults: list[float]) -> int:
        """Step spans of one inner group (whole small parameters, or one chunk of a big one) through the next ring
        slot, one fused call for all (see the module docstring); the bytes that went up (as many come back). A
        dozen calls into torch per slot, whatever the number of parameters in it (GPT-2-XL's blocks: 2 slots, where
        a slot per tensor took 12; its streamed steps ran as slow either way, so those calls were not their cost)."""
        s = self.streams
        k = self.stream_next
        self.stream_next = (k + 1) % len(self.stream_ring)
        ring = self.stream_ring[k]
        n = ring.numel() // 4
        views: list[list[torch.Tensor]] = [[], [], [], []]  # master, exp_avg, exp_avg_sq, upcast gradient
        at = 0
        for sp in pack:
            for j in range(4):
                views[j].append(ring[j * n + at : j * n + at + sp.numel])
            at += sp.numel
        p, m, v, up = views
        s.stream_wait(s.state_h2d, self.stream_events[k])  # the slot's last contents went back
        srcs = [sp.state[j] for j in range(3) for sp in pack]
        torch._foreach_copy_(p + m + v, srcs, non_blocking=True)
        for ready in {id(sp.ready): sp.ready for sp in pack}.values():
            s.stream_wait(s.state_h2d, ready)  # backward produced the gradients
        torch._foreach_copy_(up, [sp.grad for sp in pack])
        for mult in mults:
            torch._foreach_mul_(up, mult)
        steps = {c: torch.full((), c, dtype=torch.float32, device=ring.device) for c in {sp.step for sp in pack}}
        fused, kw = _host_adam.fused_kernel(opt, opt.param_groups[inner_of[pack[0].group]])
        fused(p, up, m, v, [], [steps[sp.step] for sp in pack], **kw)
        torch._foreach_copy_([sp.param for sp in pack], p)  # cast into the device weights
        stepped = s.record(s.state_h2d)
        with s.on(s.state_d2h):
            s.stream_wait(s.state_d2h, stepped)
            torch._foreach_copy_(srcs, p + m + v, non_blocking=True)
            self.stream_events[k] = s.record(s.state_d2h)
        return 12 * at


@dataclasses.dataclass
class _Span:
    """Elements of one streamed parameter that step together (the whole parameter, or a chunk of a big one)."""

    group: int  # the user group (one fused call per inner group)
    state: list[torch.Tensor]  # flat host master, exp_avg, exp_avg_sq (pinned)
    grad: torch.Tensor  # flat device gradient
    param: torch.Tensor  # flat device weight
    ready: Any  # event after which the gradient may be read
    step: float  # the step count after this step

    @property
    def numel(self) -> int:
        return self.param.numel()
