"""Where a recorded step's time went, from a trainer run's profiler trace (`--profile.steps A-B`, then
`python3 benchmarks/trace_summary.py OUT/profile/trace.json`): per thread the longest top-level host ranges, and each
GPU stream's busy time, over the last recorded step."""
import collections
import gzip
import json
import sys

ev = json.load(gzip.open(sys.argv[1]) if sys.argv[1].endswith(".gz") else open(sys.argv[1]))
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

# the compute stream's longest idle gaps inside the window, and what the rest of the process was doing meanwhile:
# the innermost host event running on each CPU thread at the gap's start and any copy in flight across it
kern = collections.defaultdict(list)
for e in inwin:
    if e.get("cat") == "kernel":
        kern[(e["pid"], e["tid"])].append(e)
if kern:
    stream = max(kern, key=lambda k: sum(e["dur"] for e in kern[k]))
    ks = sorted(kern[stream], key=lambda e: e["ts"])
    gaps, end = [], max(t0, ks[0]["ts"])
    for e in ks:
        if e["ts"] > end:
            gaps.append((e["ts"] - end, end, e))
        end = max(end, e["ts"] + e["dur"])
    idle = sum(g for g, _, _ in gaps) / 1e3
    print(f"\ncompute stream {stream}: idle {idle:.1f} ms in {len(gaps)} gaps; the longest:")
    for g, start, nxt in sorted(gaps, key=lambda x: -x[0])[:12]:
        print(f"  {g / 1e3:6.2f} ms at {(start - t0) / 1e3:7.1f} ms, then {nxt['name'][:50]}")
        for key, es in threads.items():
            if key[0] == "cpu_op":
                inner = [x for x in es if x["ts"] <= start < x["ts"] + x["dur"]]
                if inner:
                    x = min(inner, key=lambda x: x["dur"])
                    at, dur = (x["ts"] - t0) / 1e3, x["dur"] / 1e3
                    print(f"        cpu {key[2]}: {x['name'][:60]} ({at:.1f}+{dur:.1f} ms)")
            elif key[0] == "gpu_memcpy":
                over = [x for x in es if x["ts"] < start + g and x["ts"] + x["dur"] > start]
                if over:
                    print(f"        copies on {key[2]}: {len(over)} ({over[0]['name'][:30]}), "
                          f"{sum(x['dur'] for x in over) / 1e3:.1f} ms")
