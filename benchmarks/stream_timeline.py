"""Each GPU stream's busy spans over the recorded steps of a trace (the bench's ``ELBOWROOM_BENCH_TRACE_OVERLAP``,
or a trainer's ``--profile.steps``): where the copies and kernels of each stream ran, and the host's long waits.

    python3 benchmarks/stream_timeline.py TRACE.json[.gz] [--gap-ms 2]

Times are in ms from the first "elbowroom step" range; spans closer than ``--gap-ms`` are merged, and each span says
how many events and, for copies, how many GB it moved.
"""
import argparse
import collections
import gzip
import json

ap = argparse.ArgumentParser()
ap.add_argument("trace")
ap.add_argument("--gap-ms", type=float, default=2.0)
a = ap.parse_args()
ev = json.load(gzip.open(a.trace) if a.trace.endswith(".gz") else open(a.trace))
ev = ev["traceEvents"] if isinstance(ev, dict) else ev
ev = [e for e in ev if e.get("ph") == "X" and "dur" in e]
steps = sorted((e for e in ev if e["name"].startswith("elbowroom step") and e.get("cat") == "user_annotation"),
               key=lambda e: e["ts"])
t0 = steps[0]["ts"] if steps else min(e["ts"] for e in ev)
for s in steps:
    print(f"{s['name']}: {(s['ts'] - t0) / 1e3:8.1f} -> {(s['ts'] + s['dur'] - t0) / 1e3:8.1f} ms")
by = collections.defaultdict(list)
for e in ev:
    if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset"):
        by[(e["cat"] if e["cat"] != "gpu_memset" else "kernel", e["tid"])].append(e)
for (cat, tid), es in sorted(by.items(), key=lambda kv: (kv[0][1], kv[0][0])):
    es.sort(key=lambda e: e["ts"])
    spans = []
    for e in es:
        nbytes = int((e.get("args") or {}).get("bytes", 0))
        kind = e["name"].split(" (")[0][:24] if cat == "gpu_memcpy" else "kernels"
        if spans and e["ts"] - spans[-1]["end"] <= a.gap_ms * 1e3 and spans[-1]["kind"] == kind:
            sp = spans[-1]
            sp["end"] = max(sp["end"], e["ts"] + e["dur"])
            sp["busy"] += e["dur"]
            sp["n"] += 1
            sp["bytes"] += nbytes
        else:
            spans.append({"start": e["ts"], "end": e["ts"] + e["dur"], "busy": e["dur"], "n": 1, "bytes": nbytes,
                          "kind": kind})
    print(f"\nstream {tid} ({cat}): {sum(s['busy'] for s in spans) / 1e3:.1f} ms busy")
    for sp in spans:
        if sp["end"] - sp["start"] < 1e3 and len(spans) > 40:
            continue  # (short spans of a busy stream)
        rate = sp["bytes"] / max(sp["busy"], 1) / 1e3
        gb = f", {sp['bytes'] / 1e9:.2f} GB ({rate:.0f} GB/s busy)" if sp["bytes"] else ""
        print(f"   {(sp['start'] - t0) / 1e3:8.1f} -> {(sp['end'] - t0) / 1e3:8.1f} ms  {sp['kind']}: "
              f"{sp['n']} events, {sp['busy'] / 1e3:.1f} ms busy{gb}")
# the host's long waits (synchronizations and blocking calls over 5 ms)
waits = [e for e in ev if e.get("cat") in ("cuda_runtime", "cpu_op", "python_function") and e["dur"] > 5e3
         and any(k in e["name"] for k in ("Synchronize", "synchronize", "wait", "Wait"))]
print("\nhost waits over 5 ms:")
for e in sorted(waits, key=lambda e: e["ts"])[:40]:
    print(f"   {(e['ts'] - t0) / 1e3:8.1f} ms for {e['dur'] / 1e3:6.1f} ms  tid {e['tid']}  {e['name'][:60]}")
