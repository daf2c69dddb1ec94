"""elbowroom.activations: activation memory, block by block: keep, recompute, or offload to host.

The one entry point for a trainer (or any training loop)::

    from elbowroom.activations import apply_activation_policy
    apply_activation_policy(model, checkpoint="full", offload_checkpoint_inputs=True)
    # same as apply_activation_policy(model, ActivationConfig(checkpoint="full", ...))

It wraps ``model``'s repeated blocks in place (``model.blocks``, or the longest ModuleList of one
block class) and returns the model. ``state_dict`` keys do not change, and nothing has to be entered
per step: recompute and offload hooks live in the blocks' forwards, so a plain loop of
``loss = f(model(x)); loss.backward(); opt.step()`` just works. Settings (:class:`ActivationConfig`):

- ``checkpoint``: "none" | "full" | "selective" (keep matmul and attention outputs, recompute norms
  and pointwise ops); ``every`` (every k-th block from block 0) or ``checkpoint_blocks`` (indices);
  ``use_reentrant``.
- ``offload_ratio``: fraction of each block's saved bytes sent to pinned host memory, largest first
  (haiscale semantics: the first pass measures). On selective blocks it applies to the kept
  outputs; a fully checkpointed block saves only its input, which any ratio > 0 offloads.
- ``offload_checkpoint_inputs``: offload the input each checkpointed block saves.
- ``host_memory_limit_bytes``: cap on the pinned pool (ValueError naming the need when exceeded);
  ``min_offload_bytes``; ``keep_last`` (the last blocks never offload: backward needs them first).
- On a CPU model offload does nothing (the tensors are in host memory already): no pool, a warning once.
  ``simulate_host=True`` offloads anyway into a separate host buffer, which is how the CPU tests
  exercise the engine.

Hugging Face models work as they are: their blocks are found (``model.model.layers``,
``model.transformer.h``) and recompute passes the layers' keyword arguments through, gradients of tensor
keywords included. Train with ``use_cache=False``: a recomputed layer refuses to write a KV cache twice.

Bad or contradictory settings raise ValueError with the fix. For a per-block plan (what the planner
emits) use :func:`apply_block_policies` with one :class:`BlockPolicy` per block;
:func:`get_offload_engine` returns the model's engine (``.stats()``), :func:`remove_activation_policy`
undoes everything.

Single mechanisms by hand: :func:`checkpoint` (``elbowroom.checkpoint(block, "selective")``),
:func:`gradient_checkpointing_enable`, :func:`offload` (``with elbowroom.offload(0.5, tag="blk"):``)
and :func:`offload_module`. :func:`compile_blocks` compiles each block in place (regional
compilation: one graph for all blocks alike, inside their policies). The output head and the loss:
:func:`linear_cross_entropy` computes ``cross_entropy(head(h), targets)`` chunk by chunk, so the logits never
exist whole.
"""

from elbowroom.activations.compiled import CompiledBlocks, compile_blocks, uncompile_blocks
from elbowroom.activations.offload import OffloadEngine, OffloadStats, offload, offload_module
from elbowroom.activations.policy import (
    ActivationConfig,
    BlockPolicy,
    apply_activation_policy,
    apply_block_policies,
    get_offload_engine,
    remove_activation_policy,
)
from elbowroom.activations.recompute import (
    checkpoint,
    checkpoint_blocks,
    gradient_checkpointing_disable,
    gradient_checkpointing_enable,
    selective_policy,
    uncheckpoint,
)
from elbowroom.ops.linear_cross_entropy import LinearCrossEntropy, linear_cross_entropy

__all__ = [
    "ActivationConfig",
    "BlockPolicy",
    "CompiledBlocks",
    "LinearCrossEntropy",
    "OffloadEngine",
    "OffloadStats",
    "apply_activation_policy",
    "apply_block_policies",
    "checkpoint",
    "checkpoint_blocks",
    "compile_blocks",
    "get_offload_engine",
    "gradient_checkpointing_disable",
    "gradient_checkpointing_enable",
    "linear_cross_entropy",
    "offload",
    "offload_module",
    "remove_activation_policy",
    "selective_policy",
    "uncheckpoint",
    "uncompile_blocks",
]
