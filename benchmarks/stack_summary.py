"""Which Python code ran inside the autograd thread's ops of a recorded step (a trace taken with Python stacks:
``benchmarks/trainer_variant.py --stack``): for the named autograd nodes, the Python functions nested in them,
by self time.

    python3 benchmarks/stack_summary.py RUN/profile/trace.json [AddBackward0 AccumulateGrad ...]
"""
import collections
import gzip
import json
import sys

ev = json.load(gzip.open(sys.argv[1]) if sys.argv[1].endswith(".gz") else open(sys.argv[1]))
ev = ev["traceEvents"] if isinstance(ev, dict) else ev
ev = [e for e in ev if e.get("ph") == "X" and "dur" in e]
names = sys.argv[2:] or ["AddBackward0", "AccumulateGrad", "MmBackward0"]
steps = sorted((e for e in ev if e["name"].startswith("elbowroom step") and e.get("cat") == "user_annotation"),
               key=lambda e: e["ts"])
w = steps[-1] if steps else None
t0, t1 = (w["ts"], w["ts"] + w["dur"]) if w else (-1e30, 1e30)
ev = [e for e in ev if e["ts"] < t1 and e["ts"] + e["dur"] > t0]
by_thread = collections.defaultdict(list)
for e in ev:
    by_thread[e["tid"]].append(e)
for name in names:
    outer = [e for e in ev if e.get("cat") == "cpu_op" and e["name"].startswith("autograd::engine::evaluate_function")
             and e["name"].endswith(name)]
    if not outer:
        continue
    total = sum(e["dur"] for e in outer)
    print(f"\n{name}: {len(outer)} calls, {total / 1e3:.1f} ms")
    self_t = collections.Counter()
    ops = collections.Counter()
    for o in outer:
        inner = [e for e in by_thread[o["tid"]] if e is not o and e["ts"] >= o["ts"]
                 and e["ts"] + e["dur"] <= o["ts"] + o["dur"]]
        inner.sort(key=lambda e: (e["ts"], -e["dur"]))
        # self time of each nested event: its duration less its direct children's
        stack: list[dict] = []
        child = collections.defaultdict(float)
        for e in inner:
            while stack and stack[-1]["ts"] + stack[-1]["dur"] <= e["ts"]:
                stack.pop()
            if stack:
                child[id(stack[-1])] += e["dur"]
            stack.append(e)
        for e in inner:
            s = e["dur"] - child[id(e)]
            if e.get("cat") == "python_function":
                self_t[e["name"][:90]] += s
            else:
                ops[e["name"][:90]] += s
    for n, d in self_t.most_common(15):
        print(f"   py  {d / 1e3:8.1f} ms  {n}")
    for n, d in ops.most_common(8):
        print(f"   op  {d / 1e3:8.1f} ms  {n}")
