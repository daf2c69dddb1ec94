"""Regional compilation: each repeated block's own forward under ``torch.compile``, in place.

One compiled graph serves every block of one class and input shape (``torch.compile`` caches by code, and a block's
parameters are the graph's inputs), so a 24-block model compiles one block's worth. Compiled whole, W1 under DDP on
4 GPUs had not reached its first step after 100 s (``BENCHMARKS.md``, nineteenth session).

What is compiled is the block's forward, with its checkpoint where it has one; everything around it stays eager and
works as it does without:

- the activation policy's offload region and backward prefetch: an offloading block's hooks pack what the compiled
  graph saves (saved-tensor hooks are not traced, so the region is never inside the compiled function);
- DDP's and FSDP2's module hooks, and the parameters they gather or all-reduce;
- an offloading optimizer's waits for updated weights (moved from the block's submodules to the block);
- the embedding, the head, the loss (the fused head + loss too) and the optimizer.

A recomputed block compiles its checkpoint with its forward, so the backward graph recomputes: whole blocks under
torch's non-reentrant checkpoint (the one the compiler traces), selective ones under torch's own selective modes,
which tag the graph for the compiler's recompute (keep matmul and attention outputs, recompute the rest), as our
selective dispatch modes must see every op, which a compiled forward hides. :func:`arrangement` says which blocks
keep an eager checkpoint around a compiled forward (tensor parallel) or stay eager.

``state_dict`` keys do not change (nothing is wrapped in ``OptimizedModule``), so checkpoints load either way.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import types
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn as nn

from elbowroom.activations import _wrap
from elbowroom.activations.recompute import find_blocks

logger = logging.getLogger(__name__)

__all__ = ["POINTWISE_RECOMPUTE", "CompiledBlocks", "compile_blocks", "is_compiled", "uncompile_blocks"]

_MARK = "_elbowroom_compiled"


@dataclass(frozen=True)
class CompiledBlocks:
    """What :func:`compile_blocks` did."""

    compiled: int
    """Blocks that now run compiled."""
    eager: int
    """Selective blocks that offload their kept outputs, left eager (the offload region's saved-tensor hooks are not
    traced by the compiler)."""


POINTWISE_RECOMPUTE = {"ban_recompute_materialized_backward": False}
"""The partitioner's settings under ``compile_blocks(recompute_pointwise=True)``: the min-cut partitioner may then
recompute in backward the pointwise results a backward kernel would read whole (by default it saves them), such as
autocast's bf16 casts of fp32 weights (it saves the free weight instead) and an activation's product with its gate.
On CPU a W1-shaped block (dim 256) kept whole saved 29% fewer bytes with bf16 weights, and 46% fewer with fp32
weights under autocast (the latter: ``benchmarks/compiled_saved.py``)."""


def compile_blocks(model: nn.Module, blocks: nn.ModuleList | None = None, *, recompute_pointwise: bool = False,
                   **compile_kwargs: Any) -> CompiledBlocks:
    """Compile each of ``model``'s repeated blocks, in place.

    Apply activation policies (``apply_block_policies``, a plan's ``apply``) before, and data-parallel wrappers
    before or after: a block compiled already is left as it is. Build an offloading optimizer that waits for its
    weights in forward (``CPUOffloadOptimizer.overlap_with_forward``) before: its waits on a block's submodules
    move to the block, outside the compiled forward (added after, each would break the graph where it stands).

    - A block kept whole, or kept and offloading: its own forward is compiled, inside the policy's wrapper (the
      offload region stays eager around it).
    - A block recomputed whole: its checkpoint is compiled with its forward (torch's non-reentrant one, which the
      compiler traces, whatever the policy asked), so the backward graph recomputes the forward itself: what it
      saves is the block's inputs, and the offload region, where its input leaves, stays eager around it. Eager
      around a compiled forward, a recomputed block cost the host 0.80-0.89 ms on the development CPU
      (``benchmarks/host_overhead.py --compiled``), compiled with its checkpoint 0.38, a kept block 0.26. Over
      tensor-parallel DTensor parameters the checkpoint stays eager around the compiled forward (the compiler
      would save their device mesh for the backward; apply tensor parallel before compiling). FSDP2's units compile
      their checkpoint: the compiler sees gathered tensors.
    - A selective block: the wrapper is compiled with the forward, so its checkpoint runs under torch's selective
      modes, which tag the graph for the compiler's recompute (ours must see every op, which a compiled forward
      hides). One that offloads its kept outputs compiles its checkpoint alone, and the offload region stays eager
      around it: what the compiled graph saves (the kept outputs, largest first, to the region's share of their
      bytes; the block's inputs only when all of it leaves) travels as a kept block's saved tensors do. One that
      offloads its input and a share of its kept outputs stays eager.

    Args:
        model: the model (its blocks are found as the planner finds them, :func:`find_blocks`).
        blocks: the blocks to compile, when they are not ``model``'s longest list of one class.
        recompute_pointwise: compile (and recompile) each block under :data:`POINTWISE_RECOMPUTE`, so that its
            backward recomputes pointwise results instead of saving them: fewer bytes saved, a little more work in
            backward. A profile and a plan made with the same option (``profile(compiled={...})``,
            ``fit(compile={...})``) price it as it runs.
        **compile_kwargs: passed to ``torch.compile`` (``mode=``, ``fullgraph=``, ``dynamic=``, ...).

    Returns:
        How many blocks run compiled and how many were left eager.

    Raises:
        ValueError: if ``model`` has no repeated blocks (compile it whole with ``torch.compile`` instead).
    """
    blocks = find_blocks(model) if blocks is None else blocks
    if getattr(getattr(model, "config", None), "use_cache", False):
        # a Hugging Face model builds a KV cache in every forward unless told not to, and hands it to each block:
        # the compiled blocks guard on its state, which differs from layer to layer, and recompile until torch's
        # limit turns them back to eager
        logger.warning("compile_blocks: model.config.use_cache is True, so each forward builds a KV cache and the "
                       "compiled blocks recompile for it; for training set model.config.use_cache = False (or call "
                       "the model with use_cache=False)")
    compiled = eager = 0
    for blk in blocks:
        if is_compiled(blk):
            compiled += 1
            continue
        blk.__dict__.pop(_MARK, None)  # a mark whose function a policy change has since dropped
        _hoist_weight_waits(blk)
        pol = _wrap.get_policy(blk)
        how = arrangement(blk, pol)
        if how == "eager":
            eager += 1
            continue
        if how == "checkpoint":  # run by the wrapper inside its offload region, in place of its own checkpoint
            inner = pol.orig_forward if pol.orig_forward is not None else types.MethodType(type(blk).forward, blk)
            spec = dataclasses.replace(pol.recompute, use_reentrant=False)  # (the one the compiler traces)
            fn = _compile(functools.partial(_wrap.checkpointed_call, inner, spec), recompute_pointwise, compile_kwargs)
            pol.compiled_checkpoint = (fn, pol.recompute)
            before = None
        elif how == "wrapper":
            before = blk.__dict__.get("forward")  # the policy's wrapper, one set by someone else, or none
            blk.forward = fn = _compile(blk.forward, recompute_pointwise, compile_kwargs)
        else:  # "forward", inside the policy's wrapper
            before = pol.orig_forward
            inner = before if before is not None else types.MethodType(type(blk).forward, blk)
            pol.orig_forward = fn = _compile(inner, recompute_pointwise, compile_kwargs)
        blk.__dict__[_MARK] = (fn, before)
        compiled += 1
    return CompiledBlocks(compiled, eager)


def _compile(fn: Any, recompute_pointwise: bool, compile_kwargs: dict[str, Any]) -> Any:
    """``torch.compile(fn, **compile_kwargs)``; with ``recompute_pointwise``, through :func:`_pointwise_backend`."""
    if not recompute_pointwise:
        return torch.compile(fn, **compile_kwargs)
    kwargs = dict(compile_kwargs)
    if kwargs.get("backend", "inductor") != "inductor":
        raise ValueError(f"compile_blocks(recompute_pointwise=True) compiles with inductor, not backend="
                         f"{kwargs['backend']!r}")
    kwargs.pop("backend", None)
    mode = kwargs.pop("mode", None)
    if mode not in (None, "default"):
        from torch._inductor import list_mode_options

        patches = dict(list_mode_options(mode))
    else:
        patches = {}
    patches.update(kwargs.pop("options", None) or {})
    return torch.compile(fn, backend=_pointwise_backend(tuple(sorted(patches.items()))), **kwargs)


@functools.cache
def _pointwise_backend(patches: tuple[tuple[str, Any], ...]) -> Any:
    """Inductor with the partitioner under :data:`POINTWISE_RECOMPUTE` (it partitions when the forward compiles),
    and inductor's own ``patches`` (``torch.compile``'s ``mode`` and ``options``). One backend object per set of
    patches: the compiler reuses compiled code only under the backend that compiled it (its cache entries are
    guarded on it, not on the partitioner's settings), so blocks compiled with and without the option in one
    process never share a graph."""

    def backend(gm: torch.fx.GraphModule, example_inputs: Any) -> Any:
        from torch._functorch import config as partitioner
        from torch._inductor.compile_fx import compile_fx

        with partitioner.patch(POINTWISE_RECOMPUTE):
            return compile_fx(gm, example_inputs, config_patches=dict(patches))

    return backend


def arrangement(blk: nn.Module, pol: Any, tensor_parallel: bool | None = None) -> str:
    """What :func:`compile_blocks` compiles of ``blk`` under its policy ``pol`` (None: no policy); ``tensor_parallel``:
    whether its parameters are tensor-parallel DTensors (None: look):

    - ``"wrapper"``: the block's forward as it is called (no policy, or the policy's wrapper of a selective block
      that offloads nothing: its checkpoint runs under torch's selective modes, traced);
    - ``"forward"``: the block's own forward, inside the policy's wrapper (kept; a whole-block checkpoint over
      tensor-parallel shards, where the compiler would save the DTensors' device mesh for the backward, which its
      partitioner refuses);
    - ``"checkpoint"``: the checkpoint with the forward, run by the wrapper inside its offload region (recomputed
      whole; selective and offloading);
    - ``"eager"``: nothing (selective and offloading its input with a share of the rest, whose saved tensors the
      compiled graph does not tell apart; selective and offloading over tensor-parallel shards).
    """
    if pol is None:
        return "wrapper"
    rc, off = pol.recompute, pol.offload
    if rc is None:
        return "forward"
    tp = _tensor_parallel(blk) if tensor_parallel is None else tensor_parallel
    if rc.mode == "full":
        return "forward" if tp else "checkpoint"
    if off is None or (off.ratio <= 0 and off.cache_ratio <= 0):
        return "wrapper"
    if tp or (0 < off.ratio and min(off.ratio, off.cache_ratio) < 1):
        return "eager"
    return "checkpoint"


def _tensor_parallel(blk: nn.Module) -> bool:
    """Whether ``blk``'s parameters may be tensor-parallel DTensors: DTensors of a block FSDP2 does not shard, or over a
    mesh of more than one dimension (FSDP2's own shards are DTensors over one, and run as plain tensors when
    gathered, as the compiler sees them)."""
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:  # a torch built without distributed: no DTensors either
        return False
    fsdp = isinstance(blk, FSDPModule)
    for p in blk.parameters():
        mesh = getattr(p, "device_mesh", None)
        if mesh is not None and (not fsdp or mesh.ndim > 1):
            return True
    return False


def _hoist_weight_waits(blk: nn.Module) -> None:
    """Move the forward pre-hooks that wait for updated weights (an offloading optimizer's, marked
    ``elbowroom_waits_for_weights``) from ``blk``'s submodules to ``blk`` itself, in the order the submodules
    were registered: inside a compiled forward each would break the graph. The block then waits for all its
    weights before it starts, where it waited for each submodule's as that submodule started: at most one block's
    host steps overlap less with its own forward."""
    from elbowroom.optim.handover import WEIGHT_WAIT

    waits = []
    for sub in blk.modules():
        if sub is blk:
            continue
        for key, hook in list(sub._forward_pre_hooks.items()):
            if getattr(hook, WEIGHT_WAIT, False):
                waits.append(hook)
                del sub._forward_pre_hooks[key]  # (the optimizer's handle then removes nothing: it finds no key)
    if not waits:
        return

    @torch.compiler.disable  # (a host wait: never traced, should the block sit inside a compiled region after all)
    def wait_all(module: nn.Module, args: Any) -> None:
        for hook in waits:
            hook(module, args)

    setattr(wait_all, WEIGHT_WAIT, True)
    blk.register_forward_pre_hook(wait_all, prepend=True)


def is_compiled(blk: nn.Module) -> bool:
    """Whether :func:`compile_blocks` compiled ``blk`` and its forward still calls the compiled function."""
    mark = blk.__dict__.get(_MARK)
    if mark is None:
        return False
    pol = _wrap.get_policy(blk)
    if pol is not None and (pol.active_compiled_checkpoint() is mark[0] or pol.orig_forward is mark[0]):
        return True
    return blk.__dict__.get("forward") is mark[0]


def uncompile_blocks(blocks: nn.ModuleList) -> None:
    """Undo :func:`compile_blocks` on ``blocks`` (call it before changing their activation policies)."""
    for blk in blocks:
        mark = blk.__dict__.pop(_MARK, None)
        if mark is None:
            continue
        fn, before = mark
        pol = _wrap.get_policy(blk)
        if pol is not None and pol.compiled_checkpoint is not None and pol.compiled_checkpoint[0] is fn:
            pol.compiled_checkpoint = None
        elif pol is not None and pol.orig_forward is fn:
            pol.orig_forward = before
        elif blk.__dict__.get("forward") is fn:
            if before is None:
                del blk.__dict__["forward"]
            else:
                blk.forward = before
