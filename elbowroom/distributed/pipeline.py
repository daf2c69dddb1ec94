"""Pipeline parallel on ``torch.distributed.pipelining``: the model split by blocks into stages, torch's schedules.

A pipeline of ``S`` stages runs on ``pp`` ranks, ``S / pp`` stages each. The blocks are split evenly; the first
stage also holds the embeddings, the last the final norm and the output head. Single-stage schedules (GPipe,
1F1B) put stage ``r`` on rank ``r``; the interleaved ones (interleaved 1F1B, interleaved zero-bubble) loop:
rank ``r`` holds stages ``r, r + pp, r + 2 pp, ...``, so a micro-batch visits every rank ``S / pp`` times and the
bubble shrinks by that factor (:func:`bubble_fraction`).

A stage's parameters keep the names they have in the whole model (``blocks.6.attn.o.weight`` on whichever
rank holds block 6): checkpoints (DCP, keyed by those names, with flattened optimizer state) are the same at
every pipeline degree and load at another one. Each stage is a module of its own, so recompute and offload
(``apply_activation_policy``) and FSDP2 apply to it as to a whole model: a stage's memory plan is its own.

The loss is computed by the schedule on the last stage, per micro-batch, with the caller's ``loss_fn``; the
gradients are the sum over micro-batches (``scale_grads=False``): normalise inside ``loss_fn`` as for
gradient accumulation. :func:`pipeline_step` runs one step and shares the loss with every pipeline rank.

Tied embeddings are refused (the embedding and the head live on different stages; elbowroom does not keep
two copies in sync), as is a step with fewer micro-batches than stages (a stage would wait forever).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from elbowroom.distributed.config import ParallelConfig

__all__ = ["Pipeline", "PipelineStageModule", "StageBlocks", "bubble_fraction", "build_pipeline",
           "pipeline_step", "rank_module", "split_model", "stage_blocks", "stage_ids"]


class StageBlocks(nn.ModuleList):
    """The blocks of a stage, named by their index in the whole model (so parameter names do not change when
    the model is split); indexing and iteration are by position within the stage."""

    def __init__(self, blocks: dict[int, nn.Module]) -> None:
        super().__init__()
        for index, block in blocks.items():
            self.add_module(str(index), block)

    def __getitem__(self, idx: int | slice) -> Any:
        return list(self._modules.values())[idx]


class PipelineStageModule(nn.Module):
    """One stage of a ``DecoderLM``: embeddings (first stage), a run of blocks, final norm and head (last).

    ``forward`` takes token ids on the first stage and hidden states elsewhere; it returns logits on the last
    stage and hidden states elsewhere. The submodules are the model's own (not copies).
    """

    def __init__(self, model: nn.Module, block_ids: range, *, first: bool, last: bool) -> None:
        super().__init__()
        self.config = model.config
        self.tok_emb = model.tok_emb if first else None
        self.pos_emb = model.pos_emb if first else None
        self.blocks = StageBlocks({i: model.blocks[i] for i in block_ids})
        self.norm = model.norm if last else None
        self.output = model.output if last else None
        self.rope = model.rope  # the blocks' shared table, registered here so that .to() moves it

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.tok_emb is not None:
            s = x.shape[1]
            h = self.tok_emb(x)
            if self.pos_emb is not None:
                h = h + self.pos_emb(torch.arange(s, device=x.device))
            if self.config.dropout and self.training:
                h = F.dropout(h, self.config.dropout, True)
            x = h
        for block in self.blocks:
            x = block(x)
        if self.output is not None:
            x = self.output(self.norm(x))
        return x


def stage_ids(parallel: ParallelConfig, pp_rank: int) -> list[int]:
    """The stages rank ``pp_rank`` holds: ``pp_rank``, ``pp_rank + pp``, ... (one for GPipe and 1F1B)."""
    return list(range(pp_rank, parallel.pp_num_stages, parallel.pp))


def split_model(model: nn.Module, parallel: ParallelConfig, pp_rank: int) -> list[PipelineStageModule]:
    """This rank's stages of ``model`` (a ``DecoderLM``), in stage order.

    Args:
        model: the whole model; its submodules are shared with the stages, so drop it afterwards.
        parallel: ``pp`` and the schedule (which sets the stages per rank).
        pp_rank: this rank's index in the pipeline.

    Returns:
        One :class:`PipelineStageModule` per stage this rank runs.
    """
    n_stages = parallel.pp_num_stages
    return [
        PipelineStageModule(model, stage_blocks(parallel, len(model.blocks), s), first=s == 0,
                            last=s == n_stages - 1)
        for s in stage_ids(parallel, pp_rank)
    ]


def stage_blocks(parallel: ParallelConfig, n_layers: int, stage: int) -> range:
    """The blocks of pipeline stage ``stage`` (an even split of ``n_layers`` blocks, in order)."""
    n_stages = parallel.pp_num_stages
    assert n_layers % n_stages == 0, "validate_layout checks that the blocks split evenly"
    per_stage = n_layers // n_stages
    return range(stage * per_stage, (stage + 1) * per_stage)


def rank_module(stages: list[nn.Module]) -> nn.Module:
    """One module holding this rank's stages under the whole model's names (``tok_emb``, ``blocks.N``,
    ``norm``, ``output``): what a checkpoint saves and loads, one per rank."""
    if len(stages) == 1:
        return stages[0]
    view = nn.Module()
    blocks: dict[int, nn.Module] = {}
    for stage in stages:
        for name in ("tok_emb", "pos_emb", "norm", "output"):
            if getattr(stage, name, None) is not None:
                setattr(view, name, getattr(stage, name))
        blocks.update({int(k): v for k, v in stage.blocks.named_children()})
    view.blocks = StageBlocks(dict(sorted(blocks.items())))
    return view


@dataclass
class Pipeline:
    """A built pipeline: the schedule and what :func:`pipeline_step` needs to feed it."""

    schedule: Any
    """The torch schedule (``ScheduleGPipe``, ``Schedule1F1B``, ``ScheduleInterleaved1F1B`` or
    ``ScheduleInterleavedZeroBubble``)."""
    stages: list[Any]
    """This rank's ``PipelineStage`` objects."""
    has_first: bool
    """This rank holds the first stage (it is fed the token ids)."""
    has_last: bool
    """This rank holds the last stage (it is fed the targets and computes the loss)."""
    group: Any
    """The pipeline's process group."""
    last_rank: int
    """The pipeline rank (within ``group``) holding the last stage."""


def build_pipeline(stages: list[nn.Module], parallel: ParallelConfig, pp_mesh: Any, device: torch.device,
                   loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]) -> Pipeline:
    """Wrap this rank's stage modules (TP, recompute and FSDP2 already applied) in torch's stages and schedule.

    Args:
        stages: from :func:`split_model`, in the same order.
        parallel: the schedule, micro-batches and stage count.
        pp_mesh: the 1-D ``pp`` mesh.
        device: where the stages compute.
        loss_fn: ``loss_fn(logits, targets)`` for one micro-batch; the gradients sum over micro-batches.

    Returns:
        The :class:`Pipeline`.
    """
    from torch.distributed.pipelining import (
        PipelineStage,
        Schedule1F1B,
        ScheduleGPipe,
        ScheduleInterleaved1F1B,
        ScheduleInterleavedZeroBubble,
    )

    group = pp_mesh.get_group()
    pp_rank = pp_mesh.get_local_rank()
    n_stages = parallel.pp_num_stages
    ids = stage_ids(parallel, pp_rank)
    torch_stages = [PipelineStage(m, i, n_stages, device, group=group) for m, i in zip(stages, ids)]
    kw = dict(n_microbatches=parallel.pp_num_microbatches, loss_fn=loss_fn, scale_grads=False)
    if parallel.pp_schedule in ("gpipe", "1f1b"):
        cls = ScheduleGPipe if parallel.pp_schedule == "gpipe" else Schedule1F1B
        schedule = cls(torch_stages[0], **kw)
    else:
        cls = ScheduleInterleaved1F1B if parallel.pp_schedule == "interleaved_1f1b" else ScheduleInterleavedZeroBubble
        schedule = cls(torch_stages, **kw)
    return Pipeline(schedule=schedule, stages=torch_stages, has_first=0 in ids, has_last=n_stages - 1 in ids,
                    group=group, last_rank=(n_stages - 1) % parallel.pp)


def pipeline_step(pipe: Pipeline, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Forward and backward of one batch through the pipeline; returns the summed micro-batch losses.

    Every rank of the pipeline calls this with the same batch (ranks that do not hold the first or last stage
    ignore ``inputs`` or ``targets``). The batch is split into ``pp_num_microbatches`` along dimension 0.

    Returns:
        The sum of ``loss_fn`` over the micro-batches, on every pipeline rank (a broadcast from the last
        stage; a host-device sync when the caller reads it).
    """
    losses: list[torch.Tensor] = []
    args = (inputs,) if pipe.has_first else ()
    pipe.schedule.step(*args, target=targets if pipe.has_last else None, losses=losses if pipe.has_last else None,
                       return_outputs=False)
    device = inputs.device
    loss = torch.stack([x.detach().float() for x in losses]).sum() if pipe.has_last else torch.zeros((), device=device)
    dist.broadcast(loss, group=pipe.group, group_src=pipe.last_rank)
    return loss


def bubble_fraction(stages: int, microbatches: int, stages_per_rank: int = 1) -> float:
    """Share of a pipeline step a rank sits idle: ``(p - 1) / (m + p - 1)`` for ``p`` ranks and ``m``
    micro-batches (GPipe and 1F1B have the same bubble; 1F1B only holds fewer activations). Interleaving
    ``v`` stages per rank divides the idle time by ``v``: ``(p - 1) / (v m + p - 1)``. Zero-bubble schedules
    fill most of what remains with the weight-gradient halves of backward; this is their upper bound.

    Args:
        stages: pipeline ranks ``p``.
        microbatches: micro-batches per step ``m``.
        stages_per_rank: ``v``.
    """
    p, m, v = stages, microbatches, stages_per_rank
    return (p - 1) / (v * m + p - 1)
