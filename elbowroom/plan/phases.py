"""The cost model's peak memory: the activation-side bytes at every phase of a step, forward block by block, the
forward's end, backward block by block and the optimizer step (the equations of :mod:`elbowroom.plan.cost`'s module
docstring, "Memory").

:func:`phases` gives every phase with the terms it adds up from (what :func:`~elbowroom.plan.cost.predict` prints at
the peak); :func:`peak_bytes` gives the largest alone, which the search checks for thousands of plans, so the terms
that the options and the micro-batch alone decide are cached (:func:`_held`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np

from elbowroom.plan import cost, options
from elbowroom.plan.types import Profile

__all__ = ["STREAMED_TERM", "peak_bytes", "phases"]


@dataclass(frozen=True)
class _Phases:
    """Activation-side bytes above ``M'`` at every phase (forward blocks, forward end, backward blocks, optimizer
    step, in that order), with the terms they add up from (all scaled to the micro-batch, int64 arrays)."""

    values: np.ndarray
    kept: np.ndarray
    off: np.ndarray
    saved: np.ndarray
    before: np.ndarray  # kept by the blocks before i
    work_fwd: np.ndarray  # S_i + L_i
    inflight: np.ndarray
    fetch: np.ndarray
    work_bwd: np.ndarray  # 2 In_i + L_i + G
    grads: np.ndarray  # gradients alive at backward block i
    streamed: np.ndarray  # streamed gradients held at backward block i (sum_{j>=i}); forward block i holds i + 1's
    end: dict[str, int]
    step_grads: int  # every gradient at the optimizer step: the resident ones and the streamed ones held

    def describe(self, at: int) -> tuple[str, dict[str, int]]:
        """The name and the terms of phase ``at`` (an index into ``values``)."""
        n = len(self.kept)
        if at < n:
            return f"forward block {at}", {"activations kept": int(self.before[at]),
                                           "block working set": int(self.work_fwd[at]),
                                           "copies in flight": int(self.inflight[at]),
                                           **_named(STREAMED_TERM, int(self.streamed[at + 1]))}
        if at == n:
            return "forward end", dict(self.end)
        if at <= 2 * n:
            i = at - n - 1
            return f"backward block {i}", {
                "gradients": int(self.grads[i]), **_named(STREAMED_TERM, int(self.streamed[i])),
                "activations kept": int(self.before[i]),
                "block rematerialised": int(self.saved[i]), "prefetch": int(self.fetch[i]),
                "backward working set": int(self.work_bwd[i]),
            }
        return "optimizer step", {"gradients": self.step_grads - self.streamed_total,
                                  **_named(STREAMED_TERM, self.streamed_total)}

    @property
    def streamed_total(self) -> int:
        return int(self.streamed[0])


STREAMED_TERM = "streamed gradients held"
"""The phases' name for :func:`~elbowroom.plan.cost.streamed_gradient_bytes`."""


def _named(name: str, value: int) -> dict[str, int]:
    """``{name: value}``, or nothing when ``value`` is 0 (a term plans without streamed blocks never have)."""
    return {name: value} if value else {}


_SCALED: dict[tuple[int, float], tuple[Profile, tuple[np.ndarray, np.ndarray, np.ndarray]]] = {}
_LATER: dict[tuple[Any, ...], tuple[Profile, np.ndarray]] = {}
_STREAMED_HELD: dict[tuple[Any, ...], tuple[Profile, np.ndarray]] = {}


def _scaled(profile: Profile, s: float) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Every block's saved bytes, largest saved tensor and input at ``s`` times the profile's micro-batch (int64),
    cached: the search prices thousands of plans at a few micro-batches."""
    got = _SCALED.get((id(profile), s))
    if got is not None and got[0] is profile:
        return got[1]
    sums = cost._sums(profile)
    arrays = tuple(np.ceil(s * a).astype(np.int64) for a in (sums.saved, sums.largest_each, sums.input_each))
    for a in arrays:
        a.flags.writeable = False  # (shared by every caller)
    if len(_SCALED) > 64:
        _SCALED.clear()
    _SCALED[(id(profile), s)] = (profile, arrays)  # the profile is held, so its id is not reused while cached
    return arrays


def _later_gradients(profile: Profile, d: cost.Decisions) -> np.ndarray:
    """``sum_{j>=i} G_j`` for every block ``i`` (int64), cached on the blocks' placement and the layout."""
    key = (id(profile), d.offload_blocks, d.stream_blocks, d.layout)
    got = _LATER.get(key)
    if got is not None and got[0] is profile:
        return got[1]
    _, g_blocks = cost.gradient_bytes(profile, d)
    later = np.cumsum(np.asarray(g_blocks, dtype=np.int64)[::-1])[::-1]
    later.flags.writeable = False  # (shared by every caller)
    if len(_LATER) > 1024:
        _LATER.clear()
    _LATER[key] = (profile, later)  # the profile is held, so its id is not reused while cached
    return later


def _streamed_held(profile: Profile, d: cost.Decisions) -> np.ndarray:
    """The streamed gradients held at backward block ``i``: ``sum_{j>=i}`` of :func:`cost.streamed_gradient_bytes`
    (int64, and a trailing 0: forward block ``i`` holds entry ``i + 1``, its own released by its pre-hook), zeros
    where the gradients are not transient (then in the model states). Cached on the blocks' placement, the split and
    the layout."""
    key = (id(profile), d.offload_blocks, d.stream_blocks, d.split_share, d.layout, cost.transient_gradients(d))
    got = _STREAMED_HELD.get(key)
    if got is not None and got[0] is profile:
        return got[1]
    n = len(profile.blocks)
    if d.streams and cost.transient_gradients(d):
        per = np.asarray(cost.streamed_gradient_bytes(profile, d), dtype=np.int64)
        held = np.concatenate((np.cumsum(per[::-1])[::-1], [0])).astype(np.int64)
    else:
        held = np.zeros(n + 1, dtype=np.int64)
    held.flags.writeable = False  # (shared by every caller)
    if len(_STREAMED_HELD) > 1024:
        _STREAMED_HELD.clear()
    _STREAMED_HELD[key] = (profile, held)  # the profile is held, so its id is not reused while cached
    return held


@dataclass(frozen=True)
class _Held:
    """The terms of :func:`phases` that the options and the micro-batch alone decide (int64 arrays, scaled)."""

    kept: np.ndarray
    off: np.ndarray
    saved: np.ndarray
    before: np.ndarray  # kept by the blocks before i, and by the other micro-batches in flight
    work_fwd: np.ndarray  # S_i + L_i
    inflight: np.ndarray
    fetch: np.ndarray
    work_bwd: np.ndarray  # 2 In_i + L_i, without G
    total_kept: int
    last_off: int
    policy: bool  # some block has a policy (autocast's weight cache is off)
    fwd_max: int  # the largest forward block phase
    bwd: np.ndarray  # backward block phases without gradients and G
    bwd_max: int


_HELD: dict[tuple[Any, ...], tuple[Profile, _Held]] = {}


def copy_rate(profile: Profile, d: cost.Decisions) -> float:
    """The rate the activations' copies out are counted to leave at, for the memory they hold: the slowest the plan
    gives them (half the duplex rate beside streamed states, the duplex rate beside the optimizer's copies, else
    the one-way rate)."""
    m = profile.machine
    if d.streams:
        return options.SHARED_LINK_SHARE * m.duplex_bandwidth
    return m.duplex_bandwidth if d.offloads_params else m.d2h_bandwidth


def _held(profile: Profile, idx: np.ndarray, s: float, window: int, rate: float) -> _Held:
    """:class:`_Held` for options ``idx`` at ``s`` times the profile's micro-batch, cached: the search checks the same
    few options under many global choices.

    Copies in flight: in forward block ``i``, those of the nearest block ``p < i`` that offloads, while they have not
    left by the end of block ``i - 1`` at ``rate`` (the engine frees a region's memory at the first region end after
    its copies finished, and waits for them at the end of the next region that offloads); at the forward's end, the
    last such block's, unless its copies left under the forward after it. In backward block ``i``, ``p``'s tensors on
    their way back when ``p`` is at most :data:`~elbowroom.plan.options.PREFETCH_LEAD_BLOCKS` blocks before
    (:class:`elbowroom.activations._wrap.PrefetchChain`), at most the prefetch window."""
    key = (id(profile), idx.tobytes(), s, window, rate)
    got = _HELD.get(key)
    if got is not None and got[0] is profile:
        return got[1]
    n = len(profile.blocks)
    tab = options.block_tables(profile)
    rows = np.arange(n)
    kept = np.ceil(s * tab.kept[rows, idx]).astype(np.int64)
    off = np.ceil(s * tab.offloaded[rows, idx]).astype(np.int64)
    saved, largest, inp = _scaled(profile, s)
    held = (profile.inflight_microbatches - 1) * (int(kept.sum()) + math.ceil(s * profile.head.saved_bytes))
    before = np.concatenate(([0], np.cumsum(kept)[:-1])).astype(np.int64) + held  # + other micro-batches in flight
    # (times at the profile's micro-batch: bytes and compute scale alike)
    leave = tab.offloaded[rows, idx] / rate if rate > 0 else np.where(off > 0, math.inf, 0.0)
    cf = np.concatenate(([0.0], np.cumsum([b.forward_s for b in profile.blocks])))
    last = np.maximum.accumulate(np.where(off > 0, rows, -1))  # the nearest block <= i that offloads
    p = np.concatenate(([-1], last[:-1]))  # ... < i
    pp = np.maximum(p, 0)
    flying = (p >= 0) & (leave[pp] > cf[rows] - cf[pp + 1])
    inflight = np.where(flying, off[pp], 0).astype(np.int64)
    work_fwd = saved + largest
    fetch = np.where((p >= 0) & (rows - p <= options.PREFETCH_LEAD_BLOCKS), np.minimum(off[pp], window), 0)
    fetch = fetch.astype(np.int64)
    work_bwd = 2 * inp + largest
    bwd = before + saved + fetch + work_bwd
    top = int(last[-1])
    last_off = int(off[top]) if top >= 0 and (top == n - 1 or leave[top] > cf[n] - cf[top + 1]) else 0
    arrays = (kept, off, saved, before, work_fwd, inflight, fetch, work_bwd, bwd)
    for a in arrays:
        a.flags.writeable = False  # (shared by every caller that asks for the same options)
    out = _Held(kept, off, saved, before, work_fwd, inflight, fetch, work_bwd, total_kept=int(kept.sum()) + held,
                last_off=last_off, policy=bool(idx.any()),
                fwd_max=int((before + work_fwd + inflight).max()), bwd=bwd, bwd_max=int(bwd.max()))
    if len(_HELD) > 1024:  # (nine arrays of one int64 per block each)
        _HELD.clear()
    _HELD[key] = (profile, out)  # the profile is held, so its id is not reused while cached
    return out


def _grad_work(profile: Profile, g: cost.Globals, s: float) -> int:
    """``G``: the backward's working memory beyond ``2 In_max + L_max`` (bf16 weight gradients, waiting copies)."""
    sums = cost._sums(profile)
    return g.backward_work - int(math.ceil(s * (2 * sums.in_max + sums.largest)))


def phases(profile: Profile, g: cost.Globals, d: cost.Decisions, idx: np.ndarray, window: int) -> _Phases:
    """The phases of the cost model for options ``idx`` (indices into :data:`~elbowroom.plan.cost.OPTIONS`),
    vectorised."""
    n = len(profile.blocks)
    s = d.micro_batch / profile.micro_batch
    h = _held(profile, idx, s, window, copy_rate(profile, d))
    cache = g.cache if not h.policy else 0  # OPTIONS[0] is Option(): no block has a policy
    grad_t = _grad_work(profile, g, s)
    held = _streamed_held(profile, d)
    fwd = h.before + h.work_fwd + h.inflight + held[1:]
    root = profile.rank_head_transient_bytes  # (in g.head)
    end = {"activations kept": h.total_kept, "copies in flight": h.last_off, "head and loss": g.head - root,
           **({"FSDP2 gathered root and its gradients": root} if root else {}), "autocast weight cache": cache}
    fwd_end = h.total_kept + h.last_off + g.head + cache
    work_bwd = h.work_bwd + grad_t
    if g.transient_grads:
        grads = g.head_grads + _later_gradients(profile, d)
    else:
        grads = np.zeros(n, dtype=np.int64)
    bwd = grads + held[:-1] + h.before + h.saved + h.fetch + work_bwd
    step = g.transient_grads + int(held[0])
    values = np.concatenate((fwd, [fwd_end], bwd, [step])).astype(np.int64)
    return _Phases(values, h.kept, h.off, h.saved, h.before, h.work_fwd, h.inflight, h.fetch, work_bwd, grads, held,
                   end, step)


def peak_bytes(profile: Profile, d: cost.Decisions, idx: np.ndarray, budget_bytes: int, window: int,
               g: cost.Globals | None = None) -> int:
    """:func:`~elbowroom.plan.cost.predict`'s peak alone, for options ``idx`` (the search checks thousands of plans
    with it): the largest of :func:`phases`' values, from the options' part of them (:func:`_held`) and the global
    terms."""
    g = cost.globals_for(profile, d) if g is None else g
    s = d.micro_batch / profile.micro_batch
    h = _held(profile, idx, s, window, copy_rate(profile, d))
    held = _streamed_held(profile, d)
    streamed = bool(held[0])
    fwd_max = int((h.before + h.work_fwd + h.inflight + held[1:]).max()) if streamed else h.fwd_max
    bwd = h.bwd + held[:-1] if streamed else h.bwd
    if g.transient_grads:
        bwd_max = int((bwd + (g.head_grads + _later_gradients(profile, d))).max())
    else:
        bwd_max = int(bwd.max()) if streamed else h.bwd_max
    top = max(fwd_max, h.total_kept + h.last_off + g.head + (0 if h.policy else g.cache),
              bwd_max + _grad_work(profile, g, s), g.transient_grads + int(held[0]))
    return g.states - g.transient_grads + top + cost.margin_bytes(profile, budget_bytes, d.expandable_segments)


