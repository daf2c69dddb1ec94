"""The Adam/AdamW step for fp32 masters whose gradients and parameter copies are in another dtype.

Used on the host for offloaded parameters (below), and on the device for the fp32 masters of bf16
parameters that stay there (``elbowroom.optim.masters.step_device``): there chunking keeps the upcast
gradients to one chunk of scratch instead of an fp32 copy of every gradient at the end of each step.

With bf16 device weights the host step of an offloaded parameter has three parts: upcast the bf16
gradient to fp32, update the fp32 master and both moments with torch's fused CPU kernel, cast the master
to a bf16 copy for the way back. Run one after the other over whole parameters, that is three passes over
host memory: 6 + 28 + 6 = 40 bytes per parameter, where the fused kernel alone on fp32 gradients moves 28.
Here the three run chunk by chunk, so the fp32 gradient chunk and the updated master chunk are still in
the CPU's caches when the next op reads them, aiming at the 30 bytes that must move (read 2 + 12, write
12 + 2), at the cost of three op calls per chunk. The arithmetic is torch's own (``_fused_adam_`` /
``_fused_adamw_``), elementwise, so the result is bitwise what torch's optimizer computes on the upcast
gradients.

Measured on the lent H100 host (16 cores, 14 threads, ``benchmarks/host_adam.py``): torch's fused AdamW on
fp32 gradients 4.29-5.25 G params/s (two machines), the three passes over whole bf16 parameters 2.15-2.94,
chunk by chunk 2.54 (on the machine that gave 2.15 and 4.29): far from the fp32 rate, so the optimizer runs
these casts on the device by default (``CPUOffloadConfig.cast_on_device``) and this path only where they
stay on the host.

(A ``torch.compile``-built one-pass kernel was tried first and dropped: Inductor's CPU kernel ran at 2.7-2.9 G
params/s whatever the thread setting, with its own OpenMP team that ``torch.set_num_threads`` does not
size, and training with it ran at 41 model TFLOP/s on the 7B shape instead of 133: its calls from the
step thread stalled the training thread.)
"""

from __future__ import annotations

from typing import Any

import torch

from elbowroom.optim import shards

CHUNK_NUMEL = 1 << 21
"""Elements per chunk: 8 MiB of fp32 gradient and 8 MiB of master, split over the step's threads. A
multiple of 64, so that chunk ends fall on vector boundaries: torch's kernel runs the tail of each range in
scalar code, whose last bit can differ from the vector code's."""


def supports(optimizer: torch.optim.Optimizer) -> bool:
    """Whether this inner optimizer is exactly torch's Adam or AdamW with fused CPU arithmetic we can call
    per chunk (no AMSGrad, no tensor hyperparameters)."""
    if type(optimizer) not in (torch.optim.Adam, torch.optim.AdamW):
        return False
    for g in optimizer.param_groups:
        if not g.get("fused") or g.get("amsgrad", False) or g.get("differentiable", False):
            return False
        if isinstance(g.get("betas", (0, 0))[0], torch.Tensor):
            return False
    return True


def grad_scale(mults: list[torch.Tensor]) -> torch.Tensor | None:
    """What torch's fused Adam/AdamW divides the gradients by so that they come out multiplied by ``mults`` (CPU
    scalars, multiplied in order), or None for none: one over their product. Dividing by it is not bitwise
    multiplying by each (``CPUOffloadConfig.scale_in_kernel``)."""
    if not mults:
        return None
    factor = mults[0].to(torch.float32)
    for m in mults[1:]:
        factor = factor * m
    return 1.0 / factor


def step_scaled(optimizer: torch.optim.Optimizer, mults: list[torch.Tensor]) -> None:
    """``optimizer.step()`` on its gradients times ``mults``, the scale applied inside torch's fused kernel (its
    ``grad_scale``, as torch's GradScaler hands it over; the kernel writes the scaled gradients back): one pass over
    host memory instead of a scaling pass and then the step. ``optimizer`` must pass :func:`supports`."""
    optimizer.grad_scale = grad_scale(mults)
    try:
        optimizer.step()
    finally:
        del optimizer.grad_scale


def adam_state(optimizer: torch.optim.Optimizer, master: torch.Tensor) -> dict[str, torch.Tensor]:
    """The parameter's state in torch's own layout (created as torch's fused Adam does), so that
    ``state_dict()`` and torch's own step see the same thing."""
    st = optimizer.state[master]
    if not st:
        st["step"] = torch.tensor(0.0, dtype=torch.float32, device=master.device)  # fused: on the master's device
        st["exp_avg"] = torch.zeros_like(master, memory_format=torch.preserve_format)
        st["exp_avg_sq"] = torch.zeros_like(master, memory_format=torch.preserve_format)
    return st


def fused_kernel(optimizer: torch.optim.Optimizer, group: dict[str, Any]) -> tuple[Any, dict[str, Any]]:
    """torch's fused Adam or AdamW kernel for this optimizer and the keyword arguments of ``group`` it takes."""
    decoupled = isinstance(optimizer, torch.optim.AdamW) or bool(group.get("decoupled_weight_decay", False))
    beta1, beta2 = group["betas"]
    kw = {
        "lr": float(group["lr"]),
        "beta1": float(beta1),
        "beta2": float(beta2),
        "weight_decay": float(group["weight_decay"]),
        "eps": float(group["eps"]),
        "amsgrad": False,
        "maximize": bool(group.get("maximize", False)),
    }
    return (torch._fused_adamw_ if decoupled else torch._fused_adam_), kw


def step_chunked(
    optimizer: torch.optim.Optimizer,
    group: dict[str, Any],
    master: torch.Tensor,
    grad: torch.Tensor,
    out: torch.Tensor | None,
    scratch: torch.Tensor,
    mults: list[torch.Tensor],
    chunk: int | None = None,
    *,
    span: tuple[int, int] | None = None,
    count_step: bool = True,
    in_kernel: bool = False,
) -> None:
    """One Adam(W) step of ``master`` (fp32) on ``grad`` (any float dtype) times ``mults``; ``out`` (if given)
    gets the new master in its own dtype. ``scratch``: fp32, at least ``min(chunk, numel)`` elements (unused,
    and may be None, when ``grad`` is fp32: it is then scaled in place); ``chunk`` defaults to
    :data:`CHUNK_NUMEL`.

    ``span=(a, e)`` steps only the flat elements ``[a, e)`` of the master and its moments, with ``grad`` and
    ``out`` holding just those ``e - a`` elements: a parameter stepped piece by piece (its step count is
    advanced by the first piece only, ``count_step``). ``a`` must be a multiple of 64, as chunk ends are.
    ``in_kernel``: ``mults`` go into torch's kernel as its ``grad_scale`` (:func:`step_scaled`), not bitwise."""
    chunk = chunk or CHUNK_NUMEL
    if chunk % 64:
        raise ValueError(f"chunk must be a multiple of 64 elements, got {chunk}")
    # FSDP2: a sharded master, its moments, gradient and weight are stepped as this rank's shards
    master_local, grad, out = shards.local(master), shards.local(grad), None if out is None else shards.local(out)
    a, e = span if span is not None else (0, master_local.numel())
    if a % 64:
        raise ValueError(f"a span must start at a multiple of 64 elements, got {a}")
    st = adam_state(optimizer, master)
    if count_step:
        st["step"] += 1
    fused, kw = fused_kernel(optimizer, group)
    p, m, v = (shards.local(t).view(-1)[a:e] for t in (master, st["exp_avg"], st["exp_avg_sq"]))
    g = grad.view(-1)
    if g.numel() != e - a:
        raise ValueError(f"grad has {g.numel()} elements for a span of {e - a}")
    o = out.view(-1) if out is not None else None
    steps = [st["step"]]
    scale = grad_scale(mults) if in_kernel else None
    n = p.numel()
    for s in range(0, n, chunk):
        t = min(n, s + chunk)
        if g.dtype == torch.float32:
            up = g[s:t]  # scaled in place: the caller's buffer
        else:
            assert scratch is not None
            up = scratch[: t - s]
            up.copy_(g[s:t])
        if scale is None:
            for mult in mults:
                up.mul_(mult)  # in cache: the same order of multiplications as the unchunked path
        fused([p[s:t]], [up], [m[s:t]], [v[s:t]], [], steps, grad_scale=scale, **kw)
        if o is not None:
            o[s:t].copy_(p[s:t])


def step_batched(
    optimizer: torch.optim.Optimizer,
    group: dict[str, Any],
    masters: list[torch.Tensor],
    grads: list[torch.Tensor],
    outs: list[torch.Tensor],
    scratch: torch.Tensor,
) -> None:
    """One Adam(W) step of several small fp32 ``masters`` at once: their gradients (any float dtype) upcast into
    consecutive views of ``scratch`` (fp32, at least their total number of elements), one call of torch's fused
    kernel over all of them, the new masters cast into ``outs`` (contiguous, each its master's shape, in its own
    dtype). The arithmetic is :func:`step_chunked`'s (the same kernel, elementwise), so the result is bitwise the
    same; what it saves is the per-tensor launches and Python work of a model of many small parameters
    (GPT-2-XL's 48 blocks hold 576 of them: stepped one by one, the device step was launch-bound at 2.3x its
    memory traffic on the H100).

    Raises:
        ValueError: the masters need more elements than ``scratch`` has.
    """
    if not masters:
        return
    sizes = [m.numel() for m in masters]
    if sum(sizes) > scratch.numel():
        raise ValueError(f"{sum(sizes)} elements for a scratch of {scratch.numel()}")
    states = [adam_state(optimizer, m) for m in masters]
    steps = [st["step"] for st in states]
    torch._foreach_add_(steps, 1)
    fused, kw = fused_kernel(optimizer, group)
    ups = list(scratch[: sum(sizes)].split(sizes))
    torch._foreach_copy_(ups, [g.reshape(-1) for g in grads])
    flat = [m.view(-1) for m in masters]
    fused(flat, ups, [st["exp_avg"].view(-1) for st in states], [st["exp_avg_sq"].view(-1) for st in states], [],
          steps, **kw)
    torch._foreach_copy_([o.view(-1) for o in outs], flat)
