"""Where a policy's step time goes, beside what the planner's profile measured for it (diagnosis, one workload).

    python3 benchmarks/block_times.py --workload gpt2-xl --options selective,full,keep:0.25

For each option (the names of ``bench.py``'s ``uniform@`` rows) every block runs under it, and the script prints
per step: the wall time (synchronised), the GPU's forward and backward (CUDA events), the host's time to enqueue
them (no sync inside), the kernel time (any stream) and the copies' bytes, time and rate each way (one recorded
step); before them the profile's own totals per mode (forward and backward, CUDA events per block). A step
whose host time nears its wall time is bound by the host, which CUDA events per block do not see.
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from modes_plan import _option  # noqa: E402

from elbowroom.activations import BlockPolicy, apply_block_policies, remove_activation_policy  # noqa: E402
from elbowroom.models import build_model  # noqa: E402
from elbowroom.models.decoder import PRESETS  # noqa: E402
from elbowroom.models.workloads import WORKLOADS  # noqa: E402


def _gpu_split(step: Any, sync: Any) -> str:
    """One recorded step: kernel time, and the bytes, time and rate of the copies each way (kineto's trace)."""
    import json
    import tempfile

    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        step()
        sync()
    with tempfile.NamedTemporaryFile(suffix=".json") as f:
        prof.export_chrome_trace(f.name)
        events = json.load(open(f.name))["traceEvents"]
    kern, copies = [], {"DtoH": [0, 0.0], "HtoD": [0, 0.0]}
    for e in events:
        if e.get("ph") != "X":
            continue
        if e.get("cat") == "kernel":
            kern.append((e["ts"], e["ts"] + e["dur"]))
        elif e.get("cat") == "gpu_memcpy":
            for k in copies:
                if k in e["name"]:
                    copies[k][0] += int(e.get("args", {}).get("bytes", 0))
                    copies[k][1] += e["dur"]
    kern.sort()
    tot, end = 0.0, -1.0
    for s, e in kern:  # union of kernel intervals, any stream
        if e > end:
            tot += e - max(s, end)
            end = e
    out = f"kernels {tot / 1e3:6.1f} ms"
    for k, (b, d) in copies.items():
        if b:
            out += f"  {k} {b / 2**30:5.2f} GiB in {d / 1e3:6.1f} ms ({b / d / 1e3 if d else 0:4.1f} GB/s)"
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workload", default="gpt2-xl", choices=sorted(WORKLOADS))
    ap.add_argument("--options", default="keep,selective,full,keep:0.25")
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--bf16", action="store_true", help="the whole model in bf16, no autocast (the planner's bf16 "
                    "layout), instead of fp32 weights under bf16 autocast")
    args = ap.parse_args()
    w = WORKLOADS[args.workload]
    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    torch.manual_seed(0)
    from dataclasses import replace
    cfg = replace(PRESETS[w.preset], max_seq_len=w.seq_len) if hasattr(PRESETS[w.preset], "max_seq_len") \
        else PRESETS[w.preset]
    model = build_model(cfg, device=dev)
    if args.bf16:
        model.to(torch.bfloat16)
    idx = torch.randint(0, cfg.vocab_size, (w.batch_size, w.seq_len), device=dev)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5, fused=dev.type == "cuda")
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)

    # the profile's own per-mode totals (the runner the planner uses)
    from elbowroom.plan import profiler as P
    blocks, _ = P._resolve_blocks(model, None)
    runner = P._Runner(model, blocks, P._Step(model, idx, None), dev, None if args.bf16 else torch.bfloat16, dev.type)
    with runner.preserved():
        t = runner.time_modes(1, 3)
    for mode, v in t.items():
        print(f"profile {mode or 'plain':10s} fwd {v['total_fwd'] * 1e3:7.1f} ms  bwd {v['total_bwd'] * 1e3:7.1f} ms  "
              f"blocks fwd {sum(v['fwd']) * 1e3:7.1f} bwd {sum(v['bwd']) * 1e3:7.1f}")

    cuda = dev.type == "cuda"
    marks = [torch.cuda.Event(enable_timing=True) for _ in range(3)] if cuda else []

    def step() -> tuple[float, float]:
        if cuda:
            marks[0].record()
        h0 = time.perf_counter()
        with torch.autocast(dev.type, dtype=torch.bfloat16, enabled=not args.bf16):
            logits = model(idx)[:, :-1]
            loss = F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), idx[:, 1:].reshape(-1))
        h1 = time.perf_counter()
        if cuda:
            marks[1].record()
        loss.backward()
        h2 = time.perf_counter()
        if cuda:
            marks[2].record()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return h1 - h0, h2 - h1

    for text in args.options.split(","):
        o = _option(text)
        pol = BlockPolicy(checkpoint=o.checkpoint, offload_ratio=o.offload_ratio, offload_input=o.offload_input)
        if text != "keep":
            apply_block_policies(model, [pol] * len(blocks))
        walls, hf, hb, gf, gb = [], [], [], [], []
        for i in range(2 + args.steps):
            sync()
            t0 = time.perf_counter()
            f, b = step()
            sync()
            if i >= 2:
                walls.append(time.perf_counter() - t0)
                hf.append(f)
                hb.append(b)
                if cuda:
                    gf.append(marks[0].elapsed_time(marks[1]))
                    gb.append(marks[1].elapsed_time(marks[2]))
        busy = ""
        if dev.type == "cuda":
            busy = "  " + _gpu_split(step, sync)
        med = sorted(walls)[len(walls) // 2]
        gpu = f"  GPU fwd {sorted(gf)[len(gf) // 2]:6.1f} bwd {sorted(gb)[len(gb) // 2]:6.1f}" if cuda else ""
        host = f"  host fwd {min(hf) * 1e3:7.1f} bwd {min(hb) * 1e3:7.1f} ms"
        print(f"{text:16s} wall {med * 1e3:7.1f} ms{gpu}{host}{busy}", flush=True)
        remove_activation_policy(model)


if __name__ == "__main__":
    main()
