"""Host-device traffic and compute-stream occupancy, read from torch.profiler's Chrome trace.

The trace is what ``prof.export_chrome_trace`` writes: ``traceEvents`` with complete events (``"ph": "X"``,
``ts``/``dur`` in microseconds). Copies are the ``gpu_memcpy`` events (names ``Memcpy HtoD ...`` / ``Memcpy DtoH
...``, ``args.bytes``), kernels the ``kernel`` events; ``args.stream`` tells the streams apart. The compute stream
is the one with the most kernel time. The window is the last ``elbowroom step N`` range the recorder marked on the
host (the recorder synchronises before closing it, so the step's device work lies inside), else the whole trace.
The device-side copy of that range (``gpu_user_annotation``) is not the window: it spans only the kernels launched
from the thread that opened the range, which is the forward; the backward runs on autograd's own thread.
"""

from __future__ import annotations

import gzip
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

__all__ = ["LinkTimeline", "read_trace", "link_timeline"]


def read_trace(path: Path) -> list[dict[str, Any]]:
    """The complete (``"ph": "X"``) events of a Chrome trace file (plain or gzipped JSON)."""
    raw = path.read_bytes()
    if raw[:2] == b"\x1f\x8b":
        raw = gzip.decompress(raw)
    doc = json.loads(raw)
    events = doc.get("traceEvents", []) if isinstance(doc, dict) else doc
    return [e for e in events if isinstance(e, dict) and e.get("ph") == "X" and "ts" in e]


@dataclass(frozen=True)
class LinkTimeline:
    """One step's link traffic and compute occupancy in equal time bins."""

    step: int | None
    """The recorder's step the window is (None: the whole trace)."""
    edges_s: list[float]
    """Bin edges, seconds from the window's start (len = bins + 1)."""
    h2d_bytes_per_s: list[float]
    """Host-to-device bytes per second in each bin."""
    d2h_bytes_per_s: list[float]
    """Device-to-host bytes per second in each bin."""
    compute_busy: list[float]
    """Fraction of each bin the compute stream ran kernels (1 - this: waiting)."""
    h2d_bytes: int
    """Host-to-device bytes over the window."""
    d2h_bytes: int
    """Device-to-host bytes over the window."""
    best_copy_bytes_per_s: float
    """The fastest single copy's rate: a lower bound on the link's limit when the plan does not give one."""

    @property
    def seconds(self) -> float:
        return self.edges_s[-1] if self.edges_s else 0.0


def _direction(e: dict[str, Any]) -> str | None:
    name = str(e.get("name", ""))
    if "HtoD" in name:
        return "h2d"
    if "DtoH" in name:
        return "d2h"
    return None


def _overlap(a0: float, a1: float, b0: float, b1: float) -> float:
    return max(0.0, min(a1, b1) - max(a0, b0))


def link_timeline(events: list[dict[str, Any]], bins: int = 100) -> LinkTimeline | None:
    """Bin one step's copies and kernels.

    Args:
        events: complete events of a trace (:func:`read_trace`).
        bins: number of time bins.

    Returns:
        The timeline, or None when the trace has no device events (a CPU run).
    """
    kernels = [e for e in events if e.get("cat") == "kernel"]
    copies = [e for e in events if e.get("cat") == "gpu_memcpy" and _direction(e)]
    if not kernels and not copies:
        return None
    step, t0, t1 = None, None, None
    marks = [e for e in events if str(e.get("name", "")).startswith("elbowroom step ")
             and not str(e.get("cat", "")).startswith("gpu_")]
    if marks:
        last = max(marks, key=lambda e: e["ts"])
        t0, t1 = float(last["ts"]), float(last["ts"]) + float(last.get("dur", 0))
        try:
            step = int(str(last["name"]).rsplit(" ", 1)[1])
        except ValueError:
            step = None
    dev = kernels + copies
    if t0 is None or t1 is None or t1 <= t0:
        t0 = min(float(e["ts"]) for e in dev)
        t1 = max(float(e["ts"]) + float(e.get("dur", 0)) for e in dev)
    width = (t1 - t0) / bins if t1 > t0 else 1.0
    edges = [t0 + i * width for i in range(bins + 1)]
    h2d, d2h, busy = [0.0] * bins, [0.0] * bins, [0.0] * bins
    total = {"h2d": 0, "d2h": 0}
    best = 0.0

    def spread(e: dict[str, Any], into: list[float], amount: float) -> None:
        a0 = float(e["ts"])
        dur = max(float(e.get("dur", 0)), 1e-3)
        a1 = a0 + dur
        lo = max(0, int((a0 - t0) // width))
        hi = min(bins - 1, int((a1 - t0) // width))
        for i in range(lo, hi + 1):
            into[i] += amount * _overlap(a0, a1, edges[i], edges[i + 1]) / dur

    for e in copies:
        if float(e["ts"]) + float(e.get("dur", 0)) < t0 or float(e["ts"]) > t1:
            continue
        args = e.get("args", {}) or {}
        nbytes = float(args.get("bytes", 0) or 0)
        d = _direction(e)
        total[d] += int(nbytes)
        spread(e, h2d if d == "h2d" else d2h, nbytes)
        dur_s = float(e.get("dur", 0)) * 1e-6
        if dur_s > 0 and nbytes >= (1 << 20):  # small copies are latency-bound: they say nothing of the limit
            best = max(best, nbytes / dur_s)
    by_stream: dict[Any, float] = {}
    for e in kernels:
        s = (e.get("args", {}) or {}).get("stream", e.get("tid"))
        by_stream[s] = by_stream.get(s, 0.0) + float(e.get("dur", 0))
    compute = max(by_stream, key=by_stream.get) if by_stream else None
    for e in kernels:
        if (e.get("args", {}) or {}).get("stream", e.get("tid")) != compute:
            continue
        if float(e["ts"]) + float(e.get("dur", 0)) < t0 or float(e["ts"]) > t1:
            continue
        spread(e, busy, float(e.get("dur", 0)))  # microseconds of kernel time in each bin
    bin_s = width * 1e-6
    return LinkTimeline(
        step=step,
        edges_s=[(x - t0) * 1e-6 for x in edges],
        h2d_bytes_per_s=[b / bin_s for b in h2d],
        d2h_bytes_per_s=[b / bin_s for b in d2h],
        compute_busy=[min(1.0, b / width) for b in busy],
        h2d_bytes=total["h2d"],
        d2h_bytes=total["d2h"],
        best_copy_bytes_per_s=best,
    )
