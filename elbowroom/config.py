"""Config as a tree of dataclasses: loaded from TOML, overridden from the command line.

Every field is typed and carries a one-line docstring (the string literal under it), which
``elbowroom train --help`` shows. Values are checked in ``__post_init__`` with a message that names the
field and the fix. Overrides are ``--section.key VALUE`` (``--section.key`` alone sets a bool to true).
"""

from __future__ import annotations

import ast
import dataclasses
import inspect
import json
import os
import re
import sys
import textwrap
import types
import typing
from dataclasses import dataclass, field, fields
from functools import cache
from pathlib import Path
from typing import Any, Literal, Union, get_args, get_origin

# The mechanisms own their config dataclasses (frozen, validated, one docstring per field); the run's config
# composes them, so each setting has one schema and --help shows the mechanism's own words.
from elbowroom.activations.policy import ActivationConfig
from elbowroom.distributed.config import ParallelConfig
from elbowroom.optim.config import CPUOffloadConfig
from elbowroom.report.config import RecordConfig

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - exercised on 3.10 only
    import tomli as tomllib


class ConfigError(ValueError):
    """A config value, key or file is wrong; the message says which and how to fix it."""


@dataclass
class ModelSection:
    preset: str = "tiny"
    """Named shape: tiny (CPU default), w1, w2, 7b; the fields below override it."""
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
    """Wrap the model with torch.compile."""
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
        if self.fused_loss and self.compile:
            raise ConfigError(
                "train.fused_loss runs outside torch.compile; drop one of --train.fused_loss, --train.compile"
            )
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
    may change only its length, evaluation, checkpoints, logging and memory layout."""
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
            ("--train.compile", cfg.train.compile, "runs the student's head chunk by chunk outside torch.compile"),
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


# Short flags users expect from nanoGPT/torchtitan-style CLIs, mapped to their dotted keys.
ALIASES = {
    "steps": "train.steps",
    "log-every": "logging.log_every",
    "log_every": "logging.log_every",
    "seed": "train.seed",
    "device": "train.device",
    "host-budget": "host_budget",
    "cap-memory": "cap_memory",
}


# ---------------------------------------------------------------- field docs
_ROLE = re.compile(r":(?:py:)?(\w+):`([^`]+)`")  # :func:`name`, :class:`~pkg.Name`, :meth:`title <target>`


def _plain_text(doc: str) -> str:
    """A docstring as ``--help`` shows it: a reST role as its target's name (a function's with "()", a ``~`` target's
    last component) and double-backquoted literals without their backquotes."""

    def role(m: re.Match[str]) -> str:
        kind, target = m.groups()
        if target.endswith(">") and "<" in target:  # an explicit title
            return target.split("<", 1)[0].strip()
        if target.startswith("~"):  # shown as its last component
            target = target[1:].rsplit(".", 1)[-1]
        return f"{target}()" if kind in ("func", "meth") else target

    return _ROLE.sub(role, doc).replace("``", "")


@cache
def field_docs(cls: type) -> dict[str, str]:
    """The docstrings under each field of a dataclass, read from its source, as plain text."""
    try:
        tree = ast.parse(textwrap.dedent(inspect.getsource(cls)))
    except (OSError, TypeError):  # source unavailable (frozen app): no help text, nothing breaks
        return {}
    docs: dict[str, str] = {}
    body = tree.body[0].body  # type: ignore[attr-defined]
    for node, nxt in zip(body, body[1:]):
        if (
            isinstance(node, ast.AnnAssign)
            and isinstance(node.target, ast.Name)
            and isinstance(nxt, ast.Expr)
            and isinstance(nxt.value, ast.Constant)
            and isinstance(nxt.value.value, str)
        ):
            docs[node.target.id] = _plain_text(" ".join(nxt.value.value.split()))
    return docs


def _is_section(tp: Any) -> bool:
    return isinstance(tp, type) and dataclasses.is_dataclass(tp)


def _resolved_types(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)


def iter_options(cfg_cls: type = Config) -> list[tuple[str, Any, Any, str]]:
    """Every option as (dotted key, type, default, doc), in declaration order."""
    out = []
    hints = _resolved_types(cfg_cls)
    docs = field_docs(cfg_cls)
    for f in fields(cfg_cls):
        tp = hints[f.name]
        if _is_section(tp):
            sub_hints = _resolved_types(tp)
            sub_docs = field_docs(tp)
            for sf in fields(tp):
                out.append((f"{f.name}.{sf.name}", sub_hints[sf.name], _default(sf), sub_docs.get(sf.name, "")))
        else:
            out.append((f.name, tp, _default(f), docs.get(f.name, "")))
    return out


def _default(f: dataclasses.Field) -> Any:
    if f.default is not dataclasses.MISSING:
        return f.default
    if f.default_factory is not dataclasses.MISSING:  # type: ignore[misc]
        return f.default_factory()  # type: ignore[misc]
    return None


def type_name(tp: Any) -> str:
    """A short human name of a field type, for help and errors."""
    origin = get_origin(tp)
    if origin is Literal:
        return "|".join(str(a) for a in get_args(tp))
    if origin in (Union, types.UnionType):
        args = [a for a in get_args(tp) if a is not type(None)]
        return type_name(args[0]) if len(args) == 1 else "|".join(type_name(a) for a in args)
    if origin is tuple:
        return ",".join("..." if a is Ellipsis else type_name(a) for a in get_args(tp))
    return getattr(tp, "__name__", str(tp))


# ---------------------------------------------------------------- value conversion
_TRUE = {"true", "1", "yes", "on"}
_FALSE = {"false", "0", "no", "off"}
_NONE = {"none", "null", ""}


def convert(key: str, value: Any, tp: Any) -> Any:
    """Convert a TOML or command-line value to the field type ``tp``; ConfigError on a mismatch."""
    origin = get_origin(tp)
    if origin in (Union, types.UnionType):
        args = get_args(tp)
        if type(None) in args and (value is None or (isinstance(value, str) and value.lower() in _NONE)):
            return None
        inner = [a for a in args if a is not type(None)]
        return convert(key, value, inner[0])
    if origin is Literal:
        choices = get_args(tp)
        if value not in choices:
            raise ConfigError(f"{key} must be one of {', '.join(map(str, choices))}, got {value!r}")
        return value
    if origin is tuple:
        args = get_args(tp)
        items = [v.strip() for v in value.split(",")] if isinstance(value, str) else value
        if len(args) == 2 and args[1] is Ellipsis:  # tuple[int, ...]: any number, written 0,3,5
            if not isinstance(items, (list, tuple)):
                raise ConfigError(f"{key} expects values like 0,3,5, got {value!r}")
            return tuple(convert(key, v, args[0]) for v in items)
        if not isinstance(items, (list, tuple)) or len(items) != len(args):
            raise ConfigError(f"{key} expects {len(args)} values like 0.9,0.95, got {value!r}")
        return tuple(convert(key, v, a) for v, a in zip(items, args))
    if tp is bool:
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value.lower() in _TRUE | _FALSE:
            return value.lower() in _TRUE
        raise ConfigError(f"{key} expects true or false, got {value!r}")
    if tp is int:
        if isinstance(value, bool):
            raise ConfigError(f"{key} expects an integer, got {value!r}")
        if isinstance(value, int):
            return value
        if isinstance(value, str):
            try:
                return int(value.replace("_", ""))
            except ValueError:
                pass
        raise ConfigError(f"{key} expects an integer, got {value!r}")
    if tp is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        if isinstance(value, str):
            try:
                return float(value)
            except ValueError:
                pass
        raise ConfigError(f"{key} expects a number, got {value!r}")
    if tp is str:
        if isinstance(value, str):
            return value
        raise ConfigError(f"{key} expects a string, got {value!r}")
    raise ConfigError(f"{key}: unsupported type {tp}")  # our own bug if reached


# ---------------------------------------------------------------- building
def _known_keys() -> list[str]:
    return [k for k, *_ in iter_options()]


def _unknown_key(key: str) -> ConfigError:
    import difflib

    near = difflib.get_close_matches(key, _known_keys(), n=1)
    hint = f"; did you mean {near[0]}?" if near else "; `elbowroom train --help` lists every option"
    return ConfigError(f"unknown config key {key!r}{hint}")


def build_config(raw: dict[str, Any]) -> Config:
    """Build a validated Config from a nested dict (TOML layout); unknown keys and wrong types raise."""
    hints = _resolved_types(Config)
    top: dict[str, Any] = {}
    for name, value in raw.items():
        if name not in hints:
            raise _unknown_key(name)
        tp = hints[name]
        if _is_section(tp):
            if not isinstance(value, dict):
                raise ConfigError(f"[{name}] must be a table of keys, got {value!r}")
            sub_hints = _resolved_types(tp)
            kwargs = {}
            for k, v in value.items():
                if k not in sub_hints:
                    raise _unknown_key(f"{name}.{k}")
                kwargs[k] = convert(f"{name}.{k}", v, sub_hints[k])
            try:
                top[name] = tp(**kwargs)
            except ConfigError:
                raise
            except (ValueError, TypeError) as e:  # validation that lives in a mechanism's own dataclass
                raise ConfigError(_section_message(name, tp, list(kwargs), str(e))) from None
        else:
            top[name] = convert(name, value, tp)
    return Config(**top)


def _section_message(section: str, tp: type, given: list[str], message: str) -> str:
    """A mechanism's own validation message, made to name the key: ``[offload] bucket_bytes must ...``, or
    ``profile.steps: ...`` when the message does not start with a field name and one key was given."""
    if f"{section}." in message:
        return message
    if message.split(" ", 1)[0] in {f.name for f in fields(tp)} or len(given) != 1:
        return f"[{section}] {message}"
    return f"{section}.{given[0]}: {message}"


def load_toml(path: str) -> dict[str, Any]:
    """Read a TOML config file, with a clear error for a missing or malformed one."""
    try:
        with open(path, "rb") as f:
            return tomllib.load(f)
    except FileNotFoundError:
        raise ConfigError(f"config file {path} does not exist; pass an existing --config FILE.toml") from None
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"config file {path} is not valid TOML: {e}") from None


# ---------------------------------------------------------------- a file given to the wrong option
# each of elbowroom's files: what it is, and how `elbowroom train` takes it
_FILE_KINDS = {
    "plan": ("a plan file", "pass it with --plan {path}"),
    "config": ("a run config", "pass it with --config {path}"),
    "profile": ("a profile", "plan from it with `elbowroom plan --profile {path} --budget SIZE --out plan.toml`, then "
                "pass --plan plan.toml"),
}


def file_kind(path: str | os.PathLike[str]) -> str | None:
    """Which of elbowroom's files ``path`` is, read from its keys: "plan" (``elbowroom plan --out``, a run's
    OUT/plan.toml), "profile" (the JSON ``elbowroom plan --profile`` reads), "config" (a run's config.toml), or None
    (another file, or none at all)."""
    p = Path(path)
    if p.suffix not in (".toml", ".json") or not p.is_file():
        return None  # (a token file may be gigabytes: only these are read)
    try:
        data = tomllib.loads(p.read_text()) if p.suffix == ".toml" else json.loads(p.read_text())
    except (OSError, UnicodeDecodeError, ValueError):  # (TOML's and JSON's decode errors are ValueErrors)
        return None
    if not isinstance(data, dict):
        return None
    if {"blocks", "budget_bytes"} <= data.keys():
        return "plan"
    if {"blocks", "machine", "head"} <= data.keys():
        return "profile"
    hints = _resolved_types(Config)
    if data.keys() <= hints.keys() and any(_is_section(hints[k]) for k in data):
        return "config"
    return None


def wrong_file(option: str, path: str | os.PathLike[str], takes: str) -> str | None:
    """The fix-it message for one of elbowroom's files given to ``option``, which takes ``takes`` (a kind of
    :func:`file_kind`, or words such as "a token file"), or None when the file is that kind or none of elbowroom's.
    """
    kind = file_kind(path)
    if kind is None or kind == takes:
        return None
    what, fix = _FILE_KINDS[kind]
    expected = _FILE_KINDS[takes][0] if takes in _FILE_KINDS else takes
    return f"{option} {path}: {path} is {what}, not {expected}; {fix.format(path=path)}"


def _section_as_option(section: str, value: str | None) -> ConfigError:
    """``--profile FILE`` (an option of ``elbowroom plan``) or ``--train 3``: a section given as an option."""
    first = next(k for k in _known_keys() if k.startswith(f"{section}."))
    message = (f"--{section} is the [{section}] section, not an option: set its keys as --{section}.KEY VALUE "
               f"(such as --{first})")
    kind = file_kind(value) if value is not None else None
    if kind is not None:
        what, fix = _FILE_KINDS[kind]
        message += f"; {value} is {what}: {fix.format(path=value)}"
    return ConfigError(message)


def set_dotted(raw: dict[str, Any], key: str, value: Any) -> None:
    """Set ``raw["a"]["b"] = value`` for key "a.b" (creating the table)."""
    parts = key.split(".")
    if len(parts) > 2:
        raise _unknown_key(key)
    if len(parts) == 1:
        raw[key] = value
        return
    section = raw.setdefault(parts[0], {})
    if not isinstance(section, dict):
        raise ConfigError(f"{parts[0]} is a section; set its keys as --{parts[0]}.KEY VALUE")
    section[parts[1]] = value


def parse_overrides(args: list[str]) -> list[tuple[str, Any]]:
    """Parse ``--a.b VALUE``, ``--a.b=VALUE`` and bare ``--a.b`` (true for bools) into (key, value)."""
    hints = {k: tp for k, tp, *_ in iter_options()}
    out: list[tuple[str, Any]] = []
    i = 0
    while i < len(args):
        tok = args[i]
        if not tok.startswith("--") or tok == "--":
            raise ConfigError(f"unexpected argument {tok!r}; options look like --section.key VALUE")
        name, eq, value = tok[2:].partition("=")
        if name in ALIASES:
            name = ALIASES[name]
        name = name.replace("-", "_") if name not in hints else name
        if name not in hints:
            if any(k.startswith(f"{name}.") for k in hints):  # --profile plan.toml
                nxt = args[i + 1] if i + 1 < len(args) and not args[i + 1].startswith("--") else None
                raise _section_as_option(name, value if eq else nxt)
            raise _unknown_key(name)
        tp = hints[name]
        if not eq:
            nxt = args[i + 1] if i + 1 < len(args) else None
            is_bool = tp is bool
            if is_bool and nxt is not None and not nxt.startswith("--") and nxt.lower() not in _TRUE | _FALSE:
                # (no positional argument follows an option: this was meant as its value)
                raise ConfigError(f"--{tok[2:]} takes true or false (alone: true), got {nxt!r}")
            if is_bool and (nxt is None or nxt.startswith("--")):
                value = "true"
            elif nxt is None or (nxt.startswith("--") and not _looks_numeric(nxt)):
                raise ConfigError(f"--{name} needs a value ({type_name(tp)})")
            else:
                value = nxt
                i += 1
        out.append((name, value))
        i += 1
    return out


def _looks_numeric(s: str) -> bool:
    try:
        float(s)
        return True
    except ValueError:
        return False


def _load_config_file(path: str) -> dict[str, Any]:
    """The ``--config`` file, refused with the fix when it is another of elbowroom's files (a plan, a profile)."""
    wrong = wrong_file("--config", path, takes="config")
    if wrong is not None:
        raise ConfigError(wrong)
    return load_toml(path)


def resolve(config_file: str | None, overrides: list[str]) -> Config:
    """The config of a run: defaults, then the TOML file, then command-line overrides."""
    raw: dict[str, Any] = _load_config_file(config_file) if config_file else {}
    for key, value in parse_overrides(overrides):
        set_dotted(raw, key, value)
    return build_config(raw)


# What a resumed run may change: how long it runs and how it evaluates, saves, logs and is laid out in memory and
# across devices. Everything else (model, data, optimizer, schedule, seed, precision, ...) is the run's trajectory.
# (train.qat is the trainer's to check, against the checkpoint; --budget and --plan against the run's OUT/plan.toml.)
RESUME_MAY_CHANGE = (
    "out", "resume", "budget", "host_budget", "plan", "cap_memory", "train.steps", "train.eval_every",
    "train.eval_batches", "train.device", "train.gc_every",
    "train.compile", "train.qat", "scheduler.decay_steps", "data.num_workers", "data.pin_memory", "data.cache_dir",
    "checkpoint.", "logging.", "profile.", "activations.", "offload.", "parallel.",
)
# Saved settings a resume does not carry over: the checkpoint keeps the schedule's length (see the trainer's
# schedule_length), the run's OUT/plan.toml its plan, and profiling is asked for per command.
_NOT_CARRIED = ("plan", "scheduler.decay_steps", "profile")


def _may_change(key: str) -> bool:
    return any(key == k or (k.endswith(".") and key.startswith(k)) for k in RESUME_MAY_CHANGE)


def resolve_resume(saved: dict[str, Any], where: str, config_file: str | None, overrides: list[str]) -> Config:
    """The config of a resumed run: its saved config, then the options given explicitly (file and command line).

    An explicit option that would change the run's training (anything not in ``RESUME_MAY_CHANGE``) and differs
    from the saved value raises ConfigError naming it: a resumed run continues the exact loss curve.

    Args:
        saved: the run's saved config as a nested dict (its ``OUT/config.toml``).
        where: the file it came from, for messages.
        config_file: this command's ``--config`` file, if any.
        overrides: this command's ``--section.key VALUE`` arguments.
    """
    explicit: dict[str, Any] = _load_config_file(config_file) if config_file else {}
    for key, value in parse_overrides(overrides):
        set_dotted(explicit, key, value)
    base = {k: dict(v) if isinstance(v, dict) else v for k, v in saved.items() if k not in _NOT_CARRIED}
    for key in _NOT_CARRIED:
        sec, _, name = key.rpartition(".")
        if sec and isinstance(base.get(sec), dict):
            base[sec].pop(name, None)
    try:
        run_cfg = build_config(base)
    except ConfigError as e:
        raise ConfigError(f"--resume: the run's saved config {where} does not load ({e}); fix or remove it") from None
    merged = {k: dict(v) if isinstance(v, dict) else v for k, v in base.items()}
    for key, value in _flat(explicit):
        set_dotted(merged, key, value)
    cfg = build_config(merged)
    changed = []
    for key, _ in _flat(explicit):
        if _may_change(key):
            continue
        now, was = _get(cfg, key), _get(run_cfg, key)
        if now != was:
            changed.append(f"--{key} {_shown(now)} (the run has {_shown(was)})")
    if changed:
        raise ConfigError(
            f"--resume continues the run as saved in {where}, and these would change its training: "
            f"{', '.join(changed)}; drop them to resume, or start a new run with another --out"
        )
    return cfg


def _get(cfg: Config, key: str) -> Any:
    obj: Any = cfg
    for part in key.split("."):
        obj = getattr(obj, part)
    return obj


def _shown(value: Any) -> str:
    return ",".join(map(str, value)) if isinstance(value, tuple) else str(value)


def to_dict(cfg: Any) -> dict[str, Any]:
    """A config as a plain nested dict (tuples as lists, so it is TOML- and JSON-friendly)."""
    d = dataclasses.asdict(cfg)

    def fix(x: Any) -> Any:
        if isinstance(x, dict):
            return {k: fix(v) for k, v in x.items()}
        if isinstance(x, tuple):
            return list(x)
        return x

    return fix(d)


def to_toml(cfg: Config) -> str:
    """Serialise a config to TOML (None values are left out: they mean "the default")."""
    # TOML has no null: a None whose default is also None is left out; one that overrides a default
    # is written as "none", which the loader reads back as None.
    defaults = {key: default for key, _, default, _ in iter_options()}
    lines: list[str] = []
    sections: dict[str, list[str]] = {}
    for key, value in _flat(to_dict(cfg)):
        if value is None:
            if defaults[key] is None:
                continue
            value = "none"
        sec, _, name = key.rpartition(".")
        (sections.setdefault(sec, []) if sec else lines).append(f"{name} = {_toml_value(value)}")
    for sec, body in sections.items():
        lines.append(f"\n[{sec}]")
        lines.extend(body)
    return "\n".join(lines) + "\n"


def _flat(d: dict[str, Any], prefix: str = "") -> list[tuple[str, Any]]:
    out = []
    for k, v in d.items():
        out.extend(_flat(v, f"{prefix}{k}.") if isinstance(v, dict) else [(f"{prefix}{k}", v)])
    return out


def _toml_value(v: Any) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, (int, float)):
        return repr(v)
    if isinstance(v, list):
        return "[" + ", ".join(_toml_value(x) for x in v) + "]"
    return '"' + str(v).replace("\\", "\\\\").replace('"', '\\"') + '"'


def help_text() -> str:
    """Every option with its type, default and docstring, grouped by section."""
    lines = []
    section = None
    for key, tp, default, doc in iter_options():
        if key.startswith("offload.") and key.removeprefix("offload.") in _OFFLOAD_PLACEMENT:
            continue  # set from [optimizer]; refused here
        sec = key.split(".")[0] if "." in key else ""
        if sec != section:
            section = sec
            lines.append(f"\n[{sec}]" if sec else "\n[top level]")
        shown = ",".join(map(str, default)) if isinstance(default, tuple) else default
        lines.append(f"  --{key} {type_name(tp).upper() if tp is not bool else ''}".rstrip())
        lines.append(f"      {doc} (default: {shown})")
    return "\n".join(lines)
