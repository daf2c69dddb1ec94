"""The largest allocations live at the peak of a recorded CUDA memory snapshot (a trainer run's
`--profile.steps`), then every allocation live there summed by where it was made (its first frames outside torch):
`python3 benchmarks/snapshot_peak.py RUN/profile/memory_snapshot.pickle [TOP]`."""
import collections
import sys
from pathlib import Path

from elbowroom.report.snapshot import load_snapshot, peak_allocations

top = int(sys.argv[2]) if len(sys.argv) > 2 else 14
p = peak_allocations(load_snapshot(Path(sys.argv[1])), top=1_000_000, frames=7)
G, M = 2**30, 2**20
print(f"peak {p.peak_bytes/G:.2f} GiB, before history {p.before_history_bytes/G:.2f}, live {p.live_count}")
for a in p.top[:top]:
    print(f"{a.size/M:9.1f} MiB")
    for f in a.frames:
        print("      ", f)
sites: dict[str, list[int]] = collections.defaultdict(list)
for a in p.top:
    sites[" < ".join(f.rsplit("/", 1)[-1] for f in a.frames[:3]) or "?"].append(a.size)
print(f"\nlive at the peak by site ({sum(map(sum, sites.values()))/G:.2f} GiB after the history began):")
for site, sizes in sorted(sites.items(), key=lambda kv: -sum(kv[1])):
    print(f"{sum(sizes)/M:9.1f} MiB  {len(sizes):4d} x  {site}")
