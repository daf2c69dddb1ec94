"""A one-pass Adam/AdamW step for host masters whose gradients and device copies are in another dtype.

With bf16 device weights the host step of an offloaded parameter has three parts: read the bf16 gradient,
update the fp32 master and both moments, write a bf16 copy of the master for the way back. Done with
torch's ops that is three passes over host memory: an upcast of the gradient into fp32 scratch (6 bytes
per parameter), the fused AdamW kernel (28), a cast of the master to bf16 (6): 40 bytes. This module fuses
them into one pass of 28 bytes (read 2 + 12, write 12 + 2) with ``torch.compile`` (Inductor's C++ code,
vectorized and parallel with OpenMP). The gradient multiplier of clipping and GradScaler rides along.

The step is memory-bound: on the lent H100 host the torch path ran at ~2.8 G params/s inside training,
the same kernel on fp32 gradients at ~3.7. The arithmetic is torch's fused CPU Adam's, in fp32: decoupled
or L2 weight decay, ``lerp`` for the first moment, ``sqrt(v) / sqrt(bias_correction2) + eps``.

Where ``torch.compile`` cannot build the kernel (no C++ compiler), :func:`compiled_kernel` returns None
and the optimizer keeps the three-pass path.
"""

from __future__ import annotations

import logging
import math
import threading
from collections.abc import Callable
from typing import Any

import torch

logger = logging.getLogger(__name__)

# slots of the per-call hyperparameter vector (one fp32 CPU tensor, so a new lr or step never recompiles)
_DECAY, _ONE_MINUS_B1, _B2, _ONE_MINUS_B2, _EPS, _STEP_SIZE, _BC2_SQRT, _GRAD_MULT, _WD = range(9)
_NUM_HYPER = 9


def adam_math(
    param: torch.Tensor,
    grad: torch.Tensor,
    exp_avg: torch.Tensor,
    exp_avg_sq: torch.Tensor,
    out: torch.Tensor | None,
    hyper: torch.Tensor,
    decoupled: bool,
) -> None:
    """One Adam(W) step in place on flat fp32 ``param``/``exp_avg``/``exp_avg_sq``; ``out`` gets the new
    ``param`` in its own dtype. ``grad`` may be any float dtype. ``hyper`` is :func:`hyper_vector`'s."""
    g = grad.float() * hyper[_GRAD_MULT]
    if decoupled:
        p = param * hyper[_DECAY]
    else:
        p = param
        g = g + param * hyper[_WD]
    m = exp_avg + (g - exp_avg) * hyper[_ONE_MINUS_B1]
    v = exp_avg_sq * hyper[_B2] + hyper[_ONE_MINUS_B2] * g * g
    p = p - hyper[_STEP_SIZE] * m / (v.sqrt() / hyper[_BC2_SQRT] + hyper[_EPS])
    exp_avg.copy_(m)
    exp_avg_sq.copy_(v)
    param.copy_(p)
    if out is not None:
        out.copy_(p)


def hyper_vector(group: dict[str, Any], step: float, grad_mult: float) -> torch.Tensor:
    """The scalars of one step of a param group, as torch's fused Adam derives them from ``step``."""
    lr = float(group["lr"])
    beta1, beta2 = (float(b) for b in group["betas"])
    wd = float(group["weight_decay"])
    sign = -1.0 if group.get("maximize", False) else 1.0
    bc1 = 1.0 - beta1**step
    bc2 = 1.0 - beta2**step
    h = [0.0] * _NUM_HYPER
    h[_DECAY] = 1.0 - lr * wd
    h[_ONE_MINUS_B1] = 1.0 - beta1
    h[_B2] = beta2
    h[_ONE_MINUS_B2] = 1.0 - beta2
    h[_EPS] = float(group["eps"])
    h[_STEP_SIZE] = lr / bc1
    h[_BC2_SQRT] = math.sqrt(bc2)
    h[_GRAD_MULT] = sign * grad_mult
    h[_WD] = wd
    return torch.tensor(h, dtype=torch.float32)


def supports(optimizer: torch.optim.Optimizer) -> bool:
    """Whether this inner optimizer's update is the one :func:`adam_math` computes (exactly Adam or
    AdamW, no AMSGrad, fp32 state)."""
    if type(optimizer) not in (torch.optim.Adam, torch.optim.AdamW):
        return False
    for g in optimizer.param_groups:
        if g.get("amsgrad", False) or g.get("differentiable", False):
            return False
        if isinstance(g.get("betas", (0, 0))[0], torch.Tensor):
            return False
    return True


def decoupled(optimizer: torch.optim.Optimizer, group: dict[str, Any]) -> bool:
    return isinstance(optimizer, torch.optim.AdamW) or bool(group.get("decoupled_weight_decay", False))


def adam_state(optimizer: torch.optim.Optimizer, master: torch.Tensor) -> dict[str, torch.Tensor]:
    """The parameter's state in torch's own layout (created as torch's fused Adam would), so that
    ``state_dict()`` and the torch step path see the same thing."""
    st = optimizer.state[master]
    if not st:
        st["step"] = torch.tensor(0.0, dtype=torch.float32)
        st["exp_avg"] = torch.zeros_like(master, memory_format=torch.preserve_format)
        st["exp_avg_sq"] = torch.zeros_like(master, memory_format=torch.preserve_format)
    return st


_lock = threading.Lock()
_compiled: Callable[..., None] | None = None
_failed = False


def compiled_kernel() -> Callable[..., None] | None:
    """``adam_math`` compiled for the CPU (built on the first call, ~3-20 s), or None where it cannot be."""
    global _compiled, _failed
    with _lock:
        if _compiled is not None or _failed:
            return _compiled
        try:
            fn = torch.compile(adam_math, dynamic=True, fullgraph=True)
            # build it now, on a small problem: a failure falls back instead of breaking a step later
            n = 64
            h = hyper_vector({"lr": 1e-3, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 0.0}, 1, 1.0)
            for gd in (torch.bfloat16, torch.float32):
                p, m, v, out = torch.ones(n), torch.zeros(n), torch.zeros(n), torch.empty(n, dtype=torch.bfloat16)
                fn(p, torch.ones(n, dtype=gd), m, v, out, h, True)
                # Adam's first step moves every weight by lr
                if not (torch.allclose(p, torch.full_like(p, 0.999)) and torch.equal(out, p.bfloat16())):
                    raise RuntimeError(f"the compiled kernel computed {p[0].item()}, expected 0.999")
            _compiled = fn
        except Exception as exc:  # noqa: BLE001 - no compiler, an unsupported platform...: keep torch's path
            _failed = True
            logger.warning(
                "CPUOffloadOptimizer: could not build the one-pass host Adam kernel with torch.compile (%s: %s); "
                "using torch's fused CPU kernel with separate casts (slower for low-precision device weights)",
                type(exc).__name__,
                exc,
            )
        return _compiled
