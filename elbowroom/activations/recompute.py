"""Recompute: wrap a module in place so that its forward runs again in backward.

Built on :func:`torch.utils.checkpoint.checkpoint` (non-reentrant by default) and, for
``mode="selective"``, on the two dispatch modes of :mod:`elbowroom.activations.selective` (torch's own
under ``torch.compile``): the outputs of matmuls and attention kernels are kept, norms and pointwise ops
are recomputed. Dropout
and any other RNG inside a recomputed region replay exactly (``preserve_rng_state=True``), so the
gradients equal a plain run's. For that, an op that draws random numbers (dropout, an attention
kernel with ``dropout_p > 0``) is never kept, whatever the policy says: the recompute restores the
RNG state and replays the region's draws in order, and a kept op would skip its draw there, so every
later dropout in the region would get another mask (on CUDA, fp32 attention with dropout runs the
efficient kernel, whose philox draw made the gradients of a "selective" block wrong).

Hugging Face decoder layers work as they are called (``attention_mask``, ``position_embeddings=(cos, sin)``,
``position_ids``... as keywords), in every mode; tensor keywords get the gradients of a plain run. A layer
called with its KV cache on (``use_cache=True`` or a ``past_key_values`` cache) raises a ValueError naming
``use_cache=False``: the recompute runs the forward again and would write the cache a second time (HF
itself turns the cache off under gradient checkpointing). No-grad calls (generation) are not recomputed.

The module keeps its class, its parameters and its ``state_dict`` keys: only the instance's
``forward`` is replaced (see :mod:`elbowroom.activations._wrap`), so a checkpoint saved from a
wrapped model loads into an unwrapped one and back.

Example::

    import elbowroom
    for blk in model.blocks:
        elbowroom.checkpoint(blk, "selective")
    # or, for every block of a model (HF-familiar spelling):
    elbowroom.gradient_checkpointing_enable(model, {"use_reentrant": False})
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch.nn as nn
from torch.utils.checkpoint import CheckpointPolicy

from elbowroom.activations import _wrap, selective
from elbowroom.activations.selective import default_selective_ops, draws_random_numbers

logger = logging.getLogger(__name__)

__all__ = [
    "CHECKPOINT_MODES",
    "checkpoint",
    "checkpoint_blocks",
    "default_selective_ops",
    "draws_random_numbers",
    "reentrant_default",
    "find_blocks",
    "gradient_checkpointing_disable",
    "gradient_checkpointing_enable",
    "selective_policy",
    "uncheckpoint",
]

CHECKPOINT_MODES = ("full", "selective")
"""The recompute modes: every op of the region ("full") or all but matmuls and attention ("selective")."""

Policy = Callable[..., Any]
"""A selective-checkpoint policy: ``(ctx, op, *args, **kwargs) -> CheckpointPolicy | bool``."""


def selective_policy(keep: Iterable | None = None) -> Policy:
    """A policy that saves the outputs of ``keep`` ops and recomputes every other op.

    Args:
        keep: aten ``OpOverload``s to keep; ``None`` keeps :func:`default_selective_ops`.

    Returns:
        A policy callable for :func:`torch.utils.checkpoint.create_selective_checkpoint_contexts`.
    """
    keep_ops = selective.resolve_keep_ops(keep)

    def policy(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
        return CheckpointPolicy.MUST_SAVE if op in keep_ops else CheckpointPolicy.PREFER_RECOMPUTE

    policy.keep_ops = keep_ops  # type: ignore[attr-defined]  (for inspection and tests)
    return policy


def _rng_safe(policy: Policy) -> Policy:
    """``policy``, except that ops drawing random numbers are recomputed (see the module docstring)."""
    if getattr(policy, "rng_safe", False):
        return policy

    def safe(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> Any:
        decision = policy(ctx, op, *args, **kwargs)
        if decision in selective.SAVE_DECISIONS and draws_random_numbers(op, args, kwargs):
            # kept, it would not draw in the recompute: every later draw of the region would shift
            return CheckpointPolicy.PREFER_RECOMPUTE
        return decision

    safe.rng_safe = True  # type: ignore[attr-defined]
    safe.keep_ops = getattr(policy, "keep_ops", None)  # type: ignore[attr-defined]
    safe.inner = policy  # type: ignore[attr-defined]
    return safe


def _resolve_policy(mode: str, policy: Policy | Iterable | None) -> Policy | None:
    if mode == "full":
        if policy is not None:
            raise ValueError("a checkpoint policy only applies to mode='selective'; drop policy= or pass it "
                             "with mode='selective'")
        return None
    if policy is None:
        return _rng_safe(selective_policy())
    if callable(policy):
        return _rng_safe(policy)
    return _rng_safe(selective_policy(policy))


def checkpoint(
    module: nn.Module,
    mode: str = "full",
    *,
    use_reentrant: bool = False,
    preserve_rng_state: bool = True,
    policy: Policy | Iterable | None = None,
    determinism_check: str = "default",
) -> nn.Module:
    """Make ``module`` recompute its forward in backward instead of saving its activations.

    Wraps the module in place (its ``forward`` is replaced on the instance; class, parameters and
    ``state_dict`` keys are unchanged) and returns it. Calling it again replaces the settings;
    :func:`uncheckpoint` undoes it. Composes with :func:`elbowroom.offload` applied per module: the
    offload region always sits outside the recomputed region, so it sees what the checkpoint saves
    (the block's inputs, and in "selective" mode the kept matmul/attention outputs).

    Args:
        module: the module to wrap, typically one transformer block.
        mode: "full" recomputes every op of the forward; "selective" keeps the outputs of matmuls and
            attention kernels and recomputes norms and pointwise ops.
        use_reentrant: use torch's reentrant implementation (not with "selective"). Keyword arguments work in
            both implementations; under the reentrant one every tensor of the call (a keyword, a tuple such
            as ``position_embeddings=(cos, sin)``) is passed to it positionally, so it gets its gradient.
        preserve_rng_state: replay RNG (dropout) exactly in the recompute.
        policy: for "selective" only: a policy callable ``(ctx, op, *args, **kwargs) ->
            CheckpointPolicy | bool`` or an iterable of aten OpOverloads to keep. Ops that draw random
            numbers are recomputed whatever it says (see the module docstring).
        determinism_check: passed to torch's non-reentrant checkpoint ("default" or "none").

    Returns:
        ``module`` itself.

    Raises:
        ValueError: on an unknown mode or a combination torch cannot run; when the wrapped module is later
            called for training with a KV cache (``use_cache=True``, ``past_key_values``), which the
            recompute would write twice: call the model with ``use_cache=False``.
        TypeError: if ``module`` is not an ``nn.Module``.
    """
    if not isinstance(module, nn.Module):
        raise TypeError(f"checkpoint() wraps an nn.Module, got {type(module).__name__}")
    if mode not in CHECKPOINT_MODES:
        raise ValueError(f"checkpoint mode must be one of {', '.join(CHECKPOINT_MODES)}, got {mode!r}")
    if use_reentrant and mode == "selective":
        raise ValueError("selective checkpoint needs the non-reentrant implementation; pass use_reentrant=False")
    if determinism_check not in ("default", "none"):
        raise ValueError(f"determinism_check must be 'default' or 'none', got {determinism_check!r}")
    spec = _wrap.RecomputeSpec(
        mode=mode,
        use_reentrant=use_reentrant,
        preserve_rng_state=preserve_rng_state,
        policy=_resolve_policy(mode, policy),
        determinism_check=determinism_check,
    )
    _wrap.set_recompute(module, spec)
    return module


def reentrant_default() -> bool:
    """Whether the planner recomputes whole blocks with torch's reentrant checkpoint: yes, unless torch.distributed
    is initialized (DDP and FSDP2 need the non-reentrant one).

    The reentrant checkpoint runs the forward under no_grad and keeps only the inputs, so it hooks no saved tensor:
    a recomputed block costs the host less, once in the forward and once per saved tensor in the backward (a small
    Hugging Face block on CPU: 0.39 ms over a plain step against 0.82), and its backward runs without the
    interpreter's lock that the optimizer's threads share. Where the host bounds the step that is the step's time:
    GPT-2-XL at 24 GiB trained 22-25% more tokens per second (``BENCHMARKS.md``). It does not work with
    ``torch.autograd.grad`` nor with ``backward(inputs=...)`` (torch raises); a loop using them passes
    ``reentrant=False`` to :func:`elbowroom.fit`.
    """
    import torch.distributed as dist

    return not (dist.is_available() and dist.is_initialized())


def uncheckpoint(module: nn.Module) -> nn.Module:
    """Undo :func:`checkpoint` on ``module`` (offload settings, if any, stay). Returns the module."""
    _wrap.set_recompute(module, None)
    return module


def find_blocks(model: nn.Module) -> nn.ModuleList:
    """The repeated blocks of ``model``, in forward order.

    ``model.blocks`` when it is an ``nn.ModuleList`` (elbowroom's reference models); otherwise the
    longest ``nn.ModuleList`` whose children all share one class (``model.model.layers`` of a Hugging
    Face ``LlamaForCausalLM``, ``model.transformer.h`` of ``GPT2LMHeadModel``; tested).

    Raises:
        ValueError: if the model has no such list.
    """
    blocks = getattr(model, "blocks", None)
    if isinstance(blocks, nn.ModuleList) and len(blocks):
        return blocks
    best: nn.ModuleList | None = None
    for _, mod in model.named_modules():
        if isinstance(mod, nn.ModuleList) and len(mod) and len({type(m) for m in mod}) == 1:
            if best is None or len(mod) > len(best):
                best = mod
    if best is None:
        raise ValueError(
            f"{type(model).__name__} has no repeated blocks: give it a `.blocks` nn.ModuleList, or wrap "
            "modules one by one with elbowroom.checkpoint(module)"
        )
    return best


def select_blocks(n: int, *, every: int = 1, blocks: Sequence[int] | None = None) -> list[int]:
    """Indices of the blocks a model-level policy applies to.

    Args:
        n: number of blocks.
        every: every k-th block, starting with block 0 (``every=2`` -> 0, 2, 4, ...).
        blocks: explicit indices (negative ones count from the end); overrides ``every``.

    Returns:
        Sorted, de-duplicated indices in ``[0, n)``.

    Raises:
        ValueError: on ``every < 1``, an index out of range, or both ``every`` and ``blocks`` given.
    """
    if blocks is not None:
        if every != 1:
            raise ValueError("give either every= or blocks= (explicit indices), not both")
        out = set()
        for i in blocks:
            if not isinstance(i, int) or isinstance(i, bool):
                raise TypeError(f"block indices must be ints, got {i!r}")
            if not -n <= i < n:
                raise ValueError(f"block index {i} out of range for a model with {n} blocks")
            out.add(i % n)
        return sorted(out)
    if not isinstance(every, int) or every < 1:
        raise ValueError(f"every must be a positive int (1 = every block), got {every!r}")
    return list(range(0, n, every))


def checkpoint_blocks(
    model: nn.Module,
    mode: str = "full",
    *,
    every: int = 1,
    blocks: Sequence[int] | None = None,
    **kwargs: Any,
) -> nn.Module:
    """Apply :func:`checkpoint` to every block, every k-th block, or listed blocks of ``model``.

    Args:
        model: a model with repeated blocks (see :func:`find_blocks`).
        mode: "full" or "selective".
        every: checkpoint blocks 0, k, 2k, ...
        blocks: explicit block indices; overrides ``every``.
        **kwargs: passed to :func:`checkpoint` (``use_reentrant``, ``preserve_rng_state``, ``policy``).

    Returns:
        ``model`` itself.
    """
    all_blocks = find_blocks(model)
    for i in select_blocks(len(all_blocks), every=every, blocks=blocks):
        checkpoint(all_blocks[i], mode, **kwargs)
    return model


def gradient_checkpointing_enable(
    model: nn.Module, gradient_checkpointing_kwargs: dict[str, Any] | None = None
) -> nn.Module:
    """Hugging Face-style alias: recompute every block of ``model``.

    Args:
        model: a model with repeated blocks (see :func:`find_blocks`).
        gradient_checkpointing_kwargs: keyword arguments of :func:`checkpoint_blocks`
            (``use_reentrant`` defaults to False here, ``mode``, ``every``, ``blocks``, ...).

    Returns:
        ``model`` itself.
    """
    kwargs = dict(gradient_checkpointing_kwargs or {})
    kwargs.setdefault("use_reentrant", False)
    return checkpoint_blocks(model, **kwargs)


def gradient_checkpointing_disable(model: nn.Module) -> nn.Module:
    """Undo :func:`gradient_checkpointing_enable` on every block. Returns the model."""
    for blk in find_blocks(model):
        uncheckpoint(blk)
    return model
