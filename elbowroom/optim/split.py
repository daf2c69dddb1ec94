"""Which parameters to offload: pick a byte fraction from the end (or the start) of the parameter order.

Backward produces the gradients of the last blocks first and the next forward needs their weights last,
so offloading the *last* parameters gives their CPU step the most time to hide behind device work;
offloading the first ones (Megatron's default) puts the CPU step on the critical path.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

__all__ = ["first_fraction", "last_fraction"]


def _take(params: list[torch.Tensor], fraction: float) -> list[torch.Tensor]:
    if not 0.0 <= fraction <= 1.0:
        raise ValueError(f"fraction must be in [0, 1], got {fraction}")
    trainable = [p for p in params if p.requires_grad]
    limit = fraction * sum(p.numel() * p.element_size() for p in trainable)
    out, taken = [], 0
    for p in trainable:
        if taken >= limit:
            break
        out.append(p)
        taken += p.numel() * p.element_size()
    return out


def last_fraction(params: Iterable[torch.Tensor], fraction: float) -> list[torch.Tensor]:
    """The trainable parameters making up the last ``fraction`` of the bytes, in parameter order.

    Args:
        params: parameters in the order the model registers them (``model.parameters()``).
        fraction: share of the trainable bytes to return, in [0, 1]; the parameter that crosses the
            boundary is included.

    Returns:
        The chosen parameters, for ``CPUOffloadOptimizer(..., offload_params=...)``.
    """
    return _take(list(params)[::-1], fraction)[::-1]


def first_fraction(params: Iterable[torch.Tensor], fraction: float) -> list[torch.Tensor]:
    """The trainable parameters making up the first ``fraction`` of the bytes (the default split).

    Args:
        params: parameters in model order.
        fraction: share of the trainable bytes to return, in [0, 1].

    Returns:
        The chosen parameters.
    """
    return _take(list(params), fraction)
