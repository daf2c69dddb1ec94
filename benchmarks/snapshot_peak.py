"""The largest allocations live at the peak of a recorded CUDA memory snapshot (a trainer run's
`--profile.steps`): `python3 benchmarks/snapshot_peak.py RUN/profile/memory_snapshot.pickle`."""
import sys
from pathlib import Path

from elbowroom.report.snapshot import load_snapshot, peak_allocations

p = peak_allocations(load_snapshot(Path(sys.argv[1])), top=14, frames=7)
G = 2**30
print(f"peak {p.peak_bytes/G:.2f} GiB, before history {p.before_history_bytes/G:.2f}, live {p.live_count}")
for a in p.top:
    print(f"{a.size/2**20:9.1f} MiB")
    for f in a.frames:
        print("      ", f)
