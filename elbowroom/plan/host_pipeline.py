"""The host optimizer step as a pipeline beside the device's work: how much of it the device does not hide.

Part of the cost model (:mod:`elbowroom.plan.cost`, whose module docstring describes the pipeline): each offloaded
block's gradients go out over the link, step on the host, and come back; with clipping the jobs start after the
whole backward in forward order, without it as the gradients become final (late blocks first); with offloaded
gradients and ``CPUOffloadConfig.step_order="needed_first"`` the host steps, among the jobs whose gradients have
landed, the one the next forward needs first. The next forward needs each block's weights back before it reaches
that block.
"""

from __future__ import annotations

import heapq
import math
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    from collections.abc import Sequence

    from elbowroom.plan.cost import Decisions
    from elbowroom.plan.types import Profile

OPTIMIZER_LINK_BYTES_PER_PARAM = 4
"""Bytes per offloaded parameter on the link each way per step: fp32 gradients out and fp32 masters back (with bf16
device weights the casts run on the device, so fp32 travels either way: ``CPUOffloadOptimizer.cast_on_device``)."""


def host_exposed_seconds(profile: Profile, d: Decisions, device_step_s: float, rate_scale: float = 1.0,
                         extra_backward_s: Sequence[float] | None = None) -> tuple[float, float]:
    """(host step seconds, the part of it the device does not hide): the pipeline of :mod:`elbowroom.plan.cost`,
    with the host optimizer at ``rate_scale`` times the machine's measured rate. ``extra_backward_s``: seconds each
    block's backward runs besides its own (its recompute, unscaled), which hide host work too."""
    m = profile.machine
    s = d.micro_batch / profile.micro_batch
    jobs: list[tuple[int, int]] = [(i, b.num_params) for i, (b, o) in enumerate(zip(profile.blocks, d.offload_blocks))
                                   if o]
    if not jobs and not d.offload_other:
        return 0.0, 0.0
    rate, bw = m.host_adam_params_per_s * rate_scale, m.duplex_bandwidth
    if rate <= 0 or bw <= 0:
        return math.inf, math.inf
    n = len(profile.blocks)
    fwd_before = np.concatenate(([0.0], np.cumsum([b.forward_s for b in profile.blocks]))) * s
    bwd = [b.backward_s for b in profile.blocks]
    if extra_backward_s is not None:
        bwd = [b + e for b, e in zip(bwd, extra_backward_s)]
    t_backward = s * (profile.head.backward_s + sum(bwd))
    # the parameters outside the blocks: those before them (embeddings: final last, needed first, index -1) and those
    # after them (an untied output head: final first, needed after the last block, index n)
    head = profile.head
    after = head.num_params - head.before_params if d.offload_other else 0
    before = [(-1, head.before_params)] if d.offload_other and head.before_params else []
    tail = [(n, after)] if after else []
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
        starts = [final[j] if j >= 0 else t_backward for j, _ in order]
        t0 = t_backward
    # the gradients' copies run one after another in the order the jobs become ready
    copied: list[tuple[float, int, int]] = []  # (copy done, block index or -1, parameters)
    dn = -math.inf
    for (j, p), t in zip(order, starts):
        dn = max(dn, t) + OPTIMIZER_LINK_BYTES_PER_PARAM * p / bw
        copied.append((dn, j, p))
    if d.offload_gradients and not d.grad_clipping and d.optimizer_config.step_order == "needed_first":
        # the host has several jobs at once (gradients land at link speed): it steps the one needed first
        # (CPUOffloadOptimizer's step thread, earliest deadline first)
        steps: list[tuple[float, int, int]] = []
        landed: list[tuple[int, int]] = []  # heap of (block index or -1, parameters) whose copies are done
        now, i = -math.inf, 0
        while i < len(copied) or landed:
            if not landed:
                now = max(now, copied[i][0])
            while i < len(copied) and copied[i][0] <= now:  # the copies finish in order (one after another)
                heapq.heappush(landed, (copied[i][1], copied[i][2]))
                i += 1
            j, p = heapq.heappop(landed)
            now += p / rate
            steps.append((now, j, p))
    else:
        steps, hn = [], -math.inf
        for c, j, p in copied:  # in arrival order
            hn = max(hn, c) + p / rate
            steps.append((hn, j, p))
    un = late = -math.inf
    total = 0.0
    for h, j, p in steps:
        total += p / rate
        un = max(un, h) + OPTIMIZER_LINK_BYTES_PER_PARAM * p / bw
        need = t0 + device_step_s + (fwd_before[j] if j >= 0 else 0.0)
        late = max(late, un - need)
    return total, max(0.0, late)
