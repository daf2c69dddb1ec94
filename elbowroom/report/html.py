"""report.html: one self-contained page (pictures inlined as data URIs) of a run's plan beside what happened.

Every number shown in a table cell also sits, unformatted, in the cell's ``data-value`` attribute, so that the
page can be read back by a program (the tests do).
"""

from __future__ import annotations

import base64
import html
import json
import statistics
from pathlib import Path
from typing import Any

from elbowroom.report.categories import CATEGORIES, CATEGORY_LABELS
from elbowroom.report.rundir import RunData, step_samples
from elbowroom.report.snapshot import PeakAllocations
from elbowroom.report.trace import CommOverlap

__all__ = ["render_html", "summary"]

_CSS = """
body{font-family:system-ui,-apple-system,Segoe UI,sans-serif;margin:2em auto;max-width:1200px;color:#222;padding:0 1em}
h1{font-size:1.5em} h2{font-size:1.2em;margin-top:2em;border-bottom:1px solid #ddd}
table{border-collapse:collapse;margin:.5em 0;font-size:.9em}
td,th{border:1px solid #ccc;padding:3px 8px;text-align:right}
th{background:#f3f3f3} td.l,th.l{text-align:left} img{max-width:100%;border:1px solid #eee}
pre{background:#f7f7f7;padding:.5em;font-size:.8em;overflow-x:auto;margin:0} .note{color:#666;font-size:.9em}
"""


def _fmt(v: Any) -> str:
    if v is None:
        return "—"
    if isinstance(v, bool):
        return str(v).lower()
    if isinstance(v, int):
        return f"{v:,}"
    if isinstance(v, float):
        return f"{v:.4g}"
    if isinstance(v, (dict, list)):
        return json.dumps(v)
    return str(v)


def _bytes(v: float | None) -> str:
    if v is None:
        return "—"
    for div, name in ((2**30, "GiB"), (2**20, "MiB"), (2**10, "KiB")):
        if abs(v) >= div:
            return f"{v / div:.3g} {name}"
    return f"{v:.0f} B"


def _cell(v: Any, shown: str | None = None, cls: str = "") -> str:
    raw = "" if v is None else (json.dumps(v) if isinstance(v, (dict, list, bool)) else str(v))
    c = f' class="{cls}"' if cls else ""
    text = html.escape(shown if shown is not None else _fmt(v))
    return f'<td{c} data-value="{html.escape(raw, quote=True)}">{text}</td>'


def _img(path: Path | None, alt: str) -> str:
    if path is None:
        return ""
    data = base64.b64encode(path.read_bytes()).decode()
    return f'<p><img alt="{html.escape(alt)}" src="data:image/png;base64,{data}"></p>'


def summary(data: RunData) -> dict[str, Any]:
    """Predicted and measured numbers of the run (the page's first table), as plain values.

    Returns:
        A dict with ``predicted_*``/``measured_*`` peaks, step seconds and tokens/s, ``budget_bytes``, and the
        metrics summary (``first_step``, ``last_step``, ``last_loss``, ``min_loss``, ``last_val_loss``,
        ``median_tokens_per_s``, ``max_peak_memory_bytes``).
    """
    plan = data.plan or {}
    m = data.metrics
    tps = [r["tokens_per_s"] for r in m if isinstance(r.get("tokens_per_s"), (int, float))]
    peaks = [r["peak_memory_bytes"] for r in m if isinstance(r.get("peak_memory_bytes"), (int, float))]
    losses = [r["loss"] for r in m if isinstance(r.get("loss"), (int, float))]
    rec_secs = [r["seconds"] for r in data.steps if isinstance(r.get("seconds"), (int, float))]
    if data.device == "cuda":
        # a plan's peak includes the allocator's margin: it predicts the reserved peak where the recorder has it
        rec_peaks = [r.get("reserved_peak_bytes") or r["peak_bytes"] for r in data.steps
                     if isinstance(r.get("peak_bytes"), (int, float))]
    else:
        # on a CPU the plan's bytes are tensor bytes: compare with the tensors' sampled peak, not the RSS
        rec_peaks = [sum(v for k, v in s["bytes"].items() if k != "other") for s in data.samples]
    tokens_per_step = plan.get("tokens_per_step")
    pred_s = plan.get("predicted_step_seconds")
    med_tps = statistics.median(tps) if tps else None
    measured_step = statistics.median(rec_secs) if rec_secs else None
    if measured_step is None and med_tps and isinstance(tokens_per_step, (int, float)):
        measured_step = tokens_per_step / med_tps
    return {
        "predicted_peak_bytes": plan.get("predicted_peak_bytes"),
        "measured_peak_bytes": max(rec_peaks) if rec_peaks else (max(peaks) if peaks else None),
        "budget_bytes": plan.get("budget_bytes"),
        "predicted_step_seconds": pred_s,
        "measured_step_seconds": measured_step,
        "predicted_tokens_per_s": tokens_per_step / pred_s
        if isinstance(tokens_per_step, (int, float)) and isinstance(pred_s, (int, float)) and pred_s > 0
        else None,
        "measured_tokens_per_s": med_tps,
        "first_step": m[0]["step"],
        "last_step": m[-1]["step"],
        "last_loss": losses[-1] if losses else None,
        "min_loss": min(losses) if losses else None,
        "last_val_loss": data.val[-1]["val_loss"] if data.val else None,
        "median_tokens_per_s": med_tps,
        "max_peak_memory_bytes": max(peaks) if peaks else None,
    }


def _compare_table(s: dict[str, Any], data: RunData) -> str:
    cpu = data.device != "cuda"
    peak_note = (
        "largest tensor bytes sampled in the recorded steps (the RSS is in the memory picture)"
        if cpu
        else "allocator peak (max_memory_reserved, the plan's terms) of the run up to the last recorded step"
    )
    if not data.steps:
        peak_note = "max peak_memory_bytes in metrics.jsonl"
    rows = [
        ("peak memory", "peak_bytes", s["predicted_peak_bytes"], s["measured_peak_bytes"], _bytes, peak_note),
        ("budget", "budget", s["budget_bytes"], None, _bytes, "from plan.json"),
        (
            "step time",
            "step_seconds",
            s["predicted_step_seconds"],
            s["measured_step_seconds"],
            lambda v: "—" if v is None else f"{v:.4g} s",
            "median over recorded steps (host clock, sampling included)",
        ),
        (
            "tokens/s",
            "tokens_per_s",
            s["predicted_tokens_per_s"],
            s["measured_tokens_per_s"],
            lambda v: "—" if v is None else f"{v:,.0f}",
            "median of tokens_per_s in metrics.jsonl",
        ),
    ]
    out = [
        '<table id="compare"><tr><th class="l">quantity</th><th>predicted</th><th>measured</th>'
        '<th>measured / predicted</th><th class="l">measured as</th></tr>'
    ]
    for name, key, pred, meas, fmt, note in rows:
        ratio = meas / pred if isinstance(pred, (int, float)) and isinstance(meas, (int, float)) and pred else None
        out.append(
            f'<tr data-key="{key}"><td class="l">{name}</td>{_cell(pred, fmt(pred))}{_cell(meas, fmt(meas))}'
            f'{_cell(ratio, "—" if ratio is None else f"{ratio:.2f}")}<td class="l">{html.escape(note)}</td></tr>'
        )
    out.append("</table>")
    return "\n".join(out)


def _metrics_table(s: dict[str, Any]) -> str:
    keys = [
        "first_step",
        "last_step",
        "last_loss",
        "min_loss",
        "last_val_loss",
        "median_tokens_per_s",
        "max_peak_memory_bytes",
    ]
    out = ['<table id="metrics"><tr><th class="l">metric</th><th>value</th></tr>']
    for k in keys:
        shown = _bytes(s[k]) if k.endswith("bytes") else None
        out.append(f'<tr data-key="{k}"><td class="l">{k.replace("_", " ")}</td>{_cell(s[k], shown)}</tr>')
    out.append("</table>")
    return "\n".join(out)


def _plan_table(data: RunData) -> str:
    plan = data.plan
    if not plan:
        return '<p class="note">No plan.json in the run directory: nothing predicted to compare with.</p>'
    rows = plan.get("blocks") or []
    scalars = {k: v for k, v in plan.items() if k != "blocks" and not isinstance(v, (dict, list))}
    out = ['<table id="plan-summary"><tr><th class="l">plan</th><th>value</th></tr>']
    for k, v in scalars.items():
        out.append(
            f'<tr data-key="{html.escape(k)}"><td class="l">{html.escape(k)}</td>'
            f"{_cell(v, _bytes(v) if k.endswith('bytes') and isinstance(v, (int, float)) else None)}</tr>"
        )
    out.append("</table>")
    if rows:
        cols: list[str] = []
        for r in rows:
            cols += [k for k in r if k not in cols]
        out.append('<table id="plan-table"><tr>' + "".join(f"<th>{html.escape(c)}</th>" for c in cols) + "</tr>")
        for r in rows:
            out.append("<tr>" + "".join(_cell(r.get(c)) for c in cols) + "</tr>")
        out.append("</table>")
    return "\n".join(out)


def _peak_table(data: RunData) -> str:
    samples = step_samples(data)
    if not samples:
        return ""
    cuda = data.device == "cuda"
    peak = max(
        samples, key=lambda s: s["total_bytes"] if cuda else sum(v for k, v in s["bytes"].items() if k != "other")
    )
    where = f"{peak['phase']} {peak['event']}" + (f", block {peak['block']}" if peak.get("block") is not None else "")
    out = [
        f"<p>At the sampled peak of step {data.shown_step} ({html.escape(where)}, {peak['t'] * 1e3:.1f} ms):</p>",
        '<table id="categories"><tr><th class="l">category</th><th>bytes</th><th>share</th></tr>',
    ]
    total = peak["total_bytes"] or 1
    for c in CATEGORIES:
        v = peak["bytes"].get(c, 0)
        out.append(
            f'<tr data-key="{c}"><td class="l">{CATEGORY_LABELS[c]}</td>{_cell(v, _bytes(v))}'
            f"{_cell(v / total, f'{100 * v / total:.1f}%')}</tr>"
        )
    out.append(
        f'<tr data-key="total"><th class="l">total ({"memory_allocated" if cuda else "process RSS"})</th>'
        f"{_cell(peak['total_bytes'], _bytes(peak['total_bytes']))}<td></td></tr></table>"
    )
    return "\n".join(out)


def _alloc_table(peak: PeakAllocations | None) -> str:
    if peak is None:
        return ""
    out = [
        f"<p>Replaying the snapshot, the peak is {_bytes(peak.peak_bytes)} on cuda:{peak.device} "
        f"({_bytes(peak.before_history_bytes)} allocated before recording began, without stacks; "
        f"{peak.live_count} allocations from the recording live). The largest:</p>",
        '<table id="allocations"><tr><th>bytes</th><th class="l">stack (innermost first, user code)</th></tr>',
    ]
    for a in peak.top:
        stack = html.escape("\n".join(a.frames) or "(no stack recorded)")
        out.append(f'<tr>{_cell(a.size, _bytes(a.size))}<td class="l"><pre>{stack}</pre></td></tr>')
    out.append("</table>")
    return "\n".join(out)


def _comm_table(c: CommOverlap) -> str:
    """NCCL's kernels against the compute kernels over the recorded step: how much of the communication the
    compute hid, and how busy the GPU was (low: it waited, for the collectives or for the host)."""
    busy = c.compute_s / c.window_s if c.window_s > 0 else 0.0
    rows = [
        ("step", "" if c.step is None else str(c.step)),
        ("step time (recorded, under the profiler)", f"{c.window_s * 1e3:.1f} ms"),
        ("compute kernels running", f"{c.compute_s * 1e3:.1f} ms ({busy:.0%} of the step)"),
        ("NCCL kernels running", f"{c.comm_s * 1e3:.1f} ms"),
        ("NCCL time under compute kernels", f"{c.overlapped_s * 1e3:.1f} ms ({c.hidden:.0%})"),
    ]
    body = "".join(f"<tr><td>{html.escape(k)}</td><td>{html.escape(v)}</td></tr>" for k, v in rows)
    return f"<table>{body}</table>"


def render_html(data: RunData, pictures: dict[str, Path | None], peak: PeakAllocations | None, notes: list[str],
                comm: CommOverlap | None = None) -> str:
    """The page.

    Args:
        data: the parsed run.
        pictures: ``{"memory": path, "plan": ..., "link": ..., "metrics": ...}``, None for those not drawn.
        peak: the snapshot's peak allocations (CUDA), or None.
        notes: sentences on what is missing and why (shown at the top).
        comm: the recorded step's collectives against its compute (a run on several GPUs), or None.

    Returns:
        The HTML text.
    """
    s = summary(data)
    run = html.escape(str(data.run_dir))
    parts = [
        f"<!doctype html><html><head><meta charset='utf-8'><title>elbowroom report: {run}</title>"
        f"<style>{_CSS}</style></head><body>",
        f"<h1>elbowroom report: {run}</h1>",
    ]
    recorded = ", ".join(str(r["step"]) for r in data.steps) or "none"
    parts.append(
        f'<p class="note">Device of the recording: {data.device}. Recorded steps: {recorded}. '
        f"Steps logged: {s['first_step']}–{s['last_step']}.</p>"
    )
    for n in notes:
        parts.append(f'<p class="note">{html.escape(n)}</p>')
    parts.append("<h2>Predicted against measured</h2>")
    parts.append(_compare_table(s, data))
    if pictures.get("memory") or data.samples:
        parts.append("<h2>Memory over one step</h2>")
        parts.append(_img(pictures.get("memory"), "memory timeline"))
        parts.append(_peak_table(data))
    if peak is not None:
        parts.append("<h2>Top allocations at the peak</h2>")
        parts.append(_alloc_table(peak))
    parts.append("<h2>Plan</h2>")
    parts.append(_img(pictures.get("plan"), "plan per block"))
    parts.append(_plan_table(data))
    if pictures.get("link"):
        parts.append("<h2>Host-device link and compute stream</h2>")
        parts.append(_img(pictures["link"], "link traffic"))
    if comm is not None and comm.comm_s > 0:
        parts.append("<h2>Communication and compute (this rank)</h2>")
        parts.append(_comm_table(comm))
    parts.append("<h2>Training metrics</h2>")
    parts.append(_img(pictures.get("metrics"), "metrics curves"))
    parts.append(_metrics_table(s))
    links = []
    if data.snapshot_path:
        links.append(
            f'<li><a href="../profile/{data.snapshot_path.name}">memory snapshot</a> '
            '(drag into <a href="https://pytorch.org/memory_viz">pytorch.org/memory_viz</a>)</li>'
        )
    if data.trace_path:
        links.append(
            f'<li><a href="../profile/{data.trace_path.name}">profiler trace</a> '
            '(open in <a href="https://ui.perfetto.dev">ui.perfetto.dev</a>)</li>'
        )
    if links:
        parts.append("<h2>Raw recordings</h2><ul>" + "".join(links) + "</ul>")
    parts.append("</body></html>")
    return "\n".join(p for p in parts if p)
