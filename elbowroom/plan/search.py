"""The search: the fastest plan the cost model predicts under a memory budget.

:func:`plan_for` enumerates the global choices in an outer grid (weight layout, which blocks' optimizer leaves the
device and whether the other parameters' does (all of them, or the head and final norm alone, the embeddings kept on
the device), micro-batch and accumulation, fused loss, allocator setting, and a
cap ``E`` on any block's backward extra, see :mod:`elbowroom.plan.cost`) and, inside, solves the per-block
choices exactly: a multiple-choice knapsack over the blocks' :data:`~elbowroom.plan.cost.OPTIONS`
(:class:`~elbowroom.plan.knapsack.Knapsack`, whose programme also carries the gap to the next block that offloads),
memory discretised in units that depend on the profile only (never on the budget), minimising the summed per-block
seconds. One dynamic programme serves every memory capacity at once (its last row is the best time for each
capacity), every micro-batch size whose copies see the same link (bytes and times scale alike, so the units do
not change), and every optimizer placement whose copies see the same link (they only move the capacity), so a
search runs a few dozen numpy-vectorised programmes however fine the outer grid is.

The blocks whose optimizer leaves the device are the last ``k`` (needed last by the next forward); of them the
earliest may stream (:func:`_stream_counts`: none, all, and the two counts around the split where the link's work
and the host's take as long) and the rest step on the host. Of the placements one count ``k`` gives, those that
another beats at every budget are left out before the knapsack (:func:`_undominated`).

Why a tighter budget never predicts a faster step: every term of the step time is either a global term fixed by
the outer choice or a per-block sum the knapsack minimises exactly; feasibility of an outer choice and the
knapsack's capacity only grow with the budget (units, bounds and margins do not depend on it, except the
allocator margin's fraction of the budget, which grows slower than the budget), so the set of plans the search
can reach at a larger budget contains the set at a smaller one, and it returns the minimum over that set.

The bound is loose where gradients meet activations (it adds every kept byte to every gradient), so a second
pass (:func:`_refine`) tries larger capacities of a fixed grid for the outer choices that could still win, and
keeps the largest whose exact peak fits. It assumes the exact peak grows with the capacity, which holds in all but
corner cases; the monotonicity tests sweep budgets over fixed and random models to hold it to that.

Where no plan fits, the search finds the minimum and its parts; :mod:`elbowroom.plan.budget_error` words the error.
"""

from __future__ import annotations

import functools
import gc
import itertools
import math
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

import numpy as np

from elbowroom.plan import cost, options, phases, streaming
from elbowroom.plan.budget_error import WAITING, BudgetError, budget_error, margin_part, min_budget, size_text
from elbowroom.plan.cost import OPTIONS, Decisions, Option
from elbowroom.plan.host_pipeline import OPTIMIZER_LINK_BYTES_PER_PARAM, host_rate, stream_link_seconds
from elbowroom.plan.knapsack import KEEP, Knapsack
from elbowroom.plan.plan import BlockPlan, Plan, ProfileSummary
from elbowroom.plan.types import Profile

__all__ = ["BudgetError", "plan_for", "plan_from_decisions"]

_MAX_MICRO_BATCHES = 6
"""Most micro-batch sizes tried for a global batch (the largest and smallest divisor and a geometric spread)."""
_MAX_OFFLOAD_STEPS = 48
"""Most optimizer placements tried (every block count when the model has fewer blocks)."""
_REFINE_GRID = 48
"""Capacities tried above the bound's, per outer choice: ``M j / _REFINE_GRID`` (never depends on the budget)."""


@dataclass(frozen=True)
class _Outer:
    layout: str
    k: int  # the last k blocks' optimizer leaves the device
    other: bool
    micro_batch: int
    accumulation: int
    fused: bool
    expandable: bool | None  # None: the allocator as the process runs it (CPU, or not the plan's to set)
    gradients_out: bool = False  # the offloaded parameters' gradients leave the device in the backward
    streamed: int = 0  # of those k, the first (earliest) this many stream; the rest step on the host
    head: bool = False  # not other: the parameters after the blocks (head, final norm) alone on the host
    split: float = 0.0  # the streamed blocks' share stepped on the host (Decisions.split_share)


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def _micro_batches(profile: Profile, global_batch: int | None) -> list[int]:
    if global_batch is None:
        return [profile.micro_batch]
    divs = _divisors(global_batch)
    if len(divs) <= _MAX_MICRO_BATCHES:
        return divs[::-1]
    logs = np.log(np.array(divs, dtype=float))
    targets = np.linspace(logs[0], logs[-1], _MAX_MICRO_BATCHES)
    pick = sorted({int(np.abs(logs - t).argmin()) for t in targets})
    return [divs[i] for i in pick][::-1]


def _offload_counts(n: int) -> list[int]:
    if n + 1 <= _MAX_OFFLOAD_STEPS:
        return list(range(n + 1))
    return sorted({int(round(x)) for x in np.linspace(0, n, _MAX_OFFLOAD_STEPS)})


@functools.lru_cache(maxsize=4096)
def _placement(n: int, k: int, streamed: int) -> tuple[tuple[bool, ...], tuple[bool, ...]]:
    """(``offload_blocks``, ``stream_blocks``) where the last ``k`` blocks' optimizer leaves the device and the first
    ``streamed`` of them stream (``stream_blocks`` empty when none does)."""
    host = tuple(i >= n - k + streamed for i in range(n))
    stream = tuple(n - k <= i < n - k + streamed for i in range(n)) if streamed else ()
    return host, stream


def _stream_counts(profile: Profile, k: int, outside: int, host_ok: bool, grad_clipping: bool,
                   offload_config: Any = None) -> list[int]:
    """How many of the last ``k`` blocks the search tries to stream (the earliest of them; the later ones, needed last,
    step on the host): none, all, and around the split where the link's work (12 B per streamed parameter and 4 per
    host-stepped one, each way) takes as long as the host's (at the mean of its measured pace and the slow end of its
    spread, as the cost model prices it). The pipeline decides between them; they depend on the profile alone, never
    on the budget. Only all of them when the host cannot step (``host_ok`` False)."""
    if not k:
        return [0]
    if not host_ok:
        return [k]
    m = profile.machine
    params = np.array([b.num_params for b in profile.blocks[len(profile.blocks) - k:]], dtype=np.float64)
    streamed = np.concatenate(([0.0], np.cumsum(params)))  # parameters of the first st of them, st = 0..k
    host = streamed[-1] - streamed + outside  # (the parameters outside the blocks that step on the host)
    bw = m.duplex_bandwidth
    link = stream_link_seconds(streamed, bw) + OPTIMIZER_LINK_BYTES_PER_PARAM * host / bw
    rate = host_rate(m.host_adam_params_per_s, grad_clipping, offload_config)
    pace = 0.5 * (1.0 + 1.0 / cost.HOST_STEP_SPREAD) / rate
    split = int(np.argmin(np.maximum(link, host * pace)))
    # the crossing lies between the best and its neighbour on the side where the other resource is the longer
    other_side = split - 1 if link[split] > host[split] * pace else split + 1
    return sorted({0, k, split, min(max(other_side, 0), k)})


_MEMORY_TERMS = ("states", "transient_grads", "head_grads", "streamed_grads", "head", "cache", "backward_work",
                 "largest", "host_bytes")
"""The fields of :class:`cost.Globals` a plan's device and host memory depend on."""


def _undominated(placed: list[tuple[int, Decisions, cost.Globals]], s: float, accumulation: int
                 ) -> list[tuple[int, Decisions, cost.Globals]]:
    """The optimizer placements of one outer choice (one count of blocks off the device, split between the host and
    streaming) that another does not beat at every budget: no faster, no more memory in any term, and its activation
    copies sharing the link no more. The same blocks leave the device in each, so their knapsacks and gradients are
    alike; which are left out depends on the profile alone, so a tighter budget still never predicts a faster step."""
    def key(c: tuple[int, Decisions, cost.Globals]) -> tuple[float, ...]:
        _, d, g = c
        return (cost.step_seconds(g, s, accumulation, 0.0), cost.stream_share(d),
                *(getattr(g, f) for f in _MEMORY_TERMS))

    keys = [key(c) for c in placed]
    out = []
    for i, (c, a) in enumerate(zip(placed, keys)):
        # beaten by another that is no worse anywhere, and better somewhere or (a tie) earlier in the list
        if not any(all(x <= y for x, y in zip(b, a)) and (b != a or j < i) for j, b in enumerate(keys) if j != i):
            out.append(c)
    return out


def _bound_extra(g: cost.Globals, s: float, e: float, off: float, level0: bool, window: int,
                 streamed: bool = True) -> int:
    """The non-additive part of the peak bound (module docstring of :mod:`cost`), scaled; without ``streamed``, with
    no streamed gradient held."""
    ex, of = s * e, s * off
    held = g.streamed_grads if streamed else 0
    fwd_end = g.head + (g.cache if level0 else 0) + of
    # (streamed gradients: all of them beside every kept byte, true only where the first block kept everything)
    bwd = ex + min(of, window) + g.backward_work + g.transient_grads + held
    fwd_blk = ex + g.largest + of + held
    return int(math.ceil(max(fwd_end, bwd, fwd_blk))) - g.transient_grads


def _without_cyclic_gc(fn: Any) -> Any:
    """Run ``fn`` with the cyclic garbage collector paused: the search makes millions of short-lived acyclic objects
    (tuples, floats, small dataclasses), which reference counting frees, and each collection they trigger walks every
    object of the process for none of them (a 100-block search in a long-lived process: 1-2 s of 7-10)."""

    @functools.wraps(fn)
    def run(*args: Any, **kwargs: Any) -> Any:
        was = gc.isenabled()
        gc.disable()
        try:
            return fn(*args, **kwargs)
        finally:
            if was:
                gc.enable()

    return run


@_without_cyclic_gc
def plan_for(
    profile: Profile,
    budget_bytes: int,
    *,
    global_batch: int | None = None,
    precision: str = "fp32",
    fused_loss_allowed: bool = False,
    offload_allowed: bool = True,
    gradient_offload_allowed: bool | None = None,
    grad_clipping: bool = True,
    persistent_gradients: bool = False,
    allocator_allowed: bool = True,
    prefetch_window_bytes: int | None = None,
    selective_allowed: bool = True,
    stream_allowed: bool = True,
    offload_config: Any = None,
    bf16_bytes: Profile | None = None,
    weight_layouts: Sequence[str] | None = None,
    _layouts: list[str] | None = None,
) -> Plan:
    """The plan with the shortest predicted step whose predicted peak fits ``budget_bytes``.

    Args:
        profile: the model on the machine (``elbowroom.plan.profiler.profile``).
        budget_bytes: device memory the training step may use (incl. the allocator's margin).
        global_batch: samples per optimizer step; the search picks the micro-batch among its divisors and
            accumulates. None keeps the profile's micro-batch without accumulation (the loop's own batch).
        precision: "fp32" keeps fp32 weights (autocast computes in the profile's dtype); "bf16" also allows bf16
            device copies of offloaded weights and the whole model in bf16, always with fp32 masters.
        fused_loss_allowed: the loop can compute head and loss with ``elbowroom.linear_cross_entropy``.
        offload_allowed: activations and optimizer state may go to host memory.
        gradient_offload_allowed: the gradients of host-stepped parameters may leave the device during the backward
            (``CPUOffloadOptimizer(offload_gradients=True)``; not under DDP, whose buckets keep them), at one
            unhidden copy of them per step; chosen only where it is faster within the budget (i.e. where it fits).
            Only the optimizer sees them then: a loop that clips must use ``optimizer.clip_grad_norm_``. None: allowed
            when ``grad_clipping`` is False (a loop clipping with ``torch.nn.utils.clip_grad_norm_`` would miss them).
        grad_clipping: the loop clips gradients (or uses a GradScaler): the host step waits for the whole backward.
        persistent_gradients: every gradient exists for the whole step, in the forward too (DDP's buckets, which
            its ``.grad`` are views of); no gradient leaves the device early then.
        allocator_allowed: the plan may set CUDA allocator options (``expandable_segments:True``).
        prefetch_window_bytes: the activation offload engine's prefetch window (its default when None).
        offload_config: the ``CPUOffloadConfig`` the optimizer will be built with (its staging slots are priced).
        bf16_bytes: a profile of the same model with bf16 weights: its bytes price the bf16 layout, and its times
            too when it was measured (:func:`with_bf16_measurements`); an analytic one gives bytes only.
            A profile taken under autocast saves fp32 norm and residual outputs that a bf16 model saves in bf16;
            with this, bf16-weight layouts are priced with their own bytes (times stay the profile's).
        weight_layouts: the weight layouts (keys of ``cost.LAYOUTS``) the loop can run, None: every one the
            precision allows (FSDP2 shards cannot hold bf16 device copies of fp32 weights: ``fp32`` and ``bf16``).
        selective_allowed: blocks may use selective recompute (:func:`~elbowroom.plan.fit` turns it off for
            blocks that are not elbowroom's reference blocks, see there).
        stream_allowed: blocks' optimizer state may live on the host and step on the device, streamed through a
            device ring (``CPUOffloadOptimizer(stream_params=...)``): only for Adam and AdamW, whose fused device
            kernel steps them (:func:`~elbowroom.plan.fit` allows it for those classes alone).

    Returns:
        The :class:`~elbowroom.plan.plan.Plan`.

    Raises:
        BudgetError: no plan fits; the message names the minimum budget and what it consists of.
        ValueError: a bad argument.
    """
    if isinstance(budget_bytes, bool) or not isinstance(budget_bytes, int) or budget_bytes <= 0:
        raise ValueError(f"budget_bytes must be a positive int, got {budget_bytes!r}")
    if precision not in ("fp32", "bf16"):
        raise ValueError(f"precision must be 'fp32' or 'bf16', got {precision!r}")
    if global_batch is not None and (isinstance(global_batch, bool) or not isinstance(global_batch, int)
                                     or global_batch < 1):
        raise ValueError(f"global_batch must be a positive int of samples, got {global_batch!r}")
    if not profile.blocks:
        raise ValueError("the profile has no blocks: the planner decides block by block")
    if gradient_offload_allowed is None:
        gradient_offload_allowed = not grad_clipping
    if persistent_gradients:
        gradient_offload_allowed = False
    if prefetch_window_bytes is None:
        from elbowroom.activations.offload import DEFAULT_PREFETCH_WINDOW_BYTES

        prefetch_window_bytes = DEFAULT_PREFETCH_WINDOW_BYTES
    m = profile.machine
    notes: list[str] = []
    link_ok = m.h2d_bandwidth > 0 and m.d2h_bandwidth > 0 and m.duplex_bandwidth > 0
    opt_ok = offload_allowed and link_ok and m.host_adam_params_per_s > 0
    stream_ok = offload_allowed and link_ok and stream_allowed
    if offload_allowed and not link_ok:
        notes.append(f"{m.name} has no host link in the profile: nothing is offloaded")
    if profile.extra.get("compiled_blocks"):
        notes.append(COMPILED_NOTE)
        if profile.extra.get("compile_options"):  # to run as priced, compile with the same options
            compiled_with = ", ".join(f"{k}={v!r}" for k, v in sorted(profile.extra["compile_options"].items()))
            notes.append(f"the blocks compiled with compile_blocks({compiled_with})")
        if profile.extra.get("compiled_kept_as_selective"):
            notes.append("analytic: a compiled block kept whole is priced at what selective recompute keeps (as "
                         "blocks compiled with pointwise recompute were measured to save)")
    layouts, layout_notes = cost.layouts_for(profile, precision)
    notes += layout_notes
    if weight_layouts is not None:
        unknown = sorted(set(weight_layouts) - set(cost.LAYOUTS))
        if unknown or not weight_layouts:
            raise ValueError(f"weight_layouts must name some of {', '.join(cost.LAYOUTS)}, got {list(weight_layouts)}")
        layouts = [x for x in layouts if x in weight_layouts] or ["fp32"]
    # the search's own arguments, for the searches this one makes again (a layout alone, the host unbound)
    kw: dict[str, Any] = dict(
        global_batch=global_batch, precision=precision, fused_loss_allowed=fused_loss_allowed,
        offload_allowed=offload_allowed, gradient_offload_allowed=gradient_offload_allowed,
        grad_clipping=grad_clipping, persistent_gradients=persistent_gradients, allocator_allowed=allocator_allowed,
        prefetch_window_bytes=prefetch_window_bytes, selective_allowed=selective_allowed,
        stream_allowed=stream_allowed, offload_config=offload_config)
    whole_kw = dict(kw, bf16_bytes=bf16_bytes, weight_layouts=weight_layouts)
    if bf16_bytes is not None and "bf16" in layouts and _layouts is None:
        # the bf16 layout on its own bytes, the others on the profile's: the faster of the two searches (each
        # exact, so a tighter budget still never predicts a faster step)
        found: list[Plan] = []
        errors: list[BudgetError] = []
        bf16 = (with_bf16_measurements(profile, bf16_bytes) if bf16_bytes.source == "measured"
                else with_bytes_of(profile, bf16_bytes))
        for prof, only in ((bf16, ["bf16"]),
                           (profile, [x for x in layouts if x != "bf16"])):
            if not only:
                continue
            try:
                found.append(plan_for(prof, budget_bytes, _layouts=only, **kw))
            except BudgetError as e:
                errors.append(e)
        if not found:
            raise min(errors, key=lambda e: e.minimum_bytes)
        return _with_host_note(profile, budget_bytes, min(found, key=lambda pl: pl.predicted_step_seconds), whole_kw)
    if _layouts is not None:
        layouts = [x for x in layouts if x in _layouts]
    cuda_like = allocator_allowed and m.name.lower() != "cpu"
    budget = budget_bytes
    if m.device_memory_bytes > 0 and budget > m.device_memory_bytes:
        notes.append(f"budget {size_text(budget_bytes)} is above the device's {size_text(m.device_memory_bytes)}: "
                     "planned for the device's memory")
        budget = int(m.device_memory_bytes)

    tables = options.block_tables(profile)
    ks_all = Knapsack(profile, tables, offload_ok=link_ok and offload_allowed, prefetch_window=prefetch_window_bytes,
                       selective_ok=selective_allowed)
    host_mem = m.host_memory_bytes if m.host_memory_bytes > 0 else math.inf
    n = len(profile.blocks)
    programmes = [ks_all]
    if max(ks_all.level_pool) > 0 and max(ks_all.level_pool) * max(_micro_batches(profile, global_batch)) \
            / profile.micro_batch + _most_optimizer_host_bytes(profile, opt_ok, gradient_offload_allowed,
                                                               offload_config) > host_mem:
        # where the host cannot hold every activation a level may offload beside the most optimizer state it may
        # hold, the same levels without activation offload stay open (recompute alone), so that a small host limits
        # the offload, not the plan. (Against half the host's memory, without the optimizer's share, W1 at 1x4096 on
        # a 23.5 GiB host lost the recompute-only plans: 12.1 GiB minimum where 1x2048 and 1x8192 planned in 9.)
        programmes.append(Knapsack(profile, tables, offload_ok=False, prefetch_window=prefetch_window_bytes,
                                    selective_ok=selective_allowed))
    mbs = _micro_batches(profile, global_batch)
    gb = global_batch if global_batch is not None else profile.micro_batch
    fused_opts = [False, True] if fused_loss_allowed else [False]
    # expandable segments first: where both fit at the same speed, the one that fragments less (a plan that frees
    # gradients one by one in the backward ran out of memory under a capped allocator with the defaults, W1 8 GiB)
    alloc_opts: list[bool | None] = [True, False] if cuda_like else [None]
    k_opts = _offload_counts(n) if opt_ok or stream_ok else [0]
    # the parameters outside the blocks: on the device, all on the host, or (where the model has both) the head and
    # final norm alone, the embeddings kept on the device (a clipped host step would stand before the next forward)
    other_opts = [(False, False)]
    if opt_ok:
        other_opts.append((True, False))
        if 0 < profile.head.after_params < profile.head.num_params:
            other_opts.append((False, True))
    # a pipeline stage holds the kept bytes (and its head's or output's) of ``k`` micro-batches: k x sum_j k_j
    k_in = profile.inflight_microbatches
    slack = (n + 16) * k_in  # bytes lost to rounding each block's bytes up separately

    def decisions(outer: _Outer, opts: tuple[int, ...]) -> Decisions:
        host, stream = _placement(n, outer.k, outer.streamed)
        return Decisions(
            offload_config=offload_config, options=tuple(OPTIONS[o] for o in opts),
            offload_blocks=host, stream_blocks=stream, split_share=outer.split,
            offload_other=outer.other,
            offload_head=outer.head,
            layout=outer.layout,
            micro_batch=outer.micro_batch,
            accumulation=outer.accumulation,
            fused_loss=outer.fused,
            expandable_segments=outer.expandable,
            grad_clipping=grad_clipping,
            offload_gradients=outer.gradients_out,
            persistent_gradients=persistent_gradients,
        )

    # (seconds, outer, level, capacity, w, ks)
    best: tuple[float, _Outer, int, int, tuple[float, float], Knapsack] | None = None
    minimum: tuple[int, _Outer, dict[str, int]] | None = None
    # the same without the host's memory as a limit: (minimum budget, host bytes its plan needs), for the hint
    unhosted: tuple[int, int] | None = None
    # every choice the bound admits, with the fastest its programme could be at any capacity (refined below)
    admitted: list[tuple[float, _Outer, int, int, tuple[float, float], Knapsack, cost.Globals]] = []
    # the choices with streamed blocks: (the least budget any plan of theirs could need, the bound's need, ...)
    streamed_least: list[tuple[int, float, _Outer, int, tuple[float, float], Knapsack, cost.Globals]] = []
    for layout, k, (other, head), og in itertools.product(layouts, k_opts, other_opts, [False, True]):
        outside = profile.head.num_params if other else profile.head.after_params if head else 0
        if layout != "fp32" and not (k or outside) and layout == "fp32-offload-bf16":
            continue  # nothing offloaded: the same as fp32
        if og and not (gradient_offload_allowed and (k or outside)):
            continue
        # how many of the k blocks stream (their gradients stay on the device: offloaded gradients need a host one)
        counts = _stream_counts(profile, k, outside, opt_ok, grad_clipping, offload_config) if stream_ok else [0]
        splits = [st for st in counts if not og or k > st or outside]
        # every one of the k blocks streamed with a share of its tensors on the host (its gradients go there too):
        # tried where the host and the link are both needed, the crossing of their work inside the k blocks
        shares = streaming.SPLIT_SHARES if stream_ok and opt_ok and any(0 < st < k for st in counts) else ()
        for mb in mbs:
            s = mb / profile.micro_batch
            acc = gb // mb
            if og and acc > 1:
                continue  # (accumulating on the host copies every micro-batch's gradients: not priced)
            for fused in fused_opts:
                placed = []
                for st, share in [(st, 0.0) for st in splits] + [(k, h) for h in shares if k]:
                    offload_blocks, stream_blocks = _placement(n, k, st)
                    d = Decisions(
                        offload_config=offload_config, options=(Option(),) * n, offload_blocks=offload_blocks,
                        stream_blocks=stream_blocks, split_share=share, offload_other=other, offload_head=head,
                        layout=layout, micro_batch=mb, accumulation=acc, fused_loss=fused,
                        grad_clipping=grad_clipping, offload_gradients=og, persistent_gradients=persistent_gradients,
                    )
                    g = cost.globals_for(profile, d)
                    if not math.isinf(g.host_exposed_s):
                        placed.append(((st, share), d, g))
                for (st, share), d, g in _undominated(placed, s, acc):
                    w = cost.link_shares(d, profile)
                    floor_s = cost.step_seconds(g, s, acc, 0.0)
                    for expandable, ks in ((a, k) for a in alloc_opts for k in programmes):
                        for li, e in enumerate(ks.levels):
                            host_need = int(g.host_bytes + s * ks.level_pool[li])
                            base = g.states + slack + (k_in - 1) * math.ceil(s * profile.head.saved_bytes)
                            fixed = base + _bound_extra(g, s, e, ks.level_off[li], li == 0, prefetch_window_bytes)
                            outer = _Outer(layout, k, other, mb, acc, fused, expandable, og, st, head, share)
                            least = k_in * ks.min_units[li] * ks.unit0 * s
                            need = fixed + least
                            margin = cost.margin_bytes(profile, budget, expandable)
                            loose = False  # the bound fails where the bound without streamed gradients does not
                            if g.streamed_grads:
                                # the bound holds every streamed gradient beside every kept byte: where the bound
                                # without them fits, the exact phases may too (tried in _refine; for the minimum,
                                # priced exactly when no plan fits)
                                unheld = base + least + _bound_extra(g, s, e, ks.level_off[li], li == 0,
                                                                     prefetch_window_bytes, streamed=False)
                                if host_need <= host_mem:
                                    streamed_least.append((min_budget(profile, unheld, expandable), unheld, need,
                                                           outer, li, w, ks, g))
                                loose = unheld + margin <= budget
                            need_budget = min_budget(profile, need, expandable)
                            if unhosted is None or need_budget < unhosted[0]:
                                unhosted = (need_budget, host_need)
                            if host_need > host_mem:
                                continue
                            if minimum is None or need_budget < minimum[0]:
                                minimum = (need_budget, outer, {
                                    **_minimum_parts(profile, d, g, s, e, ks.level_off[li], li == 0,
                                                     prefetch_window_bytes, fixed, need),
                                    **margin_part(profile, need, need_budget, expandable)})
                            cap = int(math.floor((budget - margin - fixed) / (k_in * ks.unit0 * s)))
                            if cap < ks.min_units[li]:
                                # every capacity from the least up, at their exact phases: the fastest this choice
                                # could be is its floor until its programme is solved there
                                if loose and (best is None or floor_s < best[0]):
                                    admitted.append((floor_s, outer, li, ks.min_units[li] - 1, w, ks, g))
                                continue
                            if best is not None and floor_s >= best[0]:
                                continue
                            cap = min(cap, ks.M)
                            times = ks.best(li, w)
                            t_blocks = times[cap]
                            if not math.isfinite(t_blocks):
                                continue
                            t = cost.step_seconds(g, s, acc, float(t_blocks))
                            t_any = cost.step_seconds(g, s, acc, float(times[ks.M]))
                            if t_any < t:
                                admitted.append((t_any, outer, li, cap, w, ks, g))
                            if best is None or t < best[0]:
                                best = (t, outer, li, cap, w, ks)
    best = _refine(profile, best, admitted, budget, decisions, prefetch_window_bytes)
    if best is None:
        minimum = _exact_minimum(profile, minimum, streamed_least, budget, decisions, prefetch_window_bytes)
        raise budget_error(
            profile, budget_bytes, minimum, precision, layouts, opt_ok, global_batch, fused_loss_allowed,
            offload_config, unhosted=unhosted, usable=budget,
        )
    t, outer, li, cap, w, ks = best
    d = decisions(outer, ks.backtrack(li, w, cap))
    plan = plan_from_decisions(
        profile, d, budget_bytes, notes=tuple(notes), prefetch_window_bytes=prefetch_window_bytes,
        budget_for_margin=budget,
    )
    # the search's objective and the cost model's prediction are one expression; keep the search's number so that
    # the monotonicity over budgets is exact to the last bit
    assert math.isclose(plan.predicted_step_seconds, t, rel_tol=1e-9), (plan.predicted_step_seconds, t)
    assert plan.predicted_peak_bytes <= budget, (plan.predicted_peak_bytes, budget)
    tokens = plan.global_batch * profile.seq_len
    plan = replace(plan, predicted_step_seconds=t, predicted_tokens_per_s=tokens / t if t > 0 else math.inf)
    if _layouts is not None:  # one layout's search of the two above: the note is the whole plan's
        return plan
    return _with_host_note(profile, budget_bytes, plan, whole_kw)


HOST_BINDS = 0.9
"""A plan whose host memory reaches this share of the host's is planned again without the host's limit
(:func:`_with_host_note`)."""
HOST_NOTE_GAIN = 0.05
"""... and the note says what more host memory would buy where the step would be at least this much shorter."""


def _with_host_note(profile: Profile, budget_bytes: int, plan: Plan, kw: dict[str, Any]) -> Plan:
    """``plan`` with a note where the host's memory binds it: what the step would take with as much host memory as
    the plan without that limit uses. The 7B shape with a 32 GiB host on an H200 (``BENCHMARKS.md``, twenty-sixth
    session): at 73 GiB of device memory its plan held 31.7 GiB of host memory, and at 72 GiB the fp32-weight
    layout no longer fitted the host, a step of 0.98 s predicted against 0.74; nothing said the host was the
    limit."""
    host = profile.machine.host_memory_bytes
    if host <= 0 or plan.host_bytes < HOST_BINDS * host:
        return plan
    unbound = replace(profile, machine=replace(profile.machine, host_memory_bytes=0))  # (0: no limit)
    try:
        roomy = plan_for(unbound, budget_bytes, **kw)
    except BudgetError:
        return plan
    if roomy.predicted_step_seconds > (1.0 - HOST_NOTE_GAIN) * plan.predicted_step_seconds:
        return plan
    note = (f"the host's {size_text(host)} binds this plan ({size_text(plan.host_bytes)} used): with "
            f"{size_text(roomy.host_bytes)} of host memory the step would take "
            f"{roomy.predicted_step_seconds * 1e3:.0f} ms ({plan.predicted_step_seconds * 1e3:.0f} here)")
    return replace(plan, notes=(*plan.notes, note))


def _refine(profile: Profile, best: tuple | None, admitted: list, budget: int, decisions: Any, window: int
            ) -> tuple | None:
    """Capacities above the bound's where the exact peak still fits.

    The bound adds every kept byte to every gradient (true only at the optimizer step, when no activation is
    left) and to every streamed gradient held (true only where the first blocks keep everything), so it leaves room
    that the exact phases of :func:`cost.predict` show. For each admitted outer choice, fastest possible first, a
    bisection over a fixed grid of capacities (``M j / _REFINE_GRID`` and the level's least, never dependent on the
    budget) finds the largest whose plan's exact peak fits; a choice whose fastest possible step cannot
    beat the best so far is skipped. The exact peak grows with the capacity in all but corner cases (a larger
    capacity keeps more), which the bisection assumes: a larger budget then never predicts a slower step.
    """
    for t_any, outer, li, cap, w, ks, g in sorted(admitted, key=lambda a: a[0]):
        if best is not None and t_any >= best[0]:
            break
        times = ks.best(li, w)
        s = outer.micro_batch / profile.micro_batch
        steps = {ks.min_units[li], *(ks.M * j // _REFINE_GRID for j in range(1, _REFINE_GRID + 1))}
        grid = [c for c in sorted(steps) if c > cap
                and cost.step_seconds(g, s, outer.accumulation, float(times[c])) < (best[0] if best else math.inf)]
        lo, hi = 0, len(grid)  # grid[:lo] fit (or are untried below the first fit), grid[hi:] do not
        d = decisions(outer, (KEEP,) * len(profile.blocks))  # (the peak reads the options from ``opts``)
        while lo < hi:
            mid = (lo + hi) // 2
            if phases.peak_bytes(profile, d, ks.picked(li, w, grid[mid]), budget, window, g) <= budget:
                lo = mid + 1
            else:
                hi = mid
        if lo:
            c = grid[lo - 1]
            best = (cost.step_seconds(g, s, outer.accumulation, float(times[c])), outer, li, c, w, ks)
    return best


def _exact_minimum(profile: Profile, minimum: tuple | None, candidates: list, budget: int, decisions: Any,
                   window: int) -> tuple | None:
    """``minimum`` lowered by the choices that stream, each priced by its least plan's exact phases instead of the
    bound (which holds every streamed gradient beside every kept byte).

    A choice's need is never taken below its bound without streamed gradients: the search tries no choice under
    that, so the minimum named must plan. Candidates go in the order of that floor, until it cannot beat the minimum.
    Only called when no plan fits (the error names the minimum)."""
    for unheld_budget, unheld, bound_need, outer, li, w, ks, g in sorted(candidates, key=lambda c: c[0]):
        if minimum is not None and unheld_budget >= minimum[0]:
            break
        d = decisions(outer, tuple(ks.picked(li, w, ks.min_units[li])))
        need = max(unheld, _exact_need(profile, d, g, budget, window))
        need_budget = min_budget(profile, need, outer.expandable)
        if need < bound_need and (minimum is None or need_budget < minimum[0]):
            minimum = (need_budget, outer, {**_exact_parts(profile, d, budget, window),
                                            **margin_part(profile, need, need_budget, outer.expandable)})
    return minimum


def _exact_need(profile: Profile, d: Decisions, g: cost.Globals, budget: int, window: int) -> int:
    """Device bytes of plan ``d``, less the allocator's margin, at its exact phases."""
    idx = np.array([OPTIONS.index(o) for o in d.options], dtype=np.int64)
    return phases.peak_bytes(profile, d, idx, budget, window, g) - cost.margin_bytes(profile, budget,
                                                                                     d.expandable_segments)


def _exact_parts(profile: Profile, d: Decisions, budget: int, window: int) -> dict[str, int]:
    """What plan ``d``'s exact peak consists of, less the allocator's margin (for the BudgetError)."""
    memory = cost.predict(profile, d, budget, prefetch_window_bytes=window).memory
    return {k: v for k, v in memory.items() if k != "allocator margin"}


def _most_optimizer_host_bytes(profile: Profile, opt_ok: bool, gradients_out: bool, offload_config: Any) -> int:
    """Host bytes of the most optimizer state a plan may put there: every parameter's (and their host gradients
    where they may leave the device), 0 when nothing may go."""
    if not opt_ok:
        return 0
    n = len(profile.blocks)
    d = Decisions(offload_config=offload_config, options=(Option(),) * n, offload_blocks=(True,) * n,
                  offload_other=True, offload_gradients=gradients_out)
    return cost.globals_for(profile, d).host_bytes


def _minimum_parts(profile: Profile, d: Decisions, g: cost.Globals, s: float, e: float, off: float, level0: bool,
                   window: int, fixed: float, need: float) -> dict[str, int]:
    """What the smallest plan's bound consists of, for the BudgetError. The gradients of host-stepped parameters that
    wait for their copy (``offload_gradients``) are named apart from the head and working memory they used to hide
    in: they grow as the micro-batch shrinks (a shorter backward hides less of the copies), which made W1's minimum
    fall with the tokens (1x2048 9.9 GiB, 1x8192 7.4 GiB on a 1 TiB host) under a name that did not say why."""
    def share(without: cost.Globals) -> int:  # the bound's part that ``without`` leaves out
        return max(0, _bound_extra(g, s, e, off, level0, window) - _bound_extra(without, s, e, off, level0, window))

    backlog = cost.gradient_backlog_bytes(profile, d)
    waiting = share(replace(g, backward_work=g.backward_work - backlog)) if backlog else 0
    streamed = share(replace(g, streamed_grads=0)) if g.streamed_grads else 0
    parts = {"model states and optimizer buffers": g.states, "activations at least": int(need - fixed)}
    if waiting:
        parts[WAITING] = int(waiting)
    if streamed:
        parts[phases.STREAMED_TERM] = int(streamed)
    parts["head, loss and working memory"] = int(fixed - g.states - waiting - streamed)
    return parts


COMPILED_NOTE = "priced on the blocks compiled, as they run (compile_blocks)"
"""The note of a plan whose profile ran the blocks compiled (``profile(compiled=True)``: ``fit(compile=True)``,
``--train.compile``)."""

_SLOW_HOST_NOTE = "the host optimizer step"


def _slow_host_note(profile: Profile, d: Decisions, step_s: float) -> tuple[str, ...]:
    """A note when the step would take noticeably longer (3% or more) were the host step at the slow end of its
    measured spread (:data:`~elbowroom.plan.cost.HOST_STEP_SPREAD`; the prediction counts the mean of the two):
    the prediction's range, where it rests on the host step hiding."""
    if not (any(d.offload_blocks) or d.offload_other or d.offload_head) or profile.machine.host_adam_params_per_s <= 0:
        return ()
    g = cost.globals_for(profile, d)
    _, exposed_slow = cost.host_terms(profile, d, g.device_step_s, cost.HOST_STEP_SPREAD)
    slow = step_s - g.host_exposed_s + exposed_slow
    if not slow > 1.03 * step_s:
        return ()
    known = "as measured" if profile.machine.source == "measured" else "from the device table"
    return (f"{_SLOW_HOST_NOTE} ({profile.machine.host_adam_params_per_s / 1e9:.2f} G params/s {known}) must "
            f"hide behind the device's work: at {cost.HOST_STEP_SPREAD:.2f}x that rate, within its spread between "
            f"runs, the step would take {slow * 1e3:.0f} ms (predicted {step_s * 1e3:.0f}, the mean of the two)",)


_RECOMPUTE_NOTE = "the recompute in the backward"


def _recompute_hides_note(profile: Profile, d: Decisions, step_s: float) -> tuple[str, ...]:
    """A note when the recompute in the backward would hide 3% or more of the step's host optimizer time: the cost
    model leaves it out (it keeps the search's cost a sum), so the prediction is the upper end of a range."""
    if d.grad_clipping or not (any(d.offload_blocks) or d.offload_other or d.offload_head) or not any(
            o.checkpoint != "none" for o in d.options):
        return ()
    g = cost.globals_for(profile, d)
    idx = [OPTIONS.index(o) for o in d.options]
    recompute = options.block_tables(profile).recompute[np.arange(len(idx)), idx]  # the options' own recompute
    hidden = 0.5 * sum(cost.host_terms(profile, d, g.device_step_s, r, recompute)[1]
                       for r in (1.0, cost.HOST_STEP_SPREAD))
    low = step_s - g.host_exposed_s + hidden
    if not low < 0.97 * step_s:
        return ()
    return (f"{_RECOMPUTE_NOTE} hides host optimizer time too, which the prediction leaves out: counted, the step "
            f"would take {low * 1e3:.0f} ms (predicted {step_s * 1e3:.0f})",)


def plan_from_decisions(
    profile: Profile,
    d: Decisions,
    budget_bytes: int,
    *,
    notes: tuple[str, ...] = (),
    prefetch_window_bytes: int | None = None,
    budget_for_margin: int | None = None,
) -> Plan:
    """A :class:`Plan` for given decisions with the cost model's predictions (options snapped to the planner's)."""
    snapped = tuple(_snap(o) for o in d.options)
    d = replace(d, options=snapped)
    pred = cost.predict(profile, d, budget_for_margin or budget_bytes, prefetch_window_bytes=prefetch_window_bytes)
    weight, off_dtype = cost.LAYOUTS[d.layout]
    rows = tuple(
        BlockPlan(
            index=i,
            checkpoint=o.checkpoint,
            offload_ratio=o.offload_ratio,
            offload_input=o.offload_input,
            optimizer_on_host=d.offload_blocks[i],
            optimizer_streamed=d.streamed[i],
            kept_bytes=bc.kept_bytes,
            offloaded_bytes=bc.offloaded_bytes,
            recomputed_bytes=bc.recomputed_bytes,
            seconds=bc.seconds,
        )
        for i, (o, bc) in enumerate(zip(d.options, pred.blocks))
    )
    tokens = d.micro_batch * d.accumulation * profile.seq_len
    t = pred.step_seconds
    notes = tuple(n for n in notes if not n.startswith((_SLOW_HOST_NOTE, _RECOMPUTE_NOTE))) + _slow_host_note(
        profile, d, t) + _recompute_hides_note(profile, d, t)
    return Plan(
        blocks=rows,
        budget_bytes=budget_bytes,
        predicted_peak_bytes=pred.peak_bytes,
        predicted_step_seconds=t,
        predicted_tokens_per_s=tokens / t if t > 0 else math.inf,
        micro_batch=d.micro_batch,
        gradient_accumulation_steps=d.accumulation,
        weight_dtype=weight,
        offload_param_dtype=off_dtype if d.offloads_params or weight == "bfloat16" else "float32",
        offload_other_params=d.offload_other,
        offload_head_params=d.offload_head and not d.offload_other,
        optimizer_split_share=d.split_share if d.streams else 0.0,
        fused_loss=d.fused_loss,
        # (the defaults said too: a process an earlier plan or PYTORCH_CUDA_ALLOC_CONF left on expandable segments
        # would otherwise run this plan with the setting it did not price)
        allocator_settings="" if d.expandable_segments is None else f"expandable_segments:{d.expandable_segments}",
        grad_clipping=d.grad_clipping,
        offload_gradients=d.offload_gradients,
        persistent_gradients=d.persistent_gradients,
        peak_phase=pred.peak_phase,
        memory=dict(pred.memory),
        time=dict(pred.time),
        host_bytes=pred.host_bytes,
        profile=ProfileSummary(
            machine=profile.machine.name,
            source=profile.source,
            seq_len=profile.seq_len,
            micro_batch=profile.micro_batch,
            compute_dtype=profile.compute_dtype,
            param_dtype=profile.param_dtype,
            block_path=profile.block_path,
            num_params=profile.num_params,
            shard_factor=int(profile.extra.get("shard_factor", 1)),
        ),
        notes=tuple(notes),
    )


def _snap(o: Option) -> Option:
    """The planner's option nearest to a hand-written one (for predictions of edited plans)."""
    if o in OPTIONS:
        return o
    same = [c for c in OPTIONS if c.checkpoint == o.checkpoint and c.offload_input == o.offload_input]
    if not same:
        same = [c for c in OPTIONS if c.checkpoint == o.checkpoint]
    return min(same, key=lambda c: abs(c.offload_ratio - o.offload_ratio))


def with_bytes_of(profile: Profile, other: Profile) -> Profile:
    """``profile`` with the saved bytes of ``other`` (the same model traced in another precision); its times,
    machine and model states stay."""
    if len(other.blocks) != len(profile.blocks):
        raise ValueError(f"the two profiles have {len(profile.blocks)} and {len(other.blocks)} blocks")
    blocks = tuple(
        replace(b, saved_bytes=dict(o.saved_bytes), selective_saved_bytes=o.selective_saved_bytes,
                saved_sizes=o.saved_sizes, kept_sizes=o.kept_sizes,
                input_bytes=o.input_bytes, largest_saved_bytes=o.largest_saved_bytes)
        for b, o in zip(profile.blocks, other.blocks)
    )
    head = replace(profile.head, saved_bytes=other.head.saved_bytes,
                   logits_transient_bytes=other.head.logits_transient_bytes,
                   fused_transient_bytes=other.head.fused_transient_bytes,
                   fused_chunk_tokens=other.head.fused_chunk_tokens)
    return replace(profile, blocks=blocks, head=head)


def with_bf16_measurements(profile: Profile, bf16: Profile) -> Profile:
    """``profile`` with the bytes and the times of ``bf16``, a measured profile of the same model with bf16 weights
    (no autocast): what the bf16 layout saves and costs, measured. Its times hold no weight casts, so the result
    is marked as bf16 weights (the cost model then credits no cast). Model states, machine and allocator margins
    stay ``profile``'s."""
    out = with_bytes_of(profile, bf16)
    blocks = tuple(
        replace(b, forward_s=o.forward_s, backward_s=o.backward_s, recompute_s=o.recompute_s,
                selective_recompute_s=o.selective_recompute_s)
        for b, o in zip(out.blocks, bf16.blocks)
    )
    head = replace(out.head, forward_s=bf16.head.forward_s, backward_s=bf16.head.backward_s)
    return replace(out, blocks=blocks, head=head, param_dtype=bf16.param_dtype, compute_dtype=bf16.compute_dtype)
