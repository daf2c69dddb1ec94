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

__all__ = ["CommOverlap", "LinkTimeline", "comm_overlap", "read_trace", "link_timeline"]


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


def _window(events: list[dict[str, Any]], device_events: list[dict[str, Any]]) -> tuple[int | None, float, float]:
    """The last step the recorder marked on the host, as ``(step, start, end)`` in microseconds; without a mark,
    the span of ``device_events`` (step None)."""
    marks = [e for e in events if str(e.get("name", "")).startswith("elbowroom step ")
             and not str(e.get("cat", "")).startswith("gpu_")]
    if marks:
        last = max(marks, key=lambda e: e["ts"])
        t0, t1 = float(last["ts"]), float(last["ts"]) + float(last.get("dur", 0))
        if t1 > t0:
            try:
                return int(str(last["name"]).rsplit(" ", 1)[1]), t0, t1
            except ValueError:
                return None, t0, t1
    return (None, min(float(e["ts"]) for e in device_events),
            max(float(e["ts"]) + float(e.get("dur", 0)) for e in device_events))


def _is_comm(e: dict[str, Any]) -> bool:
    name = str(e.get("name", "")).lower()
    return "nccl" in name or "allreduce" in name or "all_reduce" in name or "reducescatter" in name


def _union(spans: list[tuple[float, float]]) -> list[tuple[float, float]]:
    out: list[tuple[float, float]] = []
    for a, b in sorted(spans):
        if out and a <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], b))
        else:
            out.append((a, b))
    return out


def _covered(spans: list[tuple[float, float]], cover: list[tuple[float, float]]) -> float:
    """Time of ``spans`` (disjoint) that ``cover`` (disjoint, sorted) also covers."""
    return sum(_overlap(a, b, c, d) for a, b in spans for c, d in cover if c < b and d > a)


@dataclass(frozen=True)
class CommOverlap:
    """How much of one step's collective-communication kernel time ran while compute kernels ran."""

    step: int | None
    """The recorder's step the window is (None: the whole trace)."""
    window_s: float
    """The window's length."""
    comm_s: float
    """Time at least one communication kernel (NCCL) ran."""
    overlapped_s: float
    """Part of ``comm_s`` during which a compute kernel also ran, on another stream."""
    compute_s: float
    """Time at least one compute (non-communication) kernel ran."""

    @property
    def hidden(self) -> float:
        """Share of communication time hidden behind compute (1.0: all of it; 1.0 when there is none)."""
        return self.overlapped_s / self.comm_s if self.comm_s > 0 else 1.0


def comm_overlap(events: list[dict[str, Any]]) -> CommOverlap | None:
    """Communication against compute over the last recorded step: NCCL kernels (all-reduce, reduce-scatter,
    all-gather) are the communication, every other kernel the compute.

    Args:
        events: complete events of a trace (:func:`read_trace`).

    Returns:
        The overlap, or None when the trace has no kernels (a CPU run).
    """
    kernels = [e for e in events if e.get("cat") == "kernel"]
    if not kernels:
        return None
    step, t0, t1 = _window(events, kernels)

    def spans(comm: bool) -> list[tuple[float, float]]:
        return _union([(max(float(e["ts"]), t0), min(float(e["ts"]) + float(e.get("dur", 0)), t1))
                       for e in kernels if _is_comm(e) == comm
                       and float(e["ts"]) < t1 and float(e["ts"]) + float(e.get("dur", 0)) > t0])

    comm, compute = spans(True), spans(False)
    return CommOverlap(step=step, window_s=(t1 - t0) * 1e-6, comm_s=sum(b - a for a, b in comm) * 1e-6,
                       overlapped_s=_covered(comm, compute) * 1e-6, compute_s=sum(b - a for a, b in compute) * 1e-6)


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
    step, t0, t1 = _window(events, kernels + copies)
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
