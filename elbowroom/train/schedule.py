"""Learning-rate schedules: linear warmup + cosine, OneCycle, constant."""

from __future__ import annotations

import math

import torch
from torch.optim.lr_scheduler import LambdaLR, LRScheduler, OneCycleLR


def warmup_cosine(step: int, *, warmup: int, total: int, min_ratio: float) -> float:
    """LR multiplier at ``step`` (0-based count of finished optimizer steps)."""
    if warmup and step < warmup:
        return (step + 1) / warmup
    if total <= warmup:
        return 1.0
    progress = min(1.0, (step - warmup) / max(1, total - warmup))
    return min_ratio + (1.0 - min_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))


def warmup_constant(step: int, *, warmup: int) -> float:
    return (step + 1) / warmup if warmup and step < warmup else 1.0


def build_scheduler(
    optimizer: torch.optim.Optimizer, name: str, *, total_steps: int, warmup_steps: int, min_lr_ratio: float
) -> LRScheduler:
    """The schedule ``name`` over ``total_steps`` optimizer steps; call ``.step()`` after each one.

    Args:
        optimizer: the optimizer whose ``param_groups[i]["lr"]`` hold the peak LR.
        name: "cosine", "onecycle" or "constant".
        total_steps: optimizer steps of the whole run.
        warmup_steps: steps of linear warmup (onecycle: its rising phase).
        min_lr_ratio: final LR over peak LR for cosine.

    Returns:
        A torch LR scheduler (its ``state_dict`` goes into checkpoints).
    """
    total = max(1, total_steps)
    if name == "cosine":
        return LambdaLR(
            optimizer,
            lambda s: warmup_cosine(s, warmup=warmup_steps, total=total, min_ratio=min_lr_ratio),
        )
    if name == "constant":
        return LambdaLR(optimizer, lambda s: warmup_constant(s, warmup=warmup_steps))
    if name == "onecycle":
        max_lrs = [g["lr"] for g in optimizer.param_groups]
        pct = min(0.5, max(warmup_steps / total, 1.0 / total))
        # OneCycle steps total+1 times at most; one spare step keeps the last .step() legal.
        return OneCycleLR(optimizer, max_lr=max_lrs, total_steps=total + 1, pct_start=pct, cycle_momentum=False)
    raise ValueError(f"unknown schedule {name!r}; choose cosine, onecycle or constant")


def sync_lr(scheduler: LRScheduler) -> None:
    """Set each group's LR to what ``scheduler`` gives at its current step.

    A LambdaLR rebuilt with another length and then given an older ``state_dict`` keeps the optimizer's
    saved LR for one step; this makes the next step use the new curve at once.
    """
    if not isinstance(scheduler, LambdaLR):
        return
    step = scheduler.last_epoch
    lrs = [base * fn(step) for base, fn in zip(scheduler.base_lrs, scheduler.lr_lambdas)]
    for group, lr in zip(scheduler.optimizer.param_groups, lrs):
        group["lr"] = lr
    scheduler._last_lr = lrs  # what get_last_lr() reports
