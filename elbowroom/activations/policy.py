"""Model-level activation policy: which blocks recompute, which offload, and how much.

Two entry points, both wrapping the model's blocks in place (``state_dict`` keys unchanged) and
returning the model:

- :func:`apply_activation_policy` takes the trainer's switches (:class:`ActivationConfig`);
- :func:`apply_block_policies` takes one :class:`BlockPolicy` per block (what a planner emits).

Nothing has to be entered per step: the hooks live in the blocks' forwards, so a plain training
loop works unchanged. :func:`get_offload_engine` gives the engine (for its stats).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, fields, replace
from typing import Any

import torch
import torch.nn as nn

from elbowroom.activations import _wrap
from elbowroom.activations.offload import (
    DEFAULT_MIN_OFFLOAD_BYTES,
    DEFAULT_PREFETCH_WINDOW_BYTES,
    OffloadEngine,
    offload_module,
)
from elbowroom.activations.recompute import CHECKPOINT_MODES, checkpoint, find_blocks, select_blocks, uncheckpoint

logger = logging.getLogger(__name__)

__all__ = [
    "ActivationConfig",
    "BlockPolicy",
    "apply_activation_policy",
    "apply_block_policies",
    "get_offload_engine",
    "remove_activation_policy",
]

_CHECKPOINT_CHOICES = ("none", *CHECKPOINT_MODES)
_STATE_ATTR = "_elbowroom_activations"


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _check_ratio(name: str, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0.0 <= value <= 1.0:
        raise ValueError(f"{name} must be in [0, 1], got {value!r}")


@dataclass(frozen=True)
class BlockPolicy:
    """What one block does with its activations."""

    checkpoint: str = "none"
    """Recompute: "none" (keep), "full" (recompute the block) or "selective" (keep matmul/attention outputs)."""
    offload_ratio: float = 0.0
    """Fraction of the block's saved bytes sent to host memory, largest tensors first: the activations of
    a kept block, the kept matmul/attention outputs of a selective block; a "full" block saves only its
    input, so any ratio > 0 offloads that input."""
    offload_input: bool = False
    """Offload the input a checkpointed block saves (its only saved tensor under "full")."""

    def __post_init__(self) -> None:
        if self.checkpoint not in _CHECKPOINT_CHOICES:
            raise ValueError(f"checkpoint must be one of {', '.join(_CHECKPOINT_CHOICES)}, got {self.checkpoint!r}")
        _check_ratio("offload_ratio", self.offload_ratio)
        if self.offload_input and self.checkpoint == "none":
            raise ValueError(
                "offload_input needs a checkpointed block (checkpoint='full' or 'selective'); for a kept block "
                "use offload_ratio"
            )

    @property
    def offloads(self) -> bool:
        return self.offload_input or self.offload_ratio > 0.0


@dataclass(frozen=True)
class ActivationConfig:
    """The trainer's activation-memory switches (``--activations.<field>``), the one config of this mechanism.

    Field types stay simple (str, int, float, bool, ``int | None``, ``tuple[int, ...] | None``) so that a CLI can
    expose every field; contradictory or no-effect combinations raise ValueError with the fix.
    """

    checkpoint: str = "none"
    """Recompute blocks: none | full | selective (keep matmul and attention outputs, recompute the rest)."""
    every: int = 1
    """Checkpoint every k-th block (0, k, 2k, ...); 1 checkpoints every block."""
    checkpoint_blocks: tuple[int, ...] | None = None
    """Explicit indices of the blocks to checkpoint (negative from the end); overrides every."""
    offload_ratio: float = 0.0
    """Fraction of each block's saved bytes offloaded to pinned host memory (largest first); 0 disables."""
    offload_checkpoint_inputs: bool = False
    """Offload the input each checkpointed block saves (per-block checkpoint speed at lower memory)."""
    host_memory_limit_bytes: int | None = None
    """Cap on the pinned host pool; exceeding it raises an error naming the need. None: no cap."""
    use_reentrant: bool = False
    """torch's reentrant checkpoint (not with selective)."""
    min_offload_bytes: int = DEFAULT_MIN_OFFLOAD_BYTES
    """Saved tensors smaller than this stay on the device."""
    keep_last: int = 1
    """The last blocks never offload (backward needs them first); at least 1."""
    prefetch_window_bytes: int = DEFAULT_PREFETCH_WINDOW_BYTES
    """Bytes of an offloaded block brought back ahead of its backward (less lowers the backward peak)."""
    simulate_host: bool = False
    """On a CPU model, offload anyway into a separate host buffer (tests the engine on CPU; saves nothing)."""

    def __post_init__(self) -> None:
        if isinstance(self.checkpoint_blocks, list):
            object.__setattr__(self, "checkpoint_blocks", tuple(self.checkpoint_blocks))
        if self.checkpoint not in _CHECKPOINT_CHOICES:
            raise ValueError(
                f"activations.checkpoint must be one of {', '.join(_CHECKPOINT_CHOICES)}, got {self.checkpoint!r}"
            )
        if not _is_int(self.every) or self.every < 1:
            raise ValueError(f"activations.every must be a positive int (1 = every block), got {self.every!r}")
        if self.checkpoint == "none":
            if self.every != 1 or self.checkpoint_blocks is not None:
                raise ValueError(
                    "activations.every / checkpoint_blocks choose blocks to checkpoint, but checkpoint='none'; "
                    "set activations.checkpoint to 'full' or 'selective'"
                )
            if self.offload_checkpoint_inputs:
                raise ValueError(
                    "activations.offload_checkpoint_inputs needs checkpointed blocks; set activations.checkpoint "
                    "to 'full' or 'selective' (or use offload_ratio to offload activations)"
                )
            if self.use_reentrant:
                raise ValueError("activations.use_reentrant has no effect without checkpoint; drop it")
        if self.checkpoint_blocks is not None:
            if not isinstance(self.checkpoint_blocks, tuple) or not all(_is_int(i) for i in self.checkpoint_blocks):
                raise ValueError(
                    "activations.checkpoint_blocks must be a tuple of block indices (ints), "
                    f"got {self.checkpoint_blocks!r}"
                )
        if self.checkpoint_blocks is not None and self.every != 1:
            raise ValueError("give either activations.every or activations.checkpoint_blocks, not both")
        if self.use_reentrant and self.checkpoint == "selective":
            raise ValueError("selective checkpoint needs use_reentrant=False")
        _check_ratio("activations.offload_ratio", self.offload_ratio)
        if self.host_memory_limit_bytes is not None:
            if not _is_int(self.host_memory_limit_bytes) or self.host_memory_limit_bytes <= 0:
                raise ValueError(
                    f"activations.host_memory_limit_bytes must be a positive int, got {self.host_memory_limit_bytes!r}"
                )
            if not self.offloads:
                raise ValueError(
                    "activations.host_memory_limit_bytes caps the offload pool, but nothing is offloaded; set "
                    "offload_ratio or offload_checkpoint_inputs, or drop the limit"
                )
        if not _is_int(self.min_offload_bytes) or self.min_offload_bytes < 0:
            raise ValueError(
                f"activations.min_offload_bytes must be a non-negative int, got {self.min_offload_bytes!r}"
            )
        if not _is_int(self.prefetch_window_bytes) or self.prefetch_window_bytes < 1:
            raise ValueError(
                f"activations.prefetch_window_bytes must be a positive int, got {self.prefetch_window_bytes!r}"
            )
        for name in ("offload_checkpoint_inputs", "use_reentrant", "simulate_host"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"activations.{name} must be a bool, got {getattr(self, name)!r}")
        if self.simulate_host and not self.offloads:
            raise ValueError(
                "activations.simulate_host has no effect without offload; set offload_ratio or "
                "offload_checkpoint_inputs, or drop it"
            )
        if not _is_int(self.keep_last) or self.keep_last < 1:
            raise ValueError(
                "activations.keep_last must be >= 1 (the last block is needed first in backward), "
                f"got {self.keep_last!r}"
            )

    @property
    def offloads(self) -> bool:
        """Whether anything is offloaded."""
        return self.offload_ratio > 0.0 or self.offload_checkpoint_inputs

    def block_policies(self, n_blocks: int) -> list[BlockPolicy]:
        """The per-block plan these switches mean, for a model with ``n_blocks`` blocks."""
        ckpt = set()
        if self.checkpoint != "none":
            ckpt = set(select_blocks(n_blocks, every=self.every, blocks=self.checkpoint_blocks))
        out = []
        for i in range(n_blocks):
            may_offload = i < n_blocks - self.keep_last
            mode = self.checkpoint if i in ckpt else "none"
            if mode == "none":
                out.append(BlockPolicy("none", self.offload_ratio if may_offload else 0.0))
            else:
                out.append(
                    BlockPolicy(
                        mode,
                        offload_ratio=self.offload_ratio if may_offload and mode == "selective" else 0.0,
                        offload_input=may_offload and (self.offload_checkpoint_inputs or self.offload_ratio > 0.0),
                    )
                )
        return out


def apply_activation_policy(model: nn.Module, config: ActivationConfig | None = None, **kwargs: Any) -> nn.Module:
    """Apply the trainer's activation switches to ``model``'s blocks, in place.

    ``apply_activation_policy(model, checkpoint="full", offload_checkpoint_inputs=True)`` or
    ``apply_activation_policy(model, ActivationConfig(...))``; keyword arguments override fields of
    ``config``. Re-applying replaces the previous policy; the all-default config removes it.

    Args:
        model: a model with repeated blocks (``model.blocks``, or the longest homogeneous ModuleList).
        config: the switches; None means the defaults.
        **kwargs: field overrides of :class:`ActivationConfig`.

    Returns:
        ``model`` itself.

    Raises:
        ValueError: on settings that contradict each other or would silently do nothing.
        TypeError: on an unknown keyword.
    """
    cfg = config or ActivationConfig()
    if kwargs:
        known = {f.name for f in fields(ActivationConfig)}
        unknown = sorted(set(kwargs) - known)
        if unknown:
            raise TypeError(f"unknown activation setting(s) {', '.join(unknown)}; known: {', '.join(sorted(known))}")
        cfg = replace(cfg, **kwargs)
    blocks = find_blocks(model)
    if cfg.offloads and len(blocks) <= cfg.keep_last:
        raise ValueError(
            f"the model has {len(blocks)} block(s) and the last {cfg.keep_last} never offload, so nothing would be "
            "offloaded; lower keep_last or drop the offload settings"
        )
    return apply_block_policies(
        model,
        cfg.block_policies(len(blocks)),
        use_reentrant=cfg.use_reentrant,
        host_memory_limit_bytes=cfg.host_memory_limit_bytes,
        min_offload_bytes=cfg.min_offload_bytes,
        prefetch_window_bytes=cfg.prefetch_window_bytes,
        simulate_host=cfg.simulate_host,
    )


def apply_block_policies(
    model: nn.Module,
    policies: Sequence[BlockPolicy] | Mapping[int, BlockPolicy],
    *,
    engine: OffloadEngine | None = None,
    use_reentrant: bool = False,
    host_memory_limit_bytes: int | None = None,
    min_offload_bytes: int = DEFAULT_MIN_OFFLOAD_BYTES,
    max_inflight_regions: int = 1,
    prefetch_window_bytes: int = DEFAULT_PREFETCH_WINDOW_BYTES,
    simulate_host: bool = False,
    prefetch_lead_blocks: int = _wrap.PREFETCH_LEAD_BLOCKS,
) -> nn.Module:
    """Give each block of ``model`` its own :class:`BlockPolicy`, in place.

    In a plan that recomputes or offloads anything, the blocks kept whole still get a region of the engine
    with nothing to offload: their saved weight casts (autocast's bf16 copies) are cast again in backward
    instead of being held from forward (W1: ~0.1 GiB per block, ~0.1 ms to recast), and autocast's weight cache
    is off inside every block of the plan. An all-default plan removes every wrapper.

    Args:
        model: a model with repeated blocks.
        policies: one policy per block, or a mapping block index -> policy (others are kept whole).
        engine: the offload engine to use; None makes one for this model when a policy offloads.
        use_reentrant: torch's reentrant checkpoint for the "full" blocks ("selective" ones need the non-reentrant
            one and keep it): less host work per recomputed block, which bounds the step of small blocks
            (:func:`elbowroom.plan.apply.reentrant_default` says when the planner uses it).
        host_memory_limit_bytes: cap of a new engine's host pool.
        min_offload_bytes: smallest tensor a new engine offloads.
        max_inflight_regions: blocks whose copies may still run while the next block computes (see
            :class:`~elbowroom.activations.offload.OffloadEngine`).
        prefetch_window_bytes: how many bytes of an offloaded block travel back ahead of its backward (a new
            engine's; less than a block's offloaded bytes lowers the peak in backward, and the link stays busy
            as long as it exceeds the largest saved tensor).
        simulate_host: a new engine on a CPU model offloads anyway, into a separate host buffer (for tests; see
            :class:`~elbowroom.activations.offload.OffloadEngine`). Without it a CPU model offloads nothing.
        prefetch_lead_blocks: how many blocks before the backward reaches it an offloaded block starts back, at
            most: blocks that offload nothing in between lend it their backward (see
            :class:`~elbowroom.activations._wrap.PrefetchChain`; the planner prices the same lead).

    Returns:
        ``model`` itself.
    """
    blocks = find_blocks(model)
    n = len(blocks)
    if isinstance(policies, Mapping):
        plan = [BlockPolicy()] * n
        for i, p in policies.items():
            if not -n <= i < n:
                raise ValueError(f"block index {i} out of range for a model with {n} blocks")
            plan[i % n] = p
    else:
        plan = list(policies)
        if len(plan) != n:
            raise ValueError(f"got {len(plan)} block policies for a model with {n} blocks")
    for p in plan:
        if not isinstance(p, BlockPolicy):
            raise TypeError(f"block policies must be BlockPolicy, got {type(p).__name__}")

    if not isinstance(prefetch_lead_blocks, int) or isinstance(prefetch_lead_blocks, bool) or prefetch_lead_blocks < 1:
        raise ValueError(f"prefetch_lead_blocks must be an int >= 1, got {prefetch_lead_blocks!r}")
    remove_activation_policy(model)
    if all(p == BlockPolicy() for p in plan):
        return model  # nothing to recompute or offload: no wrapper at all
    offloads = any(p.offloads for p in plan)
    if engine is None:
        engine = OffloadEngine(
            device=_model_device(model),
            min_offload_bytes=min_offload_bytes,
            host_memory_limit_bytes=host_memory_limit_bytes,
            keep_module=model,
            max_inflight_regions=max_inflight_regions,
            prefetch_window_bytes=prefetch_window_bytes,
            simulate_host=simulate_host,
        )
    chain = _wrap.PrefetchChain(n, prefetch_lead_blocks) if offloads else None
    for i, (blk, p) in enumerate(zip(blocks, plan)):
        if p.checkpoint != "none":
            checkpoint(blk, p.checkpoint, use_reentrant=use_reentrant and p.checkpoint == "full")
        if p.offloads:
            # one tag per (block class, policy): identical blocks share the ratio measurement
            tag = (type(blk).__qualname__, p.checkpoint, p.offload_ratio, p.offload_input)
            if p.checkpoint == "none":
                in_ratio = p.offload_ratio
            else:  # what the hooks see of a checkpointed block is its input
                in_ratio = 1.0 if p.offload_input or p.checkpoint == "full" else 0.0
            offload_module(blk, in_ratio, engine=engine, tag=tag, cache_ratio=p.offload_ratio)
        elif p.checkpoint == "none":
            # kept whole: a region that offloads nothing, so that its weight casts are recast in backward
            _wrap.set_offload(blk, _wrap.OffloadSpec(engine, 0.0, 0.0, (type(blk).__qualname__, "kept")))
        if chain is not None:
            _wrap.set_chain(blk, chain, i)
    model.__dict__[_STATE_ATTR] = (engine if offloads else None, tuple(plan))
    logger.info(
        "activation policy: %d checkpointed (%d selective), %d offloading of %d blocks",
        sum(p.checkpoint != "none" for p in plan), sum(p.checkpoint == "selective" for p in plan),
        sum(p.offloads for p in plan), n,
    )
    return model


def _model_device(model: nn.Module) -> torch.device | None:
    """The device of the model's first parameter that has one; None for a model on meta (or without
    parameters): the engine then adopts the device of the first tensor it packs, and raises on a saved tensor
    of another accelerator (it never skips one silently)."""
    for p in model.parameters():
        if p.device.type != "meta":
            return p.device
    return None


def remove_activation_policy(model: nn.Module) -> nn.Module:
    """Unwrap every block of ``model`` (recompute, offload, prefetch chain). Returns the model."""
    for blk in find_blocks(model):
        uncheckpoint(blk)
        offload_module(blk, 0.0)
        _wrap.set_chain(blk, None)
    model.__dict__.pop(_STATE_ATTR, None)
    return model


def get_offload_engine(model: nn.Module) -> OffloadEngine | None:
    """The engine :func:`apply_activation_policy` made for ``model`` (None when nothing offloads)."""
    state = model.__dict__.get(_STATE_ATTR)
    return state[0] if state is not None else None


def get_block_policies(model: nn.Module) -> tuple[BlockPolicy, ...] | None:
    """The per-block plan applied to ``model``, or None."""
    state = model.__dict__.get(_STATE_ATTR)
    return state[1] if state is not None else None
