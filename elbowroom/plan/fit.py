"""``fit``: profile, plan and apply in one call, for any model whose repeated blocks can be found.

::

    model, optimizer, plan = elbowroom.plan.fit(model, sample_batch, budget="24GiB", lr=3e-4)
    for x, y in loader:                       # the plain torch loop, unchanged
        loss = loss_fn(model(x), y)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad()
"""

from __future__ import annotations

import dataclasses
import inspect
import logging
import re
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
import torch.nn as nn
from torch.utils._pytree import tree_leaves

from elbowroom.plan.plan import Plan
from elbowroom.plan.search import COMPILED_NOTE  # noqa: F401  (re-exported: the note of a compiled profile's plans)

__all__ = ["fit", "parse_budget"]

logger = logging.getLogger("elbowroom.plan")

_UNITS = {
    "": 1, "b": 1,
    "kib": 1 << 10, "mib": 1 << 20, "gib": 1 << 30, "tib": 1 << 40,
    "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
}
_BUDGET_RE = re.compile(r"^\s*([-+]?)\s*([0-9]+(?:\.[0-9]+)?)\s*([a-zA-Z]*)\s*$")


def parse_budget(budget: str | int, *, name: str = "budget") -> int:
    """Bytes of a budget: ``"24GiB"``, ``"24GB"`` (10^9), ``"512MiB"``, ``"1.5 TiB"`` or an int of bytes.

    Args:
        budget: the size.
        name: what the size is, as the caller's user knows it (``--host-memory``), for the messages.

    Raises:
        ValueError: anything else, naming the accepted forms.
    """
    forms = (
        "accepted: a number with GiB, GB, MiB, MB, KiB, KB, TiB, TB or B (e.g. '24GiB', '512MiB'), "
        "or an int of bytes"
    )
    if isinstance(budget, bool):
        raise ValueError(f"{name} must be a size, got {budget!r}; {forms}")
    if isinstance(budget, int):
        if budget <= 0:
            raise ValueError(f"{name} must be positive, got {budget}; {forms}")
        return budget
    if not isinstance(budget, str):
        raise ValueError(f"{name} must be a string or an int, got {type(budget).__name__}; {forms}")
    m = _BUDGET_RE.match(budget)
    unit = m.group(3).lower() if m else None
    if m is None or unit not in _UNITS:
        raise ValueError(f"cannot read {name} {budget!r}; {forms}")
    number = float(m.group(2))
    if m.group(1) == "-" or number <= 0:
        raise ValueError(f"{name} must be positive, got {budget!r}; {forms}")
    if _UNITS[unit] == 1 and not number.is_integer():
        # "1.5" read as bytes would plan for 1 byte: surely a size whose unit was left out
        raise ValueError(f"{name} {budget!r} is not a whole number of bytes; add a unit (e.g. '{m.group(2)}GiB')")
    value = int(number * _UNITS[unit])
    if value <= 0:
        raise ValueError(f"{name} must be at least one byte, got {budget!r}; {forms}")
    return value


def fit(
    model: nn.Module,
    sample_batch: Any,
    budget: str | int = "24GiB",
    optimizer: type[torch.optim.Optimizer] = torch.optim.AdamW,
    *,
    global_batch: int | None = None,
    precision: str = "fp32",
    fused_loss: bool = False,
    source: str = "auto",
    machine: Any = None,
    cache_dir: str | None = None,
    compute_dtype: torch.dtype | None = None,
    blocks: str | Sequence[nn.Module] | nn.ModuleList | None = None,
    loss_fn: Callable[..., torch.Tensor] | None = None,
    grad_clipping: bool = True,
    selective: bool = True,
    gradient_offload: bool | None = None,
    persistent_gradients: bool = False,
    ranks_per_host: int = 1,
    shared_link: tuple[float, float, float] | None = None,
    reentrant: bool | None = None,
    stream: bool | None = None,
    host_memory: str | int | None = None,
    compile: bool | dict[str, Any] = False,
    watch: bool = True,
    before_apply: Callable[[Plan], None] | None = None,
    profiles: dict[Any, Any] | None = None,
    **opt_kwargs: Any,
) -> tuple[nn.Module, torch.optim.Optimizer, Plan]:
    """Fit a training step of ``model`` into ``budget``: profile it, plan, apply the plan, log the plan's table.

    The training loop stays the plain torch loop. What the plan may ask of it:

    - Gradient accumulation (``plan.gradient_accumulation_steps > 1``, only when ``global_batch`` is given): run
      ``plan.micro_batch`` samples per forward, and when the optimizer is a
      :class:`~elbowroom.optim.CPUOffloadOptimizer` mark every micro-batch but the last with
      ``with optimizer.accumulating(i < n - 1):`` (it raises if gradients of a non-final micro-batch arrive
      unmarked). Without ``global_batch`` the loop's batch is the sample batch's and nothing changes.
    - ``plan.fused_loss`` (only when ``fused_loss=True``): compute the loss with
      ``elbowroom.linear_cross_entropy(hidden_states, head.weight, targets)``; if the plan also offloads the
      head's parameters (``plan.offload_other_params``, or ``plan.offload_head_params``: the head and final norm
      alone), call ``optimizer.wait_for(head.weight)``
      before it: that weight is read outside its module's forward, where the optimizer cannot see the read.
      elbowroom's own models need neither: ``model.output(hidden_states, targets)`` computes the fused loss
      (summed over the target tokens) inside the head's forward, where the optimizer (and FSDP2) see it.
    - ``precision="bf16"``: the plan may keep the offloaded weights in bf16 on the device
      (``plan.offload_param_dtype``) or the whole model (``plan.weight_dtype == "bfloat16"``), always with fp32
      masters in the optimizer; the loop keeps running under bf16 autocast, as it was profiled (with the whole
      model in bf16 autocast may also go).

    Everything else needs nothing: gradient clipping with ``torch.nn.utils.clip_grad_norm_(model.parameters(),
    ...)`` sees every gradient (the plan never frees device gradients early), ``optimizer.step()`` / ``zero_grad()``
    / ``state_dict()`` / LR schedulers behave as torch's, and each block waits for its own updated weights in
    forward. Weights read outside their module's forward (a tied weight used functionally, evaluation that bypasses
    ``forward``) need ``optimizer.wait_for(weight)`` first. ``clip_grad_norm_``, ``accumulating`` and ``wait_for``
    are a :class:`~elbowroom.optim.CPUOffloadOptimizer`'s; a plan that keeps every optimizer state on the device
    returns torch's own optimizer, which needs none of them (``hasattr(optimizer, "accumulating")`` tells a loop
    written for every budget which it has).

    A plan fits ``budget`` in what its steps allocate, with the allocator's overhead as the profile measured it;
    the steps of a plan that mixes recompute, host-stepped and streamed blocks can hold more (the 7B shape: 3.2-5.0
    GiB where 1.75 was measured). On a device of the budget's size that shows as allocator retries
    (``torch.cuda.memory_stats()["num_alloc_retries"]`` growing every step) and slow steps; plan about 5% lower then.
    The optimizer ``fit`` returns says so once, as a warning naming that budget, and once if the allocator reserves
    more than the budget (``watch``); ``elbowroom train --budget`` plans again by itself
    (:class:`elbowroom.train.metrics.BudgetWatch`).

    Args:
        model: the model, on its training device (parameters in fp32).
        sample_batch: one micro-batch as the model takes it (a tensor, or a tuple/dict of them).
        budget: device memory for the step: "24GiB", "24GB", "512MiB" or an int of bytes.
        optimizer: the torch optimizer class.
        global_batch: samples per optimizer step; the planner then picks micro-batch and accumulation.
        precision: "fp32", or "bf16" to allow bf16 device weights (fp32 masters). With "bf16" and a measured
            profile, a bf16 copy of the model is profiled beside it (half the model's bytes more while planning,
            freed after), so that the bf16 layouts are priced with their own times.
        fused_loss: the loop can use ``elbowroom.linear_cross_entropy`` (the planner decides whether it pays).
        source: how to profile: "auto", "measured" or "analytic".
        machine: a device name of ``elbowroom.plan.devices`` (or a MachineProfile) for analytic profiles.
        cache_dir: where the measured machine's numbers are cached (measured once per machine and torch version;
            None: measured every time).
        compute_dtype: the dtype the loop computes in (its autocast dtype, or the weights' dtype without
            autocast); None: bf16 on CUDA, the weights' dtype elsewhere (see ``elbowroom.profile``'s ``dtype``).
        blocks: the repeated blocks when they cannot be found (a dotted path such as "model.layers", or modules).
        loss_fn: ``loss_fn(model, batch) -> loss`` for the profile, when ``model(batch)`` is not enough.
        grad_clipping: the loop clips gradients (the planner assumes the host step then waits for the backward).
        gradient_offload: the plan may send the host-stepped parameters' gradients to the host during the backward
            (``plan.offload_gradients``), where only the optimizer still sees them: a loop that clips must then
            clip with ``optimizer.clip_grad_norm_``. None (default): allowed when ``grad_clipping`` is False
            (``torch.nn.utils.clip_grad_norm_`` would miss them). Never under DDP, whose buckets keep every
            gradient.
        persistent_gradients: every gradient exists for the whole step (the model is, or will be, wrapped in
            DDP, whose buckets hold them from its construction on): priced in the forward too, none offloaded.
        ranks_per_host: data-parallel ranks on this host that plan alike: each gets that share of the host's
            memory and of its host optimizer rate (they step at once, bound by its memory bandwidth).
        shared_link: with ``ranks_per_host`` above 1, the link's rates (bytes/s: to the device, from it, each way
            at once) while every rank of the host copies, from the collective
            :func:`~elbowroom.plan.machine.measure_shared_link`; None: each GPU's link is its own.
        selective: allow selective recompute (False for blocks whose forward changes state a recompute would
            see differently; a Hugging Face KV cache is switched off by :func:`~elbowroom.plan.apply` instead).
        reentrant: recompute whole blocks with torch's reentrant checkpoint (less host work per block; profiled
            the same way). None: yes unless torch.distributed is initialized
            (:func:`~elbowroom.activations.recompute.reentrant_default`). A loop that calls ``torch.autograd.grad``
            or ``backward(inputs=...)`` through the model passes False: torch refuses those under it.
        stream: let blocks keep their optimizer state on the host and step it on the device, streamed through a
            small ring each step (``CPUOffloadOptimizer(stream_params=...)``): a second optimizer beside the host's,
            paced by the link instead of the host's memory. None (default): where the optimizer can (Adam and AdamW
            without amsgrad) and torch.distributed is not initialized; False: never; True: where the plan gains by
            it, and an optimizer that cannot is refused.
        host_memory: host memory this process's plan may use (``"32GiB"`` or bytes): the host optimizer's state,
            its pinned buffers and offloaded activations must fit it. None: this machine's physical memory (shared
            by ``ranks_per_host``). Where it binds, the planner keeps gradients off the host and streams state through
            the device, so that each offloaded parameter costs the host little more than its 12 bytes of fp32
            master and moments.
        compile: compile the blocks in place after applying the plan
            (:func:`~elbowroom.activations.compile_blocks`), and price the plan on them compiled: the profile
            measures their times and the bytes they save with the blocks compiled (a compiled block kept whole
            saves what the compiler's partition keeps, W1-shaped blocks on CPU about a fifth less, and a selective
            one drops its per-op host work). An analytic profile prices them only as planned runs compile them
            (pointwise recomputed); whole blocks then recompute with the non-reentrant checkpoint. A dict: compiled
            so, with these keyword arguments of ``compile_blocks`` (``{"mode": ...}``), in the profile and in the
            run alike, over :data:`PLANNED_COMPILE` (pointwise results recomputed in backward;
            ``{"recompute_pointwise": False}`` turns that off). The profile's compiled code is dropped before the
            run (``torch.compiler.reset()``): the run compiles its own.
        watch: on CUDA, a step post-hook on the optimizer (:class:`BudgetHook`) reads the allocator's counters after
            each of the first 50 steps, then every 50th, and warns once when it keeps retrying at the budget and once
            when it reserves more than the budget (a step that would not fit a device of the budget's size). False:
            no hook (the trainer watches its own rows).
        before_apply: called with the plan before it is applied; it may raise to refuse it, leaving the model as
            it was (the trainer refuses a re-plan that would not be faster, before its pinned memory is allocated).
        profiles: a dict that keeps the profiles this call measures, and gives them to a later call passed the same
            dict with the same profiling arguments and batch shapes (:func:`profile_key`), which then plans without
            measuring: the trainer's re-plans at a lower budget, of a model built again from the same seed, skip the
            profile and price both plans on one measurement (the 7B's re-plan on an H200: 25 s from the warning
            to the plan applied, against 33 s measuring again on another; its search and 22.6 GiB of pinned
            memory take the rest). Only for
            the same model (its shapes and code): the key cannot see a changed forward.
        **opt_kwargs: the optimizer's arguments (``lr``, ``weight_decay``...).

    Returns:
        ``(model, optimizer, plan)``.

    Raises:
        BudgetError: no plan fits the budget (the message names the minimum).
        ValueError: a bad budget or argument.
    """
    from elbowroom.plan.apply import apply, can_stream, resolve_blocks
    from elbowroom.plan.search import plan_for

    budget_bytes = parse_budget(budget)
    host_bytes = None if host_memory is None else parse_budget(host_memory, name="host_memory")
    if source != "analytic":
        check_memory_cap(model, budget_bytes)
    streamable = can_stream(optimizer, opt_kwargs)
    if stream and not streamable:
        raise ValueError(f"stream=True needs torch.optim.Adam or AdamW without amsgrad, not "
                         f"{getattr(optimizer, '__name__', optimizer)} with {opt_kwargs}; leave stream unset")
    if stream is None:
        # (not measured under data parallel, where DDP's reduced gradients and FSDP2's shards come into play)
        stream = streamable and not (torch.distributed.is_available() and torch.distributed.is_initialized())
    resolve_blocks(model, blocks)  # no repeated blocks: say so before profiling
    from elbowroom.plan.profiler import profile as take_profile  # the profiler: imported when first needed

    given = dict(compile) if isinstance(compile, dict) else {}
    known = {"recompute_pointwise", *inspect.signature(torch.compile).parameters} - {"model"}
    if set(given) - known:  # said before any profiling
        raise ValueError(f"fit(compile=...) takes compile_blocks' keyword arguments ({', '.join(sorted(known))}), "
                         f"not {sorted(set(given) - known)}")
    compile = isinstance(compile, dict) or bool(compile)
    compile_options = planned_compile_options(given) if compile else {}
    compiled_as = compile_options if compile else False  # what the profiles compile with, as the run will
    if compile:
        reentrant = False  # torch.compile traces the non-reentrant checkpoint only
    if reentrant is None:
        from elbowroom.activations.recompute import reentrant_default

        reentrant = reentrant_default()
    prof_kwargs: dict[str, Any] = {"source": source, "machine": machine, "blocks": blocks, "cache_dir": cache_dir,
                                   "dtype": compute_dtype, "reentrant": reentrant, "compiled": compiled_as}
    if loss_fn is not None:
        prof_kwargs["loss_fn"] = loss_fn
    key = profile_key(model, sample_batch, precision, prof_kwargs) if profiles is not None else None
    if key is not None and key in profiles:
        prof, bf16_prof = profiles[key]
        logger.info("planning from the profile measured before (not measured again)")
    else:
        prof = take_profile(model, sample_batch, **prof_kwargs)
        bf16_prof = None
        if precision == "bf16" and prof.param_dtype != "bfloat16" and prof.compute_dtype == "bfloat16":
            bf16_prof = profile_bf16_copy(model, sample_batch, prof, take_profile, loss_fn, reentrant,
                                          compiled=compiled_as)
        if key is not None:
            profiles[key] = prof, bf16_prof
    from elbowroom.plan.ranks import host_share, with_host_memory

    if ranks_per_host > 1:
        prof = dataclasses.replace(prof, machine=host_share(prof.machine, ranks_per_host, shared_link))
    prof = with_host_memory(prof, host_bytes)
    plan = plan_for(
        prof,
        budget_bytes,
        global_batch=global_batch,
        precision=precision,
        fused_loss_allowed=fused_loss,
        grad_clipping=grad_clipping,
        selective_allowed=selective,
        stream_allowed=stream,
        gradient_offload_allowed=gradient_offload,
        persistent_gradients=persistent_gradients,
        offload_config=opt_kwargs.get("offload_config"),
        bf16_bytes=bf16_prof,
    )
    if ranks_per_host > 1:
        plan = dataclasses.replace(plan, notes=(*plan.notes, (
            f"one of {ranks_per_host} ranks on this host: planned on 1/{ranks_per_host} of its memory and of its host "
            f"optimizer rate ({prof.machine.host_adam_params_per_s / 1e9:.2f} G params/s)")))
    if before_apply is not None:
        before_apply(plan)
    model, opt = apply(model, plan, optimizer, blocks=blocks, reentrant=reentrant, **opt_kwargs)
    if compile:
        from elbowroom.activations import compile_blocks

        compile_blocks(model, blocks=resolve_blocks(model, blocks), **compile_options)
    logger.info("%s", plan.table())
    device = next((p.device for p in model.parameters() if p.device.type == "cuda"), None)
    if watch and device is not None:
        BudgetHook(plan, device).register(opt)
    return model, opt, plan


def profile_key(model: nn.Module, sample_batch: Any, precision: str, prof_kwargs: dict[str, Any]) -> tuple[Any, ...]:
    """What :func:`fit`'s ``profiles`` keeps a measurement under: the model's class and parameter shapes and dtypes,
    the sample batch's tensor shapes and dtypes, the precision (whether a bf16 copy was profiled) and every
    profiling argument (by value; a loss function or block list by identity)."""
    params = tuple((name, tuple(p.shape), p.dtype, p.device.type) for name, p in model.named_parameters())
    batch = tuple((tuple(t.shape), t.dtype) for t in tree_leaves(sample_batch) if isinstance(t, torch.Tensor))
    args = tuple(sorted((k, v if isinstance(v, (str, bool, int, float, type(None), torch.dtype)) else
                         repr(v) if isinstance(v, dict) else id(v)) for k, v in prof_kwargs.items()))
    return type(model), params, batch, precision, args


class BudgetHook:
    """A step post-hook that watches the caching allocator of a loop ``fit`` planned: the trainer's
    :class:`~elbowroom.train.metrics.BudgetWatch` over the allocator's counters after a step, read after each of the
    first :data:`EVERY_STEP` steps and then every :data:`EVERY`-th (``torch.cuda.memory_stats``: no device sync).

    It reads what the allocator holds now, not its peaks: those count the profile's steps. It removes itself once
    both warnings have been given."""

    EVERY_STEP = 50
    EVERY = 50

    def __init__(self, plan: Plan, device: torch.device) -> None:
        from elbowroom.train.metrics import BudgetWatch  # (the trainer's: one rule for both)

        self.watch = BudgetWatch(plan, suggest="fit(budget='{}')")
        self.device, self.steps, self._handle = device, 0, None

    def register(self, optimizer: torch.optim.Optimizer) -> None:
        self._handle = optimizer.register_step_post_hook(self)

    def __call__(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        self.steps += 1
        if self.steps > self.EVERY_STEP and self.steps % self.EVERY:
            return
        stats = torch.cuda.memory_stats(self.device)
        self.watch.check({"step": self.steps, "alloc_retries": stats.get("num_alloc_retries", 0),
                          "peak_reserved_bytes": stats.get("reserved_bytes.all.current", 0),
                          "peak_memory_bytes": stats.get("allocated_bytes.all.current", 0)})
        if self.watch.warned and self.watch.warned_retries and self._handle is not None:
            self._handle.remove()
            self._handle = None


PLANNED_COMPILE: dict[str, Any] = {"recompute_pointwise": True}
"""What a planned run compiles its blocks with unless told otherwise (``fit(compile=True)``, the trainer's
``--train.compile`` with ``--budget``): the partitioner recomputes pointwise results in backward instead of saving them
(:data:`~elbowroom.activations.compiled.POINTWISE_RECOMPUTE`), so a kept block saves fewer bytes and the plan keeps
more blocks. On one H200 (``BENCHMARKS.md``, twenty-second session) it beat the partitioner's defaults in every
planned row measured: W1 at 24 GiB 105.1% and 103.6% of plain against 101.2%, at 16 GiB 96.8% against 89.1%, at 8
GiB 70.9% against 68.0%; GPT-2-XL at 24 GiB 85.1% against 76.6%. ``compile={"recompute_pointwise": False}`` turns it
off."""


def check_memory_cap(model: nn.Module, budget_bytes: int) -> None:
    """Refuse a budget above this process's CUDA memory cap (``torch.cuda.set_per_process_memory_fraction``, set by
    the caller or left by an earlier capped run): the profile would run under a ceiling the plan does not know of,
    and the run would fail against it.

    Raises:
        ValueError: the budget is above the cap (:func:`memory_cap_error`).
    """
    dev = next((p.device for p in model.parameters()), None)
    if dev is None or dev.type != "cuda" or not hasattr(torch.cuda, "get_per_process_memory_fraction"):
        return
    index = dev.index if dev.index is not None else torch.cuda.current_device()
    err = memory_cap_error(budget_bytes, torch.cuda.get_per_process_memory_fraction(index),
                           torch.cuda.get_device_properties(index).total_memory)
    if err:
        raise ValueError(err)


def memory_cap_error(budget_bytes: int, fraction: float, total_bytes: int) -> str | None:
    """What :func:`check_memory_cap` says of ``budget_bytes`` on a device of ``total_bytes`` capped at ``fraction``
    of it (None: the budget is within the cap)."""
    cap = int(fraction * total_bytes)
    if fraction >= 1.0 or budget_bytes <= cap:
        return None
    return (f"budget {budget_bytes / 2**30:.1f} GiB is above this process's CUDA memory cap of {cap / 2**30:.1f} GiB "
            f"(torch.cuda.set_per_process_memory_fraction({fraction:.3g}), set earlier in this process): lift it "
            f"with torch.cuda.set_per_process_memory_fraction(1.0) before fit, or plan for at most the cap")


def planned_compile_options(given: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """``compile_blocks``' keyword arguments for a planned run: ``given`` over :data:`PLANNED_COMPILE` (which needs
    inductor, so a run given another backend compiles with that one alone)."""
    opts = dict(given or {})
    if opts.get("backend", "inductor") == "inductor":
        for k, v in PLANNED_COMPILE.items():
            opts.setdefault(k, v)
    return opts


def profile_bf16_copy(model: nn.Module, sample_batch: Any, prof: Any, take_profile: Callable[..., Any],
                      loss_fn: Callable[..., torch.Tensor] | None, reentrant: bool,
                      compiled: bool | dict[str, Any] = False) -> Any:
    """The model with bf16 weights, profiled: measured on a bf16 copy on the device when the model was
    measured there (its bytes and its times: a bf16 model runs its norms and residuals in bf16 and casts no
    weights, W1 11% and GPT-2-XL 15% faster than fp32 weights under autocast on the H100, ``BENCHMARKS.md``),
    else traced on a meta copy (its bytes only, in a second or two; ``compiled``: the measured copy runs its blocks
    compiled, and the meta trace prices them compiled where they recompute pointwise results, else eager). The bf16
    layout's bytes and times here, and under FSDP2, which gathers in bf16, a rank's activation bytes
    (``elbowroom.plan.ranks.as_fsdp_computes``)."""
    from elbowroom.plan.profiler import bf16_copy, meta_copy

    extra: dict[str, Any] = {"reentrant": reentrant}
    if loss_fn is not None:
        extra["loss_fn"] = loss_fn
    path = prof.block_path or None
    if prof.source == "measured" and path is not None:
        # a model whose plain step does not fit (the 7B shape) is measured on the copy as on itself, every block
        # recomputed: the copy needs half the model's bytes beside it
        copy = None
        try:
            copy = bf16_copy(model)
            return take_profile(copy, sample_batch, source="measured", machine=prof.machine, dtype=torch.bfloat16,
                                blocks=path, compiled=compiled, **extra)
        except torch.OutOfMemoryError:
            logger.warning("no room for a bf16 copy of the model beside it: the bf16 layouts are priced with the "
                           "autocast profile's times")
        finally:
            del copy
            if torch.cuda.is_available():
                torch.cuda.empty_cache()
    if isinstance(compiled, Mapping) and compiled.get("recompute_pointwise"):  # priced compiled on meta too
        extra["compiled"] = compiled
    return take_profile(meta_copy(model).to(torch.bfloat16), sample_batch, source="analytic", machine=prof.machine,
                        dtype=torch.bfloat16, blocks=path, **extra)
