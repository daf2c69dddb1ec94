"""``elbowroom report RUN_DIR``: draw what a run did into ``RUN_DIR/report/`` (pictures and one HTML page).

Everything is read and checked before anything is written: a missing or partial run directory, or a missing
matplotlib, exits with code 2 and one sentence, leaving the run directory untouched.
"""

from __future__ import annotations

import argparse
import importlib.util
import logging
import sys
from pathlib import Path

from elbowroom.report.rundir import RunDirError, load_run

__all__ = ["cmd_report", "write_report", "MissingPlotsError"]

logger = logging.getLogger(__name__)

USAGE = "elbowroom report RUN_DIR"


class MissingPlotsError(RuntimeError):
    """matplotlib is not installed."""


def write_report(run_dir: str | Path) -> Path:
    """Write ``RUN_DIR/report/`` (memory.png, plan.png, link.png, metrics.png, report.html; those with data).

    Args:
        run_dir: a run directory (``metrics.jsonl``; ``plan.json`` and ``profile/`` when there).

    Returns:
        The path of report.html.

    Raises:
        RunDirError: the run directory is missing, partial or malformed.
        MissingPlotsError: matplotlib is not installed.
    """
    data = load_run(run_dir)
    if importlib.util.find_spec("matplotlib") is None:
        raise MissingPlotsError("elbowroom report draws with matplotlib: pip install 'elbowroom[plots]'")
    notes: list[str] = []
    timeline = comm = None
    if data.trace_path is not None:
        from elbowroom.report.trace import comm_overlap, link_timeline, read_trace

        try:
            events = read_trace(data.trace_path)
            timeline = link_timeline(events)
            comm = comm_overlap(events)
        except (ValueError, OSError) as e:
            raise RunDirError(
                f"{data.trace_path} is not a readable Chrome trace ({e}); record the steps again"
            ) from None
    peak = None
    if data.snapshot_path is not None:
        from elbowroom.report.snapshot import load_snapshot, peak_allocations

        try:
            peak = peak_allocations(load_snapshot(data.snapshot_path))
        except (ValueError, OSError, EOFError, KeyError) as e:
            raise RunDirError(f"{data.snapshot_path} is not a readable memory snapshot ({e}); record again") from None
    if not data.samples:
        notes.append(
            "No recorded steps (profile/memory.jsonl): train with --profile.steps, e.g. 3-4, for the memory "
            "timeline, the measured plan and the link picture."
        )
    if data.plan is None:
        notes.append("No plan.json: the predictions and the plan picture are left out.")

    from elbowroom.report import plots
    from elbowroom.report.html import render_html

    out = data.run_dir / "report"
    out.mkdir(exist_ok=True)
    for name in ("memory.png", "plan.png", "link.png", "metrics.png"):
        (out / name).unlink(missing_ok=True)  # a picture left from an earlier report would disagree with this one
    pictures = {
        "memory": plots.draw_memory(data, out / "memory.png"),
        "plan": plots.draw_plan(data, out / "plan.png"),
        "link": plots.draw_link(timeline, data.plan, out / "link.png") if timeline is not None else None,
        "metrics": plots.draw_metrics(data, out / "metrics.png"),
    }
    page = out / "report.html"
    page.write_text(render_html(data, pictures, peak, notes, comm=comm))
    return page


def cmd_report(argv: list[str]) -> int:
    """The ``elbowroom report`` command.

    Args:
        argv: the arguments after ``report``.

    Returns:
        0 when the report was written; 2 (with one line on stderr) when the run directory or matplotlib is missing.
    """
    parser = argparse.ArgumentParser(
        prog="elbowroom report",
        description="Draw a run's memory timeline, plan and link traffic into RUN_DIR/report/ (report.html).",
    )
    parser.add_argument("run_dir", metavar="RUN_DIR", help="directory a training run wrote (elbowroom train --out)")
    args = parser.parse_args(argv)
    try:
        page = write_report(args.run_dir)
    except (RunDirError, MissingPlotsError) as e:
        print(f"elbowroom report: error: {e}", file=sys.stderr)
        return 2
    print(page)
    return 0
