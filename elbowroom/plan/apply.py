"""Apply a Plan to a model: the one place that wires elbowroom's mechanisms together.

:func:`apply` casts the weights when the plan says bf16, installs the per-block activation policies
(:func:`~elbowroom.activations.apply_block_policies`), builds the optimizer (torch's own when nothing is
offloaded and no masters are needed, else :class:`~elbowroom.optim.CPUOffloadOptimizer` with the plan's
parameters on the host, those of its streamed blocks streaming, and ``overlap_with_forward``), and sets the CUDA
allocator options the plan names.

It is two steps, callable apart: :func:`install` (casts, policies, allocator) and :func:`build_optimizer`. Under
FSDP2 the policies must wrap the blocks before ``fully_shard`` does and the optimizer must see the shards, so the
trainer calls the first before sharding and the second after (``elbowroom.train.distributed_run``).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

import torch
import torch.nn as nn

from elbowroom.plan.devices import allocator_settings_setter
from elbowroom.plan.plan import Plan
from elbowroom.plan.streaming import split_on_host

__all__ = ["apply", "build_optimizer", "install", "resolve_blocks"]

logger = logging.getLogger(__name__)

STREAMING_OPTIMIZERS: tuple[type[torch.optim.Optimizer], ...] = (torch.optim.Adam, torch.optim.AdamW)
"""The optimizer classes whose state can stream through the device to step (``BlockPlan.optimizer_streamed``): the
offloaded optimizer steps streamed parameters with torch's fused Adam/AdamW kernel on the device."""


def can_stream(optimizer_class: Any, opt_kwargs: dict[str, Any]) -> bool:
    """Whether ``optimizer_class(..., **opt_kwargs)`` can step streamed parameters: Adam or AdamW without AMSGrad
    (``CPUOffloadOptimizer(stream_params=...)`` refuses the others)."""
    return optimizer_class in STREAMING_OPTIMIZERS and not opt_kwargs.get("amsgrad", False)

_PROXY_ATTR = "_elbowroom_plan_blocks"


class _BlockList(nn.Module):
    """A stand-in owner of blocks the caller named, so that the policy code finds exactly those blocks."""

    def __init__(self, blocks: nn.ModuleList) -> None:
        super().__init__()
        self.blocks = blocks


def resolve_blocks(model: nn.Module, blocks: str | Sequence[nn.Module] | nn.ModuleList | None = None) -> nn.ModuleList:
    """The repeated blocks of ``model``: found (``model.blocks``, Hugging Face ``model.layers`` /
    ``transformer.h``: the longest list of one block class) or named by the caller.

    Args:
        model: the model.
        blocks: None to find them; a dotted path (``"model.layers"``); or the modules themselves.

    Returns:
        The blocks as an ``nn.ModuleList`` (the model's own when it has one).

    Raises:
        ValueError: no blocks found, or a path that does not name a list of modules.
    """
    from elbowroom.activations.recompute import find_blocks

    if blocks is None:
        try:
            return find_blocks(model)
        except ValueError as e:  # the planner also takes the blocks by name
            raise ValueError(f"{e}; or name them: blocks='path.to.list' (fit, apply, profile)") from None
    if isinstance(blocks, str):
        try:
            mod = model.get_submodule(blocks)
        except AttributeError:
            raise ValueError(f"{type(model).__name__} has no submodule {blocks!r}; name the list of blocks, e.g. "
                             "'model.layers' or 'transformer.h'") from None
        if not isinstance(mod, (nn.ModuleList, nn.Sequential)) or not len(mod):
            raise ValueError(f"{blocks!r} is a {type(mod).__name__}, not a non-empty list of blocks")
        return mod if isinstance(mod, nn.ModuleList) else nn.ModuleList(list(mod))
    if isinstance(blocks, nn.ModuleList):
        return blocks
    mods = list(blocks)
    if not mods or not all(isinstance(m, nn.Module) for m in mods):
        raise ValueError("blocks must be a dotted path, an nn.ModuleList or a non-empty sequence of modules")
    return nn.ModuleList(mods)


def _policy_owner(model: nn.Module, blocks: nn.ModuleList) -> tuple[nn.Module, bool]:
    """The module whose blocks ``apply_block_policies`` will find: the model itself when they are its own."""
    from elbowroom.activations.recompute import find_blocks

    try:
        found = find_blocks(model)
    except ValueError:
        found = None
    if found is not None and len(found) == len(blocks) and all(a is b for a, b in zip(found, blocks)):
        return model, False
    return _BlockList(blocks), True


def _cast_bf16(model: nn.Module) -> None:
    # parameters only, in place (the same Parameter objects): buffers such as rotary tables keep their precision
    for p in model.parameters():
        if p.is_floating_point() and p.dtype != torch.bfloat16:
            p.data = p.data.to(torch.bfloat16)


def install(
    model: nn.Module,
    plan: Plan,
    *,
    blocks: str | Sequence[nn.Module] | nn.ModuleList | None = None,
    reentrant: bool | None = None,
) -> nn.Module:
    """The plan's part that wraps the model: its weight cast, its per-block activation policies and its allocator
    settings; no optimizer (:func:`build_optimizer` builds it, perhaps after FSDP2 has sharded the blocks).

    ``reentrant``: the blocks the plan recomputes whole use torch's reentrant checkpoint (None:
    :func:`~elbowroom.activations.recompute.reentrant_default`; the profile timed them the same way).

    Besides the plan's own settings, a Hugging Face model that recomputes blocks gets ``config.use_cache =
    False`` (as ``gradient_checkpointing_enable`` does): a KV cache built in a training forward would change
    between forward and recompute.

    Returns:
        ``model``, changed in place.

    Raises:
        ValueError: the plan's block count differs from the model's.
    """
    from elbowroom.activations.offload import OffloadEngine
    from elbowroom.activations.policy import apply_block_policies
    from elbowroom.activations.recompute import reentrant_default

    blks = resolve_blocks(model, blocks)
    if len(blks) != plan.num_blocks:
        raise ValueError(
            f"the plan has {plan.num_blocks} blocks but the model has {len(blks)}: plan again for this model "
            "(elbowroom.plan.fit, or elbowroom plan --model ...)"
        )
    if plan.weight_dtype == "bfloat16":
        _cast_bf16(model)

    config = getattr(model, "config", None)
    if any(b.checkpoint != "none" for b in plan.blocks) and getattr(config, "use_cache", False):
        # a Hugging Face model building its KV cache in a training forward changes state between forward and
        # recompute (selective recompute then misses the cache's slices in backward); HF's own
        # gradient_checkpointing_enable turns the cache off in training the same way
        config.use_cache = False
        logger.info("plan recomputes blocks: set model.config.use_cache = False (no KV cache in training)")
    owner, proxied = _policy_owner(model, blks)
    engine = None
    if proxied:
        # blocks the caller named: the engine must still never offload the model's own parameters
        dev = next((p.device for p in model.parameters() if p.device.type != "meta"), None)
        engine = OffloadEngine(device=dev, keep_module=model)
        model.__dict__[_PROXY_ATTR] = owner
    if reentrant is None:
        reentrant = reentrant_default()
    apply_block_policies(owner, plan.to_block_policies(), engine=engine, use_reentrant=reentrant)
    if plan.allocator_settings and any(p.device.type == "cuda" for p in model.parameters()):
        setter = allocator_settings_setter()
        if setter is not None:
            setter(plan.allocator_settings)  # applies to the segments made from now on
            torch.cuda.empty_cache()  # so that the cached segments of the old setting are not reused
        else:
            logger.warning("this torch cannot change allocator settings at run time; set PYTORCH_CUDA_ALLOC_CONF=%s",
                           plan.allocator_settings)
    return model


def _check_offloaded_dtype(plan: Plan) -> None:
    """Refuse bf16 device copies of offloaded fp32 weights in a plan profiled computing in fp32 (a hand edit: the
    planner chooses them only under bf16 compute): a loop without autocast fails in its first matmul with a dtype
    mismatch."""
    if (plan.weight_dtype == "float32" and plan.offload_param_dtype == "bfloat16" and plan.offloads_optimizer
            and plan.profile.compute_dtype == "float32"):
        raise ValueError("the plan keeps its offloaded weights in bf16 on the device, which needs the step under bf16 "
                         "autocast, but it was profiled computing in float32: set offload_param_dtype = \"float32\" "
                         "in the plan, or profile and plan the loop as it runs (under torch.autocast, "
                         "compute_dtype=torch.bfloat16)")


def _check_streaming(plan: Plan, optimizer_class: type[torch.optim.Optimizer], opt_kwargs: dict[str, Any]) -> None:
    """Refuse a plan that streams blocks for an optimizer that cannot step them on the device."""
    if plan.optimizer_stream_blocks and not can_stream(optimizer_class, opt_kwargs):
        name = getattr(optimizer_class, "__name__", optimizer_class)
        raise ValueError(
            f"the plan streams blocks {list(plan.optimizer_stream_blocks)} through the device, which only Adam and "
            f"AdamW without amsgrad can (their fused device step), not {name} with {opt_kwargs}: plan again for it "
            "(elbowroom.plan.fit does so; plan_for(..., stream_allowed=False)) or set those blocks' "
            "optimizer_streamed = false (optimizer_on_host = true to step them on the host)"
        )


def build_optimizer(
    model: nn.Module,
    plan: Plan,
    optimizer_class: type[torch.optim.Optimizer] = torch.optim.AdamW,
    *,
    blocks: str | Sequence[nn.Module] | nn.ModuleList | None = None,
    offload_config: Any = None,
    param_groups: Any = None,
    overlap_with_forward: bool = True,
    **opt_kwargs: Any,
) -> torch.optim.Optimizer:
    """The plan's optimizer for ``model``'s parameters as they are now: torch's own when nothing is offloaded and
    no masters are needed, else a :class:`~elbowroom.optim.CPUOffloadOptimizer` whose host parameters are those of
    the blocks the plan puts on the host or streams (under FSDP2, built after sharding: their local shards); the
    streamed blocks' parameters are its ``stream_params`` too (their state lives on the host, they step on the device).

    Args:
        overlap_with_forward: the offloaded optimizer's step returns at once and each module (under FSDP2 each
            unit, ahead of its all-gather) waits for its own weights in the next forward; False: ``step()`` waits
            for the host.
        (the others as :func:`apply`'s)

    Raises:
        ValueError: the plan streams blocks and ``optimizer_class`` is not Adam or AdamW (or uses AMSGrad).
    """
    blks = resolve_blocks(model, blocks)
    params = [p for p in model.parameters() if p.requires_grad]
    if not params:
        raise ValueError("the model has no trainable parameters")
    _check_streaming(plan, optimizer_class, opt_kwargs)
    offload: list[torch.Tensor] = []
    stream: list[torch.Tensor] = []  # of ``offload``, those that step on the device
    if plan.offloads_optimizer:
        seen: set[int] = set()
        in_blocks: set[int] = set()
        for i, blk in enumerate(blks):
            row = plan.blocks[i]
            own = list(blk.parameters())
            # a split block's largest tensors step on the host, the rest stream (as the planner priced its signature)
            on_host = (split_on_host(tuple(p.numel() for p in own), plan.optimizer_split_share)
                       if row.optimizer_streamed and plan.optimizer_split_share else (False,) * len(own))
            for p, host in zip(own, on_host):
                in_blocks.add(id(p))
                if (row.optimizer_on_host or row.optimizer_streamed) and p.requires_grad and id(p) not in seen:
                    seen.add(id(p))
                    offload.append(p)
                    if row.optimizer_streamed and not host:
                        stream.append(p)
        if plan.offload_other_params:
            offload += [p for p in params if id(p) not in in_blocks and id(p) not in seen]
        elif plan.offload_head_params:
            # those registered after the last block's (a tied weight counts at its first place, the embedding), as
            # the profile's HeadProfile.after_params counts them
            order = list(model.parameters())
            last = max((i for i, p in enumerate(order) if id(p) in in_blocks), default=len(order))
            offload += [p for p in order[last + 1:] if p.requires_grad and id(p) not in in_blocks
                        and id(p) not in seen]
    masters = plan.weight_dtype == "bfloat16"
    groups: Any = param_groups(model) if param_groups is not None else params
    if not offload and not masters:
        from elbowroom.optim.early_state import create_state

        opt: torch.optim.Optimizer = optimizer_class(groups, **opt_kwargs)
        create_state(opt)  # Adam/AdamW's moments now, beside the weights, not in the first step's freed ranges
    else:
        from elbowroom.optim import CPUOffloadOptimizer
        from elbowroom.optim.masters import embedding_tables

        param_dtype = torch.bfloat16 if (plan.offload_param_dtype == "bfloat16" and not masters and offload) else None
        # (only where some block streams: a plan that streams nothing builds the optimizer as it always did)
        streamed: dict[str, Any] = {"stream_params": stream} if stream else {}
        opt = CPUOffloadOptimizer(
            groups,
            optimizer_class,
            offload_params=offload,
            param_dtype=param_dtype,
            keep_dtype=embedding_tables(model),  # bf16 copies of the matrices, the residual stream kept fp32
            master_weights=masters,
            offload_gradients=bool(offload) and plan.offload_gradients,
            config=offload_config,
            **streamed,
            **opt_kwargs,
        )
        if offload and overlap_with_forward:
            # step() returns at once; each module waits for its own updated weights in the next forward
            opt.overlap_with_forward(model)
    logger.info(
        "plan applied: %d of %d blocks recompute, %d offload activations, %d parameters' optimizer on the host "
        "(%d of them streamed through the device, %d blocks), weights %s",
        sum(b.checkpoint != "none" for b in plan.blocks), plan.num_blocks,
        sum(b.offload_ratio > 0 or b.offload_input for b in plan.blocks), sum(p.numel() for p in offload),
        sum(p.numel() for p in stream), len(plan.optimizer_stream_blocks), plan.weight_dtype,
    )
    return opt


def apply(
    model: nn.Module,
    plan: Plan,
    optimizer_class: type[torch.optim.Optimizer] = torch.optim.AdamW,
    *,
    blocks: str | Sequence[nn.Module] | nn.ModuleList | None = None,
    offload_config: Any = None,
    param_groups: Any = None,
    reentrant: bool | None = None,
    **opt_kwargs: Any,
) -> tuple[nn.Module, torch.optim.Optimizer]:
    """Make ``model`` follow ``plan`` and build its optimizer: :func:`install`, then :func:`build_optimizer`.

    Args:
        model: the model (on its training device).
        plan: the plan (from :func:`~elbowroom.plan.plan_for`, or :meth:`Plan.load`).
        optimizer_class: a torch optimizer class (AdamW by default); offloaded parameters step with its CPU kernel.
        blocks: the model's repeated blocks when they cannot be found (a dotted path or the modules).
        param_groups: ``param_groups(model) -> list of groups`` for the optimizer (e.g. no weight decay on norms and
            embeddings), called after the plan's casts; None: one group of every trainable parameter.
        offload_config: the CPU-offloaded optimizer's engine settings (``elbowroom.optim.CPUOffloadConfig``: bucket
            size, staging slots, threads); the plan sets placement and precision over it.
        reentrant: torch's reentrant checkpoint for the blocks recomputed whole (see :func:`install`).
        **opt_kwargs: passed to the optimizer (``lr``, ``weight_decay``, ``betas``...).

    Returns:
        ``(model, optimizer)``: the same model, changed in place.

    Raises:
        ValueError: the plan's block count differs from the model's, or it streams blocks and ``optimizer_class``
            is not Adam or AdamW (or uses AMSGrad).
    """
    _check_streaming(plan, optimizer_class, opt_kwargs)  # (before the model changes)
    _check_offloaded_dtype(plan)
    install(model, plan, blocks=blocks, reentrant=reentrant)
    opt = build_optimizer(model, plan, optimizer_class, blocks=blocks, offload_config=offload_config,
                          param_groups=param_groups, **opt_kwargs)
    return model, opt
