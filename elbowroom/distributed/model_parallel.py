"""The model-parallel entry point: validate a layout, then split a model by tensor and pipeline parallel,
apply the activation policy per module, and wrap the result in FSDP2.

The order is torchtitan's: pipeline split (each stage a module of its own), tensor parallel (per stage),
recompute and offload (per stage: a stage's memory plan is its own; a plan's per-block policies, or one
``[activations]`` policy for every block), FSDP2 (per block and per stage, on the
``dp_shard`` or ``dp_replicate x dp_shard`` mesh beside ``tp``), then the pipeline schedule.

    topo = init_distributed(parallel, rank=..., world_size=..., local_rank=..., device=device)
    mp = apply_model_parallel(build_model(cfg), topo, device=device, loss_fn=loss_fn, activations=acts)
    optimizer = torch.optim.AdamW(mp.parameters(), lr=...)
    if mp.pipeline:                      # pp > 1: the schedule runs forward, loss and backward
        loss = pipeline_step(mp.pipeline, inputs, targets)
    else:                                # tp / dp only: the usual loop, the loss inside mp.loss_context()
        with mp.loss_context():
            loss = loss_fn(mp.modules[0](inputs), targets); loss.backward()
    checkpoint.save(path, mp.checkpoint_module, optimizer)   # names of the whole model, any layout
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn as nn

from elbowroom.config import ConfigError
from elbowroom.distributed.config import ParallelConfig
from elbowroom.distributed.pipeline import Pipeline, build_pipeline, rank_module, split_model
from elbowroom.distributed.tensor_parallel import apply_tensor_parallel, fsdp_placement, loss_context

__all__ = ["ModelParallel", "apply_model_parallel", "validate_layout"]


def validate_layout(parallel: ParallelConfig, model_cfg: Any, world_size: int, *, seq_len: int | None = None,
                    batch_size: int | None = None) -> None:
    """Refuse a layout that cannot run, with a sentence naming the fix.

    Args:
        parallel: the mesh sizes and pipeline settings.
        model_cfg: the model's ``ModelConfig`` (None for a model elbowroom did not build).
        world_size: processes launched.
        seq_len: tokens per sequence (sequence parallel splits it ``tp`` ways), if known.
        batch_size: sequences per data-parallel rank per optimizer micro-batch (the pipeline splits it into
            micro-batches), if known.

    Raises:
        ConfigError: the layout does not fit the world, the model or the batch.
    """
    p = parallel
    if p.world_size != world_size:
        raise ConfigError(
            f"the layout dp_replicate x dp_shard x tp x pp = {p.dp_replicate} x {p.dp_shard} x {p.tp} x {p.pp} = "
            f"{p.world_size} processes, but the world size is {world_size}; launch with `torchrun "
            f"--nproc-per-node {p.world_size}` or change --parallel.*"
        )
    if p.tp == 1 and p.pp == 1:
        return
    if model_cfg is None or not hasattr(model_cfg, "arch"):
        raise ConfigError("tensor and pipeline parallel split elbowroom's reference models (model.preset), not "
                          "--model.hf models; set --parallel.tp 1 --parallel.pp 1")
    if model_cfg.tie_embeddings:
        raise ConfigError(
            "model.tie_embeddings shares one weight between the embedding and the head, which pipeline parallel "
            "puts on different stages and tensor parallel splits as two layers; set --model.tie_embeddings false "
            "or --parallel.tp 1 --parallel.pp 1"
        )
    if p.tp > 1:
        for name in ("n_heads", "ffn_dim", "vocab_size", "max_seq_len"):
            value = getattr(model_cfg, name)
            if value % p.tp:
                raise ConfigError(
                    f"model.{name} = {value} must be divisible by parallel.tp = {p.tp} (each rank takes an equal "
                    f"share); choose a tp that divides it"
                )
        if seq_len is not None and seq_len % p.tp:
            raise ConfigError(f"data.seq_len = {seq_len} must be divisible by parallel.tp = {p.tp} (sequence "
                              f"parallel gives each rank an equal share of the positions)")
    if p.pp > 1:
        stages = p.pp_num_stages
        if model_cfg.n_layers % stages:
            raise ConfigError(
                f"model.n_layers = {model_cfg.n_layers} blocks do not split evenly into {stages} pipeline stages "
                f"(pp {p.pp} x {stages // p.pp} per rank); choose pp and pp_stages_per_rank whose product divides "
                f"{model_cfg.n_layers}"
            )
        m = p.pp_num_microbatches
        if batch_size is not None and batch_size % m:
            raise ConfigError(
                f"the pipeline splits each rank's {batch_size} sequences into {m} micro-batches, which must divide "
                f"them; set --parallel.pp_microbatches to a divisor of {batch_size} (>= {stages})"
            )


@dataclass
class ModelParallel:
    """What :func:`apply_model_parallel` built for this rank."""

    modules: list[nn.Module]
    """The model (without pipeline parallel) or this rank's stages, each split and wrapped."""
    pipeline: Pipeline | None
    """The pipeline schedule when pp > 1 (run it with :func:`~elbowroom.distributed.pipeline.pipeline_step`)."""
    loss_parallel: bool
    """The logits are sharded over the vocabulary: compute the loss and backward inside :meth:`loss_context`."""

    @property
    def checkpoint_module(self) -> nn.Module:
        """One module with this rank's parameters under the whole model's names, for ``checkpoint.save/load``."""
        return rank_module(self.modules)

    def parameters(self) -> Iterator[nn.Parameter]:
        """This rank's parameters (for the optimizer), each once."""
        seen: set[int] = set()
        for m in self.modules:
            for p in m.parameters():
                if id(p) not in seen:
                    seen.add(id(p))
                    yield p

    def clip_grad_norm_(self, max_norm: float) -> torch.Tensor:
        """Scale this rank's gradients so that the norm over the *whole* model is at most ``max_norm``.

        Tensor-parallel and FSDP2 gradients are DTensors, whose norm is reduced over their mesh; the stages of
        the other pipeline ranks add theirs with one all-reduce of the squared norm. Returns the total norm
        (before clipping) on every rank; ``max_norm = inf`` only measures it.
        """
        import torch.distributed as dist
        from torch.distributed.tensor import DTensor

        params = [p for p in self.parameters() if p.grad is not None]
        total = torch.nn.utils.get_total_norm([p.grad for p in params])
        if isinstance(total, DTensor):
            total = total.full_tensor()  # the sum over the shards: a collective
        if self.pipeline is not None:
            squared = total.float() ** 2
            dist.all_reduce(squared, group=self.pipeline.group)
            total = squared.sqrt()
        torch.nn.utils.clip_grads_with_norm_(params, max_norm, total)
        return total

    def loss_context(self) -> contextlib.AbstractContextManager:
        """torch's ``loss_parallel()`` when the logits are sharded, else nothing."""
        return loss_context(self.loss_parallel)


def apply_model_parallel(
    model: nn.Module,
    topo: Any,
    *,
    device: torch.device,
    loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None,
    activations: Any = None,
    block_policies: Any = None,
    seq_len: int | None = None,
    batch_size: int | None = None,
    **data_parallel_kwargs: Any,
) -> ModelParallel:
    """Split ``model`` for ``topo``'s layout and wrap it for data parallel.

    Args:
        model: a ``DecoderLM`` on ``device``, before any memory policy.
        topo: from :func:`elbowroom.distributed.data_parallel.init_distributed` (its mesh has the ``pp``,
            ``dp_replicate``, ``dp_shard`` and ``tp`` dimensions).
        device: where this rank computes.
        loss_fn: ``loss_fn(logits, targets)`` per micro-batch; needed with pipeline parallel, whose schedule
            computes the loss on the last stage.
        activations: an ``ActivationConfig`` (recompute, offload) applied to each module's blocks; None for none.
        block_policies: one ``BlockPolicy`` per block this rank holds, in stage order (a rank's plan, see
            :mod:`elbowroom.plan.ranks`), instead of ``activations``.
        seq_len, batch_size: checked against the layout when given (see :func:`validate_layout`).
        **data_parallel_kwargs: passed to ``apply_data_parallel`` (``param_dtype``, ``reduce_dtype``, ...).

    Returns:
        The :class:`ModelParallel`.

    Raises:
        ConfigError: the layout does not fit the world, the model or the batch.
    """
    from elbowroom.activations import apply_activation_policy
    from elbowroom.activations.policy import apply_block_policies
    from elbowroom.distributed.data_parallel import apply_data_parallel

    parallel: ParallelConfig = topo.parallel
    validate_layout(parallel, getattr(model, "config", None), topo.world_size, seq_len=seq_len, batch_size=batch_size)
    if parallel.pp > 1 and loss_fn is None:
        raise ConfigError("pipeline parallel computes the loss inside its schedule: pass loss_fn")
    modules = split_model(model, parallel, topo.mesh.get_local_rank("pp")) if parallel.pp > 1 else [model]
    loss_parallel = parallel.tp > 1 and parallel.tp_loss_parallel and parallel.pp == 1
    if block_policies is not None:
        if activations is not None:
            raise ValueError("pass activations (one policy for every block) or block_policies, not both")
        block_policies = list(block_policies)
        held = sum(len(m.blocks) for m in modules)
        if len(block_policies) != held:
            raise ConfigError(f"{len(block_policies)} block policies for the {held} blocks this rank holds: the "
                              "plan was made for another layout; plan again")
    wrapped = []
    for module in modules:
        if parallel.tp > 1:
            apply_tensor_parallel(module, topo.mesh["tp"], loss_parallel=loss_parallel)
        if block_policies is not None:  # this rank's plan: each block its own policy
            n = len(module.blocks)
            apply_block_policies(module, block_policies[:n])
            block_policies = block_policies[n:]
        elif activations is not None:
            apply_activation_policy(module, activations)
        if parallel.mode != "single":
            if parallel.tp > 1:
                data_parallel_kwargs.setdefault("shard_placement_fn", fsdp_placement)
            module, _ = apply_data_parallel(module, topo, blocks=list(module.blocks), **data_parallel_kwargs)
        wrapped.append(module)
    pipeline = build_pipeline(wrapped, parallel, topo.mesh["pp"], device, loss_fn) if parallel.pp > 1 else None
    return ModelParallel(modules=wrapped, pipeline=pipeline, loss_parallel=loss_parallel)
