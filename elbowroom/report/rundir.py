"""Reading a run directory: metrics.jsonl, plan.json and the recordings under profile/.

Files read (all written by others; only ``metrics.jsonl`` is required):

- ``metrics.jsonl``: one JSON object per logged step (``step``, ``loss``, ``lr``, ``grad_norm``, ``tokens_per_s``,
  ``peak_memory_bytes``, ...) and ``{"step", "val_loss"}`` rows (the trainer's ``MetricsLogger``);
- ``plan.json`` (the planner): ``predicted_peak_bytes``, ``budget_bytes``, ``predicted_step_seconds``, optional
  ``tokens_per_step``, ``h2d_bandwidth``/``d2h_bandwidth`` (bytes/s), and ``blocks``: one row per block with any
  of ``index``, ``policy``, ``kept_bytes``, ``offloaded_bytes``, ``recomputed_bytes``, ``forward_s``,
  ``backward_s``, ``extra_s`` (seconds recompute or transfers add, negative when saved); other keys are shown
  in the table, never interpreted;
- ``profile/memory.jsonl``, ``profile/trace.json``, ``profile/memory_snapshot.pickle``: :mod:`.recorder`.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

__all__ = ["RunData", "RunDirError", "load_run", "step_samples", "block_measurements"]


class RunDirError(ValueError):
    """The run directory cannot be reported on; the message is one sentence naming what is missing or bad."""


@dataclass
class RunData:
    """What a run directory holds, parsed."""

    run_dir: Path
    metrics: list[dict[str, Any]]
    """Training rows of metrics.jsonl (those with a ``loss``)."""
    val: list[dict[str, Any]]
    """Validation rows (``val_loss``)."""
    plan: dict[str, Any] | None = None
    samples: list[dict[str, Any]] = field(default_factory=list)
    """``"kind": "sample"`` rows of profile/memory.jsonl, of steps that completed."""
    steps: list[dict[str, Any]] = field(default_factory=list)
    """``"kind": "step"`` rows of profile/memory.jsonl."""
    trace_path: Path | None = None
    snapshot_path: Path | None = None

    @property
    def device(self) -> str:
        """``cuda`` or ``cpu``: where the recorded samples were measured (``cpu`` without recordings)."""
        return self.steps[-1].get("device", "cpu") if self.steps else "cpu"

    @property
    def shown_step(self) -> int | None:
        """The recorded step the pictures show: the last complete one (warmest)."""
        return self.steps[-1]["step"] if self.steps else None


def _read_jsonl(path: Path) -> list[dict[str, Any]]:
    rows = []
    lines = path.read_text().splitlines()
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            if n == len(lines):  # a run killed mid-write leaves a truncated last line: the rest is good
                break
            raise RunDirError(f"{path} line {n} is not JSON; fix or remove that line") from None
        if not isinstance(row, dict):
            raise RunDirError(f"{path} line {n} is not a JSON object; fix or remove that line")
        rows.append(row)
    return rows


def _number(x: Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


def _as_report_plan(plan: dict[str, Any]) -> dict[str, Any]:
    """The planner's own ``Plan.to_json()`` in the terms read here (a copy; other plans pass as they are).

    A :class:`~elbowroom.plan.Plan` names a block's policy by its fields (``checkpoint``, ``offload_ratio``,
    ``offload_input``) and predicts one ``seconds`` per block (forward, backward, recompute and exposed copies
    of one micro-batch), and the step's ``predicted_tokens_per_s``: here they become ``policy``,
    ``predicted_s`` and ``tokens_per_step``.
    """
    out = dict(plan)
    blocks = []
    for b in plan.get("blocks", []):
        b = dict(b)
        if "policy" not in b and "checkpoint" in b:
            from elbowroom.plan.cost import Option  # numpy only

            try:
                b["policy"] = Option(str(b["checkpoint"]), float(b.get("offload_ratio", 0.0)),
                                     bool(b.get("offload_input", False))).label
            except (TypeError, ValueError):
                pass
        if "seconds" in b and _number(b["seconds"]) and "predicted_s" not in b:
            b["predicted_s"] = b["seconds"]
        blocks.append(b)
    out["blocks"] = blocks
    tps, step = plan.get("predicted_tokens_per_s"), plan.get("predicted_step_seconds")
    if "tokens_per_step" not in plan and _number(tps) and _number(step) and math.isfinite(tps):
        out["tokens_per_step"] = round(tps * step)
    return out


def load_run(run_dir: str | Path) -> RunData:
    """Parse a run directory.

    Args:
        run_dir: the directory a training run wrote.

    Returns:
        The parsed :class:`RunData`.

    Raises:
        RunDirError: no such directory, no or empty metrics.jsonl, or a malformed file (one sentence).
    """
    run = Path(run_dir)
    if not run.is_dir():
        raise RunDirError(f"{run} is not a directory; pass the run directory that `elbowroom train --out` wrote")
    mpath = run / "metrics.jsonl"
    if not mpath.is_file():
        raise RunDirError(f"{run} has no metrics.jsonl; pass a run directory whose training logged at least one step")
    rows = _read_jsonl(mpath)
    train = [r for r in rows if _number(r.get("step")) and "loss" in r]
    val = [r for r in rows if _number(r.get("step")) and _number(r.get("val_loss"))]
    if not train:
        raise RunDirError(f"{mpath} has no training rows (step and loss); let the run log at least one step")
    data = RunData(run_dir=run, metrics=train, val=val)

    ppath = run / "plan.json"
    if ppath.exists():
        try:
            plan = json.loads(ppath.read_text())
        except json.JSONDecodeError as e:
            raise RunDirError(
                f"{ppath} is not valid JSON ({e.msg} at line {e.lineno}); rewrite it with the planner"
            ) from None
        if not isinstance(plan, dict):
            raise RunDirError(f"{ppath} must hold a JSON object; rewrite it with the planner")
        for key in ("predicted_peak_bytes", "budget_bytes", "predicted_step_seconds"):
            if key in plan and plan[key] is not None and not _number(plan[key]):
                raise RunDirError(f"{ppath}: {key} must be a number, got {plan[key]!r}")
        blocks = plan.get("blocks", [])
        if not isinstance(blocks, list) or not all(isinstance(b, dict) for b in blocks):
            raise RunDirError(f"{ppath}: blocks must be a list of objects, one per block")
        data.plan = _as_report_plan(plan)

    prof = run / "profile"
    mem = prof / "memory.jsonl"
    if mem.is_file():
        rows = _read_jsonl(mem)
        data.steps = [r for r in rows if r.get("kind") == "step" and _number(r.get("step"))]
        done = {r["step"] for r in data.steps}
        data.samples = [r for r in rows if r.get("kind") == "sample" and r.get("step") in done]
        for r in data.samples:
            if not isinstance(r.get("bytes"), dict) or not _number(r.get("total_bytes")) or not _number(r.get("t")):
                raise RunDirError(f"{mem} has a sample without t, total_bytes and bytes; record the steps again")
    if (prof / "trace.json").is_file():
        data.trace_path = prof / "trace.json"
    if (prof / "memory_snapshot.pickle").is_file():
        data.snapshot_path = prof / "memory_snapshot.pickle"
    return data


def step_samples(data: RunData, step: int | None = None) -> list[dict[str, Any]]:
    """The samples of one recorded step (default: :attr:`RunData.shown_step`), in time order."""
    step = data.shown_step if step is None else step
    return sorted((s for s in data.samples if s["step"] == step), key=lambda s: s["t"])


def block_measurements(samples: list[dict[str, Any]]) -> dict[int, dict[str, float]]:
    """Per block, what one step's samples measured.

    Args:
        samples: one step's samples, in time order.

    Returns:
        ``{block: {"kept_bytes", "forward_s", "backward_s"}}``: activation bytes the block's forward added
        (kept plus in flight), its forward seconds and its backward seconds (recompute included), host clock.
    """
    out: dict[int, dict[str, float]] = {}
    marks: dict[tuple[str, str, int], dict[str, Any]] = {}
    for s in samples:
        if s.get("block") is None:
            continue
        key = (s["phase"], s["event"], s["block"])
        if s["phase"] == "forward" or key not in marks:
            marks.setdefault(key, s)

    def act(s: dict[str, Any]) -> int:
        return s["bytes"].get("activations_kept", 0) + s["bytes"].get("activations_in_flight", 0)

    blocks = sorted({k[2] for k in marks})
    for b in blocks:
        row: dict[str, float] = {}
        fb, fe = marks.get(("forward", "begin", b)), marks.get(("forward", "end", b))
        if fb and fe:
            row["kept_bytes"] = act(fe) - act(fb)
            row["forward_s"] = fe["t"] - fb["t"]
        bb, be = marks.get(("backward", "begin", b)), marks.get(("backward", "end", b))
        if bb and be:
            row["backward_s"] = be["t"] - bb["t"]
        out[b] = row
    return out
