"""elbowroom's activation-memory modes for ``benchmarks/bench.py`` (and a copy/compute overlap trace).

    python benchmarks/bench.py --workload w1 --modes plain,torch_ckpt,torch_sac,save_on_cpu,\\
ours_offload_all,ours_offload_ckpt_inputs,ours_mix,ours_selective_offload
    python benchmarks/modes_activations.py --workload w1 --mode ours_offload_all --trace trace.json

Modes (each wraps the model's blocks in place; nothing is entered per step):
- ``ours_ckpt`` / ``ours_selective``: our per-block full / selective recompute (parity with torch's).
- ``ours_offload_all``: every block but the last offloads all it saves (the link-bound end). Knobs:
  ``ELBOWROOM_OFFLOAD_ALL="window_mib=384,inflight=1"`` (the defaults: prefetch window per block, regions in
  flight).
- ``ours_offload_everything``: ``ours_offload_all`` plus one outer region around the whole forward and
  loss (the harness's per-step context), so the last block, the LM head and the loss's saved logits go
  to host memory too, like ``save_on_cpu``; their copies back are exposed at the start of backward.
- ``ours_offload_ckpt_inputs``: per-block checkpoint, and the input each block saves goes to host.
- ``ours_mix``: per block, offload what the link hides, keep the last blocks whole, recompute (with
  offloaded inputs) the rest. Knobs: ``ELBOWROOM_MIX="offload=0,keep=6,ratio=0.4,inflight=3,sel=3,
  sel_ratio=1"`` (the defaults, sized for W1) (the first ``offload`` blocks offload ``ratio`` of their
  activations, the last ``keep`` blocks are kept whole, ``sel`` of the recomputed blocks are selective and
  offload ``sel_ratio`` of what they keep, ``inflight`` blocks' copies may run under later blocks' compute).
- ``ours_selective_offload``: selective recompute everywhere, with ``ratio`` of the kept matmul and
  attention outputs (largest first) and the inputs of ``blocks`` blocks offloaded. Knobs:
  ``ELBOWROOM_SEL_OFFLOAD="ratio=0.45,blocks=6,inflight=2,input=0,even=1,whole=2"`` (the defaults) (blocks=-1:
  all but the last; input=0 keeps the inputs on the device; even=1 spreads the offloading blocks over the
  model instead of taking the first ones; whole=K keeps the last K blocks whole, recomputing nothing).

Sizing the knobs (W1 on an H100): a block's forward takes ~5 ms and saves ~1.4 GB (selective keeps
~0.9 GB); the link moves ~55 GB/s one way, ~0.27 GB per block of forward. What a block offloads beyond
``inflight`` x that stalls the compute stream (by design: it bounds device memory), so offload a
fraction of many blocks rather than all of a few.

Environment variables are read here, in the benchmark script, and passed to the library as arguments.
After a run each mode reports the bytes its engine moved per optimizer step and its host pool size.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from common import Setup  # noqa: E402

from elbowroom.activations import (  # noqa: E402
    ActivationConfig,
    BlockPolicy,
    apply_activation_policy,
    apply_block_policies,
    get_offload_engine,
    linear_cross_entropy,
)


def _adamw(model: torch.nn.Module) -> torch.optim.Optimizer:
    return torch.optim.AdamW(model.parameters(), lr=1e-4, fused=torch.cuda.is_available())


def _knobs(var: str, defaults: dict[str, float]) -> dict[str, float]:
    """``KEY=VALUE,...`` from environment variable ``var`` over ``defaults``."""
    out = dict(defaults)
    for item in filter(None, os.environ.get(var, "").split(",")):
        key, _, value = item.partition("=")
        if key.strip() not in defaults:
            raise SystemExit(f"{var}: unknown knob {key!r}; known: {', '.join(defaults)}")
        out[key.strip()] = float(value)
    return out


def _setup(model: torch.nn.Module, args: Any, notes: dict[str, Any] | None = None) -> Setup:
    steps = max(1, getattr(args, "steps", 1))

    def stats() -> dict[str, Any]:
        eng = get_offload_engine(model)
        if eng is None:
            return {}
        s = eng.stats()
        return {
            "offload_GB_per_step": round(s.offloaded_bytes / steps / 1e9, 2),
            "reload_GB_per_step": round(s.reloaded_bytes / steps / 1e9, 2),
            "host_pool_GiB": round(s.host_pool_bytes / 2**30, 2),
            "host_allocations": s.host_allocations,
        }

    return Setup(_adamw(model), stats=stats, notes=notes or {})


def spread(k: int, n: int) -> list[int]:
    """``k`` indices spread evenly over ``range(n)`` (0 and ... n-1 where k allows)."""
    k = max(0, min(k, n))
    if k == 0:
        return []
    if k == 1:
        return [0]
    return sorted({round(i * (n - 1) / (k - 1)) for i in range(k)})


def mix_plan(
    n_blocks: int, *, offload: int = 8, keep: int = 2, ratio: float = 0.4, sel: int = 0, sel_ratio: float = 1.0
) -> list[BlockPolicy]:
    """The hand-chosen mix: the first ``offload`` blocks offload ``ratio`` of what they save (their tensors
    are needed last in backward, so they have the longest time to travel both ways), the last ``keep``
    blocks stay whole (needed first), the blocks between recompute with their inputs offloaded: ``sel`` of
    them (spread evenly) selectively, offloading ``sel_ratio`` of their kept matmul/attention outputs (the
    link has room in a recomputing forward: an input is ~1/10 of a block's activations), the rest fully.
    Counts are clamped to the model (small models in smoke runs)."""
    keep = max(1, min(keep, n_blocks - 1))
    offload = max(0, min(offload, n_blocks - keep))
    middle = list(range(offload, n_blocks - keep))
    selective = {middle[j] for j in spread(sel, len(middle))}
    plan = []
    for i in range(n_blocks):
        if i < offload:
            plan.append(BlockPolicy(offload_ratio=ratio))
        elif i >= n_blocks - keep:
            plan.append(BlockPolicy())
        elif i in selective:
            plan.append(BlockPolicy("selective", offload_ratio=sel_ratio, offload_input=True))
        else:
            plan.append(BlockPolicy("full", offload_input=True))
    return plan


def selective_offload_plan(
    n_blocks: int,
    *,
    ratio: float = 0.4,
    blocks: int = 16,
    offload_input: bool = True,
    even: bool = False,
    whole: int = 0,
) -> list[BlockPolicy]:
    """Selective recompute everywhere but the last ``whole`` blocks (kept whole: needed first in backward, they
    recompute nothing); ``blocks`` of the selective blocks (-1: all) offload ``ratio`` of their kept
    matmul/attention outputs (largest first) and, with ``offload_input``, their inputs. They are the first
    ones, or with ``even`` spread evenly over the selective blocks (so that each block's copies have the
    next blocks' compute to hide under: a selective forward is short)."""
    whole = max(1, min(whole, n_blocks)) if whole else 0
    n_sel = n_blocks - max(whole, 1)  # the last block never offloads (backward needs it first)
    k = n_sel if blocks < 0 else min(blocks, n_sel)
    chosen = set(spread(k, n_sel)) if even else set(range(k))
    plan = []
    for i in range(n_blocks):
        if i >= n_blocks - whole:
            plan.append(BlockPolicy())
        elif i in chosen:
            plan.append(BlockPolicy("selective", offload_ratio=ratio, offload_input=offload_input))
        else:
            plan.append(BlockPolicy("selective"))
    return plan


def setup_ours_ckpt(model: torch.nn.Module, args: Any) -> Setup:
    apply_activation_policy(model, checkpoint="full")
    return _setup(model, args)


def setup_ours_selective(model: torch.nn.Module, args: Any) -> Setup:
    apply_activation_policy(model, checkpoint="selective")
    return _setup(model, args)


def setup_ours_offload_all(model: torch.nn.Module, args: Any) -> Setup:
    # window_mib: how much of a block comes back ahead of its backward (the backward peak); inflight: blocks
    # whose copies may run under later compute (the forward peak)
    # default: W1 (H100) measured 2048 MiB -> 23.46 GiB peak, 640 -> 22.66, 384 -> 22.47 at the same speed;
    # 256 (below the largest saved tensor, 352 MiB) -> 21.94 GiB but ~2 points slower (one tensor in flight)
    k = _knobs("ELBOWROOM_OFFLOAD_ALL", {"window_mib": 384, "inflight": 1})
    apply_block_policies(model, ActivationConfig(offload_ratio=1.0).block_policies(len(model.blocks)),
                         max_inflight_regions=int(k["inflight"]), prefetch_window_bytes=int(k["window_mib"]) << 20)
    return _setup(model, args, notes={"offload_all": k})


def setup_ours_offload_everything(model: torch.nn.Module, args: Any) -> Setup:
    apply_activation_policy(model, offload_ratio=1.0)
    engine = get_offload_engine(model)
    setup = _setup(model, args)
    # the blocks' own regions are inner (innermost hooks win); this one catches everything else
    setup.context = lambda: engine.group("outside-blocks", ratio=1.0)
    return setup


def setup_ours_offload_ckpt_inputs(model: torch.nn.Module, args: Any) -> Setup:
    apply_activation_policy(model, checkpoint="full", offload_checkpoint_inputs=True)
    return _setup(model, args)


def setup_ours_mix(model: torch.nn.Module, args: Any) -> Setup:
    # defaults: the best measured on W1 (H100) with the fused loss: 83.0-85.4% of plain at 25.47 GiB (two calls)
    k = _knobs("ELBOWROOM_MIX", {"offload": 0, "keep": 6, "ratio": 0.4, "inflight": 3, "sel": 3, "sel_ratio": 1.0})
    plan = mix_plan(len(model.blocks), offload=int(k["offload"]), keep=int(k["keep"]), ratio=k["ratio"],
                    sel=int(k["sel"]), sel_ratio=k["sel_ratio"])
    apply_block_policies(model, plan, max_inflight_regions=int(k["inflight"]))
    return _setup(model, args, notes={"mix": k})


def setup_ours_selective_offload(model: torch.nn.Module, args: Any) -> Setup:
    # defaults: the last 2 blocks whole, the w13 output (ratio 0.45 of what a block keeps) of 6 blocks spread
    # evenly, inputs kept: ~2.3 GB on the link. W1 (H100, fused loss): 90.3-93.3% of plain at 34.96 GiB (two
    # calls; selective alone 91.7-93.5% at 35.45). 16 blocks (~6 GB) fell to 86% once the forward got faster
    k = _knobs("ELBOWROOM_SEL_OFFLOAD",
               {"ratio": 0.45, "blocks": 6, "inflight": 2, "input": 0, "even": 1, "whole": 2})
    plan = selective_offload_plan(len(model.blocks), ratio=k["ratio"], blocks=int(k["blocks"]),
                                  offload_input=bool(k["input"]), even=bool(k["even"]), whole=int(k["whole"]))
    apply_block_policies(model, plan, max_inflight_regions=int(k["inflight"]))
    return _setup(model, args, notes={"selective_offload": k})


MODES: dict[str, Callable[..., Setup]] = {
    "ours_ckpt": setup_ours_ckpt,
    "ours_selective": setup_ours_selective,
    "ours_offload_all": setup_ours_offload_all,
    "ours_offload_everything": setup_ours_offload_everything,
    "ours_offload_ckpt_inputs": setup_ours_offload_ckpt_inputs,
    "ours_mix": setup_ours_mix,
    "ours_selective_offload": setup_ours_selective_offload,
}


# ---------------------------------------------------------------- copy/compute overlap from a trace
def _union(intervals: list[tuple[float, float]]) -> list[tuple[float, float]]:
    out: list[tuple[float, float]] = []
    for s, e in sorted(intervals):
        if out and s <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], e))
        else:
            out.append((s, e))
    return out


def _length(intervals: list[tuple[float, float]]) -> float:
    return sum(e - s for s, e in intervals)


def _intersection(a: list[tuple[float, float]], b: list[tuple[float, float]]) -> float:
    i = j = 0
    total = 0.0
    while i < len(a) and j < len(b):
        s, e = max(a[i][0], b[j][0]), min(a[i][1], b[j][1])
        if s < e:
            total += e - s
        if a[i][1] < b[j][1]:
            i += 1
        else:
            j += 1
    return total


def overlap_report(events: list[Any], d2h_bytes: int, h2d_bytes: int) -> dict[str, float]:
    """From profiler device events: busy time of copies each way, how much of it overlaps compute
    kernels, and the bandwidth achieved while copying (bytes / busy time)."""
    d2h, h2d, compute = [], [], []
    for ev in events:
        tr = ev.time_range
        iv = (tr.start, tr.end)
        name = ev.name
        if "Memcpy DtoH" in name:
            d2h.append(iv)
        elif "Memcpy HtoD" in name:
            h2d.append(iv)
        elif "Memcpy" not in name and "Memset" not in name:
            compute.append(iv)
    d2h, h2d, compute = _union(d2h), _union(h2d), _union(compute)
    out = {}
    for name, ivs, nbytes in (("d2h", d2h, d2h_bytes), ("h2d", h2d, h2d_bytes)):
        busy = _length(ivs)
        out[f"{name}_busy_ms"] = round(busy / 1e3, 2)
        out[f"{name}_overlap_with_compute"] = round(_intersection(ivs, compute) / busy, 3) if busy else 0.0
        out[f"{name}_GBps_while_busy"] = round(nbytes / (busy / 1e6) / 1e9, 1) if busy else 0.0
    out["both_directions_at_once_ms"] = round(_intersection(d2h, h2d) / 1e3, 2)
    out["compute_busy_ms"] = round(_length(compute) / 1e3, 2)
    return out


def _loss(model: torch.nn.Module, idx: torch.Tensor, fused_loss: bool) -> torch.Tensor:
    """The harness's loss on ``idx`` as its own targets: plain head + cross-entropy, or the fused one."""
    import torch.nn.functional as F

    if fused_loss:
        return linear_cross_entropy(model.hidden_states(idx), model.output.weight, idx)
    logits = model(idx)
    return F.cross_entropy(logits.float().view(-1, logits.size(-1)), idx.view(-1))


def trace(workload: str, mode: str, steps: int, path: str | None, fused_loss: bool = False) -> dict[str, float]:
    """Run ``steps`` warm steps of ``mode`` under the profiler; write a Chrome trace; report overlap."""
    import bench  # the harness beside this file: its workloads and model config
    from torch.profiler import ProfilerActivity, profile

    from elbowroom.models import build_model

    preset, bsz, seq, accum = bench.WORKLOADS[workload]
    cfg = bench.model_config(preset, seq)
    model = build_model(cfg, device="cuda")
    setup = MODES[mode](model, argparse.Namespace(steps=steps))
    idx = torch.randint(0, cfg.vocab_size, (bsz, seq), device="cuda")

    def one_step() -> None:
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = _loss(model, idx, fused_loss)
        loss.backward()
        setup.optimizer.step()
        setup.optimizer.zero_grad(set_to_none=True)

    for _ in range(2):  # the first step grows the pinned pool
        one_step()
    torch.cuda.synchronize()
    eng = get_offload_engine(model)
    before = eng.stats() if eng else None
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            one_step()
        torch.cuda.synchronize()
    if path:
        prof.export_chrome_trace(path)
    after = eng.stats() if eng else None
    d2h = after.offloaded_bytes - before.offloaded_bytes if eng else 0
    h2d = after.reloaded_bytes - before.reloaded_bytes if eng else 0
    device_events = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    report = overlap_report(device_events, d2h, h2d)
    report.update(mode=mode, workload=workload, steps=steps, d2h_GB=round(d2h / 1e9, 2), h2d_GB=round(h2d / 1e9, 2))
    return report


def _live_by_origin(snapshot: dict[str, Any], top: int = 14) -> list[tuple[float, int, str]]:
    """Live device allocations of a memory snapshot grouped by where they were allocated: the innermost
    frames in our code or the model's (torch internals skipped), largest groups first (GiB, count, where)."""
    groups: dict[str, list[float]] = {}
    for seg in snapshot.get("segments", []):
        for blk in seg.get("blocks", []):
            if blk.get("state") != "active_allocated":
                continue
            py = [f for f in blk.get("frames", []) if f.get("filename", "").endswith(".py")]
            frames = [f for f in py if "/torch/" not in f["filename"]] or py
            where = " < ".join(f"{Path(f['filename']).name}:{f['line']}:{f['name']}" for f in frames[:3]) or "?"
            g = groups.setdefault(where, [0.0, 0])
            g[0] += blk.get("requested_size", blk["size"]) / 2**30
            g[1] += 1
    return sorted(((round(v[0], 3), int(v[1]), k) for k, v in groups.items()), reverse=True)[:top]


def memline(workload: str, mode: str, snapshot_at: str | None = None, fused_loss: bool = False) -> dict[str, Any]:
    """Where one warm step of ``mode`` reaches its peak: device memory at each block's forward end and
    backward start (a hook on the block's output gradient), with the peak of the stretch before it.
    Reads the allocator's host-side counters only: no sync, nothing changes in the step. With
    ``snapshot_at`` (a mark such as ``loss`` or ``f12``), also lists the live allocations at that mark of
    the last step by where they were made (the allocator's history, recorded over all steps)."""
    import bench
    import torch.nn.functional as F

    from elbowroom.models import build_model

    preset, bsz, seq, _ = bench.WORKLOADS[workload]
    cfg = bench.model_config(preset, seq)
    model = build_model(cfg, device="cuda")
    setup = MODES[mode](model, argparse.Namespace(steps=1)) if mode in MODES else bench.MODES[mode](model, None)
    idx = torch.randint(0, cfg.vocab_size, (bsz, seq), device="cuda")
    marks: list[tuple[str, float, float]] = []
    live: list[Any] = []
    last = [False]
    if snapshot_at:
        torch.cuda.memory._record_memory_history(max_entries=200_000)

    def mark(name: str) -> None:
        marks.append((name, torch.cuda.memory_allocated() / 2**30, torch.cuda.max_memory_allocated() / 2**30))
        torch.cuda.reset_peak_memory_stats()
        if snapshot_at == name and last[0]:
            live.extend(_live_by_origin(torch.cuda.memory._snapshot()))

    def fwd_hook(i: int):
        def hook(mod: Any, inp: Any, out: torch.Tensor) -> None:
            if torch.is_grad_enabled() and torch._C._current_graph_task_id() == -1:
                mark(f"f{i}")
                if out.requires_grad:
                    out.register_hook(lambda g: mark(f"b{i}"))
        return hook

    handles = [blk.register_forward_hook(fwd_hook(i)) for i, blk in enumerate(model.blocks)]
    for it in range(3):  # the last one is reported: the first grows the pinned pool
        last[0] = it == 2
        marks.clear()
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        with torch.autocast("cuda", dtype=torch.bfloat16), setup.context():
            if fused_loss:
                loss = linear_cross_entropy(model.hidden_states(idx), model.output.weight, idx)
            else:
                logits = model(idx)
                mark("logits")
                loss = F.cross_entropy(logits.float().view(-1, logits.size(-1)), idx.view(-1))
                del logits
            mark("loss")
        loss.backward()
        mark("backward_end")
        setup.optimizer.step()
        setup.optimizer.zero_grad(set_to_none=True)
        mark("opt_end")
    for h in handles:
        h.remove()
    if snapshot_at:
        torch.cuda.memory._record_memory_history(enabled=None)
    top = sorted(marks, key=lambda m: -m[2])[:6]
    out = {"mode": mode, "peak_before": [(n, round(p, 2)) for n, _, p in top],
           "line": " ".join(f"{n}:{a:.1f}/{p:.1f}" for n, a, p in marks)}
    if snapshot_at:
        out["live_at_" + snapshot_at] = live
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workload", default="w1")
    ap.add_argument("--mode", default="ours_offload_all", help=f"one of {', '.join(sorted(MODES))} (or a peer's)")
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--trace", default=None, help="write a Chrome trace here")
    ap.add_argument("--memline", action="store_true",
                    help="instead: device memory per block in forward and backward, and where the peak is")
    ap.add_argument("--snapshot-at", default=None,
                    help="with --memline: list live allocations by origin at this mark (e.g. loss, f12)")
    ap.add_argument("--fused-loss", action="store_true",
                    help="the head and loss chunk by chunk (linear_cross_entropy), as the harness's +fl modes")
    args = ap.parse_args()
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    import json

    if args.memline:
        print(json.dumps(memline(args.workload, args.mode, args.snapshot_at, args.fused_loss), indent=1))
        return
    print(json.dumps(trace(args.workload, args.mode, args.steps, args.trace, args.fused_loss)))


if __name__ == "__main__":
    main()
