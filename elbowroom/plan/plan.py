"""The Plan: what the planner decided, as plain data that prints, saves, loads and re-applies.

A :class:`Plan` is a frozen dataclass: one :class:`BlockPlan` row per block (activation policy, whether its
parameters' optimizer runs on the host, and what the cost model predicts for it), the global choices (weight
layout, micro-batch and accumulation, fused loss, allocator settings) and the predictions with their
breakdowns, plus a summary of the profile it came from. ``str(plan)`` is a table; :meth:`Plan.save` writes TOML
(``.toml``) or JSON (``.json``) and :meth:`Plan.load` reads either back, validating every field with a message
that says how to fix it, so that a plan can be edited by hand and applied again (the predictions of an edited
plan are those of the plan it was edited from until :meth:`Plan.repredicted` recomputes them).
"""

from __future__ import annotations

import dataclasses
import json
import math
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

__all__ = ["BlockPlan", "Plan", "ProfileSummary"]

_CHECKPOINTS = ("none", "selective", "full")
_DTYPES = ("float32", "bfloat16")
PLAN_VERSION = 1


def _gib(n: float) -> str:
    """Bytes in GiB from 1 GiB, else in the unit that shows them (a 512 MiB budget read "0.50 GiB", 8 MiB "0.01")."""
    for unit, size in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if abs(n) >= size:
            return f"{n / size:.2f} {unit}"
    return f"{n:.0f} B"


def _count(n: int) -> str:
    """A parameter count as people write it: 1.36B, 124M, 386K, 12."""
    for unit, size in (("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= size:
            return f"{n / size:.3g}{unit}"
    return str(n)


@dataclass(frozen=True)
class BlockPlan:
    """One block: its activation policy, its optimizer placement and what it is predicted to cost."""

    index: int
    """Position in forward order (0-based)."""
    checkpoint: str = "none"
    """Recompute: none (keep), selective or full."""
    offload_ratio: float = 0.0
    """Share of the saved (kept) bytes sent to host memory, largest first."""
    offload_input: bool = False
    """Offload the input a checkpointed block saves."""
    optimizer_on_host: bool = False
    """The block's parameters keep their fp32 masters and AdamW state on the host and step there."""
    optimizer_streamed: bool = False
    """The block's parameters keep their fp32 masters and AdamW state on the host and step on the device: the states
    stream through a small device ring each step (``CPUOffloadOptimizer(stream_params=...)``; Adam and AdamW)."""
    kept_bytes: int = 0
    """Predicted activation bytes kept on the device from forward to backward (one micro-batch)."""
    offloaded_bytes: int = 0
    """Predicted activation bytes sent to the host."""
    recomputed_bytes: int = 0
    """Predicted activation bytes rematerialised by recompute in backward."""
    seconds: float = 0.0
    """Predicted forward + backward + recompute + exposed copies, one micro-batch."""

    def __post_init__(self) -> None:
        where = f"blocks[{self.index}]"
        if self.checkpoint not in _CHECKPOINTS:
            raise ValueError(f"{where}.checkpoint must be one of {', '.join(_CHECKPOINTS)}, got {self.checkpoint!r}")
        if not 0.0 <= self.offload_ratio <= 1.0:
            raise ValueError(f"{where}.offload_ratio must be in [0, 1], got {self.offload_ratio}")
        if self.optimizer_on_host and self.optimizer_streamed:
            raise ValueError(f"{where} sets both optimizer_on_host and optimizer_streamed: a block's optimizer steps "
                             "on the host or streams through the device, not both; set one of them to false")
        if self.offload_input and self.checkpoint == "none":
            raise ValueError(
                f"{where}.offload_input needs checkpoint = 'full' or 'selective'; for a kept block set offload_ratio"
            )
        for name in ("kept_bytes", "offloaded_bytes", "recomputed_bytes"):
            if getattr(self, name) < 0:
                raise ValueError(f"{where}.{name} must be >= 0, got {getattr(self, name)}")

    @property
    def policy_label(self) -> str:
        from elbowroom.plan.cost import Option

        return Option(self.checkpoint, self.offload_ratio, self.offload_input).label


@dataclass(frozen=True)
class ProfileSummary:
    """Where the plan's numbers came from."""

    machine: str = ""
    """Device name of the profile's machine."""
    source: str = ""
    """measured or analytic."""
    seq_len: int = 0
    """Tokens per sample."""
    micro_batch: int = 0
    """Samples per micro-batch of the profile."""
    compute_dtype: str = ""
    param_dtype: str = ""
    block_path: str = ""
    """Where the blocks were found (e.g. ``model.layers``)."""
    num_params: int = 0
    """Parameters planned for (one rank's shard of them when ``shard_factor`` is above 1)."""
    shard_factor: int = 1
    """Ranks each parameter was sharded over (FSDP2's ``dp_shard``) in the profile planned on: above 1 the plan is
    one rank's, and applies only at that shard factor."""


@dataclass(frozen=True)
class Plan:
    """Everything the planner decided for one model, machine and budget, with its predictions."""

    blocks: tuple[BlockPlan, ...]
    """One row per block, in forward order."""
    budget_bytes: int
    """The memory budget the plan was made for."""
    predicted_peak_bytes: int
    """Predicted peak device memory (incl. the allocator's margin)."""
    predicted_step_seconds: float
    """Predicted time of one optimizer step (all micro-batches)."""
    predicted_tokens_per_s: float
    """Tokens of a step over its predicted time."""
    micro_batch: int = 1
    """Samples per forward/backward."""
    gradient_accumulation_steps: int = 1
    """Micro-batches per optimizer step."""
    weight_dtype: str = "float32"
    """Device dtype of the model's weights: float32 (under autocast) or bfloat16 (fp32 masters in the optimizer)."""
    offload_param_dtype: str = "float32"
    """Device dtype of the offloaded parameters' weights (bfloat16: fp32 masters on the host)."""
    offload_other_params: bool = False
    """The parameters outside the blocks (embeddings, final norm, head) step on the host."""
    offload_head_params: bool = False
    """Of those, the ones after the blocks alone (an untied output head, a final norm) step on the host, the
    embeddings on the device."""
    optimizer_split_share: float = 0.0
    """Of each streamed block, the share of its parameters that steps on the host instead: its largest tensors
    (:func:`elbowroom.plan.streaming.split_on_host`), their gradients sent there as a host-stepped block's are. 0:
    streamed blocks stream whole."""
    fused_loss: bool = False
    """The loop computes head and loss with ``elbowroom.linear_cross_entropy`` (the logits never exist whole)."""
    allocator_settings: str = ""
    """CUDA caching allocator settings, as in ``PYTORCH_CUDA_ALLOC_CONF`` (empty: the defaults)."""
    grad_clipping: bool = True
    """Planned for a loop that clips gradients (the host optimizer step starts after the whole backward)."""
    offload_gradients: bool = False
    """Gradients of the host-stepped parameters leave the device during the backward (pinned host copies), instead
    of staying there until the step: their device bytes saved, one copy's link time paid."""
    persistent_gradients: bool = False
    """Planned for gradients that exist for the whole step (DDP's buckets), not from the backward on."""
    peak_phase: str = ""
    """Where the predicted peak falls."""
    memory: dict[str, int] = field(default_factory=dict)
    """Breakdown of the predicted peak (bytes)."""
    time: dict[str, float] = field(default_factory=dict)
    """Breakdown of the predicted step time (seconds)."""
    host_bytes: int = 0
    """Predicted host memory: optimizer state of the offloaded parameters and the pinned activation pool."""
    profile: ProfileSummary = field(default_factory=ProfileSummary)
    """The profile the plan was made from."""
    notes: tuple[str, ...] = ()
    """Why some choices were left out."""
    layout: str = ""
    """The model-parallel layout and pipeline rank the plan was made for (``elbowroom.plan.ranks``); empty: one
    whole model."""
    version: int = PLAN_VERSION
    """Format version of the saved plan."""

    def __post_init__(self) -> None:
        for i, b in enumerate(self.blocks):
            if not isinstance(b, BlockPlan):
                raise TypeError(f"blocks[{i}] must be a BlockPlan, got {type(b).__name__}")
            if b.index != i:
                raise ValueError(f"blocks[{i}] has index {b.index}; rows must be numbered 0..{len(self.blocks) - 1}"
                                 " in forward order")
        if not self.blocks:
            raise ValueError("a plan needs at least one block row")
        for name in ("micro_batch", "gradient_accumulation_steps"):
            v = getattr(self, name)
            if v < 1:
                raise ValueError(f"{name} must be a positive int, got {v}")
        for name in ("weight_dtype", "offload_param_dtype"):
            if getattr(self, name) not in _DTYPES:
                raise ValueError(f"{name} must be one of {', '.join(_DTYPES)}, got {getattr(self, name)!r}")
        if self.weight_dtype == "bfloat16" and self.offload_param_dtype != "bfloat16":
            raise ValueError(
                "weight_dtype = 'bfloat16' puts every weight in bf16: set offload_param_dtype = 'bfloat16'"
            )
        if self.budget_bytes <= 0:
            raise ValueError(f"budget_bytes must be positive, got {self.budget_bytes}")
        if self.version != PLAN_VERSION:
            raise ValueError(f"plan format version {self.version} is not supported (this elbowroom reads "
                             f"{PLAN_VERSION}); plan again with `elbowroom plan`")
        if not 0.0 <= self.optimizer_split_share < 1.0:
            raise ValueError(f"optimizer_split_share is a share of each streamed block's parameters in [0, 1), got "
                             f"{self.optimizer_split_share}")
        if self.optimizer_split_share and not any(b.optimizer_streamed for b in self.blocks):
            raise ValueError("optimizer_split_share splits the streamed blocks, and no block streams: set "
                             "optimizer_streamed = true on the blocks to split, or the share to 0")
        if self.allocator_settings and any(":" not in kv for kv in self.allocator_settings.split(",")):
            raise ValueError(f"allocator_settings must read like 'expandable_segments:True', got "
                             f"{self.allocator_settings!r}")

    # ------------------------------------------------------------------------------------------ views
    @property
    def expandable_segments(self) -> bool | None:
        """The caching allocator's ``expandable_segments`` as the plan sets it; None: left as the process runs it."""
        for kv in self.allocator_settings.split(","):
            key, _, value = kv.partition(":")
            if key.strip() == "expandable_segments":
                return value.strip().lower() == "true"
        return None

    @property
    def num_blocks(self) -> int:
        return len(self.blocks)

    @property
    def optimizer_offload_blocks(self) -> tuple[int, ...]:
        """Indices of the blocks whose parameters step on the host."""
        return tuple(b.index for b in self.blocks if b.optimizer_on_host)

    @property
    def optimizer_stream_blocks(self) -> tuple[int, ...]:
        """Indices of the blocks whose optimizer state lives on the host and streams through the device to step."""
        return tuple(b.index for b in self.blocks if b.optimizer_streamed)

    @property
    def offloads_optimizer(self) -> bool:
        """Some optimizer state lives on the host (stepped there or streamed)."""
        return self.offload_other_params or self.offload_head_params or any(
            b.optimizer_on_host or b.optimizer_streamed for b in self.blocks)

    @property
    def global_batch(self) -> int:
        return self.micro_batch * self.gradient_accumulation_steps

    def to_block_policies(self) -> list[Any]:
        """One :class:`~elbowroom.activations.BlockPolicy` per block."""
        from elbowroom.activations.policy import BlockPolicy

        return [BlockPolicy(b.checkpoint, b.offload_ratio, b.offload_input) for b in self.blocks]

    def decisions(self) -> Any:
        """The plan as :class:`elbowroom.plan.cost.Decisions` (to predict it again)."""
        from elbowroom.plan.cost import LAYOUTS, Decisions, Option

        layout = next(k for k, v in LAYOUTS.items() if v == (self.weight_dtype, self.offload_param_dtype))
        streamed = tuple(b.optimizer_streamed for b in self.blocks)
        return Decisions(
            options=tuple(Option(b.checkpoint, b.offload_ratio, b.offload_input) for b in self.blocks),
            offload_blocks=tuple(b.optimizer_on_host for b in self.blocks),
            stream_blocks=streamed if any(streamed) else (),
            split_share=self.optimizer_split_share,
            offload_other=self.offload_other_params,
            offload_head=self.offload_head_params,
            layout=layout,
            micro_batch=self.micro_batch,
            accumulation=self.gradient_accumulation_steps,
            fused_loss=self.fused_loss,
            expandable_segments=self.expandable_segments,
            grad_clipping=self.grad_clipping,
            offload_gradients=self.offload_gradients,
            persistent_gradients=self.persistent_gradients,
        )

    def repredicted(self, profile: Any) -> Plan:
        """This plan with its predictions recomputed from ``profile`` (after editing it by hand).

        Options outside the planner's set (e.g. an offload ratio of 0.3) are predicted with the nearest one.
        """
        from elbowroom.plan.search import plan_from_decisions

        return plan_from_decisions(profile, self.decisions(), self.budget_bytes, notes=self.notes)

    # ------------------------------------------------------------------------------------------ table
    def table(self) -> str:
        """The plan as a text table (what ``elbowroom plan`` prints)."""
        p = self.profile
        tokens = self.global_batch * p.seq_len
        lines = [
            f"elbowroom plan: {self.num_blocks} blocks on {p.machine or '?'} ({p.source or '?'} profile, "
            f"{_count(p.num_params)} parameters)",
            f"budget {_gib(self.budget_bytes)}; predicted peak {_gib(self.predicted_peak_bytes)} at {self.peak_phase}; "
            f"step {self.predicted_step_seconds * 1e3:.1f} ms; {self.predicted_tokens_per_s:,.0f} tokens/s",
            f"batch: micro-batch {self.micro_batch} x {p.seq_len} tokens, accumulation "
            f"{self.gradient_accumulation_steps} ({tokens:,} tokens per step)",
        ]
        if self.layout:
            lines.append(f"layout: {self.layout}")
        autocast = p.compute_dtype != "float32"  # (a CPU profile of an fp32 model computes in fp32: no autocast)
        weights = ("bf16 weights, fp32 masters in the optimizer (no autocast)" if self.weight_dtype == "bfloat16"
                   else f"fp32 weights{' under autocast' if autocast else ', computed in fp32'}")
        if self.weight_dtype == "float32" and self.offload_param_dtype == "bfloat16" and self.offloads_optimizer:
            weights += "; offloaded weights bf16 on the device, fp32 masters on the host"
        lines.append(f"weights: {weights}")
        if p.shard_factor > 1:
            lines.append(f"per rank: FSDP2 over {p.shard_factor} shards (--parallel.dp_shard {p.shard_factor}); "
                         "parameters, gradients and optimizer state are one rank's shard")
        off = self.optimizer_offload_blocks
        where = _ranges(off) if off else "none"
        streamed = self.optimizer_stream_blocks
        if streamed:  # (a plan that streams nothing reads as it always did)
            where += (f" ({len(off)})" if off else "") + (f"; state on the host, streamed to step on the device: "
                                                          f"blocks {_ranges(streamed)} ({len(streamed)})")
            if self.optimizer_split_share:
                where += (f", each split: its largest tensors, as near {self.optimizer_split_share:.0%} of its "
                          "parameters as they come, step on the host")
        other = ("embeddings/head/norm on the host" if self.offload_other_params else
                 "head/norm on the host, embeddings on the device" if self.offload_head_params else
                 "embeddings/head/norm on the device")
        lines.append(f"optimizer on the host: blocks {where}; {other}"
                     + ("; their gradients leave the device in the backward" if self.offload_gradients else ""))
        lines.append(f"fused head + loss: {'on' if self.fused_loss else 'off'}; allocator: "
                     f"{self.allocator_settings or 'defaults'}; planned "
                     f"{'with' if self.grad_clipping else 'without'} gradient clipping"
                     + ("; gradients held all step (DDP's buckets)" if self.persistent_gradients else ""))
        lines.append("")
        lines.append(f"{'block':>5}  {'activations':<26} {'optimizer':<9} {'kept GiB':>9} {'offloaded':>10} "
                     f"{'recomputed':>11} {'ms':>8}")
        for b in self.blocks:
            lines.append(
                f"{b.index:>5}  {b.policy_label:<26} {_placement_of(self, b):<9} "
                f"{b.kept_bytes / 2**30:>9.3f} {b.offloaded_bytes / 2**30:>10.3f} "
                f"{b.recomputed_bytes / 2**30:>11.3f} {b.seconds * 1e3:>8.2f}"
            )
        lines.append("")
        if self.memory:
            lines.append("memory at the peak: " + ", ".join(f"{k} {_gib(v)}" for k, v in self.memory.items()))
        if self.time:
            lines.append("step time: " + ", ".join(f"{k} {v * 1e3:.1f} ms" for k, v in self.time.items()))
        if self.host_bytes:
            lines.append(f"host memory: {_gib(self.host_bytes)}")
        if self.fused_loss and (self.offload_other_params or self.offload_head_params):
            lines.append("note: the fused loss reads the head weight outside its module: call "
                         "optimizer.wait_for(head_weight) before linear_cross_entropy")
        for n in self.notes:
            lines.append(f"note: {n}")
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.table()

    # ------------------------------------------------------------------------------------------ (de)serialise
    def to_dict(self) -> dict[str, Any]:
        """Plain data (JSON and TOML friendly; no None)."""
        d = dataclasses.asdict(self)
        d["blocks"] = [dataclasses.asdict(b) for b in self.blocks]
        d["notes"] = list(self.notes)
        if not self.layout:  # a whole model's plan reads as it always did
            del d["layout"]
        return d

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Plan:
        """The inverse of :meth:`to_dict`, validating types and values (ValueError/TypeError with the fix)."""
        return _build(cls, data, "plan")

    def to_json(self, indent: int | None = 2) -> str:
        return json.dumps(self.to_dict(), indent=indent)

    def to_toml(self) -> str:
        return _toml_dumps(self.to_dict())

    @classmethod
    def from_json(cls, text: str) -> Plan:
        return cls.from_dict(json.loads(text))

    @classmethod
    def from_toml(cls, text: str) -> Plan:
        import tomllib

        return cls.from_dict(tomllib.loads(text))

    def save(self, path: str | Path) -> Path:
        """Write the plan as TOML (``.toml``) or JSON (``.json``)."""
        path = Path(path)
        if path.suffix not in (".toml", ".json"):
            raise ValueError(f"plan files end in .toml or .json, got {path.name!r}")
        path.write_text(self.to_toml() if path.suffix == ".toml" else self.to_json() + "\n")
        return path

    @classmethod
    def load(cls, path: str | Path) -> Plan:
        """Read a plan written by :meth:`save` (or edited by hand)."""
        path = Path(path)
        if path.suffix not in (".toml", ".json"):
            raise ValueError(f"plan files end in .toml or .json, got {path.name!r}")
        try:
            text = path.read_text()
            return cls.from_toml(text) if path.suffix == ".toml" else cls.from_json(text)
        except UnicodeDecodeError:
            raise ValueError(f"{path}: not a text file (a plan is TOML or JSON text)") from None
        except (ValueError, TypeError) as e:  # (a JSONDecodeError cannot be rebuilt from a message alone)
            raise (TypeError if isinstance(e, TypeError) else ValueError)(f"{path}: {e}") from None


def _placement(b: BlockPlan) -> str:
    """The table's optimizer column: where the block's optimizer steps."""
    return "host" if b.optimizer_on_host else "stream" if b.optimizer_streamed else "device"


def _placement_of(plan: Plan, b: BlockPlan) -> str:
    """:func:`_placement`, a split block named so."""
    return "split" if b.optimizer_streamed and plan.optimizer_split_share else _placement(b)


def _ranges(idx: tuple[int, ...]) -> str:
    out, start, prev = [], None, None
    for i in idx:
        if start is None:
            start = prev = i
        elif i == prev + 1:
            prev = i
        else:
            out.append(f"{start}" if start == prev else f"{start}-{prev}")
            start = prev = i
    if start is not None:
        out.append(f"{start}" if start == prev else f"{start}-{prev}")
    return ", ".join(out)


# ---------------------------------------------------------------------------------------------- validation
def _check(value: Any, tp: Any, where: str) -> Any:
    origin = typing.get_origin(tp)
    if tp is bool:
        if not isinstance(value, bool):
            raise TypeError(f"{where} must be true or false, got {value!r}")
        return value
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise TypeError(f"{where} must be an integer, got {value!r}")
        return value
    if tp is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise TypeError(f"{where} must be a number, got {value!r}")
        return float(value)
    if tp is str:
        if not isinstance(value, str):
            raise TypeError(f"{where} must be a string, got {value!r}")
        return value
    if origin is tuple:
        if not isinstance(value, (list, tuple)):
            raise TypeError(f"{where} must be a list, got {value!r}")
        (item,) = [a for a in typing.get_args(tp) if a is not Ellipsis]
        return tuple(_check(v, item, f"{where}[{i}]") for i, v in enumerate(value))
    if origin is dict:
        if not isinstance(value, dict):
            raise TypeError(f"{where} must be a table, got {value!r}")
        _, vt = typing.get_args(tp)
        return {str(k): _check(v, vt, f"{where}.{k}") for k, v in value.items()}
    if dataclasses.is_dataclass(tp):
        return _build(tp, value, where)
    raise AssertionError(f"unhandled type {tp!r}")  # our own schema only


def _build(cls: type, data: Any, where: str) -> Any:
    if not isinstance(data, dict):
        raise TypeError(f"{where} must be a table, got {data!r}")
    hints = typing.get_type_hints(cls)
    names = [f.name for f in dataclasses.fields(cls)]
    unknown = sorted(set(data) - set(names))
    if unknown:
        raise ValueError(f"{where}: unknown key(s) {', '.join(unknown)}; known: {', '.join(names)}")
    required = [f.name for f in dataclasses.fields(cls)
                if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING]
    missing = [n for n in required if n not in data]
    if missing:
        raise ValueError(f"{where}: missing key(s) {', '.join(missing)}")
    kwargs = {}
    for name, value in data.items():
        tp = hints[name]
        if name == "blocks" and cls is Plan:
            if not isinstance(value, list):
                raise TypeError(f"{where}.blocks must be an array of tables ([[blocks]])")
            kwargs[name] = tuple(_build(BlockPlan, v, f"blocks[{i}]") for i, v in enumerate(value))
        else:
            kwargs[name] = _check(value, tp, f"{where}.{name}" if where != "plan" else name)
    return cls(**kwargs)


# ---------------------------------------------------------------------------------------------- TOML writer
def _toml_value(v: Any) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, int):
        return str(v)
    if isinstance(v, float):
        if math.isnan(v):
            return "nan"
        if math.isinf(v):
            return "inf" if v > 0 else "-inf"
        return repr(v)  # shortest repr: reads back to the same float
    if isinstance(v, str):
        return json.dumps(v, ensure_ascii=False)  # JSON's escapes are TOML basic-string escapes
    if isinstance(v, (list, tuple)):
        return "[" + ", ".join(_toml_value(x) for x in v) + "]"
    if v is None:
        raise ValueError("TOML has no null; plans hold no None")
    raise TypeError(f"cannot write {type(v).__name__} to TOML")


def _toml_key(k: str) -> str:
    if k and all(c.isalnum() or c in "_-" for c in k):
        return k
    return json.dumps(k, ensure_ascii=False)


def _toml_dumps(d: dict[str, Any]) -> str:
    """A TOML document for a dict of scalars, lists of scalars, tables and arrays of tables (one level deep)."""
    head, tables, arrays = [], [], []
    for k, v in d.items():
        if isinstance(v, dict):
            tables.append((k, v))
        elif isinstance(v, list) and v and all(isinstance(x, dict) for x in v):
            arrays.append((k, v))
        else:
            head.append(f"{_toml_key(k)} = {_toml_value(v)}")
    out = ["# elbowroom plan: edit the decisions and load it with elbowroom.plan.Plan.load()", *head]
    for k, v in tables:
        out += ["", f"[{_toml_key(k)}]"] + [f"{_toml_key(kk)} = {_toml_value(vv)}" for kk, vv in v.items()]
    for k, rows in arrays:
        for row in rows:
            out += ["", f"[[{_toml_key(k)}]]"] + [f"{_toml_key(kk)} = {_toml_value(vv)}" for kk, vv in row.items()]
    return "\n".join(out) + "\n"
