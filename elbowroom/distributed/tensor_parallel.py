"""Tensor parallel on DTensor: Megatron's column/row split with sequence parallel.

The plan (both reference architectures, as torchtitan's ``parallelize_llama``; the placements are those of
torch's ColwiseParallel, RowwiseParallel and SequenceParallel):

- q, k, v and the MLP's input projections are **colwise** (each rank computes its heads and its slice of the
  MLP width, no communication); attention's ``o`` and the MLP's output projection are **rowwise** (each rank's
  partial product is summed across ranks);
- **sequence parallel** between them: the residual stream, the norms and dropout hold ``seq / tp`` positions per
  rank, so the sum after a rowwise layer is a reduce-scatter and the gather before a colwise layer an
  all-gather (the same bytes as one all-reduce, and the norms' activations are split ``tp`` ways);
- embeddings are split over their rows (vocabulary, positions) and summed (one all-reduce per step); the first
  block keeps its share of the sequence;
- the output head is colwise over the vocabulary and, with ``loss_parallel``, the logits stay sharded: torch's
  ``loss_parallel()`` computes cross-entropy on the shards, so no rank ever holds a whole logit row.

Fused projections (``qkv``, Llama's gate|up ``w13``) are one weight holding several outputs side by side. A
plain colwise split would give rank 0 all of q and half of k; a strided placement (``_StridedShard``) gives each rank
its slice *of every part*, so the model's own ``view(b, s, 3, heads, hd)`` and
``chunk(2)`` read the rank's heads and the rank's gate and up. Attention runs on ``n_heads / tp`` local heads.

Where it runs: the embeddings, the final norm and the head go through ``parallelize_module`` (once per micro-batch).
The blocks' parameters are DTensors too, but their forward runs on the local shards with the sequence-parallel
all-gather and reduce-scatter called directly (:func:`_split_block`): DTensor's dispatch on every op of every block
made the 7B shape's step three times its GPU work at tp 2.

Fused kernels: RoPE and SwiGLU run on the local shards unchanged (a rank's heads, a rank's gate|up slice).
The chunked ``linear_cross_entropy`` needs whole vocabulary rows, which tensor parallel never forms: under
tensor parallel the loss is torch's ``loss_parallel`` cross-entropy instead (:func:`fused_loss_applies`).

Checkpoints: DCP cannot describe a strided shard (it records one offset per rank), so
:func:`checkpoint_view` presents such tensors as several contiguous chunks (a ``ShardedTensor`` over views of
the local data). A checkpoint written at ``tp 2`` then loads at ``tp 1`` and the reverse.
"""

from __future__ import annotations

import contextlib
import logging
import types
import warnings
from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    PrepareModuleInput,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)
from torch.distributed.tensor.parallel.style import ParallelStyle
from torch.distributed.tensor.placement_types import _StridedShard

log = logging.getLogger(__name__)

__all__ = [
    "apply_tensor_parallel",
    "checkpoint_view",
    "fsdp_placement",
    "fused_loss_applies",
    "loss_context",
    "tp_bytes_per_block",
    "tp_local_numel",
]


def _local_linear(mod: nn.Linear, x: torch.Tensor) -> torch.Tensor:
    """``nn.Linear``'s forward on this rank's shard of a colwise weight (and bias): the input is whole (gathered),
    the output this rank's columns (``[q_r | k_r | v_r]`` for a fused one); gradients reach the parameters as
    DTensors."""
    bias = mod.bias.to_local() if mod.bias is not None else None
    return F.linear(x, mod.weight.to_local(), bias)


# ---------------------------------------------------------------- the blocks: local tensors, explicit collectives
# Blocks run once per micro-batch per pass (forward, recompute, backward): DTensor's dispatch on every op of a
# block (sharding propagation, redistribute, the subclass's Python) cost the 7B shape 17 ms of host time per block
# per micro-batch with full recompute against 5 ms of GPU work at tp 2 (H100, ``benchmarks/tp_host.py``), so the
# blocks' parameters are DTensors (optimizer, FSDP2, checkpoints see torch's placements) while their forward runs on
# the local shards, with the sequence-parallel all-gather and reduce-scatter called directly. The math and the
# collectives are Megatron's; the placements are those of torch's ColwiseParallel, RowwiseParallel and
# SequenceParallel.

def _group_name(mesh: Any) -> str:
    group = mesh.get_group()
    return group.group_name


def _gather(x: torch.Tensor, group: str, n: int) -> torch.Tensor:
    """All-gather along the sequence (dimension 1): ``(b, s/n, d)`` -> ``(b, s, d)``."""
    out = torch.ops._c10d_functional.all_gather_into_tensor(x.contiguous(), n, group)
    out = torch.ops._c10d_functional.wait_tensor(out)  # (n*b, s/n, d), rank-major
    b = x.shape[0]
    return out.view(n, b, *x.shape[1:]).movedim(0, 1).reshape(b, n * x.shape[1], *x.shape[2:])


def _scatter(x: torch.Tensor, group: str, n: int) -> torch.Tensor:
    """Reduce-scatter (sum) along the sequence (dimension 1): ``(b, s, d)`` -> ``(b, s/n, d)``."""
    b, s = x.shape[:2]
    ranks = x.reshape(b, n, s // n, *x.shape[2:]).movedim(1, 0).contiguous().flatten(0, 1)
    out = torch.ops._c10d_functional.reduce_scatter_tensor(ranks, "sum", n, group)
    return torch.ops._c10d_functional.wait_tensor(out)


class _SequenceParallel(torch.autograd.Function):
    """Into a colwise layer (``gather``): all-gather in forward, reduce-scatter the gradient in backward. Out of a
    rowwise layer: reduce-scatter its partial sums in forward, all-gather the gradient in backward."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: str, n: int, gather: bool) -> torch.Tensor:
        ctx.args = (group, n, gather)
        return (_gather if gather else _scatter)(x, group, n)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple:
        group, n, gather = ctx.args
        return (_scatter if gather else _gather)(grad, group, n), None, None, None


def _replicated(p: torch.Tensor | None) -> torch.Tensor | None:
    """A replicated parameter used on this rank's share of the sequence: its gradient is this rank's part of the sum
    (``Partial``), as torch's SequenceParallel leaves it."""
    return p.to_local(grad_placements=(Partial(),)) if p is not None else None


def _norm_then_gather(mod: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """A block's norm on this rank's positions, then the all-gather its colwise consumer needs."""
    if isinstance(mod, nn.RMSNorm):
        y = F.rms_norm(x, mod.normalized_shape, _replicated(mod.weight), mod.eps)
    else:
        y = F.layer_norm(x, mod.normalized_shape, _replicated(mod.weight), _replicated(mod.bias), mod.eps)
    return _SequenceParallel.apply(y, mod._tp_group, mod._tp_size, True)


def _rowwise_then_scatter(mod: nn.Linear, x: torch.Tensor) -> torch.Tensor:
    """A rowwise layer on this rank's input columns, its partial sums reduce-scattered over the sequence, then the
    (replicated) bias."""
    y = _SequenceParallel.apply(F.linear(x, mod.weight.to_local()), mod._tp_group, mod._tp_size, False)
    return y + _replicated(mod.bias) if mod.bias is not None else y


_SPLITS = {
    # kind: (placement of the weight, placement of the bias)
    "norm": (Replicate(), Replicate()),
    "colwise": (Shard(0), Shard(0)),
    "qkv": (_StridedShard(0, split_factor=3), _StridedShard(0, split_factor=3)),
    "gate_up": (_StridedShard(0, split_factor=2), _StridedShard(0, split_factor=2)),
    "rowwise": (Shard(1), Replicate()),
}
_FORWARDS = {"norm": _norm_then_gather, "colwise": _local_linear, "qkv": _local_linear, "gate_up": _local_linear,
             "rowwise": _rowwise_then_scatter}


def _block_layout(block: nn.Module) -> dict[str, str]:
    """How each of a block's submodules is split (a kind of :data:`_SPLITS`)."""
    layout = {"attn_norm": "norm", "mlp_norm": "norm", "attn.o": "rowwise"}
    if block.attn.fused_qkv:
        layout["attn.qkv"] = "qkv"
    else:
        layout.update({f"attn.{name}": "colwise" for name in ("q", "k", "v")})
    if hasattr(block, "w13"):  # llama: gate|up fused, SwiGLU, down
        layout.update({"w13": "gate_up", "w2": "rowwise"})
    else:  # gpt2: fc, GELU, proj
        layout.update({"fc": "colwise", "proj": "rowwise"})
    return layout


def _split_block(block: nn.Module, mesh: Any) -> None:
    """Place a block's parameters over ``mesh`` and switch its submodules to their local forwards."""
    group, n = _group_name(mesh), mesh.size()
    for name, kind in _block_layout(block).items():
        mod = block.get_submodule(name)
        weight, bias = _SPLITS[kind]
        for pname, p in list(mod.named_parameters(recurse=False)):
            placement = weight if pname == "weight" else bias
            mod.register_parameter(pname, nn.Parameter(distribute_tensor(p, mesh, [placement]), p.requires_grad))
        mod._tp_group, mod._tp_size = group, n
        mod.forward = types.MethodType(_FORWARDS[kind], mod)
    block.attn.n_heads //= n  # local heads


def apply_tensor_parallel(model: nn.Module, tp_mesh: Any, *, loss_parallel: bool = True) -> nn.Module:
    """Split ``model`` over ``tp_mesh`` in place: a ``DecoderLM`` or a pipeline stage of one.

    Stages hold a subset of ``tok_emb``/``pos_emb`` (first stage), ``blocks`` (named by their index in the whole
    model) and ``norm``/``output`` (last stage); each part present is split.

    Args:
        model: the model or stage, on its device, before recompute, offload and FSDP2 are applied.
        tp_mesh: the 1-D ``tp`` mesh.
        loss_parallel: leave the logits sharded over the vocabulary (compute the loss inside
            :func:`loss_context`); False gathers whole logits.

    Returns:
        ``model`` itself.
    """
    plan: dict[str, ParallelStyle] = {}
    for name in ("tok_emb", "pos_emb"):
        if getattr(model, name, None) is not None:
            # rows split (vocabulary, positions), partial lookups summed: every rank has the whole embedding
            plan[name] = RowwiseParallel(input_layouts=Replicate(), output_layouts=Replicate())
    for block in model.blocks.children():
        _split_block(block, tp_mesh)
    if "0" in model.blocks._modules:
        # the residual stream enters sequence parallel: each rank keeps its seq/tp positions (no communication)
        plan["blocks.0"] = PrepareModuleInput(input_layouts=(Replicate(),), desired_input_layouts=(Shard(1),),
                                              use_local_output=True)
    if getattr(model, "norm", None) is not None:
        plan["norm"] = SequenceParallel()
    if getattr(model, "output", None) is not None:
        logits = Shard(-1) if loss_parallel else Replicate()
        plan["output"] = ColwiseParallel(input_layouts=Shard(1), output_layouts=logits,
                                         use_local_output=not loss_parallel)
    parallelize_module(model, tp_mesh, plan)
    return model


def loss_context(enabled: bool) -> contextlib.AbstractContextManager:
    """Where the loss of vocabulary-sharded logits is computed *and* differentiated: torch's
    ``loss_parallel()`` when ``enabled``, nothing otherwise. Hold it around forward's loss and backward."""
    if not enabled:
        return contextlib.nullcontext()
    from torch.distributed.tensor.parallel import loss_parallel

    return loss_parallel()


def fused_loss_applies(tp: int, requested: bool) -> bool:
    """Whether the chunked ``linear_cross_entropy`` head can run: not under tensor parallel (it needs whole
    vocabulary rows); the fallback is logged once as a warning."""
    if requested and tp > 1:
        log.warning("train.fused_loss needs whole vocabulary rows, which tensor parallel splits: the loss runs as "
                    "torch's loss_parallel cross-entropy on the shards instead")
        return False
    return requested


def fsdp_placement(param: nn.Parameter) -> Shard:
    """FSDP2's sharded dimension for ``param``: dimension 1 for parameters split in strides by tensor parallel
    (FSDP2 would otherwise interleave its dimension-0 shards with the strides and mislabel them), 0 otherwise."""
    if isinstance(param, DTensor) and param.ndim > 1 and any(isinstance(p, _StridedShard) for p in param.placements):
        return Shard(1)
    return Shard(0)


# ---------------------------------------------------------------- checkpoints of strided shards
def _owned(size: int, placements: list[tuple[Any, int, int]]) -> list[int]:
    """Global indices along one tensor dimension that this rank holds, given the (placement, coordinate, mesh
    size) that split this dimension, outermost first."""
    idx = list(range(size))
    for placement, coord, n in placements:
        if isinstance(placement, _StridedShard):
            step = len(idx) // placement.split_factor
            parts = [idx[i * step:(i + 1) * step] for i in range(placement.split_factor)]
            idx = [j for part in parts for j in _chunk(part, n, coord)]
        else:
            idx = _chunk(idx, n, coord)
    return idx


def _chunk(idx: list[int], n: int, coord: int) -> list[int]:
    """``torch.chunk``'s split of ``idx`` into ``n`` pieces (the last ones shorter or empty); piece ``coord``."""
    size = -(-len(idx) // n)
    return idx[coord * size:(coord + 1) * size]


def _runs(idx: list[int]) -> list[tuple[int, int, int]]:
    """Contiguous runs of ``idx`` as (local start, global start, length)."""
    runs: list[tuple[int, int, int]] = []
    for local, g in enumerate(idx):
        if runs and runs[-1][1] + runs[-1][2] == g:
            runs[-1] = (runs[-1][0], runs[-1][1], runs[-1][2] + 1)
        else:
            runs.append((local, g, 1))
    return runs


def _chunks(t: DTensor, coords: list[int]) -> list[tuple[list[int], list[int], list[int]]]:
    """The contiguous blocks of ``t`` held at mesh coordinates ``coords``: (local start, global offset, size)."""
    import itertools

    mesh = t.device_mesh
    per_dim: list[list[tuple[Any, int, int]]] = [[] for _ in range(t.ndim)]
    for mesh_dim, placement in enumerate(t.placements):
        if isinstance(placement, (Shard, _StridedShard)):
            per_dim[placement.dim % t.ndim].append((placement, coords[mesh_dim], mesh.size(mesh_dim)))
    runs = [_runs(_owned(t.shape[d], per_dim[d])) for d in range(t.ndim)]
    return [([r[0] for r in combo], [r[1] for r in combo], [r[2] for r in combo]) for combo in itertools.product(*runs)]


def _as_chunks(t: DTensor) -> Any:
    """A ``ShardedTensor`` whose shards are views of ``t``'s local data, one per contiguous block it holds."""
    import itertools

    from torch.distributed._shard.metadata import ShardMetadata
    from torch.distributed._shard.sharded_tensor import Shard as LocalShard
    from torch.distributed._shard.sharded_tensor import ShardedTensor
    from torch.distributed._shard.sharded_tensor.metadata import ShardedTensorMetadata, TensorProperties

    mesh, local = t.device_mesh, t.to_local()
    rank = torch.distributed.get_rank()
    shards = []
    for starts, offsets, sizes in _chunks(t, mesh.get_coordinate()):
        view = local
        for d, (start, size) in enumerate(zip(starts, sizes)):
            view = view.narrow(d, start, size)
        shards.append(LocalShard(view, ShardMetadata(offsets, sizes, f"rank:{rank}/{local.device}")))
    # every rank's blocks, worked out here rather than gathered: ranks of different pipeline stages hold different
    # tensors, so a collective per tensor could pair the wrong ones
    everyone = []
    for coords in itertools.product(*(range(n) for n in mesh.shape)):
        owner = int(mesh.mesh[coords].item())
        everyone += [ShardMetadata(offsets, sizes, f"rank:{owner}/{local.device}")
                     for _, offsets, sizes in _chunks(t, list(coords))]
    metadata = ShardedTensorMetadata(everyone, t.shape, TensorProperties.create_from_tensor(local))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # ShardedTensor's deprecation: DTensor cannot say this
        return ShardedTensor._init_from_local_shards_and_global_metadata(shards, metadata)


def checkpoint_view(state: Any) -> Any:
    """``state`` (nested dicts and lists) with every strided DTensor replaced by a DCP-describable view of the
    same memory; other values are returned as they are. Saving the view saves the tensors; loading into it
    loads into them, in place."""
    if isinstance(state, dict):
        return {k: checkpoint_view(v) for k, v in state.items()}
    if isinstance(state, list):
        return [checkpoint_view(v) for v in state]
    if isinstance(state, DTensor) and any(isinstance(p, _StridedShard) for p in state.placements):
        return _as_chunks(state)
    return state


# ---------------------------------------------------------------- what one rank holds (for the planner)
def tp_local_numel(model: nn.Module, tp: int) -> tuple[list[int], int, int]:
    """Parameters one rank holds under :func:`apply_tensor_parallel` at degree ``tp``, worked out from the same
    plan without splitting anything: colwise layers (q/k/v, fused or not; the MLP's input projections; the head)
    hold ``1/tp`` of their weight and bias, rowwise ones (attention out, MLP out) ``1/tp`` of their weight and
    the whole bias, the embeddings ``1/tp`` of their rows, the norms all of theirs.

    Args:
        model: a whole ``DecoderLM`` (or a stage of one), before tensor parallel.
        tp: the degree (it divides every split dimension, as ``validate_layout`` checks).

    Returns:
        ``(per block, embeddings, final norm and output head)``: parameter counts of one rank.
    """
    def count(module: nn.Module | None, split: bool) -> int:
        return sum(p.numel() // tp if split else p.numel() for p in module.parameters()) if module is not None else 0

    def block(b: nn.Module) -> int:
        return sum(p.numel() // (1 if _SPLITS[kind][leaf == "bias"] == Replicate() else tp)
                   for name, kind in _block_layout(b).items()
                   for leaf, p in b.get_submodule(name).named_parameters(recurse=False))

    # the embeddings' rows and the head's outputs are split, the final norm is whole
    blocks = [block(b) for b in model.blocks]
    embeddings = sum(count(getattr(model, k, None), True) for k in ("tok_emb", "pos_emb"))
    head = count(getattr(model, "norm", None), False) + count(getattr(model, "output", None), True)
    return blocks, embeddings, head


# ---------------------------------------------------------------- expected traffic (for the docs)
def tp_bytes_per_block(*, tokens: int, dim: int, tp: int, bytes_per_element: int = 2,
                       sequence_parallel: bool = True, recompute: bool = False) -> int:
    """Bytes each rank sends per block per training step (forward and backward) under tensor parallel.

    Without sequence parallel a block's two rowwise layers (attention out, MLP down) all-reduce their partial
    ``(tokens, dim)`` outputs in forward, and backward all-reduces the input gradients of its two colwise
    groups (q/k/v, MLP in): four all-reduces, each sending ``2 (tp-1)/tp`` of the tensor per rank (ring).
    Sequence parallel replaces each by a reduce-scatter and an all-gather of ``(tp-1)/tp`` each: the same
    bytes. What it saves is memory and work, not traffic: the norms, dropout and residual adds hold and
    compute ``1/tp`` of the sequence. Full recompute repeats forward's collectives in backward.

    Args:
        tokens: tokens per rank per step (micro-batch x sequence x accumulation).
        dim: model width.
        tp: tensor-parallel degree.
        bytes_per_element: 2 for bf16 activations.
        sequence_parallel: count reduce-scatters and all-gathers (True) or all-reduces (False).
        recompute: add the forward collectives that recomputing each block repeats.

    Returns:
        Bytes sent by one rank per block per step.
    """
    if tp == 1:
        return 0
    shard = tokens * dim * bytes_per_element * (tp - 1) // tp  # one reduce-scatter or all-gather per rank
    if sequence_parallel:
        forward = 4 * shard  # all-gather + reduce-scatter around attention, the same around the MLP
    else:
        forward = 2 * (2 * shard)  # an all-reduce (= 2 shards) after attention out and after MLP down
    backward = forward  # the mirror image: every gather's gradient is a scatter and the reverse
    return forward + backward + (forward if recompute else 0)
