"""Where the GPU's compute waits in a recorded step: the gaps between compute kernels (NCCL's kernels not counted as
compute), largest first, each with the kernels on either side and the host ranges running on the CPU meanwhile;
then the idle time summed by phase (forward, backward, optimizer step: from the host's first backward and step
ranges) and by the innermost named host range under each gap (FSDP2's hooks, an optimizer's step, an autograd
function, ...), so that a step's idle can be read without the trace.

    python3 benchmarks/idle_gaps.py OUT/profile/trace.json [--min-ms 0.2] [--top 15]

Read with `--profile.steps A-B` runs of the trainer: a data-parallel run's gaps beside one GPU's show what the
collectives or the ranks' host work cost the compute stream.
"""

from __future__ import annotations

import argparse
import gzip
import json


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("trace")
    ap.add_argument("--min-ms", type=float, default=0.2)
    ap.add_argument("--top", type=int, default=15)
    a = ap.parse_args()
    raw = json.load(gzip.open(a.trace) if a.trace.endswith(".gz") else open(a.trace))
    ev = [e for e in (raw["traceEvents"] if isinstance(raw, dict) else raw) if e.get("ph") == "X" and "dur" in e]
    steps = sorted((e for e in ev if e["name"].startswith("elbowroom step") and e.get("cat") == "user_annotation"),
                   key=lambda e: e["ts"])
    kernels = sorted((e for e in ev if e.get("cat") == "kernel"), key=lambda e: e["ts"])
    if not steps or not kernels:
        raise SystemExit("no recorded step with kernels in this trace")
    w = steps[-1]
    t0, t1 = w["ts"], w["ts"] + w["dur"]
    comm = [e for e in kernels if "nccl" in e["name"].lower()]
    compute = [e for e in kernels if "nccl" not in e["name"].lower() and e["ts"] < t1 and e["ts"] + e["dur"] > t0]
    host = [e for e in ev if e.get("cat") in ("cpu_op", "user_annotation", "python_function") and e["ts"] < t1
            and e["ts"] + e["dur"] > t0]
    gaps, end, prev = [], t0, None
    for k in compute:
        if k["ts"] > end:
            gaps.append((k["ts"] - end, end, prev, k))
        if k["ts"] + k["dur"] > end:
            end, prev = k["ts"] + k["dur"], k
    if t1 > end:
        gaps.append((t1 - end, end, prev, None))
    idle = sum(g[0] for g in gaps)
    print(f"{w['name']}: window {(t1 - t0) / 1e3:.1f} ms, compute idle {idle / 1e3:.1f} ms in {len(gaps)} gaps "
          f"({sum(g[0] for g in gaps if g[0] >= a.min_ms * 1e3) / 1e3:.1f} ms in gaps >= {a.min_ms} ms); "
          f"NCCL kernels {sum(e['dur'] for e in comm if t0 <= e['ts'] < t1) / 1e3:.1f} ms")
    for dur, at, before, after in sorted(gaps, key=lambda g: -g[0])[: a.top]:
        if dur < a.min_ms * 1e3:
            break
        mid = [h for h in host if h["ts"] < at + dur and h["ts"] + h["dur"] > at and h["dur"] < (t1 - t0) * 0.5]
        mid.sort(key=lambda h: -h["dur"])
        names = ", ".join(f"{h['name'][:40]} ({h['dur'] / 1e3:.1f})" for h in mid[:3])
        nccl = sum(min(e["ts"] + e["dur"], at + dur) - max(e["ts"], at) for e in comm
                   if e["ts"] < at + dur and e["ts"] + e["dur"] > at)
        print(f"  {dur / 1e3:6.2f} ms at {(at - t0) / 1e3:7.1f} ms  after {(before or {}).get('name', '-')[:36]!r} "
              f"before {(after or {}).get('name', 'step end')[:36]!r}; NCCL {nccl / 1e3:.2f} ms; host: {names}")
    phases, ranges = attribute([(g[0], g[1]) for g in gaps], host, (t0, t1))
    print("  idle by phase: " + ", ".join(f"{k} {v / 1e3:.1f} ms" for k, v in phases.items()))
    print("  idle by host range: " + ", ".join(f"{k} {v / 1e3:.1f} ms" for k, v in
                                             sorted(ranges.items(), key=lambda kv: -kv[1])[:8]))


_NAMED = ("FSDP::", "Optimizer.", "autograd::engine::evaluate_function", "DistributedDataParallel.",
          "CheckpointFunction", "elbowroom")
"""Host ranges an idle gap is put down to (the innermost of them running at its middle), by name up to " (" or "#"."""


def _label(name: str) -> str:
    for cut in (" (", "#"):
        name = name.split(cut)[0]
    return name.removeprefix("autograd::engine::evaluate_function: ")


def attribute(gaps: list[tuple[float, float]], host: list[dict], window: tuple[float, float]
              ) -> tuple[dict[str, float], dict[str, float]]:
    """Idle microseconds by phase and by host range: ``gaps`` as (duration, start), ``host`` the trace's host ranges
    (``name``, ``ts``, ``dur``). Phases: forward until the first autograd range, backward until the first optimizer
    step range after it, the step after that. A gap under no named range counts as "(no named host range)"."""
    t0, t1 = window
    back = min((h["ts"] for h in host if h["name"].startswith("autograd::engine::evaluate_function")), default=t1)
    step = min((h["ts"] for h in host if h["name"].startswith("Optimizer.step") and h["ts"] >= back), default=t1)
    phases: dict[str, float] = {"forward": 0.0, "backward": 0.0, "optimizer step": 0.0}
    ranges: dict[str, float] = {}
    for dur, at in gaps:
        mid = at + dur / 2
        phases["forward" if mid < back else "backward" if mid < step else "optimizer step"] += dur
        under = [h for h in host if h["ts"] <= mid < h["ts"] + h["dur"] and h["name"].startswith(_NAMED)
                 and h["dur"] < (t1 - t0) * 0.5]
        key = _label(min(under, key=lambda h: h["dur"])["name"]) if under else "(no named host range)"
        ranges[key] = ranges.get(key, 0.0) + dur
    return phases, ranges


if __name__ == "__main__":
    main()
