"""elbowroom.optim: the CPU-offloaded / hybrid optimizer and the trainer's way to build one."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch

from elbowroom.optim.offload import CPUOffloadOptimizer
from elbowroom.optim.split import first_fraction, last_fraction

__all__ = ["CPUOffloadOptimizer", "build_optimizer", "first_fraction", "last_fraction"]


def build_optimizer(
    params: Iterable[torch.Tensor] | Iterable[dict[str, Any]],
    *,
    lr: float,
    weight_decay: float,
    betas: tuple[float, float],
    eps: float,
    fused: bool | None,
    offload_fraction: float,
    offload_gradients: bool,
    offload_params: Iterable[torch.Tensor] | None = None,
    param_dtype: torch.dtype | None = None,
    master_weights: bool = False,
) -> torch.optim.Optimizer:
    """AdamW for the trainer: torch's own when nothing is offloaded, else a :class:`CPUOffloadOptimizer`.

    Args:
        params: parameters or parameter groups (a group's own ``weight_decay`` wins over the argument).
        lr: learning rate.
        weight_decay: decoupled weight decay for groups that do not set their own.
        betas: Adam's (beta1, beta2).
        eps: Adam's epsilon.
        fused: use fused kernels (None: the optimizer's choice; the offloaded optimizer picks fused ones).
        offload_fraction: share of the parameter bytes whose state lives on the host, in [0, 1].
        offload_gradients: free device gradients of offloaded parameters once copied to the host.
        offload_params: the parameters to offload instead of the first ``offload_fraction`` (e.g.
            ``last_fraction(model.parameters(), f)``); ``offload_fraction`` is then ignored.
        param_dtype: device dtype of the offloaded parameters (see :class:`CPUOffloadOptimizer`).
        master_weights: fp32 masters for low-precision (bf16) parameters, on the host for offloaded ones and
            on the device for the rest; a :class:`CPUOffloadOptimizer` even when nothing is offloaded.

    Returns:
        ``torch.optim.AdamW`` if ``offload_fraction == 0`` and neither ``offload_gradients`` nor
        ``master_weights``, else
        ``CPUOffloadOptimizer(params, torch.optim.AdamW, ...)``. With the latter, clip with
        ``opt.clip_grad_norm_(max_norm)`` (it sees the offloaded gradients; torch's function does not once
        ``offload_gradients`` freed them) and mark non-final micro-batches with ``opt.accumulating()``.
    """
    kwargs: dict[str, Any] = {"lr": lr, "weight_decay": weight_decay, "betas": tuple(betas), "eps": eps}
    if fused is not None:
        kwargs["fused"] = fused
    if offload_fraction == 0 and not offload_gradients and not master_weights:
        if param_dtype is not None:
            raise ValueError("param_dtype applies to offloaded parameters: set offload_fraction > 0")
        return torch.optim.AdamW(params, **kwargs)
    kwargs.update(offload_gradients=offload_gradients, param_dtype=param_dtype, master_weights=master_weights)
    if offload_params is not None:
        return CPUOffloadOptimizer(params, torch.optim.AdamW, offload_params=list(offload_params), **kwargs)
    return CPUOffloadOptimizer(params, torch.optim.AdamW, offload_fraction=offload_fraction, **kwargs)
