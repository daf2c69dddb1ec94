"""The host optimizer step as a pipeline beside the device's work: how much of it the device does not hide.

Part of the cost model (:mod:`elbowroom.plan.cost`, whose module docstring describes the pipeline): each offloaded
block's gradients go out over the link, step on the host, and come back; with clipping the jobs start after the
whole backward in forward order, without it as the gradients become final (late blocks first); with offloaded
gradients and ``CPUOffloadConfig.step_order="needed_first"`` the host steps, among the jobs whose gradients have
landed, the one the next forward needs first. The next forward needs each block's weights back before it reaches
that block.

A streamed block (``Decisions.stream_blocks``, ``CPUOffloadOptimizer(stream_params=...)``) is a job of the link alone
(split, ``Decisions.split_share``, its largest tensors are a host-stepped job beside it):
its fp32 master and moments come up into the device's ring, step there and go back, chunk by chunk, so it holds both
directions at once for ``12 P / bw`` (at :data:`STREAM_LINK_EFFICIENCY` of the rate) and its weights are ready when the
last chunk has come up. The optimizer runs streamed jobs on copy streams of their own, beside the host-stepped jobs'
copies: the streamed jobs take the link one after another as their gradients become final, and the host-stepped jobs'
copies (gradients down, weights back up) run beside them at :data:`SHARED_COPY_RATE` of a direction, at the full rate
between them; a streamed job loses what those copies take (it ends later by half the time they overlap it, and the jobs
behind it start later). After a clipped backward the weights come back behind every streamed state instead: ``step()``
opens the gate and the optimizer enqueues every streamed job at once, before any host-stepped weight is ready, and the
copies of one direction run in the order they were enqueued (a profiled trainer step at 12 GiB, W1: the compute stream
idle for ~245 ms behind them, the embeddings stepped on the host).

Measured against this (H100, ``BENCHMARKS.md``):

- ``benchmarks/stream_step.py`` (53 matrices of 4096x11008, after a clipped backward, the late ones streamed; at
  38 GB/s each way): 0.84 / 0.59 / 0.57 / 0.75 s for none / half / 60% / all streamed, priced 0.85 / 0.62 / 0.49 /
  0.76 with the host at the 2.0 G params/s it kept beside that benchmark's DMA (2.85 alone).
- The 7B shape at 76 GiB (no clipping, 7 blocks streamed and 6 on the host): the earlier model queued the streamed
  jobs behind every host-stepped gradient's copy on the device-to-host direction, although their first copies go the
  other way, and priced 69-104 ms of them exposed. The model after it let the streamed jobs keep the whole link while
  the host-stepped weights went up beside them (as if the link carried both at full speed): the trainer's steady state
  ran at 0.75 s a step against 0.53 predicted, its up direction carrying 17 GB of streamed state and 4.8 GB of
  weights at 40 GB/s (a profiled step, eleventh session). The benchmark's per-step windows had hidden it.
"""

from __future__ import annotations

import heapq
import math
from typing import TYPE_CHECKING, Any

import numpy as np

from elbowroom.plan.streaming import optimizer_parts

if TYPE_CHECKING:
    from collections.abc import Sequence

    from elbowroom.plan.cost import Decisions
    from elbowroom.plan.types import Profile

OPTIMIZER_LINK_BYTES_PER_PARAM = 4
"""Bytes per offloaded parameter on the link each way per step: fp32 gradients out and fp32 masters back (with bf16
device weights the casts run on the device, so fp32 travels either way: ``CPUOffloadOptimizer.cast_on_device``)."""

STREAM_LINK_BYTES_PER_PARAM = 12
"""Bytes per streamed parameter on the link each way per step: its fp32 master and both AdamW moments come up to the
device and go back; no gradient crosses (it steps where it is)."""

STREAM_LINK_EFFICIENCY = 0.82
"""The share of the link's measured duplex rate the streamed states keep, beyond what the copies beside them take
(priced apart, :data:`SHARED_COPY_RATE`): their chunks wait between copies for the device ring's two slots and for the
optimizer's step thread. ``benchmarks/stream_step.py`` alone streamed at 38 GB/s each way on an H100 whose copies
measure 45-47 at once; in training (a trace of two back-to-back 7B steps, eleventh session) 6 streamed blocks moved 14.6
GB up in 540 ms from the middle of the backward, beside 5.9 GB of host-stepped weights, their copies at 40-48 GB/s when
busy. Priced at the full rate, that plan's next forward was predicted to wait 109 ms and waited 237."""


def outside_on_host(profile: Profile, d: Decisions) -> tuple[int, int]:
    """(before, after): the parameters outside the blocks whose optimizer ``d`` puts on the host, those before the
    blocks (embeddings, needed first) and those after them (head, final norm, needed last)."""
    head = profile.head
    if d.offload_other:
        return head.before_params, head.num_params - head.before_params
    if d.offload_head:
        return 0, min(head.after_params, head.num_params)
    return 0, 0


def stream_link_seconds(params: float, bw: float) -> float:
    """Seconds a streamed job of ``params`` parameters holds the link (each way) at measured duplex rate ``bw``."""
    return STREAM_LINK_BYTES_PER_PARAM * params / (bw * STREAM_LINK_EFFICIENCY)


HOST_ADAM_BYTES_PER_PARAM = 28
"""Host memory traffic of torch's fused AdamW per fp32 parameter: reads master, gradient and both moments, writes master
and both moments (what ``MachineProfile.host_adam_params_per_s`` measures)."""

SCALE_BYTES_PER_PARAM = 8
"""With clipping (or a GradScaler's unscale) each host-stepped fp32 gradient is multiplied by the coefficient before
the fused step: one more pass over it, read and written. Priced by its bytes, 28 / 36 of the measured rate; measured on
the H100's host (``benchmarks/host_adam.py``, 134M parameters, 14 threads): 3.48 G params/s scaled then stepped,
against 4.60 unscaled (0.76). Scaled chunk by chunk in cache it ran at 3.42: the per-chunk calls cost what the cache
saves."""


def host_rate(machine_rate: float, grad_clipping: bool, offload_config: Any = None) -> float:
    """Parameters per second the host steps: the measured fused AdamW rate, less the scaling pass with clipping (none
    where ``offload_config.scale_in_kernel`` puts the scale into the fused kernel)."""
    if grad_clipping and not getattr(offload_config, "scale_in_kernel", False):
        return machine_rate * HOST_ADAM_BYTES_PER_PARAM / (HOST_ADAM_BYTES_PER_PARAM + SCALE_BYTES_PER_PARAM)
    return machine_rate


SHARED_COPY_RATE = 0.5
"""The share of a link direction a copy gets while the streamed states' copies also run on it, where both are
enqueued as gradients become final (no clipping): the two streams' copies interleave (the streamed states run on
streams of their own), rather than one waiting for the other. Pricing
the host-stepped weights' way back as waiting for every streamed copy first predicted the 7B shape's 76 GiB plan's
forward waiting 0.17 s, where it waited 0.4 ms (H100, ``BENCHMARKS.md``)."""


HOST_RATE_BESIDE_STREAMS = 0.78
"""The host optimizer's pace, as a share of the measured rate, while streamed states hold the link both ways. The
host AdamW is bound by host memory, which the copies' DMA reads and writes too: the measured rate
(``MachineProfile.host_adam_params_per_s``) is taken beside the optimizer's own copies of the parameters stepped,
which keep the link busy a third of the step; taken with the link full both ways it read 0.75-0.8 of that
(``elbowroom.plan.machine``, its cache version 2). The 7B shape's streaming plans on an H100 (twelfth session) stepped
their host blocks at about 0.7 of the measured rate (2.75 G params/s against 3.99): the host-stepped weights came
back up to 150 ms after the model had them, and the next forward waited for them once more after waiting for the
streamed states."""

_SHARING_ROUNDS = 4
"""Rounds, at most, of the fixed point between the streamed jobs and the copies that share the link with them. Four
give the 7B shape's and W1's streaming plans the price twenty give (the measured profiles of BENCHMARKS.md; the third
round still moved the 7B shape's unclipped plan by 2.6 ms)."""


def _overlaps(spans: Sequence[tuple[float, float, int]], intervals: Sequence[tuple[float, float]]) -> list[float]:
    """Seconds of each of ``spans`` (start, end, ...) covered by ``intervals``: both sorted and disjoint, one sweep."""
    out, k = [], 0
    for a, b, _ in spans:
        while k < len(intervals) and intervals[k][1] <= a:
            k += 1
        covered, i = 0.0, k
        while i < len(intervals) and intervals[i][0] < b:
            covered += max(0.0, min(b, intervals[i][1]) - max(a, intervals[i][0]))
            i += 1
        out.append(covered)
    return out


def _host_steps(copied: Sequence[tuple[float, int, int]], rate: float, needed_first: bool,
                busy: Sequence[tuple[float, float]] = ()) -> list[tuple[float, int, int]]:
    """(step done, block index or -1, parameters) of each host-stepped job, from (copy done, block, parameters) in
    the copies' order: with ``needed_first`` (offloaded gradients, no clipping) the host has several jobs at once
    (gradients land at link speed) and steps the one needed first (CPUOffloadOptimizer's step thread, earliest deadline
    first); otherwise in arrival order. One after another, at ``rate``, and at :data:`HOST_RATE_BESIDE_STREAMS` of it
    while streamed states hold the link (``busy``: sorted, disjoint intervals)."""
    steps: list[tuple[float, int, int]] = []
    k = 0
    if needed_first:
        landed: list[tuple[int, int]] = []  # heap of (block index or -1, parameters) whose copies are done
        now, i = -math.inf, 0
        while i < len(copied) or landed:
            if not landed:
                now = max(now, copied[i][0])
            while i < len(copied) and copied[i][0] <= now:  # the copies finish in order (one after another)
                heapq.heappush(landed, (copied[i][1], copied[i][2]))
                i += 1
            j, p = heapq.heappop(landed)
            now, k = fill_after(busy, k, now, p / rate, HOST_RATE_BESIDE_STREAMS)
            steps.append((now, j, p))
        return steps
    hn = -math.inf
    for c, j, p in copied:  # in arrival order
        hn, k = fill_after(busy, k, max(hn, c), p / rate, HOST_RATE_BESIDE_STREAMS)
        steps.append((hn, j, p))
    return steps


def fill_after(busy: Sequence[tuple[float, float]], k: int, t: float, seconds: float,
               share: float = SHARED_COPY_RATE) -> tuple[float, int]:
    """When work of ``seconds`` at full pace that may start at ``t`` ends, where streamed copies hold ``busy``
    (sorted, disjoint intervals) and the work runs at ``share`` of its pace during them: a copy on a link direction
    they hold (:data:`SHARED_COPY_RATE`), or the host optimizer beside them (:data:`HOST_RATE_BESIDE_STREAMS`).
    ``k``: the first interval that may still end after ``t`` (work placed in order, so the next search starts there).
    Returns (end, next k)."""
    if not busy:
        return t + seconds, k
    while k < len(busy) and busy[k][1] <= t:
        k += 1
    while k < len(busy) and busy[k][0] < t + seconds:
        a, e = busy[k]
        seconds -= max(0.0, a - t)  # full rate until the interval starts
        t = max(t, a)
        if t + seconds / share <= e:
            return t + seconds / share, k
        seconds -= (e - t) * share  # the shared rate until it ends
        t = e
        k += 1
    return t + seconds, k


def host_exposed_seconds(profile: Profile, d: Decisions, device_step_s: float, rate_scale: float = 1.0,
                         extra_backward_s: Sequence[float] | None = None) -> tuple[float, float]:
    """(host step seconds, the part of the optimizer's step the device does not hide): the pipeline of
    :mod:`elbowroom.plan.cost`, with the host optimizer at ``rate_scale`` times the machine's measured rate; streamed
    blocks wait for the link alone. ``extra_backward_s``: seconds each block's backward runs besides its own (its
    recompute, unscaled), which hide host work too."""
    total, late = host_lateness(profile, d, rate_scale, extra_backward_s)
    return total, max(0.0, late - device_step_s)


def host_lateness(profile: Profile, d: Decisions, rate_scale: float = 1.0,
                  extra_backward_s: Sequence[float] | None = None) -> tuple[float, float]:
    """(host step seconds, how late the last job's weights are for the next forward were the device's own optimizer
    step instantaneous): :func:`host_exposed_seconds` is that lateness less the device step, floored at 0. Nothing
    else in the pipeline reads the device step, so the search prices one placement once for every weight layout."""
    m = profile.machine
    s = d.micro_batch / profile.micro_batch
    # (block index, parameters, streamed) of every block whose optimizer is off the device: a split block is two jobs,
    # its host-stepped tensors and its streamed ones, both ready as its gradients become final
    host_n, stream_n = optimizer_parts(profile, d)
    jobs: list[tuple[int, int, bool]] = [job for i, (h, st) in enumerate(zip(host_n, stream_n))
                                         for job in ((i, h, False), (i, st, True)) if job[1]]
    before_n, after_n = outside_on_host(profile, d)
    if not jobs and not (before_n or after_n):
        return 0.0, 0.0
    rate, bw = host_rate(m.host_adam_params_per_s, d.grad_clipping, d.offload_config) * rate_scale, m.duplex_bandwidth
    host_jobs = bool(before_n or after_n) or not all(st for _, _, st in jobs)
    if bw <= 0 or (host_jobs and rate <= 0):
        return math.inf, math.inf
    n = len(profile.blocks)
    fwd_before = np.concatenate(([0.0], np.cumsum([b.forward_s for b in profile.blocks]))) * s
    bwd = [b.backward_s for b in profile.blocks]
    if extra_backward_s is not None:
        bwd = [b + e for b, e in zip(bwd, extra_backward_s)]
    t_backward = s * (profile.head.backward_s + sum(bwd))
    # the parameters outside the blocks: those before them (embeddings: final last, needed first, index -1) and those
    # after them (an untied output head: final first, needed after the last block, index n)
    before = [(-1, before_n, False)] if before_n else []
    tail = [(n, after_n, False)] if after_n else []
    if d.grad_clipping:
        order = before + jobs + tail  # forward order, after the whole backward
        starts = [0.0] * len(order)
        t0 = 0.0
    else:
        order = tail + jobs[::-1] + before  # as gradients become final: the head first, then late blocks first
        # when job j's gradients are final: the head's as the backward starts, block j's after sum_{i>=j} B_i, the
        # embeddings' at its end
        final = s * (profile.head.backward_s + np.concatenate((np.cumsum(bwd[::-1])[::-1], [0.0])))
        final[n] = s * profile.head.backward_s
        # (never earlier than the job before: sums in two orders may differ in their last bit)
        starts = np.maximum.accumulate([final[j] if j >= 0 else t_backward for j, _, _ in order]).tolist()
        t0 = t_backward
    # the streamed jobs take the link one after another as their gradients become final, both directions at once
    # (state up, then back); the host-stepped jobs' copies run beside them, sharing each direction
    queue = sorted(range(len(order)), key=lambda q: (starts[q], order[q][2]))
    specs = [(starts[q], stream_link_seconds(order[q][1], bw), order[q][0]) for q in queue if order[q][2]]
    stretch = [0.0] * len(specs)
    for _ in range(_SHARING_ROUNDS):
        streams: list[tuple[float, float, int]] = []  # (start, weights on the device, block index) of streamed jobs
        up = -math.inf
        for (release, seconds, j), extra in zip(specs, stretch):
            start = max(up, release)
            up = start + seconds + extra
            streams.append((start, up, j))
        busy = [(a, b) for a, b, _ in streams]  # both directions, held by the streamed jobs
        down: list[tuple[float, float]] = []  # the host-stepped gradients' copies (device to host)
        copied: list[tuple[float, int, int]] = []  # (copy done, block index or -1, parameters)
        dn, kd = -math.inf, 0
        for q in queue:
            j, p, st = order[q]
            if not st:
                begin = max(dn, starts[q])
                dn, kd = fill_after(busy, kd, begin, OPTIMIZER_LINK_BYTES_PER_PARAM * p / bw)
                down.append((begin, dn))
                copied.append((dn, j, p))
        steps = _host_steps(copied, rate, d.offload_gradients and not d.grad_clipping
                            and d.optimizer_config.step_order == "needed_first", busy)
        late = -math.inf
        for _, ready, j in streams:
            late = max(late, ready - (t0 + (fwd_before[j] if j >= 0 else 0.0)))
        # the weights come back in the time the streamed jobs leave free; after a clipped backward, behind all of
        # them: the optimizer enqueues every streamed job at once when step() opens the gate, before any host-stepped
        # weight is ready, and the copies of one direction run in the order they were enqueued
        un, k = (max((b for _, b, _ in streams), default=-math.inf), 0) if d.grad_clipping else (-math.inf, 0)
        back_busy = [] if d.grad_clipping else busy
        back: list[tuple[float, float]] = []  # the host-stepped weights' copies (host to device)
        total = 0.0
        for h, j, p in steps:
            total += p / rate
            begin = max(un, h)
            un, k = fill_after(back_busy, k, begin, OPTIMIZER_LINK_BYTES_PER_PARAM * p / bw)
            back.append((begin, un))
            need = t0 + (fwd_before[j] if j >= 0 else 0.0)
            late = max(late, un - need)
        # a streamed job shares each direction with the copies that run beside it: it loses what they take
        # (1 - SHARED_COPY_RATE of the time they overlap it, on the busier direction), and the jobs behind it start
        # later; the copies' own schedule then changes, so this is solved a few rounds to a fixed point
        if not streams:
            break
        again = [(1.0 - SHARED_COPY_RATE) * max(x, y)
                 for x, y in zip(_overlaps(streams, down), _overlaps(streams, back))]
        if all(abs(x - y) < 1e-4 for x, y in zip(again, stretch)):
            break
        stretch = again
    return total, late
