"""The trainer's planned runs: plan under ``--budget``, load ``--plan FILE``, follow the run's own plan on resume.

The planner itself is ``elbowroom.plan``; this module decides which plan a run follows and applies it to the
trainer's model and optimizer settings.
"""

from __future__ import annotations

import logging
import math
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.nn as nn

from elbowroom.config import Config, ConfigError, memory_overrides
from elbowroom.train.tokens import default_cache_dir

if TYPE_CHECKING:
    from elbowroom.plan import Plan

log = logging.getLogger("elbowroom.train")

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
    except (ValueError, TypeError, OSError) as e:  # Plan.load's messages name the file and the field
        raise ConfigError(f"{e}; fix the plan file or plan again with `elbowroom plan`") from None


def plan_to_follow(cfg: Config, out: Path) -> Plan | None:
    """The saved plan this run applies: on ``--resume`` the run's own ``OUT/plan.toml`` (the layout its checkpoint
    was trained with), else ``--plan FILE``; None when there is none (a ``--budget`` run plans once it has a model).
    """
    from elbowroom.plan import parse_budget

    saved = out / PLAN_FILE
    if cfg.resume and saved.is_file():
        plan = load_plan(saved)
        overrides = memory_overrides(cfg)
        if overrides:
            raise ConfigError(f"{out} was trained under its plan {saved}, which decides these; drop "
                              f"{', '.join(overrides)} to resume it")
        if cfg.plan is not None and load_plan(cfg.plan) != plan:
            raise ConfigError(f"--resume continues under the run's own plan {saved}; drop --plan {cfg.plan}")
        if cfg.budget is not None and parse_budget(cfg.budget) != plan.budget_bytes:
            log.warning("--budget %s differs from the %d bytes the run was planned for; resuming under its plan "
                        "(start a new run to plan for the new budget)", cfg.budget, plan.budget_bytes)
        log.info("resuming under the run's plan %s (not planning again)", saved)
        return plan
    if cfg.resume and (cfg.budget is not None or cfg.plan is not None):
        flag = "--budget" if cfg.budget is not None else "--plan"
        raise ConfigError(f"--resume: {out} was trained without a plan (no {saved.name}); drop {flag} to continue "
                          "it as it was trained")
    return load_plan(cfg.plan) if cfg.plan is not None else None


def check_plan(plan: Plan, cfg: Config, amp_dtype: torch.dtype) -> None:
    """A saved plan must match this run: its micro-batch, and bf16 offloaded weights need bf16 autocast."""
    bsz, seq_len, planned_seq = cfg.data.batch_size, cfg.data.seq_len, plan.profile.seq_len
    if plan.micro_batch != bsz or (planned_seq and not cfg.data.variable_length and planned_seq != seq_len):
        raise ConfigError(
            f"the plan was made for micro-batches of {plan.micro_batch} x {planned_seq or '?'} tokens and this run's "
            f"are {bsz} x {seq_len}: pass --data.batch_size {plan.micro_batch}"
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
    model: nn.Module, sample: dict[str, Any], cfg: Config, fused_loss: bool, amp_dtype: torch.dtype
) -> tuple[nn.Module, torch.optim.Optimizer, Plan]:
    """Profile ``model`` on ``sample`` (a training micro-batch), plan it into ``--budget`` and apply the plan.

    The budget too small for any plan is a ConfigError whose one line names the minimum.
    """
    from elbowroom.plan import BudgetError, fit

    # measuring the machine draws random matrices from the global RNG (the profile itself restores it): the
    # run's dropout stream must be the one an unplanned run with this seed draws
    rng = torch.get_rng_state()
    try:
        return fit(
            model,
            (sample["input_ids"], sample["targets"]),
            budget=cfg.budget,
            optimizer=torch.optim.AdamW,
            precision="bf16" if cfg.optimizer.param_dtype == "bfloat16" else "fp32",
            fused_loss=fused_loss,
            grad_clipping=bool(cfg.train.max_grad_norm),
            # the machine's numbers, measured once per machine and torch, beside the corpus cache
            cache_dir=str(cfg.data.cache_dir or default_cache_dir()),
            compute_dtype=amp_dtype,  # the profile runs the step as the training loop will
            offload_config=cfg.offload,
            param_groups=_groups(cfg),
            **_adamw_kwargs(cfg),
        )
    except BudgetError as e:  # its message names the minimum in GiB; a small model's needs finer units
        text = " ".join(str(e).split())
        for api, flag in _CLI_HINTS.items():  # the planner's hints name fit()'s arguments; a trainer user has flags
            text = text.replace(api, flag)
        raise ConfigError(
            f"{text}; the minimum is {e.minimum_bytes:,} bytes: pass --budget {_size_at_least(e.minimum_bytes)} "
            "or more"
        ) from None
    except ValueError as e:  # a model the planner cannot read
        raise ConfigError(" ".join(str(e).split())) from None
    finally:
        torch.set_rng_state(rng)


_CLI_HINTS = {
    "global_batch= lets the planner split the batch into micro-batches":
        "a smaller --data.batch_size with more --train.gradient_accumulation_steps lowers it",
    "precision='bf16' allows bf16 device weights": "--optimizer.param_dtype bfloat16 allows bf16 device weights",
    "fused_loss_allowed=True (elbowroom.linear_cross_entropy) shrinks the head and loss":
        "--train.fused_loss true shrinks the head and loss",
    "(elbowroom plan --host-memory)": "",
}
"""The BudgetError hints in the trainer's terms."""


def _size_at_least(n: int) -> str:
    """``n`` bytes rounded up to two decimals of the largest binary unit it fills, as --budget reads it."""
    for unit, size in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= size:
            return f"{math.ceil(n * 100 / size) / 100:g}{unit}"
    return f"{n}B"


def apply_plan(model: nn.Module, plan: Plan, cfg: Config) -> tuple[nn.Module, torch.optim.Optimizer]:
    """Make ``model`` follow a saved plan and build its optimizer (the plan's table is logged)."""
    from elbowroom.plan import apply

    try:
        model, optimizer = apply(model, plan, torch.optim.AdamW, offload_config=cfg.offload, param_groups=_groups(cfg),
                                 **_adamw_kwargs(cfg))
    except ValueError as e:  # a plan for another model: its block count differs
        raise ConfigError(str(e)) from None
    log.info("%s", plan.table())
    return model, optimizer


def per_rank_profile(profile: Any, shard_factor: int) -> Any:
    """The profile one rank plans under FSDP2 sharding over ``shard_factor`` ranks: the seam for ``--budget``
    under data parallel.

    Each rank holds ``1 / shard_factor`` of every parameter, of its gradient and of its optimizer state, so the
    blocks' and the head's parameter counts and bytes are divided (rounded up: FSDP2 pads the last shard); the
    activations are those of the rank's own micro-batch, which the profile already measured. Under DDP the
    factor is 1 (every rank holds everything). Not counted yet (so the trainer refuses ``--budget`` under
    FSDP2 for now): the all-gathered parameters of the block in flight and the next one prefetched, and the
    reduce-scatter buffers.

    Args:
        profile: an ``elbowroom.plan.Profile`` of one rank's micro-batch.
        shard_factor: ranks each parameter is sharded over (``parallel.dp_shard``).

    Returns:
        The per-rank profile (a new frozen object).
    """
    import dataclasses

    if shard_factor < 1:
        raise ValueError(f"shard_factor must be >= 1, got {shard_factor}")
    if shard_factor == 1:
        return profile

    def shard(n: int) -> int:
        return -(-n // shard_factor)

    blocks = tuple(dataclasses.replace(b, num_params=shard(b.num_params), param_bytes=shard(b.param_bytes))
                   for b in profile.blocks)
    head = dataclasses.replace(profile.head, num_params=shard(profile.head.num_params),
                               param_bytes=shard(profile.head.param_bytes))
    return dataclasses.replace(profile, blocks=blocks, head=head)


REPLAN_FACTOR = 0.9
"""After an out-of-memory in the first step, the budget is planned again at this share of the last one."""

MAX_REPLANS = 2
"""Re-plans after an out-of-memory in the first step before the run fails with it."""


class FirstStepOutOfMemory(Exception):
    """The first step of a run planned for ``--budget`` ran out of memory, before anything was written."""

    def __init__(self, out: Path, budget_bytes: int, message: str) -> None:
        super().__init__(message)
        self.out, self.budget_bytes, self.message = out, budget_bytes, message


def replan_after_oom(cfg: Config, e: FirstStepOutOfMemory) -> Config:
    """The config of the run started over with a tighter budget (a wider margin for what the plan did not
    foresee), with a warning. The trainer asks at most :data:`MAX_REPLANS` times; after that the run fails with
    the out-of-memory error and its report, as any run does.

    The run starts over from its seed (model, data position, RNG): its first step never finished, so nothing
    was trained and nothing was written, and the run that follows is the one a user would get with the tighter
    budget. The run directory keeps its name.
    """
    import gc

    tighter = int(e.budget_bytes * REPLAN_FACTOR)
    log.warning("the first step ran out of memory under the plan for %s (%s): planning again for %s and starting "
                "over", _size_at_least(e.budget_bytes), e.message, _size_at_least(tighter))
    gc.collect()  # the failed step's model and optimizer, before the new plan profiles
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return replace(cfg, out=str(e.out), budget=str(tighter))
