"""What was alive on the GPU at the peak of a run: the CUDA allocator's recorded history replayed.

``ELBOWROOM_BENCH_MEMORY=DIR`` makes a bench row record the allocator's history from the first timed step on
(``torch.cuda.memory._record_memory_history``, Python stacks) and write ``DIR/<workload>-<mode>.txt`` after its
last step, or when it runs out of memory: the allocated bytes at the peak, split into what existed before the
steps (model states, the optimizer's buffers) and the allocations made since, grouped by where they were made.
It answers "which tensor is the cost model missing" without carrying a snapshot of hundreds of MB off the machine.

Then the reserved memory (:func:`summarize_reserved`), replayed from the allocator's state when the recording began:
its peak and, for each of the first allocator retries (a run of unmaps: the allocator freed its cache to place one
allocation), the allocation placed and its stream, the allocated bytes then, the free ranges inside the reserved
memory, and each stream's reserved, allocated, largest free ranges and top allocation sites. A copy stream's free
memory is not the compute stream's: it answers "why did the allocator retry with this much reserved and unused".

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


# ---------------------------------------------------------------------------------------------------------------
# Reserved memory: where the allocator held more than was allocated, and what its retries were for


def _add_range(ranges: list[list[int]], a: int, b: int) -> None:
    """Add ``[a, b)`` to sorted, disjoint ``ranges`` (merging neighbours)."""
    out, placed = [], False
    for lo, hi in ranges:
        if hi < a or lo > b:
            if lo > b and not placed:
                out.append([a, b])
                placed = True
            out.append([lo, hi])
        else:
            a, b = min(a, lo), max(b, hi)
    if not placed:
        out.append([a, b])
    out.sort()
    ranges[:] = out


def _sub_range(ranges: list[list[int]], a: int, b: int) -> None:
    """Remove ``[a, b)`` from sorted, disjoint ``ranges``."""
    out = []
    for lo, hi in ranges:
        if hi <= a or lo >= b:
            out.append([lo, hi])
            continue
        if lo < a:
            out.append([lo, a])
        if hi > b:
            out.append([b, hi])
    ranges[:] = out


class _Pool:
    """The allocator's mapped ranges by stream and its live blocks, replayed event by event."""

    def __init__(self, segments: list[dict[str, Any]], device: int) -> None:
        self.mapped: dict[int, list[list[int]]] = {}
        self.live: dict[int, tuple[int, int, str]] = {}  # address -> (bytes, stream, site)
        for seg in segments:
            if seg.get("device", device) != device:
                continue
            stream = int(seg.get("stream", 0))
            for blk in seg.get("blocks", ()):
                a = int(blk["address"])
                _add_range(self.mapped.setdefault(stream, []), a, a + int(blk["size"]))
                if blk.get("state") != "inactive":
                    self.live[a] = (int(blk["size"]), stream, "before the recording")
        self.reserved = sum(hi - lo for r in self.mapped.values() for lo, hi in r)
        self.allocated = sum(n for n, _, _ in self.live.values())

    def apply(self, ev: dict[str, Any], named: bool) -> None:
        action, addr, size = ev.get("action"), int(ev.get("addr", 0)), int(ev.get("size", 0))
        stream = int(ev.get("stream", 0))
        if action in ("segment_map", "segment_alloc"):
            _add_range(self.mapped.setdefault(stream, []), addr, addr + size)
            self.reserved += size
        elif action in ("segment_unmap", "segment_free"):
            for r in self.mapped.values():
                _sub_range(r, addr, addr + size)
            self.reserved -= size
        elif action == "alloc":
            self.live[addr] = (size, stream, _site(ev.get("frames", ())) if named else "")
            self.allocated += size
        elif action == "free_completed":
            self.allocated -= self.live.pop(addr, (size, 0, ""))[0]

    def holes(self) -> list[tuple[int, int]]:
        """(bytes, stream) of every mapped range no live block covers, largest first."""
        spans = sorted((a, a + n) for a, (n, _, _) in self.live.items())
        out = []
        for stream, ranges in self.mapped.items():
            for lo, hi in ranges:
                free = [[lo, hi]]
                for a, b in spans:  # (a linear scan: run once or a few times per report)
                    if b > lo and a < hi:
                        _sub_range(free, a, b)
                out += [(b - a, stream) for a, b in free if b > a]
        return sorted(out, reverse=True)

    def by_stream(self) -> dict[int, tuple[int, int]]:
        """stream -> (reserved bytes, allocated bytes)."""
        out = {s: [sum(hi - lo for lo, hi in r), 0] for s, r in self.mapped.items()}
        for n, s, _ in self.live.values():
            out.setdefault(s, [0, 0])[1] += n
        return {s: (r, a) for s, (r, a) in out.items()}


def summarize_reserved(snapshot: dict[str, Any], start_segments: list[dict[str, Any]], device: int = 0,
                       retries: int = 3) -> str:
    """What the reserved-minus-allocated was at the reserved peak of the recording, and each of the first
    ``retries`` allocator retries (a run of unmaps: the allocator freed its cache to place one allocation): the
    allocation it placed, the allocated bytes then, and the free ranges it had before (too small or on another
    stream). ``start_segments``: ``torch.cuda.memory._snapshot()["segments"]`` when the recording began."""
    traces = snapshot.get("device_traces") or []
    trace = traces[device] if device < len(traces) else []
    gib, mib = 1 << 30, 1 << 20

    pool = _Pool(start_segments, device)
    peak, at, unmaps = pool.reserved, -1, []
    for i, ev in enumerate(trace):
        pool.apply(ev, named=False)
        if pool.reserved > peak:
            peak, at = pool.reserved, i
        if ev.get("action") in ("segment_unmap", "segment_free") and (not unmaps or unmaps[-1][1] != i - 1):
            unmaps.append([i, i])
        elif unmaps and ev.get("action") in ("segment_unmap", "segment_free"):
            unmaps[-1][1] = i

    def state(upto: int) -> _Pool:
        p = _Pool(start_segments, device)
        for ev in trace[: upto + 1]:
            p.apply(ev, named=True)
        return p

    def next_alloc(i: int) -> str:
        for ev in trace[i + 1: i + 200]:
            if ev.get("action") == "alloc":
                return (f"{int(ev.get('size', 0)) / mib:.1f} MiB on stream {int(ev.get('stream', 0))} at "
                        f"{_site(ev.get('frames', ()))}")
        return "?"

    def describe(p: _Pool) -> list[str]:
        holes = p.holes()
        big = ", ".join(f"{n / mib:.0f}" for n, _ in holes[:8])
        rows = [f"  reserved {p.reserved / gib:.3f} GiB, allocated {p.allocated / gib:.3f} GiB, "
                f"free in the reserved {sum(n for n, _ in holes) / gib:.3f} GiB in {len(holes)} ranges "
                f"(largest, MiB: {big})"]
        for s, (r, a) in sorted(p.by_stream().items(), key=lambda kv: -kv[1][0]):
            mine = ", ".join(f"{n / mib:.0f}" for n in [n for n, st in holes if st == s][:4])
            rows.append(f"  stream {s}: reserved {r / gib:.3f} GiB, allocated {a / gib:.3f} GiB, largest free "
                        f"(MiB) {mine or '-'}; {sites.get(s, '')}")
        return rows

    counts: dict[int, dict[str, int]] = {}
    for ev in trace:
        if ev.get("action") == "alloc":
            c = counts.setdefault(int(ev.get("stream", 0)), {})
            site = _site(ev.get("frames", ()))
            c[site] = c.get(site, 0) + 1
    sites = {st: "allocates at " + "; ".join(f"{k} ({n})" for k, n in sorted(c.items(), key=lambda kv: -kv[1])[:2])
             for st, c in counts.items()}
    lines = [f"reserved at the start of the recording {_Pool(start_segments, device).reserved / gib:.3f} GiB; "
             f"{len(unmaps)} runs of unmaps (allocator retries or cache releases) in {len(trace)} events"]
    if at >= 0:
        lines.append(f"reserved peak {peak / gib:.3f} GiB at event {at}, growing for {next_alloc(at)}")
        lines += describe(state(at))
    for first, last in unmaps[:retries]:
        p = state(first - 1)
        freed = sum(int(ev.get("size", 0)) for ev in trace[first: last + 1])
        lines.append(f"retry at event {first}: unmapped {freed / gib:.3f} GiB to place {next_alloc(last)}")
        lines += describe(p)
    return "\n".join(lines) + "\n"
