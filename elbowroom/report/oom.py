"""What to leave behind when a step runs out of memory: a snapshot (if history was on) and a short text report.

In the trainer::

    try:
        ...  # the step
    except torch.OutOfMemoryError as e:
        write_oom_report(out_dir, model, optimizer, plan=plan_dict, error=e)
        raise
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from torch import nn

from elbowroom.report.categories import CATEGORIES, CATEGORY_LABELS, categorise

__all__ = ["write_oom_report"]


def _gib(v: float) -> str:
    return f"{v / 2**30:8.3f} GiB"


def write_oom_report(
    out_dir: str | Path,
    model: nn.Module | None,
    optimizer: Any = None,
    plan: dict[str, Any] | str | Path | None = None,
    *,
    error: BaseException | None = None,
    device: torch.device | str | None = None,
) -> Path:
    """Dump a memory snapshot (CUDA, when allocation history was recording) and write ``oom_report.txt``.

    The text says what was live by category (parameters, gradients, optimizer state, master weights; the rest
    as "activations and other", which cannot be told apart at this point) against the plan's predicted peak
    and budget, with the allocator's own counters. It costs nothing before the error and touches no tensor.

    Args:
        out_dir: the run directory; writes ``out_dir/oom_report.txt`` and ``out_dir/profile/oom_snapshot.pickle``.
        model: the model (its parameters and gradients are counted), or None.
        optimizer: its optimizer, or None.
        plan: the plan as a dict, or the path of its ``plan.json``; None: ``out_dir/plan.json`` when it exists.
        error: the exception caught (its first line goes into the report).
        device: the device that ran out; default: the model's.

    Returns:
        The path of the text report.
    """
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    params = list(model.parameters()) if model is not None else []
    if device is None:
        device = params[0].device if params else torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(device)
    if plan is None and (out / "plan.json").is_file():
        plan = out / "plan.json"
    if isinstance(plan, (str, Path)):
        try:
            plan = json.loads(Path(plan).read_text())
        except (OSError, json.JSONDecodeError):
            plan = None
    engine = None
    if model is not None:
        from elbowroom.activations.policy import get_offload_engine

        engine = get_offload_engine(model)
    total, by, host = categorise(device, params, optimizer, engine, None, baseline_other=None)
    lines = ["elbowroom: out of memory", ""]
    if error is not None:
        lines += ["error: " + str(error).strip().splitlines()[0][:400], ""]
    where = "torch.cuda.memory_allocated" if device.type == "cuda" else "process RSS"
    lines.append(f"live on {device} ({where}): {_gib(total)}")
    for c in CATEGORIES:
        if c == "activations_kept":
            continue
        name = "activations and other" if c == "other" else CATEGORY_LABELS[c]
        lines.append(f"  {name:<38}{_gib(by[c])}  {100 * by[c] / max(total, 1):5.1f}%")
    for k, v in host.items():
        lines.append(f"  host, outside the total: {k:<21}{_gib(v)}")
    if device.type == "cuda":
        stats = torch.cuda.memory_stats(device)
        lines += [
            "",
            f"reserved by the allocator: {_gib(stats.get('reserved_bytes.all.current', 0))}",
            f"peak allocated this run:   {_gib(stats.get('allocated_bytes.all.peak', 0))}",
            f"device memory in all:      {_gib(torch.cuda.get_device_properties(device).total_memory)}",
            f"allocation retries / OOMs: {stats.get('num_alloc_retries', 0)} / {stats.get('num_ooms', 0)}",
        ]
    # the plan predicts tensor bytes: on a CPU the RSS's rest (interpreter, libraries) is not part of it
    live = total if device.type == "cuda" else total - by["other"]
    if isinstance(plan, dict):
        lines.append("")
        for key, label in (("predicted_peak_bytes", "plan: predicted peak"), ("budget_bytes", "plan: budget")):
            v = plan.get(key)
            if isinstance(v, (int, float)):
                lines.append(f"{label:<27}{_gib(v)}  (live now: {100 * live / max(v, 1):.0f}% of it)")
    else:
        lines += ["", "no plan: nothing predicted to compare with"]
    if device.type == "cuda":
        snap = torch.cuda.memory._snapshot()
        if any(snap.get("device_traces") or []):  # history was recording: the snapshot has its events
            prof = out / "profile"
            prof.mkdir(exist_ok=True)
            import pickle

            with open(prof / "oom_snapshot.pickle", "wb") as f:
                pickle.dump(snap, f)
            lines += ["", f"snapshot: {prof / 'oom_snapshot.pickle'} (open at https://pytorch.org/memory_viz)"]
            from elbowroom.report.snapshot import peak_allocations

            peak = peak_allocations(snap, top=5, frames=4)
            if peak is not None:
                lines.append("largest allocations at the recorded peak:")
                for a in peak.top:
                    lines.append(f"  {_gib(a.size)}  " + (a.frames[0] if a.frames else "(no stack)"))
                    lines += [f"{'':16}{f}" for f in a.frames[1:]]
        else:
            lines += ["", "no snapshot: allocation history was not recording (record with --profile.steps)"]
    path = out / "oom_report.txt"
    path.write_text("\n".join(lines) + "\n")
    return path
