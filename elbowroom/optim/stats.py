"""Numbers of the CPU-offloaded optimizer for benchmarks and logs: placement, host memory, per-step timing.

``StepStats`` keeps the per-step figures the training thread records at the end of each ``step()`` (CPU time
of the host work, how long ``step()`` waited for it, bytes over the link, the optional timeline), counted from
the end of the previous step because CPU steps may run during backward. The engine's counters are read as one
snapshot under its lock, so ``stats()`` is safe at any time, also while CPU steps still run (lazy mode, where
the figures lag one step).
"""

from __future__ import annotations

import time
from typing import Any

from elbowroom.optim.buffers import HostMemory, nbytes
from elbowroom.optim.engine import Engine
from elbowroom.optim.placement import Placement

__all__ = ["StepStats", "trace_summary"]


class StepStats:
    """The last step's figures and the optimizer's footprint (training thread only)."""

    def __init__(self) -> None:
        self.figures: dict[str, Any] = {"steps": 0}
        self._marks = (0.0, 0, 0, 0.0)  # engine counters at the end of the last step
        self._trace_t0: float | None = None

    def record(self, engine: Engine, skip: bool, wait_s: float, t_start: float) -> None:
        """Record the step that ``step()`` started at ``t_start`` and now ends.

        Args:
            engine: the optimizer's engine (its counters and trace).
            skip: the step skipped its update.
            wait_s: how long the training thread waited for the CPU steps.
            t_start: ``time.perf_counter()`` at the start of ``step()``.
        """
        c = engine.counters()  # a consistent snapshot, also while CPU steps still run (lazy mode)
        cpu0, d2h0, h2d0, cw0 = self._marks
        self._marks = (c["cpu_s"], c["d2h_bytes"] + c["recopy_bytes"], c["h2d_bytes"], c["copy_wait_s"])
        cpu_s = c["cpu_s"] - cpu0
        events = engine.take_trace()  # the workers note into a new list from here
        if events is not None:
            events.append(("step_call", -1, t_start, time.perf_counter()))
            base = self._trace_t0 if self._trace_t0 is not None else t_start
            self._trace_t0 = t_start
            self.figures["trace"] = [(w, i, round(a - base, 5), round(b - base, 5)) for w, i, a, b in events]
        self.figures.update(
            copy_wait_s=c["copy_wait_s"] - cw0,
            chunked=engine.chunked,
            steps=self.figures["steps"] + 1,
            skipped=skip,
            cpu_step_s=cpu_s,
            cpu_wait_s=wait_s,
            step_call_s=time.perf_counter() - t_start,
            hidden_fraction=(max(0.0, 1.0 - wait_s / cpu_s) if cpu_s > 0 else 1.0),
            d2h_bytes=c["d2h_bytes"] + c["recopy_bytes"] - d2h0,
            h2d_bytes=c["h2d_bytes"] - h2d0,
        )

    def report(
        self, engine: Engine, placement: Placement, host: HostMemory, staging_bytes: int, step_in_backward: bool | None
    ) -> dict[str, Any]:
        """The optimizer's footprint and the last step's figures (see ``CPUOffloadOptimizer.stats``)."""
        off = sum(hp.param.numel() for hp in placement.hps)
        host_bytes = host.pinned_bytes + host.pageable_bytes + engine.state_bytes()
        out = {
            "offloaded_params": len(placement.hps),
            "offloaded_numel": off,
            "device_numel": sum(p.numel() for p in placement.dev_params),
            "buckets": len(placement.buckets),
            "host_bytes": host_bytes,
            "pinned_bytes": host.pinned_bytes,
            "host_bytes_per_offloaded_param": host_bytes / off if off else 0.0,
            "staging_bytes": staging_bytes,
            "scratch_bytes": nbytes(engine.scratch) if engine.scratch is not None else 0,
            "num_staging_slots": engine.pool.count,
            "slot_bytes": engine.pool.slot_bytes,
            "step_in_backward": step_in_backward,
            "cpu_threads": engine.cpu_threads,
        }
        out.update(self.figures)
        return out


def trace_summary(events: list[tuple[str, int, float, float]]) -> dict[str, dict[str, float]]:
    """The optimizer's timeline (``(kind, parameter index, start, end)``) per kind: count, busy seconds (the sum of
    the events' lengths), first start, last end."""
    out: dict[str, dict[str, float]] = {}
    for kind, _, a, b in events:
        k = out.setdefault(kind, {"count": 0, "busy_s": 0.0, "first_s": a, "last_s": b})
        k["count"] += 1
        k["busy_s"] += b - a
        k["first_s"], k["last_s"] = min(k["first_s"], a), max(k["last_s"], b)
    for k in out.values():
        k["busy_s"] = round(k["busy_s"], 5)
    return out
