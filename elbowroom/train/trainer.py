"""The training loop, readable top to bottom: build, maybe resume, then step until done.

One optimizer step = ``gradient_accumulation_steps`` micro-batches whose summed token losses are divided
by the number of target tokens of the *whole step* (counted on the host from the batches, so it costs no
device sync). The loop syncs with the device only where logging, evaluation or a checkpoint asks for it.

Everything that can be wrong with the input is checked before the first step (config, optional extras, the
checkpoint to resume, the data file, the model against the data, the checkpoint and, on CPU, the RAM), and
the run directory appears only with the first finished step, so a failed start leaves nothing behind. A
resumed run keeps its checkpoint's LR schedule length unless ``--scheduler.decay_steps`` says otherwise; one
whose checkpoint is past ``--steps`` is refused, one at ``--steps`` has nothing to do and touches nothing. On
SIGTERM/SIGINT the step finishes, a checkpoint is saved (no validation pass first) and the result carries the
signal, which the CLI turns into exit code 128 + N; a signal during a validation pass or a periodic save stops the
run once that is done, with the current step's checkpoint.

With ``--budget`` the memory layout is planned, not configured: the model is built, its first training
micro-batch is profiled and :func:`elbowroom.plan.fit` chooses recompute, offload, optimizer placement and
precision; the loop then follows the plan (its fused loss, its weight dtype, its optimizer). ``--plan FILE``
applies a saved plan instead, and ``--resume`` re-applies the run's own ``OUT/plan.toml``, so a resumed run
has the layout, and the loss curve, of the run it continues.

Under torchrun (``--parallel.dp_replicate`` / ``dp_shard`` / ``tp`` / ``pp``) the same loop runs on every rank; what
differs there (each rank's slice of the global batch, gradient sync, sums over ranks, sharded checkpoints) is
:class:`~elbowroom.train.distributed_run.DistributedRun`, called at the few places where ranks differ.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import math
import os
import random
import signal
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch
import torch.nn as nn

from elbowroom.activations.policy import ActivationConfig, apply_activation_policy
from elbowroom.config import Config, ConfigError, to_dict, to_toml, wrong_file
from elbowroom.models import PRESETS, DecoderLM, ModelConfig, build_model, count_params, flops_per_token
from elbowroom.optim.config import default_step_threads
from elbowroom.train import data as D
from elbowroom.train.checkpoint import CheckpointError, CheckpointManager, Loaded
from elbowroom.train.collection import GarbageCollection
from elbowroom.train.distributed_run import DistributedRun, Launch, resolve_launch, start_run
from elbowroom.train.hf import build_hf_model, hf_config_meta, hf_max_positions, load_hf_config
from elbowroom.train.metrics import (
    BudgetWatch,
    PaceWatch,
    check_tensorboard,
    host_step,
    peak_flops,
    peak_memory,
)
from elbowroom.train.model_parallel_run import plan_and_wrap
from elbowroom.train.model_parallel_run import plan_to_follow as mp_plan_to_follow
from elbowroom.train.objectives import Distillation, load_distillation, micro_batch_loss, token_loss_sum
from elbowroom.train.planning import (
    PLAN_FILE,
    RETRY_REPLAN_STEPS,
    EarlyOutOfMemory,
    EarlyStepsRetrying,
    Try,
    apply_plan,
    budget_limit,
    cap_memory,
    check_plan,
    may_start_over,
    plan_for_budget,
    plan_to_follow,
    shared_link_for,
    uncap_memory,
    with_replans,
)
from elbowroom.train.qat import apply_qat, resolve_qat
from elbowroom.train.run_dir import (
    atomic_write_text,
    check_out_dir,
    load_resume_checkpoint,
    new_run_directory,
    release_run_directory,
)
from elbowroom.train.schedule import build_scheduler, sync_lr
from elbowroom.train.state import _restored_global_state, _StopSignal, rng_state, set_rng_state

log = logging.getLogger("elbowroom.train")


@dataclass
class TrainResult:
    """What a run did: the last step reached, its losses, and why it stopped."""

    step: int
    losses: dict[int, float]
    """Training loss of every logged step."""
    val_losses: dict[int, float]
    """Validation loss of every evaluated step."""
    interrupted: bool = False
    """True when a signal stopped the run (a checkpoint was saved first)."""
    signal: int | None = None
    """The signal that stopped the run (SIGTERM, SIGINT), if one did."""
    out: Path | None = None


# ---------------------------------------------------------------- building blocks
def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dev = torch.device(name)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ConfigError(f"train.device is {name!r} but CUDA is not available; use --train.device cpu")
    return dev


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    if name == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[name]


def resolve_model_config(cfg: Config, data_vocab: int) -> ModelConfig:
    """The model shape: the preset, the user's overrides, the data's vocabulary and sequence length."""
    m = cfg.model
    preset = PRESETS[m.preset]
    vocab = m.vocab_size
    if vocab is None:
        # The tiny preset follows the data (256 bytes by default); big presets keep their 32000
        # unless the data needs more.
        vocab = data_vocab if m.preset == "tiny" else max(preset.vocab_size, data_vocab)
    try:
        return ModelConfig.from_preset(
            m.preset,
            arch=m.arch,
            dim=m.dim,
            n_layers=m.n_layers,
            n_heads=m.n_heads,
            ffn_dim=m.ffn_dim,
            vocab_size=vocab,
            dropout=m.dropout,
            fused_qkv=m.fused_qkv,
            max_seq_len=max(preset.max_seq_len, cfg.data.seq_len),
        )
    except ValueError as e:
        raise ConfigError(str(e)) from None


def _check_hf_model(cfg: Config, hf_config: Any, data_vocab: int) -> None:
    """A Hugging Face model must look up every token id of the data and hold --data.seq_len positions."""
    if hf_config.vocab_size < data_vocab:
        raise ConfigError(
            f"the data has vocab_size {data_vocab} but the model in {cfg.model.hf} has vocab_size "
            f"{hf_config.vocab_size}; train it on data tokenized for it (`elbowroom prepare --tokenizer`) or use a "
            f"model whose vocabulary holds at least {data_vocab} tokens"
        )
    positions = hf_max_positions(hf_config)
    if positions is not None and positions < cfg.data.seq_len:
        raise ConfigError(
            f"the model in {cfg.model.hf} holds {positions} positions, fewer than --data.seq_len {cfg.data.seq_len}; "
            f"pass --data.seq_len {positions} or less"
        )


def param_groups(model: nn.Module, weight_decay: float) -> list[dict[str, Any]]:
    """AdamW groups: decay on matmul weights; none on norms, biases and embeddings (any ``nn.Embedding``'s, so a
    Hugging Face model's too)."""
    embeddings = {id(p) for m in model.modules() if isinstance(m, nn.Embedding) for p in m.parameters()}
    decay, no_decay = [], []
    for _, p in model.named_parameters():
        if not p.requires_grad:
            continue
        if p.dim() < 2 or id(p) in embeddings:
            no_decay.append(p)
        else:
            decay.append(p)
    return [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]


def build_optimizer(model: nn.Module, cfg: Config, device: torch.device, overlap_forward: bool = True) -> Any:
    o = cfg.optimizer
    groups = param_groups(model, o.weight_decay)
    if o.offload_fraction > 0 or o.offload_gradients or o.param_dtype == "bfloat16":
        from elbowroom.optim import build_optimizer as build_offload
        from elbowroom.optim import last_fraction
        from elbowroom.optim.masters import embedding_tables

        late = o.offload_late and o.offload_fraction < 1.0
        opt = build_offload(
            groups,
            lr=o.lr,
            weight_decay=o.weight_decay,
            betas=o.betas,
            eps=o.eps,
            fused=o.fused,
            offload_fraction=o.offload_fraction,
            offload_gradients=o.offload_gradients,
            offload_params=last_fraction(list(model.parameters()), o.offload_fraction) if late else None,
            param_dtype=torch.bfloat16 if o.offload_param_dtype == "bfloat16" else None,
            master_weights=o.param_dtype == "bfloat16",  # the model was cast to bf16: fp32 masters on both sides
            config=cfg.offload,  # the engine's knobs ([offload]); the placement above overrides its own fields
            keep_dtype=embedding_tables(model),  # bf16 copies of the matrices, the residual stream kept fp32
        )
        # step() returns at once; each block waits for its own updated weights in the next forward, so
        # the CPU step of the late blocks hides behind the forward of the early ones even with clipping
        if overlap_forward:  # (under FSDP2 the wait goes ahead of each unit's all-gather)
            opt.overlap_with_forward(model)
        return opt
    return torch.optim.AdamW(groups, lr=o.lr, betas=o.betas, eps=o.eps, fused=o.fused or None)


def apply_activations(model: DecoderLM, cfg: Config) -> None:
    """The ``[activations]`` switches (the mechanism's own ActivationConfig); the defaults leave the model as is."""
    if cfg.activations == ActivationConfig():
        return
    apply_activation_policy(model, cfg.activations)


def check_activation_blocks(acts: ActivationConfig, n_blocks: int) -> None:
    """The ``[activations]`` block choice against the model's ``n_blocks``, before anything is built or written."""
    if acts.offloads and n_blocks <= acts.keep_last:
        raise ConfigError(f"the model has {n_blocks} block(s) and the last activations.keep_last {acts.keep_last} "
                          f"never offload, so nothing would be offloaded; pass --activations.keep_last {n_blocks - 1} "
                          "or less, or drop the offload settings")
    try:
        acts.block_policies(n_blocks)
    except ValueError as e:
        raise ConfigError(f"activations.checkpoint_blocks: {e}; give indices from 0 to {n_blocks - 1} (negative ones "
                          "count from the end)") from None


def accumulate_gradients(
    model: nn.Module,
    micro_batches: list[dict[str, Any]],
    autocast: Any,
    scaler: Any = None,
    optimizer: Any = None,
    fused_loss: bool = False,
    distill: Distillation | None = None,
) -> torch.Tensor:
    """Forward and backward over the micro-batches of one optimizer step; returns the step's loss (detached).

    Each micro-batch's summed token loss is divided by the target tokens of the *whole step*, so k
    micro-batches of b samples give the gradients of one batch of k*b samples, padded batches included.
    ``num_tokens`` are host ints counted by the collate function: no device sync here. An optimizer with
    an ``accumulating()`` context (the CPU-offloaded one) is told which backward passes are not the last,
    so that it moves gradients to the host only once they are final. The loss of a micro-batch is
    :func:`~elbowroom.train.objectives.micro_batch_loss`'s: cross-entropy, fused or not, or distillation.
    """
    step_tokens = sum(b["num_tokens"] for b in micro_batches)
    total = None
    marks = getattr(optimizer, "accumulating", None)
    for i, b in enumerate(micro_batches):
        with autocast:
            loss_sum = micro_batch_loss(model, b, optimizer, fused_loss=fused_loss, distill=distill)
        loss = loss_sum / step_tokens
        with marks(i < len(micro_batches) - 1) if marks is not None else contextlib.nullcontext():
            (scaler.scale(loss) if scaler is not None else loss).backward()
        total = loss.detach() if total is None else total + loss.detach()
    return total


def clip_gradients(params: list[torch.Tensor], optimizer: Any, max_norm: float) -> torch.Tensor:
    """Global-norm clipping; an optimizer that holds gradients itself (``clip_grad_norm_``) does it."""
    if hasattr(optimizer, "clip_grad_norm_"):
        return optimizer.clip_grad_norm_(max_norm)
    return torch.nn.utils.clip_grad_norm_(params, max_norm)


def gradient_norm(params: list[torch.Tensor], optimizer: Any) -> torch.Tensor | None:
    """The global L2 norm of the gradients, for logging only: reads them and changes nothing.

    Not the optimizer's ``clip_grad_norm_(inf)``: for the CPU-offloaded optimizer that call is part of the
    step (it decides whether the CPU step may start during backward), so logging through it would change
    how training runs. An optimizer that frees its device gradients once they are on the host
    (``offload_gradients``) has no complete set to read: None, the row logs no norm.
    """
    if getattr(optimizer, "offload_gradients", False):
        return None
    grads = [p.grad for p in params if p.grad is not None]
    if not grads:
        return None
    # per-tensor norms in fp32 (bf16 and fp32 gradients may mix); a Python loop, on logged steps only
    return torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g, dtype=torch.float32) for g in grads]))


def _saved_schedule_steps(meta: dict[str, Any]) -> int | None:
    """The schedule length a checkpoint was trained on (older checkpoints: from its saved config)."""
    if "schedule_steps" in meta:
        return meta["schedule_steps"]
    saved = meta.get("config") or {}
    return (saved.get("scheduler") or {}).get("decay_steps") or (saved.get("train") or {}).get("steps")


def schedule_length(cfg: Config, loaded: Loaded | None) -> int:
    """The LR schedule's length: ``--scheduler.decay_steps``, else the checkpoint's, else ``--steps``.

    A resumed run stays on the curve its checkpoint was trained on: a larger ``--steps`` alone does not
    stretch the cosine (that would jump the LR back up); ``--scheduler.decay_steps N`` changes it on purpose.
    """
    steps = cfg.scheduler.decay_steps or cfg.train.steps
    saved = _saved_schedule_steps(loaded.meta) if loaded is not None else None
    if saved is None or saved == steps:
        return steps
    if cfg.scheduler.decay_steps is None:
        log.warning(
            "resuming on the checkpoint's LR schedule of %d steps, not --steps %d (the LR continues the curve "
            "it was on); pass --scheduler.decay_steps %d to %s the schedule instead",
            saved, cfg.train.steps, cfg.train.steps, "stretch" if cfg.train.steps > saved else "shorten",
        )
        return saved
    if cfg.scheduler.name == "onecycle":
        raise ConfigError(
            f"the checkpoint's onecycle schedule is {saved} steps long and cannot change length on resume; "
            f"drop --scheduler.decay_steps {cfg.scheduler.decay_steps} (or pass {saved})"
        )
    log.warning("--scheduler.decay_steps %d: the LR schedule changes from %d to %d steps at step %d",
                steps, saved, steps, loaded.step)
    return steps


def _resumed_past_steps(cfg: Config, out: Path, loaded: Loaded) -> bool:
    """True when the checkpoint to resume is at ``--steps`` already: the run is done, which the log says.

    Raises:
        ConfigError: the checkpoint is past ``--steps`` (``--steps`` counts from the run's start, not from the
            checkpoint).
    """
    steps = cfg.train.steps
    if loaded.step > steps:
        raise ConfigError(
            f"--resume: the newest checkpoint of {out} is at step {loaded.step}, past --steps {steps} (--steps counts "
            f"from the start of the run); pass --steps {loaded.step + 1} or more to train further"
        )
    if loaded.step == steps:
        log.info("--resume: the newest checkpoint of %s is at step %d, --steps %d: the run is done, nothing to "
                 "train; pass --steps %d or more to train further", out, steps, steps, steps + 1)
        return True
    return False


def available_host_memory() -> int | None:
    """Bytes of RAM available to a new allocation (MemAvailable), or None where unknown."""
    from elbowroom.optim.placement import available_host_bytes  # the optimizer's own reading of /proc/meminfo

    available = available_host_bytes()
    if available is not None:
        return available
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return None


def check_host_memory(cfg: Config, model_cfg: ModelConfig) -> None:
    """Refuse a CPU run whose model cannot fit in RAM, before building it (the OS would kill it minutes later).

    A deliberately low estimate, so that it refuses only what cannot work: 16 bytes per parameter
    (fp32 weight and gradient, two fp32 AdamW moments) plus the block inputs and MLP activations
    backward needs (4 bytes per value) and the logits and their gradient.
    """
    available = available_host_memory()
    if available is None:
        return
    n_params = count_params(build_model(model_cfg, device="meta"))  # shapes only: no memory
    states = 16 * n_params
    tokens = cfg.data.batch_size * cfg.data.seq_len
    d, ffn, layers = model_cfg.dim, model_cfg.ffn_dim, model_cfg.n_layers
    # a recomputed block keeps its input; a planned run may recompute every block
    recompute = cfg.activations.checkpoint != "none" or cfg.budget is not None or cfg.plan is not None
    kept = d if recompute else 4 * d + 2 * ffn
    acts = 4 * tokens * (layers * kept + 4 * d + 2 * ffn + 2 * model_cfg.vocab_size)
    if states + acts <= available:
        return
    gib = 2**30
    raise ConfigError(
        f"model {cfg.model.preset} ({n_params / 1e9:.2f}B parameters) needs ~{states / gib:.1f} GiB for weights, "
        f"gradients and AdamW state plus ~{acts / gib:.1f} GiB of activations at batch {cfg.data.batch_size} x "
        f"{cfg.data.seq_len}, and this machine has {available / gib:.1f} GiB of RAM available; train it on a GPU "
        "(--train.device cuda), or choose a smaller --model.preset, --data.batch_size or --data.seq_len"
    )


def _check_enough_tokens(tokens: D.TokenFile, cfg: Config) -> None:
    """Fixed-length samples: one training batch and one validation sample must fit, else say how many tokens."""
    seq_len, bsz, vf = cfg.data.seq_len, cfg.data.batch_size, cfg.data.val_fraction
    n = tokens.num_tokens
    n_val = int(n * vf)
    need_train, need_val = bsz * seq_len + 1, seq_len + 1
    if n - n_val >= need_train and n_val >= need_val:
        return
    need = max(math.ceil(need_train / (1 - vf)), math.ceil(need_val / vf)) + 1
    raise D.DataError(
        f"{tokens.path} holds {n:,} tokens, too few for one batch: a training batch needs --data.batch_size "
        f"{bsz} x --data.seq_len {seq_len} + 1 = {need_train:,} tokens and the validation split "
        f"(--data.val_fraction {vf}) one sample of seq_len + 1 = {need_val:,}, so about {need:,} tokens in all; "
        "prepare more text with `elbowroom prepare`, or lower --data.seq_len or --data.batch_size"
    )


# ---------------------------------------------------------------- the run
def train(cfg: Config, launch: Launch | None = None) -> TrainResult:
    """Train as ``cfg`` says; returns the losses. Raises ConfigError / DataError / CheckpointError on bad input.

    Bad input is found before anything is written: the run directory appears with the first finished
    step. Process-wide settings changed here (RNG states, deterministic algorithms) are given back on return.
    With ``[parallel]`` sizes above 1 it runs as one rank of a data-parallel job: under torchrun, or inside a
    process group already initialised (see :mod:`elbowroom.train.distributed_run`).

    Args:
        cfg: the resolved run configuration (see ``elbowroom.config.Config``).
        launch: this process's rank and world size (default: the initialised process group's, else one process;
            under torchrun from Python, initialise the process group first or pass a ``Launch``: the library reads
            no environment; the CLI reads torchrun's variables, ``elbowroom.cli.launch_from_environment``).

    Returns:
        A :class:`TrainResult` with the logged training and validation losses.
    """
    launch = resolve_launch(launch)
    if launch is not None and launch.local_world_size > 1 and cfg.offload.cpu_threads is None:
        # ranks of one host share its cores: each host step gets its share (not every core, as one process would)
        cfg = replace(cfg, offload=replace(cfg.offload, cpu_threads=default_step_threads(launch.local_world_size)))
    with _restored_global_state(), start_run(cfg, launch) as run:
        claimed = None
        if cfg.out is None:  # rank 0 claims a directory of its own; every rank writes there
            claimed = run.same_on_all(new_run_directory() if run.is_main else None)
            cfg = replace(cfg, out=str(claimed[0]))
        try:
            return with_replans(cfg, lambda c, attempt: _train(c, run, attempt))
        except BaseException:
            if claimed is not None and run.is_main:  # a run that failed before its first step leaves nothing
                release_run_directory(*claimed)
            raise


def _train(cfg: Config, run: DistributedRun, attempt: Try) -> TrainResult:
    assert cfg.out is not None, "train() claims the run directory"
    out = Path(cfg.out)
    check_out_dir(out, cfg.resume or attempt.rewind_metrics)  # (a try started over after retries: its own first try's)
    device = run.place(resolve_device(cfg.train.device))
    amp_dtype = resolve_dtype(cfg.train.dtype, device)
    if cfg.optimizer.offload_param_dtype == "bfloat16" and amp_dtype != torch.bfloat16:
        raise ConfigError(
            "optimizer.offload_param_dtype bfloat16 keeps offloaded weights in bf16, which needs bf16 autocast: "
            f"set --train.dtype bf16 (it resolves to {str(amp_dtype).removeprefix('torch.')} here)"
        )
    bf16_params = cfg.optimizer.param_dtype == "bfloat16"
    if bf16_params and amp_dtype != torch.bfloat16:
        raise ConfigError(
            "optimizer.param_dtype bfloat16 runs the model in bf16: set --train.dtype bf16 (it resolves to "
            f"{str(amp_dtype).removeprefix('torch.')} here)"
        )
    if cfg.logging.tensorboard:  # optional extras are checked with the config, not at the first log line
        try:
            check_tensorboard()
        except ValueError as e:
            raise ConfigError(str(e)) from None
    if cfg.train.deterministic:
        torch.use_deterministic_algorithms(True, warn_only=True)  # given back by train()
    ckpts = CheckpointManager(out / "checkpoints", keep=cfg.checkpoint.keep)
    # read and verify the checkpoint before the data: a --resume with nothing to resume fails before any work
    loaded = load_resume_checkpoint(out, ckpts) if cfg.resume else None
    run.check_resume(loaded, cfg.data.batch_size)
    if loaded is not None and _resumed_past_steps(cfg, out, loaded):  # before anything is built, written or rewound
        return TrainResult(step=loaded.step, losses={}, val_losses={}, out=out)
    cfg = resolve_qat(cfg, loaded)  # a resumed QAT run keeps its scheme

    # --- data (validated before anything is written to OUT)
    cache_dir = cfg.data.cache_dir  # the CLI fills it from $ELBOWROOM_CACHE
    wrong = wrong_file("--data.path", cfg.data.path, takes="a token file") if cfg.data.path is not None else None
    if wrong is not None:  # a plan or a run config given as the data
        raise ConfigError(wrong)
    tokens = D.load_tokens(cfg.data.path, cache_dir=cache_dir, require_sidecar=True)
    seq_len, bsz, accum = cfg.data.seq_len, cfg.data.batch_size, cfg.train.gradient_accumulation_steps
    if not cfg.data.variable_length:
        _check_enough_tokens(tokens, cfg)
    train_tokens, val_tokens = D.split(tokens, cfg.data.val_fraction)
    if cfg.data.variable_length:
        if tokens.eos_id is None:
            raise ConfigError(
                f"data.variable_length needs documents separated by an end-of-document token, and {tokens.path} "
                "declares none; prepare the file with `elbowroom prepare` or drop --data.variable_length"
            )
        dataset, collate = (lambda t, name: D.DocumentDataset(t, seq_len, tokens.eos_id, name=name)), D.pad_collate
    else:
        dataset, collate = (lambda t, name: D.ChunkDataset(t, seq_len, name=name)), D.collate
    train_ds = dataset(train_tokens, f"the training split of {tokens.path}")
    val_ds = dataset(val_tokens, f"the validation split of {tokens.path}")
    for name, ds in (("training", train_ds), ("validation", val_ds)):
        if len(ds) < (bsz if name == "training" else 1):
            raise D.DataError(
                f"the {name} split of {tokens.path} has {len(ds)} samples of {seq_len + 1} tokens, fewer than "
                f"one batch of {bsz}; use more data, a smaller --data.seq_len or --data.batch_size"
            )

    # --- the model's shape (elbowroom's reference models, or a Hugging Face directory's config.json), checked
    # against the data, the checkpoint and (on CPU) the machine's RAM
    model_cfg: ModelConfig | None = None
    if cfg.model.hf is not None:
        hf_config = load_hf_config(cfg.model.hf)
        model_meta = hf_config_meta(hf_config)
        _check_hf_model(cfg, hf_config, tokens.vocab_size)
    else:
        model_cfg = resolve_model_config(cfg, tokens.vocab_size)
        model_meta = model_cfg.to_dict()
        D.check_vocab(tokens.vocab_size, model_cfg.vocab_size)
    if loaded is not None and loaded.meta.get("model") != model_meta:
        saved_model = loaded.meta.get("model") or {}
        diff = {k: (saved_model.get(k), v) for k, v in model_meta.items() if saved_model.get(k) != v}
        raise CheckpointError(
            f"checkpoint {loaded.path} was written for another model (checkpoint vs now: {diff}); "
            "resume with the same --model settings, or start a new run with another --out"
        )
    n_blocks = model_cfg.n_layers if model_cfg is not None else getattr(hf_config, "num_hidden_layers", None)
    if n_blocks is not None and run.model_ranks == 1:  # (tensor and pipeline parallel apply them per stage)
        check_activation_blocks(cfg.activations, n_blocks)
    if device.type == "cpu" and model_cfg is not None:
        check_host_memory(cfg, model_cfg)
    schedule_steps = schedule_length(cfg, loaded)
    cfg = replace(cfg, scheduler=replace(cfg.scheduler, decay_steps=schedule_steps))  # recorded in config.toml
    # the memory layout to follow when it is saved (--plan, the resumed run's own, or the plan a try that retried
    # goes back to); --budget plans below
    plan = attempt.plan if attempt.plan is not None else (
        (mp_plan_to_follow if run.model_ranks > 1 else plan_to_follow)(cfg, out))  # (tp/pp: one per stage)
    if plan is not None and run.model_ranks == 1:
        check_plan(plan, cfg, amp_dtype)

    # the frozen teacher of --distill.teacher, loaded before the seed: the student starts as a plain run would
    student_vocab = model_cfg.vocab_size if model_cfg is not None else tokens.vocab_size  # (no --model.hf student)
    distill = load_distillation(cfg.distill, vocab_size=student_vocab, seq_len=seq_len, device=device,
                                resumed=loaded.meta if loaded is not None else None)

    # --- the model, seeded so that every run with this config starts identically
    torch.manual_seed(cfg.train.seed)
    random.seed(cfg.train.seed)
    if model_cfg is not None:
        model: nn.Module = build_model(model_cfg, device=device)
    else:  # called as ids -> logits; checkpoints hold the Hugging Face model's own state_dict
        model = build_hf_model(cfg.model.hf, hf_config, device)
    apply_qat(model, cfg)  # --train.qat: fake-quantised block Linears, before the engines and the optimizer

    # --- loaders: the sampler starts at the data position, so a resumed run sees the same samples
    samples_seen = loaded.state["samples_seen"] if loaded is not None else 0
    pin = cfg.data.pin_memory and device.type == "cuda"
    loader = D.build_dataloader(
        train_ds,
        batch_size=bsz,
        seed=cfg.train.seed,
        start_sample=samples_seen,
        num_workers=cfg.data.num_workers,
        pin_memory=pin,
        persistent_workers=cfg.data.num_workers > 0,
        collate_fn=collate,
        **run.data_slice(),  # under data parallel: this rank's part of each global batch
    )
    batches: Any = iter(D.DevicePrefetcher(loader, device))
    # the loader's worker processes start now, before the optimizer allocates its host state: forked after it,
    # they slowed every host optimizer step (W1, the whole optimizer on the host: 2.3 s against 0.8)
    first = next(batches)  # (the first micro-batch also the one a --budget plan is made for)
    batches = itertools.chain([first], batches)
    eval_loader = run.eval_loader(val_ds, bsz, cfg.train.eval_batches, collate) if cfg.train.eval_batches else None

    # --- the memory layout and the optimizer: planned for --budget, a saved plan, or the [activations] and
    # [optimizer] switches
    planned_here = cfg.budget is not None and plan is None
    if run.model_ranks > 1 and (planned_here or plan is not None):  # tp/pp: each pipeline rank's own plan
        model, optimizer, plan = plan_and_wrap(run, model, lambda m, overlap: build_optimizer(m, cfg, device, overlap),
                                               plan, first, amp_dtype)
        fwd_model = model
    elif planned_here:  # the plan is made for the run's own first micro-batch, which step 1 then trains on
        # the fused head + loss needs our own models' head (it runs in the head's forward, which DDP and FSDP2
        # see: micro_batch_loss)
        fused_ok = model_cfg is not None
        # the link as the ranks of this host share it, every rank copying at once (a collective, before rank 0
        # plans alone)
        link = shared_link_for(cfg, device) if run.enabled else None
        model, optimizer, plan = run.plan_once(plan_for_budget, apply_plan, model, first, cfg, fused_loss=fused_ok,
                                               amp_dtype=amp_dtype, shared_link=link,  # rank 0 plans; all follow
                                               # (a re-plan's budget, below --budget, and the step it must beat)
                                               budget=attempt.plan_budget, beat_seconds=attempt.beat_seconds,
                                               profiles=attempt.profiles)  # (a re-plan's: the first try's)
        fwd_model, optimizer = run.wrap(model, optimizer=optimizer, plan=plan)  # (FSDP2: the plan's, over shards)
        if device.type == "cuda":  # the logged peak is the training steps', not the profile's (an unplanned step)
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats(device)
    elif plan is not None:
        model, optimizer = apply_plan(model, plan, cfg)
        fwd_model, optimizer = run.wrap(model, optimizer=optimizer, plan=plan)
    else:
        if bf16_params:
            model.to(torch.bfloat16)  # the optimizer keeps fp32 masters of these values
        if run.model_ranks == 1:  # (tensor and pipeline parallel apply them per stage, after the split)
            apply_activations(model, cfg)
        fwd_model, optimizer = run.wrap(model, lambda m, overlap: build_optimizer(m, cfg, device, overlap))
        if run.mp is not None:
            model = fwd_model  # this rank's split model (its stages under pp): what checkpoints save and load
    if plan is not None:  # the plan decides the weights' dtype and the loss, whatever [optimizer] and [train] say
        bf16_params = plan.weight_dtype == "bfloat16"
        fused_loss = plan.fused_loss
    else:
        fused_loss = cfg.train.fused_loss
    metrics = run.metrics(out, resume_step=loaded.step if loaded else (0 if attempt.rewind_metrics else None),
                          tensorboard=cfg.logging.tensorboard)
    progress = recorder = None
    # (no plan: they watch nothing; the step's pace is every rank's alike, so rank 0 alone says it)
    limit = budget_limit(cfg)  # --budget: the cap and the watch's limit, whatever budget the plan was made for
    # a plan searched here for --budget (one process) is searched again, tighter, if its first steps run out of
    # memory or keep the allocator retrying, before anything is checkpointed (planning.with_replans)
    replannable, started = attempt.may_replan and planned_here and not run.enabled, False
    # the retry warning names a lower --budget; where this run may plan for it itself, it says so
    suggest = "--budget {}" + (f"; this run plans for that itself if its steps keep retrying and run slow, by step "
                               f"{RETRY_REPLAN_STEPS} and before a checkpoint" if replannable else "")
    watch, pace = BudgetWatch(plan, limit, suggest), PaceWatch(plan if run.is_main else None)
    # one process: the budget is a limit from the first step on (the profile ran uncapped); lifted however the run ends
    capped = cfg.cap_memory and not run.enabled and cap_memory(plan, device, limit)
    try:  # from here on the optimizer (its host threads, pinned memory) is closed however the run ends
        scheduler = build_scheduler(
            optimizer,
            cfg.scheduler.name,
            total_steps=schedule_steps,
            warmup_steps=cfg.scheduler.warmup_steps,
            min_lr_ratio=cfg.scheduler.min_lr_ratio,
        )
        scaler = torch.amp.GradScaler(device.type) if amp_dtype == torch.float16 else None
        if cfg.train.compile:
            fwd_model = compile_model(model, fwd_model, plan)

        # --- resume: model, optimizer, schedule, scaler, RNG (the data position is the loader's)
        step = 0
        if loaded is not None:
            run.restore(loaded, model, optimizer)  # whichever world size wrote it
            scheduler.load_state_dict(loaded.state["scheduler"])
            if _saved_schedule_steps(loaded.meta) != schedule_steps:
                sync_lr(scheduler)  # the optimizer's saved LR is the old curve's
            if scaler is not None and loaded.state.get("scaler"):
                scaler.load_state_dict(loaded.state["scaler"])
            set_rng_state(loaded.state["rng"], device)
            step = loaded.step
            log.info("resumed from %s at step %d", loaded.path, step)
            loaded = replace(loaded, state={})  # the tensors now live in the model and optimizer

        n_params = count_params(model)
        # a Hugging Face model: 6 FLOPs per parameter and token, the attention scores left out
        flops_tok = flops_per_token(model_cfg, seq_len) if model_cfg is not None else 6 * n_params
        peak = peak_flops(device) if amp_dtype != torch.float32 else None
        log.info("run directory %s", out)
        log.info(
            "model %s: %.1fM parameters, %.2f GFLOP/token; %s, %s; %d step%s of %d x %d x %d tokens",
            f"{model_cfg.arch}/{cfg.model.preset}" if model_cfg is not None else
            f"{hf_config.model_type} from {cfg.model.hf}",
            n_params / 1e6, flops_tok / 1e9, device, amp_dtype,
            cfg.train.steps, "" if cfg.train.steps == 1 else "s", accum, bsz, seq_len,
        )
        autocast = (
            torch.autocast(device.type, dtype=amp_dtype)
            if amp_dtype != torch.float32 and not bf16_params  # a bf16 model runs as it is
            else contextlib.nullcontext()
        )
        params = [p for p in model.parameters() if p.requires_grad]
        result = TrainResult(step=step, losses={}, val_losses={}, out=out)
        progress = _progress_bar(cfg, step) if run.is_main else None
        if cfg.profile.enabled and run.is_main:  # --profile.steps: memory, trace and timeline into OUT/profile/
            from elbowroom.report import Recorder

            recorder = Recorder(out, cfg.profile, model=model, optimizer=optimizer, start_step=step + 1, device=device)

        def save(at: int) -> None:
            if hasattr(optimizer, "wait_for_weights"):
                optimizer.wait_for_weights()  # host wait: the CPU step of the offloaded weights must have landed
            state = {
                "scheduler": scheduler.state_dict(),
                "scaler": scaler.state_dict() if scaler is not None else None,
                "rng": rng_state(device),
                "samples_seen": samples_seen,
            }
            meta = {"model": model_meta, "config": to_dict(cfg), "schedule_steps": schedule_steps}
            path = run.save(ckpts, at, model, optimizer, state, meta)  # every rank: its shards, rank 0 the rest
            if run.is_main:
                log.info("saved checkpoint %s", path)

        # --- the loop
        tokens_since_log, t_log = 0, time.perf_counter()
        loss_acc = torch.zeros((), device=device)
        started = False
        with _StopSignal() as stop, GarbageCollection(cfg.train.gc_every) as collection:
            while step < cfg.train.steps:
                if recorder is not None:
                    recorder.step_begin(step + 1)  # numbered as metrics.jsonl numbers it
                model.train()
                micro = [next(batches) for _ in range(accum)]
                loss_acc += run.accumulate(accumulate_gradients, fwd_model, micro, autocast, scaler, optimizer,
                                           fused_loss=fused_loss, distill=distill)
                samples_seen += accum * bsz
                tokens_since_log += sum(b["input_ids"].numel() for b in micro)

                if scaler is not None:
                    scaler.unscale_(optimizer)
                last = step + 1 == cfg.train.steps or run.any_rank(stop.received is not None)
                log_now = (step + 1) % cfg.logging.log_every == 0 or step == 0 or last
                if cfg.train.max_grad_norm:
                    grad_norm = run.gradient_norm(clip_gradients, params, optimizer, cfg.train.max_grad_norm)
                elif log_now:  # without clipping the norm is read only when it is logged, and read-only
                    grad_norm = run.gradient_norm(gradient_norm, params, optimizer, None)
                else:
                    grad_norm = None
                lr = optimizer.param_groups[0]["lr"]
                if scaler is not None:
                    scaler.step(optimizer)
                    scaler.update()
                else:
                    optimizer.step()
                optimizer.zero_grad(set_to_none=True)
                scheduler.step()
                step += 1
                collection.step(step)  # the same step on every rank: no rank waits for another's collection
                if recorder is not None:
                    written = recorder.writing_seconds
                    recorder.step_end(step)
                    t_log += recorder.writing_seconds - written  # writing the recording is not training time
                if progress is not None:
                    progress.update(1)
                if not started and run.is_main:  # the run directory appears with the first finished step
                    out.mkdir(parents=True, exist_ok=True)
                    atomic_write_text(out / "config.toml", to_toml(cfg))
                    if plan is not None:
                        atomic_write_text(out / PLAN_FILE, plan.to_toml())
                        atomic_write_text(out / "plan.json", plan.to_json() + "\n")
                    started = True

                # the flag is read here and again after each thing that takes time before the next step (the log
                # line, validation, the save); a reading that finds it sets `last` with `stopping`: no signal stops
                # the run without this step's checkpoint, or one step late
                stopping = run.any_rank(stop.received is not None)
                last = last or stopping
                if log_now or last:
                    loss_val = run.global_loss(loss_acc)  # host-device sync: logging asks for it
                    now = time.perf_counter()
                    ranks = run.log_numbers(tokens_since_log)  # tokens of all ranks, comm bytes
                    tok_s = ranks.pop("tokens_all_ranks") / (now - t_log)
                    row = {
                        "step": step,
                        "loss": loss_val,
                        "lr": lr,
                        "grad_norm": run.norm_value(grad_norm),
                        "tokens_per_s": tok_s,
                        "tflops": tok_s * flops_tok / 1e12,
                        "mfu": tok_s * flops_tok / peak if peak else None,
                        "tokens": samples_seen * seq_len,
                        "elapsed_s": now - t_log,
                        **peak_memory(device),
                        **host_step(optimizer),
                        **ranks,
                    }
                    if not math.isfinite(loss_val):
                        log.warning("step %d: loss is %s", step, loss_val)
                    result.losses[step] = loss_val
                    metrics.write(row)
                    watch.check(row)  # a planned run: warn once if the allocator passed the budget
                    if watch.keeps_retrying(row) and replannable and not last and may_start_over(cfg, step):
                        # ... or keeps retrying at it, slowly: plan again for less while nothing is checkpointed
                        raise EarlyStepsRetrying(out, plan, watch.lower_budget(),
                                                 f"{row.get('alloc_retries')} retries by step {step}", watch.pace_s)
                    pace.check(row)  # ... or if its steps keep running slower than predicted
                    if progress is not None:
                        progress.set_postfix(loss=f"{loss_val:.3f}", tok_s=f"{tok_s:,.0f}", refresh=False)
                    tokens_since_log, t_log = 0, time.perf_counter()
                    if not last:  # a signal during the log line (its device sync) stops here, not one step later
                        stopping = last = run.any_rank(stop.received is not None)
                loss_acc.zero_()

                # on a signal the checkpoint comes first: no validation pass on the way out
                if eval_loader is not None and not stopping and (
                    (cfg.train.eval_every and step % cfg.train.eval_every == 0) or last
                ):
                    val = run.evaluate(evaluate, fwd_model, eval_loader, device, autocast)
                    if val is not None:
                        result.val_losses[step] = val
                        metrics.write({"step": step, "val_loss": val})
                    t_log = time.perf_counter()  # evaluation time is not training throughput
                    if not last:  # a signal during the validation pass stops here too: this step's checkpoint
                        stopping = last = run.any_rank(stop.received is not None)

                if cfg.checkpoint.enabled and (
                    (cfg.checkpoint.every and step % cfg.checkpoint.every == 0) or last
                ):
                    with stop.saving():  # a second Ctrl-C now would lose the checkpoint the first asked for
                        save(step)
                    t_log = time.perf_counter()
                    if not last:  # a first signal during this save stops here: its checkpoint is this step's
                        stopping = run.any_rank(stop.received is not None)
                if stopping:
                    result.interrupted = True
                    result.signal = stop.received
                    name = signal.Signals(stop.received).name if stop.received else "a signal"
                    if cfg.checkpoint.enabled:
                        log.warning("stopped by %s at step %d, its checkpoint saved; continue with --resume --out %s",
                                    name, step, out)
                    else:
                        log.warning("stopped by %s at step %d; checkpoints are off (--checkpoint.enabled false): "
                                    "nothing to resume", name, step)
                    break
    except torch.OutOfMemoryError as e:  # leave what was live, against the plan's prediction, then fail as before
        if replannable and may_start_over(cfg, step):
            raise EarlyOutOfMemory(out, plan.budget_bytes, str(e).splitlines()[0] if str(e) else "",
                                   started=started) from None
        from elbowroom.report import write_oom_report

        report = write_oom_report(out, model, optimizer, plan=plan.to_dict() if plan is not None else None, error=e)
        log.error("out of memory: %s", report)
        raise
    finally:
        if capped:
            uncap_memory(device)
        if recorder is not None:
            recorder.close()  # its hooks and files, also when the run failed
        metrics.close()
        if progress is not None:
            progress.close()
        if hasattr(optimizer, "close"):
            optimizer.close()  # its host threads and pinned buffers, also when the run failed
    result.step = step
    return result


@torch.no_grad()
def evaluate(model: nn.Module, loader: Any, device: torch.device, autocast: Any, reduce: Any = None) -> float | None:
    """Mean validation loss per target token over the eval batches (None when there are none); ``reduce`` sums
    the loss and token count over data-parallel ranks."""
    model.eval()
    total = torch.zeros((), device=device, dtype=torch.float64)
    n = 0
    for b in D.DevicePrefetcher(loader, device):
        with autocast:
            logits = model(b["input_ids"])
        total += token_loss_sum(logits, b["targets"]).double()
        n += b["num_tokens"]
    model.train()
    if reduce is not None:
        total, n = reduce(total, n)
    return total.item() / n if n else None  # host-device sync: evaluation result


def _progress_bar(cfg: Config, step: int) -> Any:
    import sys

    if not cfg.logging.progress or not sys.stderr.isatty():  # the CLI turns it off under $CI
        return None
    from tqdm import tqdm

    return tqdm(total=cfg.train.steps, initial=step, unit="step", dynamic_ncols=True, leave=False)


def compile_model(model: nn.Module, fwd_model: nn.Module, plan: Any = None) -> nn.Module:
    """``--train.compile``: each repeated block compiled in place (regional compilation,
    :func:`elbowroom.activations.compile_blocks`), so what wraps the blocks (DDP, FSDP2, a plan's offload regions and
    checkpoints, the fused loss) stays as it is and one block's graph serves them all; a model without repeated
    blocks is compiled whole. A planned model's blocks compile as planned runs do
    (:data:`elbowroom.plan.fit.PLANNED_COMPILE`; compiled already when the plan was made in this process). A plan made
    here was priced on them so; one loaded from a file may have been priced on eager blocks, which the log then says,
    or on other compile options (its notes name them), which run as planned runs compile: a kept block then saves no
    more than priced. Returns the module the steps call."""
    from elbowroom.activations import compile_blocks
    from elbowroom.plan.fit import planned_compile_options

    try:
        done = compile_blocks(model, **(planned_compile_options() if plan is not None else {}))
    except ValueError:
        log.info("compile: no repeated blocks found; compiling the whole model")
        return torch.compile(fwd_model)
    eager = (f"; {done.eager} selective blocks stay eager (offloading their input and part of what they keep, or "
             "offloading over tensor-parallel shards)" if done.eager else "")
    from elbowroom.plan.fit import COMPILED_NOTE

    priced = "" if plan is None or COMPILED_NOTE in plan.notes else "; the plan was priced on the eager blocks"
    log.info("compile: %d blocks compiled in place (one graph per block shape and policy; the first step compiles "
             "it)%s%s", done.compiled, eager, priced)
    return fwd_model
