"""elbowroom.optim: the CPU-offloaded / hybrid optimizer and the trainer's way to build one."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable
from typing import Any

import torch

from elbowroom.optim.config import CPUOffloadConfig, dtype_name
from elbowroom.optim.offload import CPUOffloadOptimizer
from elbowroom.optim.split import first_fraction, last_fraction

__all__ = ["CPUOffloadConfig", "CPUOffloadOptimizer", "build_optimizer", "first_fraction", "last_fraction"]


def build_optimizer(
    params: Iterable[torch.Tensor] | Iterable[dict[str, Any]],
    *,
    lr: float,
    weight_decay: float,
    betas: tuple[float, float],
    eps: float,
    fused: bool | None,
    offload_fraction: float | None = None,
    offload_gradients: bool | None = None,
    offload_params: Iterable[torch.Tensor] | None = None,
    param_dtype: torch.dtype | None = None,
    master_weights: bool | None = None,
    config: CPUOffloadConfig | None = None,
    keep_dtype: Iterable[torch.Tensor] | None = None,
) -> torch.optim.Optimizer:
    """AdamW for the trainer: torch's own when nothing is offloaded, else a :class:`CPUOffloadOptimizer`.

    The offload settings come from ``config`` (default ``CPUOffloadConfig(offload_fraction=0.0)``: nothing
    offloaded), overridden by the keyword arguments of the same name that are given (not None).

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
        config: every offload setting at once, including the engine's (bucket size, staging slots, threads).
        keep_dtype: offloaded parameters that ``param_dtype`` leaves in their dtype (the embedding tables: see
            :class:`CPUOffloadOptimizer`).

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
    if param_dtype is not None and not (isinstance(param_dtype, torch.dtype) and param_dtype.is_floating_point):
        raise ValueError(f"param_dtype must be a floating-point torch.dtype such as torch.bfloat16, got {param_dtype}")
    given = {
        "offload_fraction": offload_fraction,
        "offload_gradients": offload_gradients,
        "master_weights": master_weights,
        "param_dtype": None if param_dtype is None else dtype_name(param_dtype),
    }
    cfg = config if config is not None else CPUOffloadConfig(offload_fraction=0.0)
    cfg = dataclasses.replace(cfg, **{k: v for k, v in given.items() if v is not None})
    if cfg.offload_fraction == 0 and not cfg.offload_gradients and not cfg.master_weights:
        if cfg.param_dtype is not None:
            raise ValueError("param_dtype applies to offloaded parameters: set offload_fraction > 0")
        return torch.optim.AdamW(params, **kwargs)
    if offload_params is not None:
        # the chosen parameters replace the fraction rule (which must then stay at its neutral 1.0)
        cfg = dataclasses.replace(cfg, offload_fraction=1.0)
        return CPUOffloadOptimizer(params, torch.optim.AdamW, config=cfg, offload_params=list(offload_params),
                                   keep_dtype=keep_dtype, **kwargs)
    return CPUOffloadOptimizer(params, torch.optim.AdamW, config=cfg, keep_dtype=keep_dtype, **kwargs)
