"""The trainer under tensor and pipeline parallel (``--parallel.tp`` / ``--parallel.pp``).

:class:`~elbowroom.train.distributed_run.DistributedRun` calls this module where a model-parallel run differs
from a data-parallel one; the library is :mod:`elbowroom.distributed.model_parallel`.

- **Set-up** (:func:`check_setup`): what the trainer cannot run split is refused before anything starts
  (ConfigError, exit 2): the CPU-offloaded optimizer and bf16 weights (they step plain tensors, not DTensor shards
  or a stage's subset), fp16 (its GradScaler does not see the pipeline's backward),
  distillation and QAT, ``--model.hf`` models and tied embeddings
  (:func:`~elbowroom.distributed.model_parallel.validate_layout`), and under pipeline parallel the fused loss (its
  last stage computes cross-entropy on whole logits) and variable-length batches (a step's micro-batches are joined
  into one batch). Under tensor parallel the fused loss falls back, with a warning, to torch's ``loss_parallel``
  cross-entropy on the shards.
- **Wrapping** (:func:`wrap`): ``apply_model_parallel`` splits the seeded whole model (the same on every rank),
  applies ``[activations]`` per module and FSDP2 beside ``tp``; the optimizer steps this rank's parameters.
- **Planning** (:func:`plan_and_wrap`): ``--budget B`` is every rank's budget. Rank 0 profiles the whole model
  once on one (pipeline) micro-batch, derives each pipeline rank's profile (:mod:`elbowroom.plan.ranks`: its
  blocks, its tensor-parallel shares, its micro-batches in flight) and plans each into ``B``; every rank follows
  its pipeline rank's plan (recompute per block, installed before FSDP2 wraps the blocks). A budget below a
  rank's minimum exits 2 naming the rank and its minimum. The plans (:class:`~elbowroom.plan.ranks.RankPlans`)
  record the layout they were made for and are written to ``OUT/plan.toml``; ``--plan FILE`` of another layout is
  refused, and ``--resume`` follows the run's own.
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
from pathlib import Path
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
        ("--optimizer.offload_fraction", o.offload_fraction > 0 or o.offload_gradients,
         "the CPU-offloaded optimizer steps plain tensors, not tensor-parallel shards or one stage's parameters"),
        ("--optimizer.param_dtype bfloat16", o.param_dtype != "float32" or o.offload_param_dtype != "float32",
         "bf16 weights with fp32 masters are the CPU-offloaded optimizer's"),
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


def wrap(run: Any, model: nn.Module, build_optimizer: Any,
         block_policies: list[Any] | None = None) -> tuple[Any, nn.Module, Any]:
    """Split ``model`` for the run's layout and build the optimizer on this rank's parameters.

    Args:
        run: the :class:`~elbowroom.train.distributed_run.DistributedRun` (its topology, config and the pipeline
            loss's divisor, :attr:`pipeline_divisor`).
        model: the whole model, seeded identically on every rank.
        build_optimizer: ``build_optimizer(module, overlap_forward)``.
        block_policies: one ``BlockPolicy`` per block of this rank (a plan's), instead of ``[activations]``.

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

    acts = cfg.activations if cfg.activations != ActivationConfig() and block_policies is None else None
    mp = apply_model_parallel(model, topo, device=device, loss_fn=pipeline_loss, activations=acts,
                              block_policies=block_policies, seq_len=cfg.data.seq_len, batch_size=rows, **kwargs)
    module = mp.modules[0] if mp.pipeline is None else mp.checkpoint_module
    if run.is_main:
        log.info("model parallel: tp %d x pp %d%s over %d processes (dp_replicate %d x dp_shard %d)",
                 topo.parallel.tp, topo.parallel.pp,
                 f" ({topo.parallel.pp_schedule}, {topo.parallel.pp_num_microbatches} micro-batches)"
                 if topo.parallel.pp > 1 else "", topo.world_size, topo.parallel.dp_replicate, topo.parallel.dp_shard)
    return mp, module, build_optimizer(module, False)


# ---------------------------------------------------------------- planning: --budget, --plan, --resume
def plan_to_follow(cfg: Config, out: Path) -> Any:
    """The saved plans a model-parallel run follows (a :class:`~elbowroom.plan.ranks.RankPlans`): on ``--resume``
    the run's own ``OUT/plan.toml``, else ``--plan FILE``; None when there are none."""
    from elbowroom.train import planning

    return planning.plan_to_follow(cfg, out, load=_load, what="plans")


def _load(path: str | Path) -> Any:
    from elbowroom.plan.ranks import RankPlans

    try:
        return RankPlans.load(path)
    except FileNotFoundError:
        raise ConfigError(f"plan file {path} does not exist; pass the OUT/plan.toml of a model-parallel run of this "
                          "layout, or plan with --budget") from None
    except (ValueError, TypeError, OSError) as e:
        raise ConfigError(f"{e}; under tensor or pipeline parallel pass the OUT/plan.toml of a run of the same "
                          "layout, or plan again with --budget") from None


def _micro_batch(cfg: Config, parallel: Any) -> int:
    """Rows of one forward on a rank: the loop's micro-batch, or the pipeline's (a step's rows / micro-batches)."""
    rows = cfg.data.batch_size // parallel.dp_size
    if parallel.pp == 1:
        return rows
    return rows * cfg.train.gradient_accumulation_steps // parallel.pp_num_microbatches


def plan_ranks(model: nn.Module, sample: dict[str, Any], cfg: Config, parallel: Any, amp_dtype: torch.dtype) -> Any:
    """Profile the whole ``model`` on one micro-batch of ``sample`` and plan every pipeline rank into ``--budget``.

    Raises:
        ConfigError: the budget is below a rank's minimum (naming the rank and the minimum); a model the planner
            cannot read.
    """
    from dataclasses import replace

    from elbowroom.plan import BudgetError, parse_budget
    from elbowroom.plan.profiler import profile as take_profile
    from elbowroom.plan.ranks import RankPlans, layout_label, rank_profiles
    from elbowroom.plan.search import plan_for
    from elbowroom.train.planning import _size_at_least
    from elbowroom.train.tokens import default_cache_dir

    budget = parse_budget(cfg.budget)
    rows = _micro_batch(cfg, parallel)
    ids, targets = sample["input_ids"], sample["targets"]
    reps = -(-rows // ids.shape[0])  # a pipeline micro-batch may span several of the loop's
    batch = (ids.repeat(reps, 1)[:rows], targets.repeat(reps, 1)[:rows])
    rng = torch.get_rng_state()  # the profile and the machine's measurement draw random numbers
    try:
        prof = take_profile(model, batch, dtype=amp_dtype, cache_dir=str(cfg.data.cache_dir or default_cache_dir()))
    except ValueError as e:
        raise ConfigError(" ".join(str(e).split())) from None
    finally:
        torch.set_rng_state(rng)
    plans, short = [], []
    for r, rank_prof in enumerate(rank_profiles(prof, model, parallel)):
        try:
            plan = plan_for(rank_prof, budget, precision="fp32", fused_loss_allowed=False, offload_allowed=False,
                            grad_clipping=bool(cfg.train.max_grad_norm), allocator_allowed=False,
                            offload_config=cfg.offload)
        except BudgetError as e:
            short.append((r, len(rank_prof.blocks), e.minimum_bytes))
            continue
        plans.append(replace(plan, layout=layout_label(parallel, r, rows, cfg.data.seq_len)))
    if short:
        who = "; ".join(f"{f'pipeline rank {r} ({n} block' + 's' * (n != 1) + ')' if parallel.pp > 1 else 'a rank'}"
                        f" needs at least {low:,} bytes" for r, n, low in short)
        top = max(low for _, _, low in short)
        raise ConfigError(f"--budget {cfg.budget} is each rank's budget and is below the minimum: {who}; "
                          f"pass --budget {_size_at_least(top)} or more")
    return RankPlans(tuple(plans))


def plan_and_wrap(run: Any, model: nn.Module, build_optimizer: Any, plans: Any, sample: dict[str, Any],
                  amp_dtype: torch.dtype) -> tuple[nn.Module, Any, Any]:
    """``--budget`` / ``--plan`` / a planned ``--resume`` under tensor or pipeline parallel: plan (rank 0, shared
    with every rank, unless ``plans`` are given), check the plans' layout, split and wrap ``model`` with this
    rank's plan. Sets ``run.mp``.

    Returns:
        ``(module to call, optimizer, RankPlans)``.
    """
    from elbowroom.distributed.model_parallel import validate_layout
    from elbowroom.plan.ranks import RankPlans, layout_label

    cfg, parallel = run.cfg, run.topo.parallel
    # a layout that cannot run is refused before the profile (apply_model_parallel checks it again)
    validate_layout(parallel, getattr(model, "config", None), run.topo.world_size, seq_len=cfg.data.seq_len,
                    batch_size=cfg.data.batch_size // parallel.dp_size * cfg.train.gradient_accumulation_steps)
    if plans is None:
        made = error = None
        if run.is_main:
            try:
                made = plan_ranks(model, sample, cfg, parallel, amp_dtype).to_dict()
            except ConfigError as e:
                error = str(e)
        made, error = run.same_on_all((made, error))
        if error is not None:
            raise ConfigError(error)
        plans = RankPlans.from_dict(made)
    want = [layout_label(parallel, r, _micro_batch(cfg, parallel), cfg.data.seq_len) for r in range(parallel.pp)]
    got = [p.layout for p in plans.plans]
    if got != want:
        raise ConfigError(f"the plans were made for {' | '.join(got) or 'one whole model'}, and this run is "
                          f"{' | '.join(want)}; run with the layout they were made for, or plan again with --budget")
    pp_rank = run.topo.mesh.get_local_rank("pp") if parallel.pp > 1 else 0
    plan = plans.plans[pp_rank]
    run.mp, module, optimizer = wrap(run, model, build_optimizer, block_policies=plan.to_block_policies())
    if run.is_main:
        log.info("%s", plans.table())
    return module, optimizer, plans


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
