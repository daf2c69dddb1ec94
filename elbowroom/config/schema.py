"""The run's settings as a tree of dataclasses: one section per part of a run, each field typed with a one-line
docstring (the string literal under it) that ``elbowroom train --help`` shows, each value checked in
``__post_init__`` with a message that names the field and the fix.

The mechanisms own their config dataclasses (frozen, validated); :class:`Config` composes them, so each setting has
one schema and ``--help`` shows the mechanism's own words. How a config is read from TOML and the command line,
resumed and written back is :mod:`elbowroom.config.loading`.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Literal

from elbowroom.activations.policy import ActivationConfig
from elbowroom.distributed.config import ParallelConfig
from elbowroom.optim.config import CPUOffloadConfig
from elbowroom.report.config import RecordConfig, parse_steps


class ConfigError(ValueError):
    """A config value, key or file is wrong; the message says which and how to fix it."""


@dataclass
class ModelSection:
    preset: str = "tiny"
    """Named shape (tiny: the CPU default); the fields below override it."""
    arch: Literal["llama", "gpt2"] = "llama"
    """Block family: llama (RMSNorm, RoPE, SwiGLU) or gpt2 (LayerNorm, learned positions, GELU)."""
    dim: int | None = None
    """Model width (None: the preset's)."""
    n_layers: int | None = None
    """Number of blocks (None: the preset's)."""
    n_heads: int | None = None
    """Attention heads (None: the preset's)."""
    ffn_dim: int | None = None
    """MLP hidden width (None: the preset's)."""
    vocab_size: int | None = None
    """Vocabulary size (None: the data's vocabulary for tiny, else the preset's)."""
    dropout: float = 0.0
    """Dropout probability on embeddings, attention and MLP outputs."""
    fused_qkv: bool = True
    """Compute q, k and v with one matmul."""
    hf: str | None = None
    """A local Hugging Face causal-LM directory (config.json, weights if present) to train instead of the preset."""

    def __post_init__(self) -> None:
        from elbowroom.models import PRESETS

        if self.preset not in PRESETS:
            raise ConfigError(f"model.preset must be one of {', '.join(PRESETS)}, got {self.preset!r}")
        for name in ("dim", "n_layers", "n_heads", "ffn_dim", "vocab_size"):
            v = getattr(self, name)
            if v is not None and v <= 0:
                raise ConfigError(f"model.{name} must be positive, got {v}")
        if not 0.0 <= self.dropout < 1.0:
            raise ConfigError(f"model.dropout must be in [0, 1), got {self.dropout}")
        if self.hf is not None:
            shaped = [f"--model.{f.name}" for f in fields(self)
                      if f.name != "hf" and getattr(self, f.name) != f.default]
            if shaped:
                raise ConfigError(f"model.hf takes the model from {self.hf}/config.json; drop {', '.join(shaped)}")


@dataclass
class DataSection:
    path: str | None = None
    """Token file (.bin from `elbowroom prepare`); unset: the embedded byte-level corpus of Python's stdlib."""
    seq_len: int = 128
    """Tokens per sample."""
    batch_size: int = 16
    """Samples per micro-batch."""
    variable_length: bool = False
    """Train on whole documents of varying length, padded per batch with a loss mask."""
    val_fraction: float = 0.05
    """Share of the tokens (the last ones) held out for validation."""
    num_workers: int = 1
    """DataLoader worker processes (0: load in the main process)."""
    pin_memory: bool = True
    """Pin host batches for asynchronous copies (only where CUDA is used)."""
    cache_dir: str | None = None
    """Where the embedded corpus is cached (default ~/.cache/elbowroom, or $ELBOWROOM_CACHE)."""

    def __post_init__(self) -> None:
        if self.seq_len <= 0:
            raise ConfigError(f"data.seq_len must be positive, got {self.seq_len}")
        if self.batch_size <= 0:
            raise ConfigError(f"data.batch_size must be positive, got {self.batch_size}")
        if not 0.0 < self.val_fraction < 1.0:
            raise ConfigError(f"data.val_fraction must be in (0, 1), got {self.val_fraction}")
        if self.num_workers < 0:
            raise ConfigError(f"data.num_workers must be >= 0, got {self.num_workers}")


@dataclass
class TrainSection:
    steps: int = 200
    """Optimizer steps to run (the total, counting steps done before a resume)."""
    gradient_accumulation_steps: int = 1
    """Micro-batches per optimizer step; the loss is normalised by the target tokens of the whole step."""
    seed: int = 1337
    """Seed for initialisation, data order and dropout."""
    device: str = "auto"
    """Device: auto (cuda if available, else cpu), cpu, cuda or cuda:N."""
    dtype: Literal["auto", "fp32", "bf16", "fp16"] = "auto"
    """Autocast precision: auto (bf16 on CUDA, fp32 on CPU), fp32, bf16, or fp16 (with a GradScaler)."""
    max_grad_norm: float | None = 1.0
    """Clip gradients to this global L2 norm (None or 0: no clipping)."""
    eval_every: int = 50
    """Validate every N steps and at the end (0: only at the end)."""
    eval_batches: int = 8
    """Validation micro-batches per evaluation."""
    compile: bool = False
    """Compile each repeated block with torch.compile, in place (one graph serves all blocks alike, so it compiles in
    seconds), with its checkpoint where it recomputes; DDP, FSDP2, offload regions, the head and the fused loss stay
    eager around it. A model without repeated blocks is compiled whole."""
    fused_loss: bool = False
    """Output head and cross-entropy chunk by chunk: the logits never exist whole (~tokens x vocab x 10 bytes less
    peak memory, same FLOPs)."""
    deterministic: bool = False
    """Ask torch for deterministic algorithms (CPU runs are deterministic regardless)."""
    gc_every: int = 0
    """Collect Python's garbage every N steps, the same step on every rank, with the automatic collector off during
    the loop (0: Python's automatic collection, whose pause on one rank the others wait for at the next collective;
    W1 on 2 H200s ran as fast either way)."""
    qat: Literal["int8", "int4"] | None = None
    """Quantisation-aware training (torchao): int8 activations with int8 or int4 (groups of 32) block weights,
    fake-quantised in every step; `elbowroom export quantize RUN --method qat` converts them (needs the export
    extra)."""

    def __post_init__(self) -> None:
        if self.steps < 1:
            raise ConfigError(f"train.steps must be >= 1 (the optimizer steps of the whole run), got {self.steps}")
        if self.gradient_accumulation_steps <= 0:
            raise ConfigError(
                f"train.gradient_accumulation_steps must be >= 1, got {self.gradient_accumulation_steps}"
            )
        if self.max_grad_norm is not None and self.max_grad_norm < 0:
            raise ConfigError(f"train.max_grad_norm must be >= 0 or unset, got {self.max_grad_norm}")
        if self.gc_every < 0:
            raise ConfigError(f"train.gc_every must be >= 0 (0: Python's automatic collection), got {self.gc_every}")
        if self.eval_every < 0 or self.eval_batches < 0:
            raise ConfigError("train.eval_every and train.eval_batches must be >= 0")
        if not (self.device in ("auto", "cpu", "cuda") or self.device.startswith("cuda:")):
            raise ConfigError(f"train.device must be auto, cpu, cuda or cuda:N, got {self.device!r}")


@dataclass
class OptimizerSection:
    lr: float = 3e-3
    """Peak learning rate."""
    weight_decay: float = 0.1
    """AdamW decoupled weight decay (not applied to norms, biases and embeddings)."""
    betas: tuple[float, float] = (0.9, 0.95)
    """AdamW betas, written as 0.9,0.95 on the command line."""
    eps: float = 1e-8
    """AdamW epsilon."""
    fused: bool = True
    """Use torch's fused AdamW kernel where the device has one."""
    offload_fraction: float = 0.0
    """Share of parameter bytes whose fp32 master and optimizer state live in pinned host memory."""
    offload_gradients: bool = False
    """Free GPU gradients once copied to the host (only with offload_fraction > 0)."""
    offload_late: bool = True
    """Offload the last blocks' share (their CPU step hides under backward and the next forward), not the first."""
    offload_param_dtype: Literal["float32", "bfloat16"] = "float32"
    """GPU dtype of the offloaded parameters: bfloat16 halves their GPU memory and link bytes (fp32 masters stay
    on the host; needs train.dtype bf16)."""

    param_dtype: Literal["float32", "bfloat16"] = "float32"
    """GPU dtype of every parameter. bfloat16: the model runs in bf16 without autocast and the optimizer keeps fp32
    masters (on the host for offloaded parameters, on the GPU for the rest): the same 16 bytes per GPU-resident
    parameter as fp32 weights, but no weight casts and no fp32 gradient accumulation (on the 7B shape 13% less
    GPU time per micro-batch and 10 GiB fewer activations). Gradients accumulate over micro-batches in bf16. Needs
    train.dtype bf16."""

    def __post_init__(self) -> None:
        if self.lr < 0:
            raise ConfigError(f"optimizer.lr must be >= 0, got {self.lr}")
        if self.weight_decay < 0:
            raise ConfigError(f"optimizer.weight_decay must be >= 0, got {self.weight_decay}")
        if not all(0.0 <= b < 1.0 for b in self.betas):
            raise ConfigError(f"optimizer.betas must each be in [0, 1), got {self.betas}")
        if not 0.0 <= self.offload_fraction <= 1.0:
            raise ConfigError(f"optimizer.offload_fraction must be in [0, 1], got {self.offload_fraction}")
        if self.offload_param_dtype != "float32" and self.offload_fraction == 0.0:
            raise ConfigError(
                "optimizer.offload_param_dtype needs optimizer.offload_fraction > 0 (it applies to offloaded "
                "parameters only)"
            )
        if self.param_dtype != "float32" and self.offload_param_dtype != "float32":
            raise ConfigError(
                "optimizer.param_dtype bfloat16 already keeps the offloaded parameters in bf16; drop "
                "--optimizer.offload_param_dtype"
            )
        if self.offload_gradients and self.offload_fraction == 0.0:
            raise ConfigError(
                "optimizer.offload_gradients needs optimizer.offload_fraction > 0 (nothing is offloaded at 0)"
            )


@dataclass
class SchedulerSection:
    name: Literal["cosine", "onecycle", "constant"] = "cosine"
    """LR schedule: cosine (linear warmup then cosine decay), onecycle, or constant (after warmup)."""
    warmup_steps: int = 20
    """Steps of linear warmup from 0 (cosine, constant); onecycle uses warmup_steps / steps as its pct_start."""
    min_lr_ratio: float = 0.1
    """Final LR of the cosine decay as a fraction of the peak."""
    decay_steps: int | None = None
    """Length of the schedule in steps (None: train.steps); set it to stop early and resume on the same curve."""

    def __post_init__(self) -> None:
        if self.warmup_steps < 0:
            raise ConfigError(f"scheduler.warmup_steps must be >= 0, got {self.warmup_steps}")
        if not 0.0 <= self.min_lr_ratio <= 1.0:
            raise ConfigError(f"scheduler.min_lr_ratio must be in [0, 1], got {self.min_lr_ratio}")
        if self.decay_steps is not None and self.decay_steps <= 0:
            raise ConfigError(f"scheduler.decay_steps must be positive or unset, got {self.decay_steps}")


@dataclass
class DistillSection:
    teacher: str | None = None
    """Distil from this teacher: an elbowroom run or checkpoint directory, or a local Hugging Face model directory
    with the student's vocabulary (unset: no distillation)."""
    ratio: float = 0.5
    """Weight a of the teacher's term: loss = (1 - a) * CE + a * T^2 * KL(teacher || student); validation stays CE."""
    temperature: float = 1.0
    """Softmax temperature T of both distributions in the KL term."""
    dtype: Literal["float32", "bfloat16"] = "float32"
    """The teacher's weight dtype (bfloat16 halves its memory)."""

    def __post_init__(self) -> None:
        if not 0.0 <= self.ratio <= 1.0:
            raise ConfigError(f"distill.ratio must be in [0, 1], got {self.ratio}")
        if not self.temperature > 0:
            raise ConfigError(f"distill.temperature must be > 0, got {self.temperature}")
        if self.teacher is None:
            unused = [f"--distill.{f.name}" for f in fields(self) if getattr(self, f.name) != f.default]
            if unused:
                raise ConfigError(f"{', '.join(unused)} has no effect without --distill.teacher PATH; set the "
                                  "teacher or drop it")


@dataclass
class CheckpointSection:
    every: int = 100
    """Save a checkpoint every N steps (0: only at the end)."""
    keep: int = 2
    """Keep the newest K checkpoints; older ones are deleted after a successful save."""
    enabled: bool = True
    """Write checkpoints at all."""

    def __post_init__(self) -> None:
        if self.every < 0:
            raise ConfigError(f"checkpoint.every must be >= 0, got {self.every}")
        if self.keep < 1:
            raise ConfigError(f"checkpoint.keep must be >= 1, got {self.keep}")


@dataclass
class LoggingSection:
    log_every: int = 10
    """Log metrics every N steps (and at the first and last step)."""
    progress: bool = True
    """Show a progress bar (turned off automatically when stderr is not a terminal)."""
    tensorboard: bool = False
    """Also write TensorBoard scalars under OUT/tensorboard (needs the tensorboard extra)."""

    def __post_init__(self) -> None:
        if self.log_every < 1:
            raise ConfigError(f"logging.log_every must be >= 1, got {self.log_every}")


@dataclass
class Config:
    out: str | None = None
    """Run directory for metrics.jsonl, checkpoints/ and config.toml (unset: a new runs/YYYYmmdd-HHMMSS, -2 etc. if
    taken)."""
    resume: bool = False
    """Continue from the newest valid checkpoint in OUT/checkpoints, with the run's saved OUT/config.toml; other options
    may change only its length, evaluation, checkpoints, logging and memory layout (by hand: [activations] and the
    optimizer's offload; a run planned by --budget keeps its OUT/plan.toml, and one trained without a plan takes
    neither --budget nor --plan)."""
    budget: str | None = None
    """Device memory for one training step ("24GiB", "512MiB"): the planner chooses recompute, offload, optimizer
    placement and precision with elbowroom.plan.fit before step 1 (writes OUT/plan.toml and OUT/plan.json)."""
    host_budget: str | None = None
    """Host memory one process's plan may use ("32GiB"), with --budget: the host optimizer's state, its pinned buffers
    and offloaded activations must fit it (unset: this machine's memory, shared by the ranks on it). Where it binds
    the planner keeps gradients on the device and streams optimizer state, near 12 bytes per offloaded parameter."""
    plan: str | None = None
    """A saved plan (.toml or .json, from `elbowroom plan --out` or a run's OUT/plan.toml) to apply instead of
    planning."""
    cap_memory: bool = True
    """With --budget or --plan, in one process on a CUDA device: cap the allocator at the plan's budget once the plan
    is applied (torch.cuda.set_per_process_memory_fraction), as on a device of that size, so the budget is a limit.
    Where the allocator fills it, it frees its cache and retries (the run warns) or runs out of memory (a first step
    is planned again, tighter). false: the allocator may pass the budget, and the run warns by how much."""
    model: ModelSection = field(default_factory=ModelSection)
    data: DataSection = field(default_factory=DataSection)
    train: TrainSection = field(default_factory=TrainSection)
    optimizer: OptimizerSection = field(default_factory=OptimizerSection)
    scheduler: SchedulerSection = field(default_factory=SchedulerSection)
    checkpoint: CheckpointSection = field(default_factory=CheckpointSection)
    distill: DistillSection = field(default_factory=DistillSection)
    activations: ActivationConfig = field(default_factory=ActivationConfig)
    offload: CPUOffloadConfig = field(default_factory=CPUOffloadConfig)
    logging: LoggingSection = field(default_factory=LoggingSection)
    profile: RecordConfig = field(default_factory=RecordConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)

    def __post_init__(self) -> None:
        if self.resume and not self.out:
            raise ConfigError("--resume needs the run to continue: pass --out DIR of that run")
        if self.model.hf is not None and self.train.fused_loss:
            raise ConfigError("train.fused_loss needs elbowroom's own models (it reads their head); drop "
                              "--train.fused_loss with --model.hf")
        _check_qat_and_distill(self)
        recorded = parse_steps(self.profile.steps)
        if recorded and min(recorded) > self.train.steps:
            last = self.train.steps
            raise ConfigError(f"--profile.steps {self.profile.steps} lies past the run's last step, {last}: nothing "
                              f"would be recorded; pass steps from 1 to {last}")
        if self.budget is not None and self.plan is not None:
            raise ConfigError("--budget plans the run and --plan applies a saved plan: drop one of them")
        if self.host_budget is not None and self.budget is None:
            raise ConfigError("--host-budget bounds what --budget plans may put on the host; add --budget SIZE (or "
                              "drop --host-budget)")
        if self.budget is not None:
            from elbowroom.plan.fit import parse_budget

            try:
                parse_budget(self.budget)
                if self.host_budget is not None:
                    parse_budget(self.host_budget, name="host_budget")
            except ValueError as e:
                raise ConfigError(str(e)) from None
        if self.budget is not None or self.plan is not None:
            planned = memory_overrides(self)
            if planned:
                flag = "--budget" if self.budget is not None else "--plan"
                raise ConfigError(f"{flag} plans these; drop {', '.join(planned)}")
        # [offload] is the CPU-offloaded optimizer's own config; the trainer sets its placement and precision
        # from [optimizer] (one schema per setting), so only the engine's knobs are read from this section
        default = CPUOffloadConfig()
        for name in _OFFLOAD_PLACEMENT:
            if getattr(self.offload, name) != getattr(default, name):
                where = _OFFLOAD_PLACEMENT[name]
                raise ConfigError(
                    f"offload.{name} is set by the trainer from {where}; set that instead (the [offload] section "
                    "holds the optimizer engine's knobs: bucket_bytes, num_staging_slots, cpu_threads, ...)"
                )


def _check_qat_and_distill(cfg: Config) -> None:
    """QAT and distillation need elbowroom's own models (their head, their export) and an eager loop."""
    if cfg.train.qat is not None:
        if cfg.model.hf is not None:
            raise ConfigError("train.qat needs elbowroom's own models (its export rebuilds them); drop --model.hf "
                              "or --train.qat")
        if cfg.budget is not None or cfg.plan is not None:
            raise ConfigError("the planner does not price fake-quantised layers; drop --train.qat or "
                              f"{'--budget' if cfg.budget is not None else '--plan'} (the [activations] and "
                              "[optimizer] switches work with QAT)")
    if cfg.distill.teacher is not None:
        conflicts = [
            ("--model.hf", cfg.model.hf is not None, "reads the student's head, which only elbowroom's models expose"),
            ("--budget", cfg.budget is not None, "adds a teacher the planner does not price (a plan made for less "
             "memory with `elbowroom plan --out FILE` can be passed as --plan FILE)"),
        ]
        for flag, given, why in conflicts:
            if given:
                raise ConfigError(f"distillation {why}; drop {flag} or --distill.teacher")


def memory_overrides(cfg: Config) -> list[str]:
    """The explicit memory settings a plan decides instead (as flags, e.g. ``--activations.checkpoint``)."""
    flags = []
    default_acts = ActivationConfig()
    for f in fields(ActivationConfig):
        if getattr(cfg.activations, f.name) != getattr(default_acts, f.name):
            flags.append(f"--activations.{f.name}")
    default_opt = OptimizerSection()
    for name in ("offload_fraction", "offload_gradients", "offload_late", "offload_param_dtype"):
        if getattr(cfg.optimizer, name) != getattr(default_opt, name):
            flags.append(f"--optimizer.{name}")
    if cfg.train.fused_loss:
        flags.append("--train.fused_loss")
    return flags


# CPUOffloadConfig fields the trainer derives from [optimizer] -> where the user sets them
_OFFLOAD_PLACEMENT = {
    "offload_fraction": "--optimizer.offload_fraction",
    "offload_gradients": "--optimizer.offload_gradients",
    "param_dtype": "--optimizer.offload_param_dtype",
    "master_weights": "--optimizer.param_dtype bfloat16",
    "overlap": "the trainer (it always overlaps the host step with the next forward)",
}
