"""The trainer's planned runs: plan under ``--budget``, load ``--plan FILE``, follow the run's own plan on resume.

The planner itself is ``elbowroom.plan``; this module decides which plan a run follows and applies it to the
trainer's model and optimizer settings.

Under data parallel rank 0 plans and every rank applies the same plan (``DistributedRun.plan_once``). Under DDP
every rank holds the whole model, so one process's plan is each rank's. Under FSDP2 and HSDP (``--parallel.dp_shard
S``) the plan is one rank's: the profile of the whole model on the rank's micro-batch is turned into the rank's
(:func:`~elbowroom.plan.ranks.per_rank_profile`: 1/S of the parameters, gradients and optimizer state, plus
FSDP2's all-gathered parameters and unsharded gradients, the embedding's and head's around the head alone where they
are units of their own; the activations those of the compute dtype FSDP2 gathers in,
:func:`~elbowroom.plan.ranks.as_fsdp_computes`), planned with fp32 weights or, where
``--optimizer.param_dtype bfloat16`` allows, bf16 shards with fp32 masters, and applied in two steps around
``fully_shard``: the activation policies before it wraps the blocks (:func:`apply_plan`), the optimizer over the
local shards after (:func:`plan_optimizer`). ``--budget`` is then per rank, and a saved plan applies only at its own
shard factor.
"""

from __future__ import annotations

import functools
import itertools
import logging
import math
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

import torch
import torch.nn as nn

from elbowroom.config import Config, ConfigError, memory_overrides, wrong_file
from elbowroom.train.tokens import default_cache_dir

if TYPE_CHECKING:
    from elbowroom.plan import Plan

log = logging.getLogger("elbowroom.train")

T = TypeVar("T")

PLAN_FILE = "plan.toml"
"""The plan a planned run writes to OUT with its first step and re-applies on --resume (plan.json beside it is the
report's copy)."""


def _adamw_kwargs(cfg: Config) -> dict[str, Any]:
    o = cfg.optimizer
    return {"lr": o.lr, "betas": o.betas, "eps": o.eps, "weight_decay": o.weight_decay, "fused": o.fused or None}


def _groups(cfg: Config) -> Any:
    """The trainer's AdamW groups (no decay on norms, biases and embeddings), built after the plan's casts."""

    def groups(model: nn.Module) -> list[dict[str, Any]]:
        from elbowroom.train.trainer import param_groups  # the trainer imports this module

        return param_groups(model, cfg.optimizer.weight_decay)

    return groups


def load_plan(path: str | Path) -> Plan:
    """A saved plan (TOML or JSON); ConfigError naming the file and the fix."""
    from elbowroom.plan import Plan

    try:
        return Plan.load(path)
    except FileNotFoundError:
        raise ConfigError(
            f"plan file {path} does not exist; pass a plan saved by `elbowroom plan --out FILE.toml` or a run's "
            "OUT/plan.toml"
        ) from None
    except IsADirectoryError:
        raise ConfigError(
            f"plan file {path} is a folder; pass a plan file saved by `elbowroom plan --out FILE.toml` or a run's "
            "OUT/plan.toml"
        ) from None
    except OSError as e:  # (no read permission, an I/O error): the OS's words without its "[Errno 13]"
        raise ConfigError(f"plan file {path} cannot be read ({e.strerror or e}); pass a readable plan file") from None
    except (ValueError, TypeError) as e:  # Plan.load's messages name the file and the field
        raise ConfigError(f"{e}; fix the plan file or plan again with `elbowroom plan`") from None


def plan_to_follow(cfg: Config, out: Path, load: Callable[[str | Path], Any] | None = None,
                   what: str = "plan") -> Any:
    """The saved plan this run applies: on ``--resume`` the run's own ``OUT/plan.toml`` (the layout its checkpoint
    was trained with), else ``--plan FILE``; None when there is none (a ``--budget`` run plans once it has a model).

    ``load`` reads a plan file (default :func:`load_plan`; a model-parallel run reads its ranks' plans, ``what``
    "plans", and gets a :class:`~elbowroom.plan.ranks.RankPlans`).
    """
    from elbowroom.plan import parse_budget

    wrong = wrong_file("--plan", cfg.plan, takes="plan") if cfg.plan is not None else None
    if wrong is not None:  # a run config or a profile given as the plan
        raise ConfigError(wrong)
    load = load or load_plan
    saved = out / PLAN_FILE
    if cfg.resume and saved.is_file():
        plan = load(saved)
        overrides = memory_overrides(cfg)
        if overrides:
            verb = "decides" if what == "plan" else "decide"
            raise ConfigError(f"{out} was trained under its {what} {saved}, which {verb} these; drop "
                              f"{', '.join(overrides)} to resume it")
        if cfg.plan is not None and load(cfg.plan) != plan:
            raise ConfigError(f"--resume continues under the run's own {what} {saved}; drop --plan {cfg.plan}")
        if cfg.budget is not None and parse_budget(cfg.budget) != plan.budget_bytes:
            log.warning("--budget %s differs from the %d bytes the run was planned for; resuming under its %s "
                        "(start a new run to plan for the new budget)", cfg.budget, plan.budget_bytes, what)
        log.info("resuming under the run's %s %s (not planning again)", what, saved)
        return plan
    if cfg.resume and (cfg.budget is not None or cfg.plan is not None):
        flag = "--budget" if cfg.budget is not None else "--plan"
        raise ConfigError(f"--resume: {out} was trained without a plan (no {saved.name}); drop {flag} to continue "
                          "it as it was trained")
    return load(cfg.plan) if cfg.plan is not None else None


def sharded(cfg: Config) -> bool:
    """FSDP2 or HSDP shards this run's model (without tensor or pipeline parallel): its plan is one rank's, applied
    around ``fully_shard`` (:func:`apply_plan` before, :func:`plan_optimizer` after)."""
    p = cfg.parallel
    return p.mode in ("fsdp", "hsdp") and p.tp == 1 and p.pp == 1


def shard_factor(cfg: Config) -> int:
    """Ranks each parameter is sharded over in this run (1: each rank holds the whole model)."""
    return cfg.parallel.dp_shard if sharded(cfg) else 1


def check_plan(plan: Plan, cfg: Config, amp_dtype: torch.dtype) -> None:
    """A saved plan must match this run: its shard factor, its micro-batch (a rank's: ``data.batch_size`` is the
    global one), and bf16 offloaded weights need bf16 autocast."""
    made, now = plan.profile.shard_factor, shard_factor(cfg)
    if made != now:
        what = f"one rank of FSDP2 over {made} shards" if made > 1 else "a model that is not sharded"
        here = f"shards over {now} ranks" if now > 1 else "does not shard the model"
        raise ConfigError(
            f"the plan was made for {what} and this run {here}: its memory is per rank at its own shard factor; "
            f"run it with --parallel.dp_shard {made}, or plan again for this run with --budget"
        )
    dp = max(cfg.parallel.dp_size, 1)
    bsz, seq_len, planned_seq = cfg.data.batch_size // dp, cfg.data.seq_len, plan.profile.seq_len
    if plan.micro_batch != bsz or (planned_seq and not cfg.data.variable_length and planned_seq != seq_len):
        per = f" per rank ({dp} data-parallel ranks)" if dp > 1 else ""
        raise ConfigError(
            f"the plan was made for micro-batches of {plan.micro_batch} x {planned_seq or '?'} tokens and this run's "
            f"are {bsz} x {seq_len}{per}: pass --data.batch_size {plan.micro_batch * dp}"
            + (f" --data.seq_len {planned_seq}" if planned_seq else "")
            + " (--train.gradient_accumulation_steps sets the global batch), or plan again for this batch"
        )
    bf16_offloaded = plan.weight_dtype == "float32" and plan.offload_param_dtype == "bfloat16"
    if bf16_offloaded and plan.offloads_optimizer and amp_dtype != torch.bfloat16:
        raise ConfigError(
            "the plan keeps offloaded weights in bf16 on the device, which needs bf16 autocast: set --train.dtype "
            f"bf16 (it resolves to {str(amp_dtype).removeprefix('torch.')} here)"
        )


def plan_for_budget(
    model: nn.Module, sample: dict[str, Any], cfg: Config, fused_loss: bool, amp_dtype: torch.dtype,
    shared_link: tuple[float, float, float] | None = None, budget: int | None = None,
    beat_seconds: float | None = None, profiles: dict[Any, Any] | None = None,
) -> tuple[nn.Module, torch.optim.Optimizer | None, Plan]:
    """Profile ``model`` on ``sample`` (a training micro-batch), plan it into ``--budget`` (or ``budget`` bytes, a
    re-plan's, below it) and apply the plan. ``shared_link``: the link with every rank of the host copying
    (``DistributedRun.plan_once`` measures it). ``beat_seconds``: a plan that does not predict a shorter step is
    refused before it is applied (:class:`NoFasterPlan`). ``profiles``: the run's earlier tries' measurements, which
    a re-plan plans from (``fit``'s ``profiles``).

    Under FSDP2 the plan is one rank's and only its first half is applied here: the optimizer is None, built after
    sharding (:func:`plan_optimizer`). The budget too small for any plan is a ConfigError whose one line names the
    minimum.
    """
    from elbowroom.plan import BudgetError, fit

    if sharded(cfg):
        return _plan_for_rank(model, sample, cfg, fused_loss, amp_dtype, shared_link)
    # the run's dropout stream must be the one an unplanned run with this seed draws: the profile restores the RNG
    # and the machine's measurement draws from its own generator; this keeps it so whatever planning draws
    rng = torch.get_rng_state()
    try:
        return fit(
            model,
            (sample["input_ids"], sample["targets"]),
            budget=cfg.budget if budget is None else budget,
            optimizer=torch.optim.AdamW,
            precision="bf16" if cfg.optimizer.param_dtype == "bfloat16" else "fp32",
            fused_loss=fused_loss,
            grad_clipping=bool(cfg.train.max_grad_norm),
            # the trainer clips through the optimizer (trainer.clip_gradients): it sees the gradients on the host
            gradient_offload=True,
            persistent_gradients=cfg.parallel.mode == "ddp",  # DDP's buckets keep every gradient, all step long
            ranks_per_host=_ranks_per_host(cfg),  # DDP: they share the host's memory and its optimizer rate
            shared_link=shared_link,  # and perhaps its link
            # the machine's numbers, measured once per machine and torch, beside the corpus cache
            cache_dir=str(cfg.data.cache_dir or default_cache_dir()),
            compute_dtype=amp_dtype,  # the profile runs the step as the training loop will
            offload_config=cfg.offload,
            param_groups=_groups(cfg),
            reentrant=_reentrant(cfg),
            compile=cfg.train.compile,  # priced on the blocks as they will run
            stream=_one_process(cfg),  # DDP's reduced gradients are not measured with it
            host_memory=cfg.host_budget,
            watch=False,  # the trainer's own BudgetWatch reads its logged rows
            before_apply=None if beat_seconds is None else functools.partial(refuse_slower, beat_seconds=beat_seconds),
            profiles=profiles,
            **_adamw_kwargs(cfg),
        )
    except BudgetError as e:
        raise _budget_error(e, cfg) from None
    except ConfigError:
        raise
    except ValueError as e:  # a model the planner cannot read
        raise ConfigError(" ".join(str(e).split())) from None
    finally:
        torch.set_rng_state(rng)


def _reentrant(cfg: Config) -> bool:
    """Whether this run recomputes whole blocks with torch's reentrant checkpoint (less host work per block,
    ``elbowroom.activations.recompute.reentrant_default``): one process, not compiled (DDP, FSDP2 and the
    parallel layouts keep the non-reentrant one, and torch.compile traces only that one)."""
    return _one_process(cfg) and not cfg.train.compile


def _one_process(cfg: Config) -> bool:
    """A plain process: no other rank and no data-parallel wrapper (``--parallel.data_parallel ddp`` or ``fsdp``
    wrap a model at world size 1 too, and DDP refuses what one process may do: streamed optimizer state)."""
    return not cfg.parallel.enabled and cfg.parallel.mode == "single"


def _plan_for_rank(model: nn.Module, sample: dict[str, Any], cfg: Config, fused_loss: bool,
                   amp_dtype: torch.dtype, shared_link: tuple[float, float, float] | None = None
                   ) -> tuple[nn.Module, None, Plan]:
    """``--budget`` under FSDP2: the whole model profiled (before ``fully_shard``, leaving nothing behind), its
    per-rank profile planned, the plan's policies installed; the optimizer comes after sharding."""
    from elbowroom.distributed.data_parallel import root_apart_share
    from elbowroom.plan import BudgetError, parse_budget, plan_for, profile
    from elbowroom.plan.apply import install
    from elbowroom.plan.fit import planned_compile_options
    from elbowroom.plan.ranks import as_fsdp_computes, per_rank_profile, with_host_memory

    rng = torch.get_rng_state()  # as in plan_for_budget: the run's dropout stream stays an unplanned run's
    try:
        # priced on the blocks as they will run (trainer.compile_model compiles a planned model so)
        compiled = planned_compile_options() if cfg.train.compile else False
        whole = profile(model, (sample["input_ids"], sample["targets"]), cache_dir=str(cfg.data.cache_dir or
                        default_cache_dir()), dtype=amp_dtype, reentrant=False, compiled=compiled)
        whole = as_fsdp_computes(model, (sample["input_ids"], sample["targets"]), whole, amp_dtype, compiled)
        rank = per_rank_profile(whole, cfg.parallel.dp_shard, accumulation=cfg.train.gradient_accumulation_steps,
                                ranks_per_host=_ranks_per_host(cfg), link=shared_link,
                                root_apart=root_apart_share(model), prefetch=cfg.parallel.fsdp_prefetch)
        if cfg.host_budget is not None:  # this rank's host memory
            rank = with_host_memory(rank, parse_budget(cfg.host_budget))
        # FSDP2 shards fp32 weights (cast to --train.dtype by its MixedPrecisionPolicy) or, where
        # --optimizer.param_dtype bfloat16 allows, bf16 weights with fp32 masters; no bf16 device copies of fp32
        # shards
        plan = plan_for(rank, parse_budget(cfg.budget), fused_loss_allowed=fused_loss,
                        precision="bf16" if cfg.optimizer.param_dtype == "bfloat16" else "fp32",
                        weight_layouts=("fp32", "bf16"), grad_clipping=bool(cfg.train.max_grad_norm),
                        gradient_offload_allowed=True, offload_config=cfg.offload,
                        stream_allowed=False)  # (the optimizer streams whole parameters, not FSDP2's shards)
        plan = replace(plan, notes=(*plan.notes, _FSDP_TIME_NOTE))
    except BudgetError as e:
        raise _budget_error(e, cfg) from None
    except ValueError as e:
        raise ConfigError(" ".join(str(e).split())) from None
    finally:
        torch.set_rng_state(rng)
    install(model, plan, reentrant=False)
    log.info("%s", plan.table())
    return model, None, plan


_FSDP_TIME_NOTE = "one rank's plan under FSDP2: the predicted step leaves out FSDP2's all-gathers and reduce-scatters"


def shared_link_for(cfg: Config, device: torch.device) -> tuple[float, float, float] | None:
    """The link's rates with every rank copying at once, when several ranks share this host's GPUs and the run
    plans (a collective: every rank calls it); None on one process, without CUDA, or without ``--budget``."""
    if cfg.budget is None or _ranks_per_host(cfg) < 2 or device.type != "cuda":
        return None
    from elbowroom.plan.machine import measure_shared_link

    return measure_shared_link(device)


def _ranks_per_host(cfg: Config) -> int:
    """Ranks sharing this host's memory: one per GPU of the host (at most the world), every rank on a CPU."""
    world = cfg.parallel.world_size
    return max(1, min(world, torch.cuda.device_count())) if torch.cuda.is_available() else world


def _budget_error(e: Any, cfg: Config) -> ConfigError:
    """The planner's BudgetError in the trainer's terms: its hints as flags, the minimum in bytes (a small model's
    needs finer units than its GiB), per rank under FSDP2."""
    # the planner's hints name fit()'s arguments; a trainer user has flags, and some data parallel refuses
    text = e.reworded(_CLI_HINTS, _NOT_UNDER_DATA_PARALLEL if cfg.parallel.mode != "single" else ())
    least = f"{e.minimum_bytes:,} bytes: pass --budget {_size_at_least(e.minimum_bytes)} or more"
    if sharded(cfg):
        return ConfigError(f"--budget is one rank's memory under FSDP2 over {shard_factor(cfg)} shards: {text}; the "
                           f"minimum per rank is {least}")
    return ConfigError(f"{text}; the minimum is {least}")


_CLI_HINTS = {
    "global_batch= lets the planner split the batch into micro-batches":
        "a smaller --data.batch_size with more --train.gradient_accumulation_steps lowers it",
    "precision='bf16' allows bf16 device weights": "--optimizer.param_dtype bfloat16 allows bf16 device weights",
    "fused_loss=True (elbowroom.linear_cross_entropy) shrinks the head and loss":
        "--train.fused_loss true shrinks the head and loss",
    "(elbowroom plan --host-memory)": "",
}
"""The BudgetError hints in the trainer's terms."""

_NOT_UNDER_DATA_PARALLEL = ("--optimizer.param_dtype bfloat16 allows bf16 device weights",)
"""Hints of flags that data parallel refuses (check_setup): left out of its BudgetError."""


def _size_at_least(n: int) -> str:
    """``n`` bytes rounded up to two decimals of the largest binary unit it fills, as --budget reads it."""
    for unit, size in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= size:
            return f"{math.ceil(n * 100 / size) / 100:g}{unit}"
    return f"{n}B"


def apply_plan(model: nn.Module, plan: Plan, cfg: Config) -> tuple[nn.Module, torch.optim.Optimizer | None]:
    """Make ``model`` follow a saved plan and build its optimizer (the plan's table is logged). Under FSDP2 only the
    plan's policies: the optimizer is None, built over the shards by :func:`plan_optimizer`."""
    from elbowroom.plan import apply
    from elbowroom.plan.apply import install

    if sharded(cfg):
        try:
            install(model, plan, reentrant=False)
        except ValueError as e:
            raise ConfigError(str(e)) from None
        log.info("%s", plan.table())
        return model, None
    try:
        model, optimizer = apply(model, plan, torch.optim.AdamW, offload_config=cfg.offload, param_groups=_groups(cfg),
                                 reentrant=_reentrant(cfg), **_adamw_kwargs(cfg))
    except ValueError as e:  # a plan for another model: its block count differs
        raise ConfigError(str(e)) from None
    log.info("%s", plan.table())
    return model, optimizer


def plan_optimizer(model: nn.Module, plan: Plan, cfg: Config, overlap_forward: bool = False) -> Any:
    """The plan's optimizer over ``model``'s parameters as they are now (under FSDP2: after ``fully_shard``, so that
    its host parameters are the local shards of the blocks the plan puts on the host)."""
    from elbowroom.plan.apply import build_optimizer

    return build_optimizer(model, plan, torch.optim.AdamW, offload_config=cfg.offload, param_groups=_groups(cfg),
                           overlap_with_forward=overlap_forward, **_adamw_kwargs(cfg))


REPLAN_FACTOR = 0.9
"""After an out-of-memory in the first steps, the budget is planned again at this share of the last one."""

def cap_memory(plan: Any, device: torch.device, limit: int | None = None) -> bool:
    """Cap this process's CUDA allocator at ``limit`` bytes, else at ``plan``'s budget
    (``torch.cuda.set_per_process_memory_fraction``), as on a device of that size; whether a cap was set (none on
    CPU, without a plan, or for a budget as large as the device). The trainer's limit is ``--budget``, also for a
    plan made again below it (:func:`with_replans`). Uncapped, the allocator grows past a budget its plan fits in
    allocated bytes: W1 at 8 GiB in the trainer reserved 8.37 GiB for 5.98 allocated, where capped runs of the same
    plan reserved 6.9-7.7 with no retry (``BENCHMARKS.md``, thirteenth session). :func:`uncap_memory` undoes it."""
    budget = getattr(plan, "budget_bytes", None) if limit is None else limit
    if plan is None or budget is None or device.type != "cuda":
        return False
    index = _index(device)
    total = torch.cuda.get_device_properties(index).total_memory
    if budget >= total:
        return False
    torch.cuda.set_per_process_memory_fraction(budget / total, index)
    return True


def budget_limit(cfg: Config) -> int | None:
    """``--budget`` in bytes, the limit a one-process run's allocator is capped at (:func:`cap_memory`) and its
    reserved peak is watched against, whatever budget its plan was made for; None without one."""
    from elbowroom.plan import parse_budget

    return parse_budget(cfg.budget) if cfg.budget is not None else None


def uncap_memory(device: torch.device) -> None:
    """Lift :func:`cap_memory`'s cap (the next plan profiles, and the process's later work runs, uncapped)."""
    torch.cuda.set_per_process_memory_fraction(1.0, _index(device))


def _index(device: torch.device) -> int:
    """The CUDA device's index (``cuda`` alone: the current device)."""
    return device.index if device.index is not None else torch.cuda.current_device()


MAX_REPLANS = 2
"""Re-plans (after an out-of-memory, or retries, in the first steps) before the run fails as any run does."""


class EarlyOutOfMemory(Exception):
    """A step of a run planned for ``--budget`` ran out of memory before anything was checkpointed (by
    :data:`RETRY_REPLAN_STEPS`); ``started``: steps had finished and logged (the run directory exists)."""

    def __init__(self, out: Path, budget_bytes: int, message: str, started: bool = False) -> None:
        super().__init__(message)
        self.out, self.budget_bytes, self.message, self.started = out, budget_bytes, message, started


def _free_failed_try(e: BaseException) -> None:
    """Free the failed try's model, optimizer and device memory before the next plan profiles: let go of its frames,
    which the exception's traceback and the error it replaced keep alive while the trainer handles it, then
    collect and empty the CUDA cache."""
    import gc

    e.__traceback__, e.__context__, e.__cause__ = None, None, None
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


RETRY_REPLAN_STEPS = 50
"""A planned run whose allocator keeps retrying at its cap, its steps running slow (``BudgetWatch.keeps_retrying``),
by this step and before any checkpoint, is planned again for the lower budget ``BudgetWatch.lower_budget`` names and
started over (:func:`replan_after_retries`)."""


def may_start_over(cfg: Config, step: int) -> bool:
    """Whether a run planned here may still be planned again and started over after ``step`` finished steps: by
    :data:`RETRY_REPLAN_STEPS` and before its first checkpoint."""
    saved = cfg.checkpoint.enabled and cfg.checkpoint.every and step >= cfg.checkpoint.every
    return step <= RETRY_REPLAN_STEPS and not saved


class EarlyStepsRetrying(Exception):
    """The first steps of a run planned for ``--budget`` kept the allocator retrying at its cap (each retry waits
    for all the device's work): the plan fits in allocated bytes but not in what its steps hold. Nothing was
    checkpointed yet; the logged rows move aside when the run starts over."""

    def __init__(self, out: Path, plan: Plan, lower_bytes: int, message: str, step_seconds: float) -> None:
        super().__init__(message)
        self.out, self.plan, self.lower_bytes, self.message = out, plan, lower_bytes, message
        self.step_seconds = step_seconds  # the retrying steps' median: what the plan for less must beat


@dataclass(frozen=True)
class Try:
    """How :func:`with_replans` asks for one try of a run."""

    may_replan: bool = False
    """An early out-of-memory or retries may plan this run again (:class:`EarlyOutOfMemory`,
    :class:`EarlyStepsRetrying`)."""
    rewind_metrics: bool = False
    """An earlier try logged rows: they move aside (``metrics.rewound-0.jsonl``)."""
    plan_budget: int | None = None
    """The bytes to plan for, below ``--budget`` (None: ``--budget``); the allocator stays capped at ``--budget``."""
    beat_seconds: float | None = None
    """A plan made again after retries must predict a step faster than this, the retrying steps' median, or the run
    goes back to the plan that retried (:class:`NoFasterPlan`)."""
    plan: Plan | None = None
    """The plan to train under, as ``--plan`` gives one: the plan that retried, gone back to (no re-plan)."""
    profiles: dict[Any, Any] = field(default_factory=dict, compare=False)
    """The profiles the run's tries measured, one dict through them all: a re-plan plans from the first try's
    measurement (``fit``'s ``profiles``), not measuring the model again."""


class NoFasterPlan(ConfigError):
    """The plan for less memory than a retrying plan's predicts no faster step than that plan ran, retries and all:
    the run goes back to the plan that retried (:func:`with_replans`). On the 7B shape (H200, ``BENCHMARKS.md``
    twenty-sixth session) the 76 GiB plan's first steps retried once a step at 0.79-0.80 s, the plan for 72.2 GiB
    predicted 0.79-0.81 s, and the run went back to the 76 GiB plan (0.745-0.76 s a step); at 72 GiB the planner
    falls from fp32 to bf16 weights with 29 selective blocks (in the bench: 0.92 s predicted, 0.90 run)."""


def refuse_slower(plan: Plan, beat_seconds: float) -> None:
    """Refuse ``plan`` (:class:`NoFasterPlan`) unless it predicts a step shorter than ``beat_seconds``."""
    if plan.predicted_step_seconds >= beat_seconds:
        raise NoFasterPlan(f"the plan for {plan.budget_bytes / 2**30:.2f} GiB predicts "
                           f"{plan.predicted_step_seconds:.3f} s a step, no faster than the {beat_seconds:.3f} s the "
                           "plan that retried ran")


def replan_after_retries(e: EarlyStepsRetrying) -> int:
    """The budget to plan the run again for, the lower one the retries asked for, with a warning. As after an early
    out-of-memory (:func:`replan_after_oom`) the run starts over from its seed; the rows the first try logged move
    to ``metrics.rewound-0.jsonl`` (the trainer opens the log rewound to step 0), so that ``metrics.jsonl`` holds
    one curve. The allocator stays capped at ``--budget``: the plan for less leaves the room its mechanisms hold
    beyond its tensors. Measured on the 7B shape (H200, ``BENCHMARKS.md`` twenty-fifth session): its 76 GiB plan
    retried 9-37 times in 10 steps at 1.28-1.51x its prediction, a plan for 72 GiB under the same cap never, at
    0.96x, reserving 74.5 GiB (capped at 72.2 GiB as well, a re-plan ran out of memory: twenty-sixth session)."""
    log.warning("the first steps kept the allocator retrying at the budget of %s (%s): planning again for %s and "
                "starting over, the allocator still capped at --budget", _size_at_least(e.plan.budget_bytes), e.message,
                _size_at_least(e.lower_bytes))
    _free_failed_try(e)
    return e.lower_bytes


def with_replans(cfg: Config, train_once: Callable[[Config, Try], T]) -> T:
    """``train_once(cfg, attempt)`` until a try ends without asking to be planned again (:class:`Try`). The
    allocator's cap stays at ``--budget`` and the run's config says ``--budget``; its plan file says the budget it
    was planned for.

    An out-of-memory in the first steps (:class:`EarlyOutOfMemory`) plans again for a tighter budget
    (:func:`replan_after_oom`); first steps that keep the allocator retrying (:class:`EarlyStepsRetrying`) plan again
    for the lower budget they name (:func:`replan_after_retries`); a try after one that logged rewinds the log those
    steps wrote. At most :data:`MAX_REPLANS` re-plans; the last try fails as any run does (an out-of-memory with its
    report, what was live against the plan). Where the plan for less is not to be had (a ``ConfigError`` from its
    planning: below the run's minimum, or :class:`NoFasterPlan`), the plan that retried trains after all, as it
    was (not profiled and planned again), without another re-plan.
    """
    attempt, retried = Try(), None  # retried: the plan whose steps kept the allocator retrying
    for replans in itertools.count():
        settled = attempt.plan is not None  # back to the plan that retried: no other re-plan
        attempt = replace(attempt, may_replan=replans < MAX_REPLANS and not settled)
        try:
            return train_once(cfg, attempt)
        except EarlyOutOfMemory as e:
            attempt = Try(plan_budget=replan_after_oom(e), rewind_metrics=attempt.rewind_metrics or e.started,
                          profiles=attempt.profiles)
        except EarlyStepsRetrying as e:
            retried = e.plan
            attempt = Try(plan_budget=replan_after_retries(e), rewind_metrics=True, beat_seconds=e.step_seconds,
                          profiles=attempt.profiles)
        except ConfigError as e:
            if retried is None or settled:
                raise
            log.warning("%s; training under the plan that retried (for %s) after all", e,
                        _size_at_least(retried.budget_bytes))
            _free_failed_try(e)
            attempt = Try(plan=retried, rewind_metrics=True)


def replan_after_oom(e: EarlyOutOfMemory) -> int:
    """The budget to plan the run again for, a tighter one (a wider margin for what the plan did not foresee),
    with a warning; the allocator stays capped at ``--budget``. The trainer asks at most :data:`MAX_REPLANS` times;
    after that the run fails with the out-of-memory error and its report, as any run does.

    The run starts over from its seed (model, data position, RNG): nothing was checkpointed, and the run that
    follows is the one a user would get with the tighter plan (the rows of steps that had finished move aside, as
    after retries). The run directory keeps its name.
    """
    tighter = int(e.budget_bytes * REPLAN_FACTOR)
    log.warning("%s ran out of memory under the plan for %s (%s): planning again for %s and starting over",
                "an early step" if e.started else "the first step", _size_at_least(e.budget_bytes), e.message,
                _size_at_least(tighter))
    _free_failed_try(e)
    return tighter
