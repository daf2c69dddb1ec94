"""What a budget below every plan is told: :class:`BudgetError`, whose one message names the minimum, what it consists
of and the ways out (the optimizer on the host, bf16 weights, the fused loss, micro-batches, more host memory), in
sizes written so that a budget just under the minimum reads below it.

The search (:mod:`elbowroom.plan.search`) finds the minimum and its parts; this module turns them into the error,
and prices the allocator's share of a minimum (:func:`min_budget`, :func:`margin_part`).
"""

from __future__ import annotations

import math
from dataclasses import replace
from typing import Any

from elbowroom.plan import cost
from elbowroom.plan.cost import Decisions, Option
from elbowroom.plan.types import Profile

__all__ = ["FUSED_LOSS_HINT", "BudgetError", "budget_error", "min_budget", "size_text"]


FUSED_LOSS_HINT = "fused_loss=True (elbowroom.linear_cross_entropy) shrinks the head and loss"
"""The hint a BudgetError gives where the fused head and loss was not allowed, in ``fit``'s terms (its keyword)."""
_RENAMED_HINTS = {"fused_loss_allowed=True (elbowroom.linear_cross_entropy) shrinks the head and loss":
                  FUSED_LOSS_HINT}
"""Hints as they read before, which front ends' mappings may still name: :meth:`BudgetError.reworded` reads them
as the hints that replaced them."""


class BudgetError(ValueError):
    """The budget is below what any plan needs; the message names the minimum and what dominates it."""

    def __init__(self, message: str, minimum_bytes: int) -> None:
        super().__init__(message)
        self.minimum_bytes = minimum_bytes

    def reworded(self, names: dict[str, str], refused: tuple[str, ...] = ()) -> str:
        """The message on one line in a front end's terms: its hints name ``fit``'s arguments, ``names`` maps each
        hint to the front end's wording, and the reworded hints in ``refused`` (settings that front end refuses
        here) are left out, since they are no way out."""
        text = " ".join(str(self).split())
        for api, flag in names.items():
            text = text.replace(_RENAMED_HINTS.get(api, api), flag)
        for hint in refused:
            text = text.replace(f"; {hint}", "").replace(f"{hint}; ", "").replace(hint, "")
        return " ".join(text.replace(" ()", "").split())  # (a hint mapped to "" leaves two spaces)


def size_text(n: float, digits: int = 1) -> str:
    """Bytes in the unit that shows them: GiB from 0.1 GiB, else MiB (a small model's "0.0 GiB" says nothing)."""
    if n >= 0.1 * 2**30:
        return f"{n / 2**30:.{digits}f} GiB"
    if n >= 0.1 * 2**20:
        return f"{n / 2**20:.{digits}f} MiB"
    if n <= 0:
        return "0 B"
    return f"{n / 2**10:.{digits}f} KiB"


def sizes_apart(a: float, b: float) -> tuple[str, str]:
    """``a`` and ``b`` as :func:`size_text` writes them, with as many decimals as it takes to tell them apart (a budget
    0.4% below its minimum read "budget 2.6 MiB is below the minimum 2.6 MiB"), in bytes past three."""
    for digits in (1, 2, 3):
        if size_text(a, digits) != size_text(b, digits):
            return size_text(a, digits), size_text(b, digits)
    return f"{a:,.0f} bytes", f"{b:,.0f} bytes"


WAITING = "offloaded gradients waiting for their copy"
"""The breakdown's name for :func:`cost.gradient_backlog_bytes` (``offload_gradients``)."""


def margin_part(profile: Profile, need: float, minimum: int, expandable: bool | None) -> dict[str, int]:
    """The allocator's share of the minimum (the budget above ``need``), named by where it comes from, so that the
    BudgetError's parts add up to the minimum it names."""
    measured = cost.measured_margin(profile, expandable) > 0
    name = ("allocator margin (measured: reserved beyond allocated over the profile's steps)" if measured
            else "allocator margin (a share of the budget)")
    return {name: max(0, int(minimum - need))}


def min_budget(profile: Profile, need: float, expandable: bool | None) -> int:
    """The smallest budget whose usable part (after the allocator's margin) holds ``need`` bytes."""
    got = cost.measured_margin(profile, expandable)
    if got > 0:
        return int(math.ceil(need + got))
    frac = cost.ALLOCATOR_MARGIN["expandable_segments" if expandable else "default"]
    b = int(math.ceil(need / (1.0 - frac)))
    while b - int(frac * b) < need:
        b += 1
    return b + 1


def budget_error(
    profile: Profile,
    budget: int,
    minimum: tuple[int, Any, dict[str, int]] | None,
    precision: str,
    layouts: list[str],
    opt_ok: bool,
    global_batch: int | None,
    fused_allowed: bool,
    offload_config: Any = None,
    *,
    unhosted: tuple[int, int] | None = None,
    usable: int | None = None,
) -> BudgetError:
    """The error for ``budget``: the model states by placement, the smallest plan's parts (``minimum``: its budget,
    the search's outer choice, whose ``micro_batch`` it names, and the parts), and the hints that lower the minimum
    (``unhosted``: the minimum and the host memory it needs without the host's limit; ``usable``: the device's
    memory where the budget is above it)."""
    n = len(profile.blocks)
    all_dev = Decisions(offload_config=offload_config, options=(Option(),) * n, offload_blocks=(False,) * n)
    parts = [f"model states need {size_text(cost.state_bytes(profile, all_dev))} in fp32 AdamW"]
    if opt_ok:
        host = replace(all_dev, offload_blocks=(True,) * n, offload_other=True)
        parts.append(f"with the optimizer on the host: {size_text(cost.state_bytes(profile, host))}")
        if "bf16" in layouts:
            bf16 = cost.state_bytes(profile, replace(host, layout="bf16"))
            parts.append(f"and bf16 device weights: {size_text(bf16)}")
    host = profile.machine.host_memory_bytes
    hints = []
    if unhosted is not None and host > 0 and unhosted[0] < (minimum[0] if minimum is not None else math.inf):
        whole = cost.globals_for(profile, replace(all_dev, offload_blocks=(True,) * n, offload_other=True)).host_bytes
        limit = (f"cannot hold the whole optimizer ({size_text(whole)}), which limits the offload"
                 if opt_ok and whole > host else "limits the offload")
        hints.append(f"the host's {size_text(host)} {limit}: a host with {size_text(unhosted[1])} of memory "
                     f"(elbowroom plan --host-memory) lowers the minimum to {size_text(unhosted[0])}")
    if minimum is None:
        msg = f"no plan fits the host memory of {profile.machine.name}; " + "; ".join(parts)
        return BudgetError(msg + (" (" + "; ".join(hints) + ")" if hints else ""), 0)
    low, outer, comp = minimum
    top = max(comp, key=lambda k: comp[k])
    parts.append("the smallest plan: " + ", ".join(f"{k} {size_text(v)}" for k, v in comp.items())
                 + f" (micro-batch {outer.micro_batch}; {top} dominate)")
    if comp.get(WAITING):
        parts.append(f"the {WAITING} grow as the micro-batch's backward shortens, which hides less of the copy")
    if precision == "fp32" and profile.compute_dtype in ("bfloat16", "float16") and opt_ok:
        hints.append("precision='bf16' allows bf16 device weights")
    if not fused_allowed:
        hints.append(FUSED_LOSS_HINT)
    if global_batch is None and profile.micro_batch > 1:
        hints.append("global_batch= lets the planner split the batch into micro-batches")
    if usable is not None and usable < budget:  # planned for the device's memory (plan_for's note)
        usable_text, low_text = sizes_apart(usable, low)
        msg = (f"budget {size_text(budget)} is above the {usable_text} of {profile.machine.name}, which is below the "
               f"minimum {low_text}: " + "; ".join(parts))
    else:
        budget_text, low_text = sizes_apart(budget, low)
        msg = f"budget {budget_text} is below the minimum {low_text}: " + "; ".join(parts)
    if hints:
        msg += " (" + "; ".join(hints) + ")"
    return BudgetError(msg, low)
