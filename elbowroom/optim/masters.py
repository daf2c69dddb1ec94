"""Master weights and precision: fp32 masters for low-precision parameters, on the host and on the device.

With ``master_weights`` every low-precision (bf16/fp16) parameter steps on an fp32 master: an offloaded one's
master lives in host memory (the device copy is rewritten by a cast after each step), a resident one's on the
device next to it. ``param_dtype`` goes one step further for offloaded weight matrices: their current fp32
value becomes the host master and the device keeps only a ``param_dtype`` copy (the same ``Parameter``
object, cast in place), halving their device memory, their gradients and their bytes on the link.

The device masters of Adam/AdamW step chunk by chunk (:func:`step_device`): a chunk of the gradient is upcast
into scratch, torch's fused step runs on that chunk, the master chunk is cast into the parameter. The same
arithmetic as torch's fused step on whole upcast gradients (elementwise, bitwise), but the fp32 gradients
never exist whole: on the 7B hybrid with half of the parameters on the device that would be 13.5 GB at the
end of every step.

Everything here runs on the training thread; host masters are handed to the worker threads with their jobs
(:mod:`elbowroom.optim.engine`) and touched here only while no job of theirs is outstanding.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch.optim import Optimizer

from elbowroom.optim import _host_adam, shards
from elbowroom.optim.buffers import HostMemory

if TYPE_CHECKING:
    from elbowroom.optim.placement import HostParam

__all__ = ["cast_param", "device_master", "host_master", "reload_masters", "step_device"]


def host_master(
    p: torch.Tensor,
    host: HostMemory,
    *,
    master_weights: bool,
    param_dtype: torch.dtype | None,
    cast_on_device: bool,
) -> torch.Tensor:
    """The host master of an offloaded parameter; casts the parameter to ``param_dtype`` where that applies.

    Args:
        p: the parameter (on the device).
        host: where the master is allocated.
        master_weights: fp32 masters for floating-point parameters (else the master has the parameter's dtype).
        param_dtype: device dtype for weight matrices (at least 2-D), or None.
        cast_on_device: casts between the master and the parameter run on the device: the master is the
            pinned source of the weights' way back.

    Returns:
        The master, holding the parameter's full-precision value where it differs from the device copy (else
        uninitialised: it is re-read from the device at the first step, on the copy stream).
    """
    mdtype = torch.float32 if (master_weights and p.is_floating_point()) else p.dtype
    cast = param_dtype is not None and p.is_floating_point() and p.dim() >= 2 and p.dtype != param_dtype
    same = mdtype == p.dtype and not cast
    # the master is pinned where it is the H2D source: dtypes match, or casts run on the device;
    # else a bf16 copy travels from a pinned staging buffer
    master = host.empty(p.shape, mdtype, pinned=same or cast_on_device)
    if not same:
        with torch.no_grad():
            master.copy_(p.detach())  # host-device sync, at set-up only
    if cast:
        assert param_dtype is not None
        cast_param(p, param_dtype)  # the master took the full-precision value first
    return master


def embedding_tables(model: torch.nn.Module) -> list[torch.Tensor]:
    """The weights of ``model``'s ``nn.Embedding`` modules: what ``param_dtype`` should leave in their dtype
    (``CPUOffloadOptimizer(keep_dtype=...)``). A table's output is the residual stream, which fp32 weights under
    autocast keep in fp32; cast to bf16, it turned the stream bf16 and every norm saved an fp32 upcast of it (the 7B
    shape: 128 MiB a block more than its profile, and out of memory at 76 GiB)."""
    return [m.weight for m in model.modules() if isinstance(m, torch.nn.Embedding)]


def cast_param(p: torch.Tensor, dtype: torch.dtype) -> None:
    """Keep only a ``dtype`` copy of a parameter on the device (same Parameter object, so modules, hooks and the
    caller's references stay valid).

    Args:
        p: the parameter.
        dtype: its new dtype.
    """
    with torch.no_grad():
        p.data = p.data.to(dtype)
        if p.grad is not None:
            p.grad = p.grad.to(dtype)


def device_master(p: torch.Tensor, master_weights: bool) -> torch.Tensor | None:
    """The device fp32 master of a resident low-precision parameter, or None where it needs none.

    Args:
        p: the parameter.
        master_weights: whether low-precision parameters get masters at all.

    Returns:
        An fp32 copy of ``p`` on its device, or None.
    """
    if master_weights and p.is_floating_point() and p.dtype != torch.float32:
        return p.detach().float()
    return None


def step_device(optimizer: Optimizer, masters: dict[torch.Tensor, torch.Tensor], chunk: int) -> None:
    """Step the device optimizer: resident parameters in place, fp32 masters and then their parameters.

    Args:
        optimizer: the device optimizer (its hyperparameters already set for this step).
        masters: parameter -> its device fp32 master.
        chunk: elements per chunk of the masters' chunked step (Adam/AdamW).
    """
    if masters and _host_adam.supports(optimizer):
        _step_masters_in_chunks(optimizer, masters, chunk)  # no fp32 copy of every gradient at once
    else:
        for p, m in masters.items():
            m.grad = None if p.grad is None else p.grad.float()
    optimizer.step()  # the device parameters without masters (masters without .grad are skipped)
    for p, m in masters.items():
        if m.grad is not None:
            m.grad = None
            p.detach().copy_(m)


def _step_masters_in_chunks(optimizer: Optimizer, masters: dict[torch.Tensor, torch.Tensor], chunk: int) -> None:
    """Adam(W) on the device's fp32 masters of low-precision parameters through one fp32 scratch of ``chunk``
    elements: a parameter larger than it chunk by chunk (upcast a chunk of the gradient, torch's fused step on
    that chunk, cast the master chunk into the parameter); the smaller ones together, as many as fill the scratch,
    in one fused call (:func:`~elbowroom.optim._host_adam.step_batched`: a model of many small tensors is not
    bound by launches)."""
    group_of = {id(m): g for g in optimizer.param_groups for m in g["params"]}
    scratch: dict[torch.device, torch.Tensor] = {}  # one chunk per device, freed after the step
    # the parameters a batch may take: same device and group, contiguous weight, fp32 master of its own
    batch: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = []
    batch_key: tuple[torch.device, int] | None = None
    batch_numel = 0

    def flush() -> None:
        nonlocal batch, batch_numel
        if batch:
            dev = batch[0][0].device
            _host_adam.step_batched(optimizer, group_of[id(batch[0][0])], [m for m, _, _ in batch],
                                    [g for _, g, _ in batch], [o for _, _, o in batch], scratch[dev])
        batch, batch_numel = [], 0

    for p, m in masters.items():
        if p.grad is None:
            continue
        if m.device not in scratch:
            total = sum(q.numel() for q in masters.values() if q.device == m.device)
            scratch[m.device] = torch.empty(min(chunk, total), dtype=torch.float32, device=m.device)
        g = p.grad if p.grad.is_contiguous() else p.grad.contiguous()
        out = p.detach()
        contiguous = out.is_contiguous()
        room = scratch[m.device].numel()
        if contiguous and not shards.is_sharded(m) and m.numel() <= room:
            key = (m.device, id(group_of[id(m)]))
            if key != batch_key or batch_numel + m.numel() > room:
                flush()
                batch_key = key
            batch.append((m, g, out))
            batch_numel += m.numel()
            continue
        _host_adam.step_chunked(
            optimizer, group_of[id(m)], m, g, out if contiguous else None, scratch[m.device], [], chunk
        )
        if not contiguous:
            out.copy_(m)
    flush()


def reload_masters(hps: list[HostParam], masters: dict[torch.Tensor, torch.Tensor]) -> None:
    """Re-read the masters from the device parameters (the caller waited for every CPU step).

    Args:
        hps: the offloaded parameters.
        masters: the device masters of resident parameters.
    """
    for hp in hps:
        if hp.same_dtype:
            hp.master_stale = True  # copied in the next step, on the D2H stream
        else:
            hp.master.copy_(hp.param.detach())  # host-device sync; fp32 masters from low-precision weights
    for p, m in masters.items():
        m.copy_(p.detach())
