"""Adam/AdamW state made when the optimizer is built, not in its first ``step()``.

torch's Adam and AdamW create each parameter's moments in their first step, after the first forward and backward
have allocated and freed the step's activations and gradients, so the CUDA caching allocator places those moments,
which live for the whole run, in the ranges the first step's activations left free, and every later step's
activations and gradients fit between them. Made when the optimizer is built, before the first forward, they sit
beside the weights instead. Measured on the 7B shape at a 76 GiB cap (fp32 resident weights, 12 blocks' optimizer
streamed, no offloaded gradients; ``BENCHMARKS.md``, 2026-11-29 twenty-fifth session): the resident parameters'
moments are 32.1 GiB of the 74.3 GiB allocated peak; made early, the free ranges inside the reserved memory at the
allocator's retries went from about 210 to about 90, and the step from 0.90 to 0.83 s, but the retries stayed (24 in
10 steps: the steps' own gradients and activations still fragment the rest, as the profile now measures in
part, ``elbowroom.plan.profiler``).

The state is torch's own layout (what ``Adam._init_group`` makes): ``step`` a 0-d float32 tensor on the
parameter's device for fused or capturable groups, else on the CPU (float64 under a float64 default dtype),
``exp_avg`` and ``exp_avg_sq`` (and ``max_exp_avg_sq`` with AMSGrad) zeros like the parameter. A parameter whose
state exists and is still at step 0 steps exactly as a fresh one: its first step sets ``step`` to 1 and the moments
from zeros, as torch would. Other optimizer classes, subclasses included, are left to create their state as they do.
"""

from __future__ import annotations

import torch

__all__ = ["create_state"]


def create_state(optimizer: torch.optim.Optimizer, *, cuda_only: bool = True) -> int:
    """Create the state of every parameter of a torch Adam or AdamW that has none yet, in torch's layout.

    Args:
        optimizer: any optimizer; only an instance of exactly ``torch.optim.Adam`` or ``torch.optim.AdamW``
            (not differentiable) gets state here.
        cuda_only: only the parameters on a CUDA device, the allocator this is for; elsewhere the state is left to
            the first step, as torch makes it (an optimizer's ``state_dict()`` before its first step stays empty).

    Returns:
        The bytes of state created (0 for another class, or when every parameter had state).
    """
    if type(optimizer) not in (torch.optim.Adam, torch.optim.AdamW):
        return 0
    made = 0
    # torch's scalar dtype for a step on the CPU (``optimizer._get_scalar_dtype``): float64 under that default
    scalar = torch.float64 if torch.get_default_dtype() == torch.float64 else torch.float32
    for group in optimizer.param_groups:
        if group.get("differentiable", False):
            continue
        on_device = bool(group.get("fused")) or bool(group.get("capturable"))
        for p in group["params"]:
            if optimizer.state.get(p) or not p.requires_grad or (cuda_only and p.device.type != "cuda"):
                continue  # (get: indexing the defaultdict would leave an empty entry behind)
            state = optimizer.state[p]
            state["step"] = (torch.zeros((), dtype=torch.float32, device=p.device) if on_device
                             else torch.tensor(0.0, dtype=scalar))
            names = ("exp_avg", "exp_avg_sq") + (("max_exp_avg_sq",) if group.get("amsgrad") else ())
            for name in names:
                state[name] = torch.zeros_like(p, memory_format=torch.preserve_format)
            made += len(names) * p.numel() * p.element_size()
    return made
