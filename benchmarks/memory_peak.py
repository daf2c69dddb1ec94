"""What was alive on the GPU at the peak of a run: the CUDA allocator's recorded history replayed.

``ELBOWROOM_BENCH_MEMORY=DIR`` makes a bench row record the allocator's history from the first timed step on
(``torch.cuda.memory._record_memory_history``, Python stacks) and write ``DIR/<workload>-<mode>.txt`` after its
last step, or when it runs out of memory: the allocated bytes at the peak, split into what existed before the
steps (model states, the optimizer's buffers) and the allocations made since, grouped by where they were made.
It answers "which tensor is the cost model missing" without carrying a snapshot of hundreds of MB off the machine.

    ELBOWROOM_BENCH_MEMORY=runs/mem python3 benchmarks/bench.py --workload w3 --steps 3 --warmup 1 \\
        --modes fit_bf16@76GiB+nog+fl
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

__all__ = ["peak_allocations", "summarize"]

_OWN = ("elbowroom/", "benchmarks/")


def _site(frames: Iterable[dict[str, Any]]) -> str:
    """Where an allocation was made, in two frames: the innermost of elbowroom's or the bench's own, and the
    innermost frame above the allocation (often torch's op or module), so that groups read as "who, through what"."""
    frames = list(frames)
    own = next((f for f in frames if any(o in f.get("filename", "") for o in _OWN)), None)
    first = frames[0] if frames else None

    def short(f: dict[str, Any] | None) -> str:
        if f is None:
            return "?"
        name = f.get("filename", "?")
        for o in _OWN:
            if o in name:
                name = o + name.split(o, 1)[1]
                break
        else:
            name = name.rsplit("/", 2)[-1] if "/" in name else name
        return f"{name}:{f.get('line', '?')} {f.get('name', '')}".strip()

    if first is None:
        return "no Python frame (autograd's engine thread)"
    if own is None or own is first:
        return short(first)
    return f"{short(own)} <- {short(first)}"


def peak_allocations(trace: list[dict[str, Any]], baseline: int) -> tuple[int, int, dict[int, tuple[int, str]]]:
    """Replay one device's trace: (peak allocated bytes, index of the event at the peak, the allocations made
    during the trace and alive at the peak: address -> (bytes, site)). ``baseline``: the bytes allocated when the
    recording began; a free of an address the trace never allocated is taken from it."""
    def replay(stop: int) -> tuple[int, int, dict[int, tuple[int, str]]]:
        live: dict[int, tuple[int, str]] = {}
        now = peak = baseline
        at = -1
        for i, ev in enumerate(trace[: stop + 1] if stop >= 0 else trace):
            action, addr, size = ev.get("action"), ev.get("addr"), int(ev.get("size", 0))
            if action == "alloc":
                live[addr] = (size, _site(ev.get("frames", ())) if stop >= 0 else "")
                now += size
            elif action == "free_completed":
                now -= live.pop(addr, (size, ""))[0]
            else:
                continue
            if now > peak:
                peak, at = now, i
        return peak, at, live

    peak, at, _ = replay(-1)  # where the peak is (sites left unnamed: the cheap pass)
    if at < 0:
        return peak, at, {}
    _, _, live = replay(at)  # what was alive there
    return peak, at, live


def summarize(snapshot: dict[str, Any], baseline: int, device: int = 0, top: int = 25) -> str:
    """A text report of the peak of ``snapshot`` (``torch.cuda.memory._snapshot()``) on ``device``."""
    traces = snapshot.get("device_traces") or []
    trace = traces[device] if device < len(traces) else []
    peak, at, live = peak_allocations(trace, baseline)
    made = sum(n for n, _ in live.values())
    groups: dict[str, list[Any]] = {}
    for n, site in live.values():
        g = groups.setdefault(site, [0, 0, {}])
        g[0] += n
        g[1] += 1
        g[2][n] = g[2].get(n, 0) + 1  # the sizes often name the tensor where a stack does not
    gib = 1 << 30
    lines = [
        f"peak allocated {peak / gib:.3f} GiB at event {at} of {len(trace)}",
        f"  before the recording (model states, optimizer buffers, anything made at set-up): "
        f"{(peak - made) / gib:.3f} GiB",
        f"  made since and alive at the peak: {made / gib:.3f} GiB in {len(live)} allocations",
        "",
        "| GiB | allocations | sizes (MiB x count) | where (own frame <- innermost frame) |",
        "|---|---|---|---|",
    ]
    for site, (n, k, sizes) in sorted(groups.items(), key=lambda kv: -kv[1][0])[:top]:
        common = ", ".join(f"{b / 2**20:.1f} x {c}" for b, c in sorted(sizes.items(), key=lambda bc: -bc[1])[:3])
        lines.append(f"| {n / gib:.3f} | {k} | {common} | {site} |")
    if any(ev.get("action") == "oom" for ev in trace):
        lines.append("")
        lines.append("the recording ends with an out-of-memory event")
    return "\n".join(lines) + "\n"
