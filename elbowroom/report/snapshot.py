"""The largest live allocations at the peak of a CUDA memory snapshot (``torch.cuda.memory._snapshot()``).

The snapshot's ``device_traces`` hold the allocator's events of the recorded history (``alloc``,
``free_requested``, ``free_completed``, each with ``addr``, ``size`` and the Python ``frames`` of its call).
Replaying them from empty gives the bytes allocated during the history at each event; its maximum is the
peak, and what is live there (with its stack) is what the report lists. Allocations made before the history
began (parameters, optimizer state) are not in the trace: their bytes are the snapshot's active bytes at the
end less what the replay holds at the end, reported as one line.
"""

from __future__ import annotations

import pickle
from dataclasses import dataclass
from pathlib import Path
from typing import Any

__all__ = ["Allocation", "PeakAllocations", "load_snapshot", "peak_allocations"]


@dataclass(frozen=True)
class Allocation:
    """One live block at the peak."""

    size: int
    """Bytes."""
    frames: tuple[str, ...]
    """Its stack, innermost first, as ``file:line name``."""


@dataclass(frozen=True)
class PeakAllocations:
    """What the snapshot says about the peak."""

    device: int
    peak_bytes: int
    """Bytes allocated during the history at its peak, plus the bytes from before it."""
    before_history_bytes: int
    """Bytes allocated before the history began and still live at its end (no stacks)."""
    top: tuple[Allocation, ...]
    """The largest allocations live at the peak, largest first."""
    live_count: int
    """How many history allocations were live at the peak."""


def load_snapshot(path: Path) -> dict[str, Any]:
    """The snapshot dict torch pickled (trusted input: a file this run wrote)."""
    with open(path, "rb") as f:
        snap = pickle.load(f)  # noqa: S301 - torch's own format; the run directory is the user's
    if not isinstance(snap, dict) or "segments" not in snap:
        raise ValueError(f"{path} is not a torch memory snapshot (no 'segments'); record it again")
    return snap


def _frames(frames: Any, limit: int) -> tuple[str, ...]:
    out = []
    for fr in frames or ():
        name = f"{fr.get('filename', '?')}:{fr.get('line', '?')} {fr.get('name', '?')}"
        out.append(name)
    # user code first: skip torch's and Python's own frames at the top of the stack when others follow
    own = [f for f in out if "/torch/" not in f and not f.startswith("??")]
    return tuple((own or out)[:limit])


def peak_allocations(snap: dict[str, Any], top: int = 10, frames: int = 8) -> PeakAllocations | None:
    """Replay the snapshot's trace of the busiest device and list what was live at its peak.

    Args:
        snap: the snapshot dict.
        top: how many allocations to list.
        frames: stack frames kept per allocation.

    Returns:
        The peak, or None when the snapshot holds no trace events.
    """
    traces = snap.get("device_traces") or []
    best = None
    for dev, trace in enumerate(traces):
        if trace and (best is None or len(trace) > len(traces[best])):
            best = dev
    if best is None:
        return None
    trace = traces[best]
    frees_completed = any(e.get("action") == "free_completed" for e in trace)
    free_action = "free_completed" if frees_completed else "free_requested"
    live: dict[int, dict[str, Any]] = {}
    cur = peak = 0
    peak_live: dict[int, dict[str, Any]] = {}
    for e in trace:
        action = e.get("action")
        if action == "alloc":
            live[e["addr"]] = e
            cur += int(e.get("size", 0))
            if cur > peak:
                peak, peak_live = cur, dict(live)
        elif action == free_action:
            gone = live.pop(e.get("addr"), None)
            if gone is not None:
                cur -= int(gone.get("size", 0))
    active_end = 0
    for seg in snap.get("segments", []):
        if seg.get("device", best) != best:
            continue
        for blk in seg.get("blocks", []):
            if blk.get("state") == "active_allocated":
                active_end += int(blk.get("size", 0))
    before = max(0, active_end - cur)
    allocs = sorted(peak_live.values(), key=lambda e: -int(e.get("size", 0)))[:top]
    return PeakAllocations(
        device=best,
        peak_bytes=peak + before,
        before_history_bytes=before,
        top=tuple(Allocation(int(e.get("size", 0)), _frames(e.get("frames"), frames)) for e in allocs),
        live_count=len(peak_live),
    )
