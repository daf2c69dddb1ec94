"""The trainer under tensor and pipeline parallel (``--parallel.tp`` / ``--parallel.pp``).

:class:`~elbowroom.train.distributed_run.DistributedRun` calls this module where a model-parallel run differs
from a data-parallel one; the library is :mod:`elbowroom.distributed.model_parallel`.

- **Set-up** (:func:`check_setup`): what the trainer cannot run split is refused before anything starts
  (ConfigError, exit 2): ``--budget``/``--plan`` (the planner profiles one whole model), the CPU-offloaded
  optimizer and bf16 weights (they step plain tensors, not DTensor shards or a stage's subset), ``--train.compile``,
  fp16 (its GradScaler does not see the pipeline's backward), distillation and QAT, ``--model.hf`` models and tied
  embeddings (:func:`~elbowroom.distributed.model_parallel.validate_layout`), and under pipeline parallel the
  fused loss (its last stage computes cross-entropy on whole logits) and variable-length batches (a step's
  micro-batches are joined into one batch). Under tensor parallel the fused loss falls back, with a warning, to
  torch's ``loss_parallel`` cross-entropy on the shards.
- **Wrapping** (:func:`wrap`): ``apply_model_parallel`` splits the seeded whole model (the same on every rank),
  applies ``[activations]`` per module and FSDP2 beside ``tp``; the optimizer steps this rank's parameters.
- **A step**: without pipeline parallel the trainer's loop runs as under data parallel, the loss and its backward
  inside ``loss_context()``; with it, each data-parallel rank's whole step (batch x accumulation) goes through
  :func:`~elbowroom.distributed.pipeline.pipeline_step`, whose loss divides by the global step's target tokens.
- **Validation**: under tensor parallel on whole logits (:class:`FullLogits`); under pipeline parallel through
  torch's forward-only ``schedule.eval`` (:func:`pipeline_evaluate`), batches padded with ignored rows.
- **Numbers**: every tensor-parallel rank holds its group's loss and every pipeline rank the last stage's, so
  sums over the world are divided by ``tp x pp``; clipping takes the norm over the whole model.
- **Checkpoints**: DCP under the whole model's parameter names (:attr:`ModelParallel.checkpoint_module`), so a
  run resumes at another ``tp`` or ``pp``, one process included.
"""

from __future__ import annotations

import logging
from typing import Any

import torch
import torch.nn as nn

from elbowroom.config import Config, ConfigError

log = logging.getLogger("elbowroom.train")


def check_setup(cfg: Config) -> None:
    """Refuse what the trainer does not run under tensor or pipeline parallel (see the module docstring)."""
    p, o = cfg.parallel, cfg.optimizer
    what = " and ".join(f"--parallel.{k} {v}" for k, v in (("tp", p.tp), ("pp", p.pp)) if v > 1)
    refused = (
        ("--budget", cfg.budget is not None, "the planner profiles one whole model, not a shard or a stage; set the "
                                             "[activations] switches by hand"),
        ("--plan", cfg.plan is not None, "a plan is made for one whole model, not a shard or a stage"),
        ("--optimizer.offload_fraction", o.offload_fraction > 0 or o.offload_gradients,
         "the CPU-offloaded optimizer steps plain tensors, not tensor-parallel shards or one stage's parameters"),
        ("--optimizer.param_dtype bfloat16", o.param_dtype != "float32" or o.offload_param_dtype != "float32",
         "bf16 weights with fp32 masters are the CPU-offloaded optimizer's"),
        ("--train.compile", cfg.train.compile, "compiling a split model is not supported here yet"),
        ("--train.dtype fp16", cfg.train.dtype == "fp16", "its GradScaler does not see the pipeline's backward; "
                                                          "use bf16"),
        ("--distill.teacher", cfg.distill.teacher is not None, "distillation reads the whole output head"),
        ("--train.qat", cfg.train.qat is not None, "QAT's export rebuilds a whole model"),
    )
    for flag, on, why in refused:
        if on:
            raise ConfigError(f"{flag} does not run with {what}: {why}; drop {flag} or set tp and pp to 1")
    if p.pp > 1:
        if cfg.train.fused_loss:
            raise ConfigError(
                "--train.fused_loss reads the output head outside the model's forward, but under pipeline parallel "
                "the last stage hands whole logits to the schedule's loss; drop --train.fused_loss"
            )
        if cfg.data.variable_length:
            raise ConfigError("--data.variable_length pads each micro-batch to its own length, but a pipeline step "
                              "joins a step's micro-batches into one batch; drop --data.variable_length")


class FullLogits(nn.Module):
    """Evaluation's view of a tensor-parallel model: whole logits (gathered over the vocabulary shards), so
    that the plain cross-entropy reads them."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        logits = self.model(ids)
        return logits.full_tensor() if hasattr(logits, "full_tensor") else logits


def wrap(run: Any, model: nn.Module, build_optimizer: Any) -> tuple[Any, nn.Module, Any]:
    """Split ``model`` for the run's layout and build the optimizer on this rank's parameters.

    Args:
        run: the :class:`~elbowroom.train.distributed_run.DistributedRun` (its topology, config and the pipeline
            loss's divisor, :attr:`pipeline_divisor`).
        model: the whole model, seeded identically on every rank.
        build_optimizer: ``build_optimizer(module, overlap_forward)``.

    Returns:
        ``(ModelParallel, module to call, optimizer)``: the module is the split model (or this rank's stages
        under the whole model's names), the one whose state a checkpoint saves.
    """
    from elbowroom.distributed.model_parallel import apply_model_parallel
    from elbowroom.train.objectives import token_loss_sum
    from elbowroom.train.trainer import resolve_dtype

    cfg, topo = run.cfg, run.topo
    device = run.place(torch.device("cpu"))
    dtype = resolve_dtype(cfg.train.dtype, device)
    kwargs = {"param_dtype": dtype} if dtype != torch.float32 and topo.parallel.mode != "single" else {}

    def pipeline_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return token_loss_sum(logits, targets) / run.pipeline_divisor

    rows = cfg.data.batch_size // topo.dp_size * cfg.train.gradient_accumulation_steps
    from elbowroom.activations.policy import ActivationConfig

    acts = cfg.activations if cfg.activations != ActivationConfig() else None
    mp = apply_model_parallel(model, topo, device=device, loss_fn=pipeline_loss, activations=acts,
                              seq_len=cfg.data.seq_len, batch_size=rows, **kwargs)
    module = mp.modules[0] if mp.pipeline is None else mp.checkpoint_module
    if run.is_main:
        log.info("model parallel: tp %d x pp %d%s over %d processes (dp_replicate %d x dp_shard %d)",
                 topo.parallel.tp, topo.parallel.pp,
                 f" ({topo.parallel.pp_schedule}, {topo.parallel.pp_num_microbatches} micro-batches)"
                 if topo.parallel.pp > 1 else "", topo.world_size, topo.parallel.dp_replicate, topo.parallel.dp_shard)
    return mp, module, build_optimizer(module, False)


def pipeline_accumulate(run: Any, micro: list[dict[str, Any]], autocast: Any, global_tokens: float) -> torch.Tensor:
    """One optimizer step's forward and backward through the pipeline: this data-parallel rank's micro-batches
    joined into one batch, which the schedule splits into ``pp_microbatches``.

    Returns:
        This rank's share of the step's loss, times the data-parallel loss scale (as the data-parallel
        ``accumulate`` returns it).
    """
    from elbowroom.distributed.data_parallel import loss_scale
    from elbowroom.distributed.pipeline import pipeline_step

    run.pipeline_divisor = global_tokens / loss_scale(run.topo)
    inputs = torch.cat([b["input_ids"] for b in micro])
    targets = torch.cat([b["targets"] for b in micro])
    with autocast:
        return pipeline_step(run.mp.pipeline, inputs, targets)


@torch.no_grad()
def pipeline_evaluate(run: Any, loader: Any, device: torch.device, autocast: Any) -> float | None:
    """Mean validation loss per target token through the pipeline (torch's forward-only ``schedule.eval``).

    Every batch is padded to the loader's batch size, rounded up to a multiple of the micro-batches, with rows
    whose targets are all ignored (-100): the stages see one shape throughout and the padding adds neither loss
    nor tokens, so the value is the single process's over the same samples.
    """
    import torch.distributed as dist

    from elbowroom.train import data as D

    pipe, m = run.mp.pipeline, run.topo.parallel.pp_num_microbatches
    rows = -(-loader.batch_size // m) * m
    run.pipeline_divisor = 1.0  # the schedule's loss is then the micro-batch's summed token loss
    for module in run.mp.modules:
        module.eval()
    total = torch.zeros((), device=device, dtype=torch.float64)
    n = 0
    for b in D.DevicePrefetcher(loader, device):
        x, y = b["input_ids"], b["targets"]
        pad = rows - x.shape[0]
        if pad:
            x = torch.cat([x, x.new_zeros(pad, x.shape[1])])
            y = torch.cat([y, y.new_full((pad, y.shape[1]), -100)])
        losses: list[torch.Tensor] = []
        with autocast:
            pipe.schedule.eval(*((x,) if pipe.has_first else ()), target=y if pipe.has_last else None,
                               losses=losses if pipe.has_last else None)
        loss = (torch.stack([v.float() for v in losses]).sum() if pipe.has_last
                else torch.zeros((), device=device))
        dist.broadcast(loss, group=pipe.group, group_src=pipe.last_rank)
        total += loss.double()
        n += b["num_tokens"]
    for module in run.mp.modules:
        module.train()
    total, n = run.reduce_eval(total, n)
    return total.item() / n if n else None  # host-device sync: evaluation result
