"""Where a recorded step's time went, from a trainer run's profiler trace (`--profile.steps A-B`, then
`python3 benchmarks/trace_summary.py OUT/profile/trace.json`): per thread the longest top-level host ranges, and each
GPU stream's busy time, over the last recorded step."""
import collections
import json
import sys

ev = json.load(open(sys.argv[1]))
ev = ev["traceEvents"] if isinstance(ev, dict) else ev
ev = [e for e in ev if e.get("ph") == "X" and "dur" in e]
steps = sorted((e for e in ev if e["name"].startswith("ProfilerStep#") or e["name"].startswith("elbowroom step")),
               key=lambda e: e["ts"])
for s in steps:
    print("range", s["name"], s["cat"], round(s["dur"] / 1e3, 1), "ms")
host = [s for s in steps if s.get("cat") != "gpu_user_annotation"]
w = host[-1] if host else None
t0, t1 = (w["ts"], w["ts"] + w["dur"]) if w else (min(e["ts"] for e in ev), max(e["ts"] + e["dur"] for e in ev))
print(f"window {w['name'] if w else 'all'}: {(t1 - t0) / 1e3:.1f} ms")
inwin = [e for e in ev if e["ts"] < t1 and e["ts"] + e["dur"] > t0]
threads = collections.defaultdict(list)
for e in inwin:
    threads[(e.get("cat"), e["pid"], e["tid"])].append(e)
for key, es in sorted(threads.items(), key=lambda kv: -sum(e["dur"] for e in kv[1])):
    es.sort(key=lambda e: (e["ts"], -e["dur"]))
    top, end = [], -1
    for e in es:  # top-level only
        if e["ts"] >= end:
            top.append(e)
            end = e["ts"] + e["dur"]
    busy = sum(min(e["ts"] + e["dur"], t1) - max(e["ts"], t0) for e in top)
    print(f"\n{key}: busy {busy / 1e3:.1f} ms in {len(top)} top-level events")
    by = collections.Counter()
    first = {}
    for e in top:
        by[e["name"][:70]] += e["dur"]
        first.setdefault(e["name"][:70], (e["ts"] - t0) / 1e3)
    for name, d in by.most_common(8):
        print(f"   {d / 1e3:8.1f} ms  first at {first[name]:8.1f} ms  {name}")
    long = [e for e in es if e["dur"] > 20e3 and e["name"] not in ("ProfilerStep",)][:12]
    for e in long:
        print(f"      long: {e['name'][:60]} at {(e['ts'] - t0) / 1e3:.1f} ms for {e['dur'] / 1e3:.1f} ms")
