"""Gradient clipping by the global norm over device gradients and gradients that already left the device.

``CPUOffloadOptimizer.clip_grad_norm_`` clips as ``torch.nn.utils.clip_grad_norm_`` does, also where
``offload_gradients=True`` freed the device copies: a gradient that was final in one backward had its norm
taken on the device by the hook as it finished; one accumulated over micro-batches on the host has its norm
taken on the host (:func:`host_norm`, accurate where torch's CPU kernel is not). Resident gradients are scaled
on the device here; offloaded ones are scaled on the host right before their CPU step, by the coefficient the
returned :class:`ClipRequest` carries into ``step()``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

from elbowroom.optim import shards

if TYPE_CHECKING:
    from elbowroom.optim.placement import HostParam

__all__ = ["ClipRequest", "clip_by_global_norm", "host_norm"]

# host gradient norms: float32 within a row of this many elements, float64 across rows (see host_norm)
_NORM_ROW = 4096


@dataclasses.dataclass
class ClipRequest:
    """A clip computed before ``step()``: what the step applies to the offloaded gradients."""

    coef: torch.Tensor
    """Clamped clip coefficient, on the device."""
    total_norm: torch.Tensor
    """The global norm before clipping, on the device."""
    skip_if_nonfinite: bool
    """The step skips its update when the norm is not finite."""


def host_norm(t: torch.Tensor) -> torch.Tensor:
    """The 2-norm of a host tensor, accurate to fp32 rounding (a float32 scalar on the CPU).

    torch's CPU ``vector_norm`` accumulates float32 squares in long sequential runs per vector lane: on a
    16.7M-element gradient it comes out ~7e-4 (relative) too small, where the GPU kernel and float64 agree
    to ~1e-7. Norms of rows of ``_NORM_ROW`` elements stay accurate in float32 and are combined in float64,
    at ~3x the cost of the plain kernel and without a float64 copy of the tensor.
    """
    flat = t.detach().reshape(-1)
    n = flat.numel() - flat.numel() % _NORM_ROW
    parts = []
    if n:
        parts.append(torch.linalg.vector_norm(flat[:n].view(-1, _NORM_ROW), dim=1).double())
    if n < flat.numel():
        parts.append(torch.linalg.vector_norm(flat[n:].double()).reshape(1))
    if not parts:
        return torch.zeros((), dtype=torch.float32)
    return torch.linalg.vector_norm(torch.cat(parts)).float()


@torch.no_grad()
def clip_by_global_norm(
    groups: list[list[torch.Tensor]],
    hp_of: dict[torch.Tensor, HostParam],
    resident_params: list[torch.Tensor],
    device: torch.device,
    *,
    offload_gradients: bool,
    wait_host: Callable[[], None],
    max_norm: float,
    norm_type: float,
    error_if_nonfinite: bool,
    skip_if_nonfinite: bool,
    group: Any = None,
) -> ClipRequest:
    """The global norm of all gradients and the clip coefficient; scales the resident gradients in place.

    Norms are summed in parameter order, as torch's function does. Runs on the training thread: host
    gradients are read after ``wait_host`` while the step's gate is still closed (nothing steps then).

    Args:
        groups: the parameters of each user group, in order.
        hp_of: the offloaded parameters' bookkeeping.
        resident_params: the parameters that step on the device (their gradients are scaled here).
        device: where the norm is computed.
        offload_gradients: offloaded gradients left the device (their norms come from the hooks or the host).
        wait_host: a host wait until every handed-over gradient reached the host.
        max_norm: the largest allowed global norm.
        norm_type: the p of the p-norm; 2 only with ``offload_gradients``.
        error_if_nonfinite: raise if the total norm is nan or inf (a host-device sync).
        skip_if_nonfinite: make the coming step skip the update when the norm is not finite.
        group: FSDP2: the ranks holding the other shards; the norm is taken over all of them (a collective).

    Returns:
        The request ``step()`` applies (coefficient and total norm, device tensors).
    """
    entries: list[tuple[int, torch.Tensor]] = []  # (param index, norm)
    dev_grads: dict[tuple[torch.device, torch.dtype], list[tuple[int, torch.Tensor]]] = {}
    host_waited = False
    idx = 0
    for params in groups:
        for p in params:
            hp = hp_of.get(p)
            if hp is not None and offload_gradients and hp.final:
                if norm_type != 2.0:
                    raise ValueError("with offload_gradients=True, clip_grad_norm_ supports norm_type=2 only")
                if hp.norm is not None:
                    entries.append((idx, hp.norm))
                else:
                    if not host_waited:
                        wait_host()  # host wait: accumulated grads are on the host
                        host_waited = True
                    if hp.hgrad is not None and hp.hgrad_valid:
                        # a host norm back to the device: a tiny copy from pageable memory (syncs)
                        entries.append((idx, host_norm(hp.hgrad).to(device)))
            elif p.grad is not None:
                g = shards.local(p.grad)  # FSDP2: this rank's shard; the ranks' norms are combined below
                dev_grads.setdefault((g.device, g.dtype), []).append((idx, g))
            idx += 1
    for items in dev_grads.values():
        norms = torch._foreach_norm([g for _, g in items], norm_type)
        entries.extend(zip([i for i, _ in items], norms))
    if not entries:
        total = torch.zeros((), device=device)
    else:
        entries.sort(key=lambda e: e[0])
        total = torch.linalg.vector_norm(torch.stack([n.to(device) for _, n in entries]), norm_type)
    total = shards.reduce_norm(total, norm_type, group)  # every rank joins, also one without gradients
    if error_if_nonfinite and bool(torch.logical_or(total.isnan(), total.isinf())):  # host-device sync
        raise RuntimeError(
            f"The total norm of order {norm_type} for gradients is non-finite, so it cannot be clipped."
        )
    coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
    resident: dict[tuple[torch.device, torch.dtype], list[torch.Tensor]] = {}
    for p in resident_params:
        if p.grad is not None:
            g = shards.local(p.grad)
            resident.setdefault((g.device, g.dtype), []).append(g)
    for grads in resident.values():
        torch._foreach_mul_(grads, coef.to(grads[0].device))
    return ClipRequest(coef=coef, total_norm=total, skip_if_nonfinite=skip_if_nonfinite)
