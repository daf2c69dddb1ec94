"""Side-by-side training benchmarks on one GPU: a named workload in named modes, one table row per mode.

    python benchmarks/bench.py --workload w1 --modes plain,torch_ckpt,torch_sac,save_on_cpu
    python benchmarks/bench.py --workload w1 --modes minimal,trainer      # trainer overhead

Every mode trains the same Llama-shaped reference model (elbowroom.models) on the same random tokens
in bf16 autocast with fp32 parameters and fused AdamW, unless the mode replaces a piece. The timed steps run back to
back, as in a training loop (no device sync between them; the clock stops once the optimizer's last updates have
landed), after synced warm-up steps. Each row gives their mean step time, tokens/s, model TFLOP/s (6·N_matmul + causal
attention, as in DESIGN.md), MFU against the device's dense bf16 peak, peak GiB allocated, and tokens/s as a
percentage of the first mode of the run (put `plain` first).

Any mode + ``+fl``: the output head and cross-entropy computed chunk by chunk
(``elbowroom.activations.linear_cross_entropy``: the logits never exist whole), e.g. ``torch_ckpt+fl``.

``ELBOWROOM_BENCH_EVENTS=1`` adds ``gpu_ms`` to each row: the GPU time of every micro-batch of the last step
and of its ``step()`` + ``zero_grad()``, from CUDA events between them. ``ELBOWROOM_BENCH_SEGMENTS=1`` adds
``segments_by_stream``: the allocator's reserved and allocated GiB by the stream that owns them, after the last
step. ``ELBOWROOM_BENCH_MEMORY=DIR`` writes what was alive at the peak of the steps, by where it was allocated, and
the reserved memory's peak and retries by stream, to ``DIR/<workload>-<mode>.txt`` (``memory_peak.py``).
``ELBOWROOM_BENCH_SWITCH_INTERVAL=SECONDS`` sets the interpreter's
GIL switch interval (``sys.setswitchinterval``; 5 ms by default) for every row; ``ELBOWROOM_BENCH_GIL_PROBE=1`` adds
``gil_wait``: how late a thread sleeping 0.1 ms at a time woke over the timed steps (the wait for the interpreter's
lock). ``ELBOWROOM_BENCH_TRACE=DIR`` traces one more step, synced, after the timed ones;
``ELBOWROOM_BENCH_TRACE_OVERLAP=DIR`` traces the last two timed steps as they run (``trace_summary.py``,
``stream_timeline.py``).

Modes come from registries: the peers' and the trainer's below, ours from ``modes_activations.py`` and
``modes_optim.py`` beside this file, DeepSpeed ZeRO-Offload from ``modes_deepspeed.py``. A mode is a function
``setup(model, args) -> Setup``.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import importlib
import importlib.util
import json
import os
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))

from common import Setup  # noqa: E402

from elbowroom.models import ModelConfig, build_model, count_params, flops_per_token  # noqa: E402
from elbowroom.models.workloads import WORKLOADS as _WORKLOADS  # noqa: E402
from elbowroom.ops.linear_cross_entropy import linear_cross_entropy  # noqa: E402
from elbowroom.train.metrics import peak_flops  # noqa: E402

FUSED_LOSS = "+fl"
# the workloads of DESIGN.md, defined once in elbowroom.models.workloads
WORKLOADS = {
    name: (w.preset, w.batch_size, w.seq_len, w.gradient_accumulation_steps) for name, w in _WORKLOADS.items()
}


def fused_adamw(model: torch.nn.Module) -> torch.optim.Optimizer:
    return torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)


# ---------------------------------------------------------------- peer modes
def setup_plain(model, args) -> Setup:
    return Setup(fused_adamw(model))


def setup_plain_compiled(model, args) -> Setup:
    """plain with its blocks compiled in place (``elbowroom.compile_blocks``, as ``+compile`` rows and
    ``--train.compile`` do): the reference a compiled plan should also be read against."""
    from elbowroom import compile_blocks

    compile_blocks(model)
    return Setup(fused_adamw(model))


def setup_plain_compiled_rpw(model, args) -> Setup:
    """plain with its blocks compiled as planned runs compile them (``compile_blocks(recompute_pointwise=True)``):
    beside ``plain_compiled``, what the option costs or gains where memory does not bind (it is the planned
    default, not ``compile_blocks``' own)."""
    from elbowroom import compile_blocks

    compile_blocks(model, recompute_pointwise=True)
    return Setup(fused_adamw(model))


def _wrap_blocks(model, fn) -> None:
    """Replace each block's forward by ``fn(original_forward, x)`` (state_dict keys unchanged)."""
    for blk in model.blocks:
        orig = blk.forward
        blk.forward = lambda x, _orig=orig: fn(_orig, x)


def setup_torch_ckpt(model, args) -> Setup:
    from torch.utils.checkpoint import checkpoint

    _wrap_blocks(model, lambda f, x: checkpoint(f, x, use_reentrant=False))
    return Setup(fused_adamw(model))


def torch_sac_context():
    """torchtitan-style selective op AC: keep matmul and attention outputs, recompute the rest."""
    from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

    aten = torch.ops.aten
    keep = {aten.mm.default, aten.addmm.default, aten.bmm.default}
    for name in (
        "_scaled_dot_product_flash_attention",
        "_scaled_dot_product_efficient_attention",
        "_scaled_dot_product_cudnn_attention",
    ):
        if hasattr(aten, name):
            keep.add(getattr(aten, name).default)

    def policy(ctx, op, *a, **k):
        return CheckpointPolicy.MUST_SAVE if op in keep else CheckpointPolicy.PREFER_RECOMPUTE

    return create_selective_checkpoint_contexts(policy)


def setup_torch_sac(model, args) -> Setup:
    from torch.utils.checkpoint import checkpoint

    _wrap_blocks(model, lambda f, x: checkpoint(f, x, use_reentrant=False, context_fn=torch_sac_context))
    return Setup(fused_adamw(model))


def setup_save_on_cpu(model, args) -> Setup:
    return Setup(fused_adamw(model), context=lambda: torch.autograd.graph.save_on_cpu(pin_memory=True))


def _peers_module():
    """The peers' measurement script (copied to .peers/ from the shared bench folder), for its loaders."""
    path = HERE.parent / ".peers" / "anchors.py"
    if not path.exists():
        raise RuntimeError(f"{path} missing: copy the shared bench folder to .peers/ to run peer offload modes")
    spec = importlib.util.spec_from_file_location("peers_anchors", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def setup_tt_offload(model, args) -> Setup:
    mgr = _peers_module().load_torchtune_offload()(use_streams=True)
    return Setup(fused_adamw(model), context=lambda: mgr)


def setup_tt_offload_ckpt(model, args) -> Setup:
    s = setup_tt_offload(model, args)
    setup_torch_ckpt(model, args)
    return s


def setup_torchao_optim(model, args) -> Setup:
    from torchao.optim import CPUOffloadOptimizer

    return Setup(CPUOffloadOptimizer(model.parameters(), torch.optim.AdamW, lr=1e-4, fused=True))


def setup_torchao_optim_ckpt(model, args) -> Setup:
    setup_torch_ckpt(model, args)
    return setup_torchao_optim(model, args)


MODES: dict[str, Callable[..., Setup]] = {
    "plain": setup_plain,
    "plain_compiled": setup_plain_compiled,
    "plain_compiled_rpw": setup_plain_compiled_rpw,
    "torch_ckpt": setup_torch_ckpt,
    "torch_sac": setup_torch_sac,
    "save_on_cpu": setup_save_on_cpu,
    "tt_offload": setup_tt_offload,
    "tt_offload+ckpt": setup_tt_offload_ckpt,
    "torchao_optim": setup_torchao_optim,
    "torchao_optim+ckpt": setup_torchao_optim_ckpt,
}
for _extra in ("modes_activations", "modes_optim", "modes_deepspeed", "modes_fsdp"):
    try:
        MODES.update(importlib.import_module(_extra).MODES)
    except ImportError:
        pass


def split_fused(name: str) -> tuple[str, bool]:
    """(the mode without its ``+fl`` flag, whether it has one): ``+fl`` may stand anywhere after the first part
    (``fit_bf16@16GiB+fl+cap`` reads as ``fit_bf16@16GiB+cap`` with the fused loss)."""
    head, *flags = name.split("+")
    return "+".join([head] + [f for f in flags if f != FUSED_LOSS[1:]]), FUSED_LOSS[1:] in flags


def mode_setup(name: str) -> Callable[..., Setup] | None:
    """The setup of a mode (without its ``+fl`` flag): a registered name, or the planner's ``fit@24GiB``,
    ``fit_bf16@16GiB`` and ``plan@FILE``."""
    base = split_fused(name)[0]
    if base in MODES:
        return MODES[base]
    from modes_plan import resolve

    return resolve(base)


# ---------------------------------------------------------------- one timed run
def _fresh_memory() -> None:
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()


def model_config(preset: str, seq: int) -> ModelConfig:
    return ModelConfig.from_preset(preset, max_seq_len=max(seq, ModelConfig.from_preset(preset).max_seq_len))


def _write_trace(tracer: Any, path: Path) -> None:
    """The profiler's Chrome trace, gzipped (a step of a large model is tens of MB as text)."""
    import gzip
    import tempfile

    path.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        raw = Path(tmp) / "trace.json"
        tracer.export_chrome_trace(str(raw))
        with open(raw, "rb") as src, gzip.open(path, "wb") as dst:
            dst.write(src.read())


def run_mode(name: str, workload: str, args) -> dict[str, Any]:
    """Train ``args.steps`` steps of ``workload`` in mode ``name``; time each step with a sync around it."""
    preset, bsz, seq, accum = WORKLOADS[workload]
    accum = args.accum or accum
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    _fresh_memory()
    torch.manual_seed(0)
    cfg = model_config(preset, seq)
    model = build_model(cfg, device=device)
    idx = torch.randint(0, cfg.vocab_size, (bsz, seq), device=device)
    tgt = torch.randint(0, cfg.vocab_size, (bsz, seq), device=device)
    args.sample, args.fused_loss = (idx, tgt), split_fused(name)[1]  # what a planner mode profiles with
    args.step_accum = accum  # micro-batches of the workload's step (a planner mode plans for the whole step)
    setup = mode_setup(name)(model, args)
    _RUNNING.update(setup=setup, step=None)  # what an out-of-memory row reports
    if device.type == "cuda":
        # the peak of the training steps, not of the set-up (a planner mode profiles the model first)
        gc.collect()
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        _record_memory(workload, name)
    # the head and loss chunk by chunk (linear_cross_entropy): the suffix asks, a plan decides for itself
    fused_loss = setup.fused_loss if setup.fused_loss is not None else split_fused(name)[1]
    amp = torch.autocast(device.type, dtype=torch.bfloat16)
    # a plan may split the batch into micro-batches that accumulate: the same samples per step
    mb = setup.micro_batch or bsz
    step_idx, step_tgt = torch.cat([idx] * accum), torch.cat([tgt] * accum)  # the step's samples, in order
    micro = [(step_idx[i:i + mb], step_tgt[i:i + mb]) for i in range(0, bsz * accum, mb)]
    # a mode that names its micro-batch leaves accumulation to this loop: mean loss, all but the last marked
    split = setup.micro_batch is not None and len(micro) > 1
    times, losses = [], []
    # ELBOWROOM_BENCH_EVENTS=1: CUDA events between micro-batches: the GPU time of each in the last step
    # (the first one includes any wait of its forward for the optimizer), and of step() + zero_grad()
    events = bool(os.environ.get("ELBOWROOM_BENCH_EVENTS")) and device.type == "cuda"
    marks: list[Any] = []
    # ELBOWROOM_BENCH_TRACE=DIR: the last step under torch.profiler, written to DIR/<workload>-<mode>.json.gz (read it
    # with benchmarks/trace_summary.py); that step is left out of the timing
    trace_dir = os.environ.get("ELBOWROOM_BENCH_TRACE")
    probe = _GilProbe() if os.environ.get("ELBOWROOM_BENCH_GIL_PROBE") else None
    # ELBOWROOM_BENCH_TRACE_OVERLAP=DIR: the last two timed steps under torch.profiler, back to back as they run (each
    # in an "elbowroom step N" range), to DIR/<workload>-<mode>-overlap.json.gz; the profiler's cost is in their timing
    overlap_dir = os.environ.get("ELBOWROOM_BENCH_TRACE_OVERLAP") if device.type == "cuda" else None
    overlap = None
    for step in range(args.steps + (1 if trace_dir else 0)):
        if probe is not None and step == args.warmup:
            probe.start()
        if overlap_dir and step == max(args.warmup, args.steps - 2) and overlap is None:
            overlap = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU,
                                                         torch.profiler.ProfilerActivity.CUDA])
            overlap.__enter__()
        overlap_range = (torch.profiler.record_function(f"elbowroom step {step}")
                         if overlap is not None and step < args.steps else None)
        if overlap_range is not None:
            overlap_range.__enter__()
        _RUNNING["step"] = step
        tracing = bool(trace_dir) and step == args.steps
        if tracing:
            tracer = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]
                                            + ([torch.profiler.ProfilerActivity.CUDA] if device.type == "cuda" else []))
            tracer.__enter__()
            step_range = torch.profiler.record_function("elbowroom step")
        # the timed steps run back to back as in a training loop: no device sync between them, so that a lazy
        # optimizer's copies and streamed states overlap the next step as they do in the trainer (until the eleventh
        # session every step ran between two syncs and its window started after the first: work the optimizer's
        # threads enqueued after a step's closing sync was timed nowhere, and the 7B shape's streaming plans ran at
        # 0.42 s a step here against 0.75 s in the trainer); warm-up steps and the traced step stay synced
        synced = step <= args.warmup or tracing
        if tracing:  # the timed steps end here, once the optimizer's last updates have landed on the device
            t_end = _drain(setup.optimizer)
        t0 = time.perf_counter()
        if synced:
            _sync()
        if step == args.warmup:
            t_timed = time.perf_counter()
        if tracing:
            step_range.__enter__()
        if events:
            marks = [torch.cuda.Event(enable_timing=True)]
            marks[0].record()
        for j, (x, y) in enumerate(micro):
            with amp, setup.context():
                if fused_loss:
                    h = model.hidden_states(x)
                    if hasattr(setup.optimizer, "wait_for"):  # the head weight is read outside the head's forward
                        setup.optimizer.wait_for(model.output.weight)
                    loss = linear_cross_entropy(h, model.output.weight, y)
                else:
                    logits = model(x)
                    loss = F.cross_entropy(logits.float().view(-1, logits.size(-1)), y.view(-1))
            if split:
                loss = loss / len(micro)
            if setup.backward is not None:
                setup.backward(loss)
            elif split and hasattr(setup.optimizer, "accumulating"):
                with setup.optimizer.accumulating(j < len(micro) - 1):
                    loss.backward()
            else:
                loss.backward()
            if events:
                marks.append(torch.cuda.Event(enable_timing=True))
                marks[-1].record()
        setup.optimizer.step()
        setup.optimizer.zero_grad(set_to_none=True)
        if events:
            marks.append(torch.cuda.Event(enable_timing=True))
            marks[-1].record()
        if step < args.warmup or tracing:
            _sync()
        if tracing:
            step_range.__exit__(None, None, None)
            tracer.__exit__(None, None, None)
            _write_trace(tracer, Path(trace_dir) / f"{_file_stem(workload, name)}.json.gz")
            break
        losses.append(loss.item())
        if overlap_range is not None:
            overlap_range.__exit__(None, None, None)
        times.append(time.perf_counter() - t0)  # (timed steps: host time to the next step's start, no sync)
    if not trace_dir:
        t_end = _drain(setup.optimizer)
    if overlap is not None:
        overlap.__exit__(None, None, None)
        _write_trace(overlap, Path(overlap_dir) / f"{_file_stem(workload, name)}-overlap.json.gz")
    if probe is not None:
        probe.stop()
    timed = len(times) - args.warmup
    step_s = (t_end - t_timed) / timed if timed > 0 else min(times)
    row = _row(name, workload, cfg, bsz * seq * accum, seq, step_s, device)
    row.update(loss_first=round(losses[0], 4), loss_last=round(losses[-1], 4), accum=accum,
               step_times=[round(t, 4) for t in times])
    if timed > 1:
        # the loop's own pace: the median of the timed steps' host times, which leave out the drain of the last
        # step's host work that ``step_s`` carries once over the window (a plan bound by the host optimizer shows
        # the difference: W1 at 8 GiB on an H200, 0.48 against 0.54 s over 3 timed steps)
        row["loop_step_s"] = round(statistics.median(times[args.warmup:]), 4)
    if marks:
        row["gpu_ms"] = [round(a.elapsed_time(b), 1) for a, b in zip(marks, marks[1:])]
    if probe is not None:
        row["gil_wait"] = probe.summary(len(times) - args.warmup)
    if os.environ.get("ELBOWROOM_BENCH_SEGMENTS") and device.type == "cuda":
        row["segments_by_stream"] = _segments_by_stream()
    _write_memory()
    row["settings"] = settings(name, workload, args)
    if setup.notes:
        row["notes"] = setup.notes
    if setup.stats is not None:
        stats = setup.stats()
        mechanism = stats.pop("settings", None)  # a mode's own settings (e.g. its optimizer's config)
        row.update(stats)
        if mechanism is not None:
            row["settings"]["mechanism"] = mechanism
    if "pred_step_s" in row:  # a plan's prediction against this measurement
        row["step_vs_pred"] = round(row["step_s"] / row["pred_step_s"], 3)
        # the plan's peak includes the allocator's margin: it is a prediction of the reserved peak; without the
        # margin, of the allocated peak
        if row.get("reserved_peak_GiB"):
            row["peak_vs_pred"] = round(row["reserved_peak_GiB"] / row["pred_peak_GiB"], 3)
        if row.get("peak_GiB") and row.get("pred_alloc_GiB"):
            row["alloc_vs_pred"] = round(row["peak_GiB"] / row["pred_alloc_GiB"], 3)
    del model, setup
    return row


class _GilProbe:
    """``ELBOWROOM_BENCH_GIL_PROBE=1``: a thread that sleeps 0.1 ms at a time over the timed steps and notes how much
    later than asked it runs again: the wait for the interpreter's lock (and the CPU), which every Python thread of
    the process (the training thread's hooks, autograd's, the optimizer's copy and step threads) needs."""

    def __init__(self) -> None:
        import threading

        self.waits: list[float] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            t0 = time.perf_counter()
            time.sleep(1e-4)
            self.waits.append(time.perf_counter() - t0 - 1e-4)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()

    def summary(self, steps: int) -> dict[str, float]:
        w = sorted(self.waits) or [0.0]
        late = sum(x for x in w if x > 1e-3)
        return {"p50_ms": round(1e3 * w[len(w) // 2], 3), "p99_ms": round(1e3 * w[int(0.99 * (len(w) - 1))], 3),
                "max_ms": round(1e3 * w[-1], 2), "over_1ms_per_step_ms": round(1e3 * late / max(1, steps), 1)}


def _file_stem(workload: str, name: str) -> str:
    """A row's file name in a DIR the bench writes to: one file, whatever the mode names (``plan@results/x.toml``
    keeps only the plan file's own name)."""
    if "@" in name:
        head, _, rest = name.partition("@")
        target, plus, flags = rest.partition("+")
        name = f"{head}@{target.rsplit('/', 1)[-1]}{plus}{flags}"
    return f"{workload}-{name.replace('@', '-').replace('+', '-').replace('/', '_')}"


def _record_memory(workload: str, name: str) -> None:
    """``ELBOWROOM_BENCH_MEMORY=DIR``: record the CUDA allocator's history from here on (see ``memory_peak.py``)."""
    folder = os.environ.get("ELBOWROOM_BENCH_MEMORY")
    if not folder:
        return
    start = torch.cuda.memory._snapshot()["segments"]  # the allocator's state, for the reserved memory's replay
    _RUNNING["memory"] = (Path(folder) / f"{_file_stem(workload, name)}.txt", torch.cuda.memory_allocated(), start)
    torch.cuda.memory._record_memory_history(max_entries=4_000_000, stacks="python")


def _write_memory() -> None:
    """The report of what was alive at the peak since :func:`_record_memory` (nothing when it did not record)."""
    got = _RUNNING.pop("memory", None)
    if got is None:
        return
    import memory_peak

    path, baseline, start = got
    snapshot = torch.cuda.memory._snapshot()
    torch.cuda.memory._record_memory_history(enabled=None)
    path.parent.mkdir(parents=True, exist_ok=True)
    device = torch.cuda.current_device()
    path.write_text(memory_peak.summarize(snapshot, baseline, device)
                    + "\n" + memory_peak.summarize_reserved(snapshot, start, device))


def _segments_by_stream() -> dict[str, list[float]]:
    """After the last step: the caching allocator's segments by the stream whose pool holds them (GiB reserved,
    GiB allocated, segments). A side stream's cached blocks are not reused by the compute stream, so this tells
    where reserved-minus-allocated sits (``ELBOWROOM_BENCH_SEGMENTS=1``)."""
    out: dict[str, list[float]] = {}
    for seg in torch.cuda.memory._snapshot()["segments"]:
        r = out.setdefault(str(seg["stream"]), [0.0, 0.0, 0])
        r[0] += seg["total_size"]
        r[1] += seg["allocated_size"]
        r[2] += 1
    return {k: [round(a / 2**30, 3), round(b / 2**30, 3), int(n)] for k, (a, b, n) in out.items()}


def settings(name: str, workload: str, args: Any) -> dict[str, Any]:
    """Everything that produced a row, so that it can be measured again: the mode, the workload's shape, the
    harness's arguments, every ``ELBOWROOM_BENCH_*`` knob set, and the versions."""
    preset, bsz, seq, accum = WORKLOADS[workload]
    return {
        "mode": name,
        "workload": {"name": workload, "preset": preset, "batch_size": bsz, "seq_len": seq,
                     "gradient_accumulation_steps": args.accum or accum},
        "args": {k: v for k, v in vars(args).items()
                 if k not in ("json", "modes", "reproduce", "sample", "fused_loss")},
        "env": {k: v for k, v in sorted(os.environ.items()) if k.startswith("ELBOWROOM_BENCH_")},
        "torch": torch.__version__,
        "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
    }


def _drain(optimizer: Any) -> float:
    """Wait until the optimizer's last updates have landed on the device (a lazy one's host steps and copies); the
    time then."""
    if hasattr(optimizer, "wait_for_weights"):
        optimizer.wait_for_weights()
    _sync()
    return time.perf_counter()


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def _row(name, workload, cfg, tokens, seq, step_s, device) -> dict[str, Any]:
    tok_s = tokens / step_s
    tflops = tok_s * flops_per_token(cfg, seq) / 1e12
    peak = peak_flops(device)
    row = {
        "workload": workload,
        "mode": name,
        "params_M": round(count_params(build_model(cfg, device="meta")) / 1e6),
        "step_s": round(step_s, 4),
        "tok_per_s": round(tok_s),
        "tflops": round(tflops, 1),
        "mfu": round(tflops * 1e12 / peak, 3) if peak else None,
        "peak_GiB": round(torch.cuda.max_memory_allocated() / 2**30, 2) if device.type == "cuda" else None,
    }
    if device.type == "cuda":
        # near the edge of memory the caching allocator frees its cache and retries (a device-wide sync
        # each time): the cause when a mode that fits runs far slower than its FLOPs say
        stats = torch.cuda.memory_stats()
        row["reserved_peak_GiB"] = round(stats.get("reserved_bytes.all.peak", 0) / 2**30, 2)
        row["alloc_retries"] = stats.get("num_alloc_retries", 0)
    return row


# ---------------------------------------------------------------- trainer overhead
def run_minimal(workload: str, args) -> dict[str, Any]:
    """A minimal hand-written loop over the trainer's own model and data: the yardstick of its overhead."""
    from elbowroom.train import data as D

    preset, bsz, seq, accum = WORKLOADS[workload]
    device = torch.device("cuda")
    _fresh_memory()
    torch.manual_seed(0)
    cfg = model_config(preset, seq)
    model = build_model(cfg, device=device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, betas=(0.9, 0.95), weight_decay=0.1, fused=True)
    tokens = D.load_tokens(None)
    train_tokens, _ = D.split(tokens, 0.05)
    loader = D.build_dataloader(
        D.ChunkDataset(train_tokens, seq), batch_size=bsz, seed=0, start_sample=0, num_workers=2,
        pin_memory=True, persistent_workers=True, collate_fn=D.collate,
    )
    it = iter(loader)
    for step in range(args.steps):
        if step == args.warmup:
            torch.cuda.synchronize()
            t0 = time.perf_counter()
        b = next(it)
        x = b["input_ids"].to(device, non_blocking=True)
        y = b["targets"].to(device, non_blocking=True)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            logits = model(x)
        loss = F.cross_entropy(logits.float().view(-1, logits.size(-1)), y.view(-1))
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
    torch.cuda.synchronize()
    step_s = (time.perf_counter() - t0) / (args.steps - args.warmup)
    row = _row("minimal", workload, cfg, bsz * seq, seq, step_s, device)
    del model, opt
    return row


def run_trainer(workload: str, args) -> dict[str, Any]:
    """The elbowroom trainer in plain mode (bf16, clipping, cosine LR, its loader and prefetcher)."""
    import tempfile

    from elbowroom.config import build_config
    from elbowroom.train.trainer import train

    preset, bsz, seq, accum = WORKLOADS[workload]
    _fresh_memory()
    out = tempfile.mkdtemp(prefix="bench-trainer-")
    log_every = max(1, (args.steps - args.warmup) // 2)
    cfg = build_config({
        "out": out,
        "model": {"preset": preset},
        "data": {"seq_len": seq, "batch_size": bsz, "num_workers": 2},
        "train": {"steps": args.steps, "dtype": "bf16", "eval_every": 0, "eval_batches": 0, "seed": 0},
        "optimizer": {"lr": 1e-4},
        "checkpoint": {"enabled": False},
        "logging": {"log_every": log_every, "progress": False},
    })
    train(cfg)
    rows = [json.loads(line) for line in open(Path(out) / "metrics.jsonl")]
    timed = [r for r in rows if "tokens_per_s" in r and r["step"] > args.warmup]
    tok_s = statistics.median(r["tokens_per_s"] for r in timed)
    device = torch.device("cuda")
    mcfg = model_config(preset, seq)
    row = _row("trainer", workload, mcfg, bsz * seq, seq, bsz * seq / tok_s, device)
    row["peak_GiB"] = round(max(r["peak_memory_bytes"] for r in rows if "peak_memory_bytes" in r) / 2**30, 2)
    return row


def _blocking_events() -> None:
    """``ELBOWROOM_BENCH_BLOCKING_EVENTS=1``: the offloaded optimizer's workers wait for their copies on blocking
    events (the thread sleeps in the driver) instead of default ones (it spins on a core meanwhile). Measured on
    GPT-2-XL at 24 GiB and W1 at 8 GiB (eighth session): no difference beyond the runs' spread, so not the default."""
    from elbowroom.optim import buffers

    def record(self: Any, stream: Any = None) -> Any:
        if not self.cuda:
            return None
        ev = torch.cuda.Event(blocking=True)
        ev.record(stream if stream is not None else torch.cuda.current_stream(self.device))
        return ev

    buffers.Streams.record = record


def non_reentrant_recompute() -> None:
    """``ELBOWROOM_BENCH_NON_REENTRANT=1``: the planner recomputes whole blocks with torch's non-reentrant checkpoint
    (and profiles them so), as before the eighth session, instead of the reentrant one it uses in one process."""
    from elbowroom.activations import recompute
    from elbowroom.plan import profiler

    recompute.reentrant_default = profiler.reentrant_default = lambda: False


# ---------------------------------------------------------------- main
def main() -> None:
    if os.environ.get("ELBOWROOM_BENCH_SWITCH_INTERVAL"):
        # how long a Python thread may hold the GIL while another waits for it (the interpreter's default: 5 ms)
        sys.setswitchinterval(float(os.environ["ELBOWROOM_BENCH_SWITCH_INTERVAL"]))
    if os.environ.get("ELBOWROOM_BENCH_BLOCKING_EVENTS"):
        _blocking_events()
    if os.environ.get("ELBOWROOM_BENCH_NON_REENTRANT"):
        non_reentrant_recompute()
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workload", default="w1", choices=sorted(WORKLOADS))
    ap.add_argument("--modes", default="plain", help=f"comma-separated; known: minimal, trainer, fit@BUDGET, "
                    f"uniform@OPTION, fit_bf16@BUDGET, plan@FILE, {', '.join(MODES)}")
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--accum", type=int, default=0, help="gradient accumulation (0: the workload's)")
    ap.add_argument("--json", default=None, help="append each row as a JSON line to this file")
    ap.add_argument("--in-process", action="store_true",
                    help="run every mode in this process (default: a fresh process per mode, so that no mode's "
                         "threads, hooks, pinned memory or allocator state can touch the next one)")
    ap.add_argument("--reproduce", default=None, metavar="ROW.json",
                    help="measure a recorded row again: a file holding one JSON row (or a JSONL file: its last "
                         "row) whose `settings` give the mode, workload, arguments and ELBOWROOM_BENCH_* knobs")
    args = ap.parse_args()
    if args.reproduce:
        _apply_recorded_settings(args)
    names = args.modes.split(",")
    for name in names:
        if mode_setup(name) is None and name not in ("minimal", "trainer"):
            raise SystemExit(f"unknown mode {name!r}; known: minimal, trainer, {', '.join(MODES)}")
    device = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    print(f"# {device}, torch {torch.__version__}", flush=True)
    rows = []
    for name in names:
        if args.in_process or len(names) == 1:
            row = run_one(name, args)
        else:
            row = run_child(name, args)
        rows.append(row)
        print(json.dumps(row), flush=True)
        if args.json:
            with open(args.json, "a") as f:
                f.write(json.dumps(row) + "\n")
    print_table(rows)


def _apply_recorded_settings(args) -> None:
    """Set the mode, workload, arguments and environment knobs of a recorded row (``--reproduce``)."""
    lines = [line for line in Path(args.reproduce).read_text().splitlines() if line.strip().startswith("{")]
    if not lines:
        raise SystemExit(f"{args.reproduce} holds no JSON row")
    recorded = json.loads(lines[-1]).get("settings")
    if not recorded:
        raise SystemExit(f"the last row of {args.reproduce} has no `settings` (rows before 2026-11-23 lack them)")
    args.modes = recorded["mode"]
    args.workload = recorded["workload"]["name"]
    for key, value in recorded["args"].items():
        if key != "reproduce":
            setattr(args, key, value)
    for key in [k for k in os.environ if k.startswith("ELBOWROOM_BENCH_")]:
        del os.environ[key]  # only the recorded knobs
    os.environ.update(recorded["env"])


_RUNNING: dict[str, Any] = {}  # the mode being run: its setup and step (for the row of one that runs out of memory)


def run_one(name: str, args) -> dict[str, Any]:
    try:
        if name == "minimal":
            return run_minimal(args.workload, args)
        if name == "trainer":
            return run_trainer(args.workload, args)
        return run_mode(name, args.workload, args)
    except torch.OutOfMemoryError as e:
        _write_memory()
        # the allocator's message and, for a planned mode, its plan and predictions: what ran out, against what
        row: dict[str, Any] = {"workload": args.workload, "mode": name, "error": "OOM",
                               "oom": (str(e).splitlines() or [""])[0][:400], "oom_step": _RUNNING.get("step")}
        setup = _RUNNING.get("setup")
        if setup is not None and setup.stats is not None:
            with contextlib.suppress(Exception):  # the row stands without them
                stats = setup.stats()
                mechanism = stats.pop("settings", None)
                row.update({k: v for k, v in stats.items() if k.startswith("pred_") or k in ("budget_GiB", "plan")})
                if mechanism is not None:
                    row["settings"] = {"mechanism": mechanism}
        return row
    except Exception as e:  # noqa: BLE001 - a mode failing is itself a result; the others still run
        return {"workload": args.workload, "mode": name, "error": f"{type(e).__name__}: {e}"[:300]}


def run_child(name: str, args) -> dict[str, Any]:
    """Run one mode in a fresh interpreter and read back its row (the last JSON line it prints)."""
    import subprocess

    cmd = [sys.executable, __file__, "--workload", args.workload, "--modes", name, "--steps", str(args.steps),
           "--warmup", str(args.warmup), "--accum", str(args.accum)]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    rows = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    if rows:
        return rows[-1]
    tail = (proc.stderr or proc.stdout).strip().splitlines()[-3:]
    return {"workload": args.workload, "mode": name, "error": f"exit {proc.returncode}: {' / '.join(tail)}"[:300]}


def print_table(rows: list[dict[str, Any]]) -> None:
    base = next((r for r in rows if "tok_per_s" in r), None)
    # "by loop step": the first row's median loop step over this row's, the steady pace without the window's drain
    # of the last step's host work (what a long run sees; the tok/s column carries that drain once per window)
    print(f"\n| workload | mode | tok/s | % of {base['mode'] if base else '-'} | by loop step | model TFLOP/s | MFU | "
          "peak GiB | reserved GiB | predicted alloc / reserved GiB | predicted step s | step / pred | plan |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        if "tok_per_s" not in r:
            print(f"| {r['workload']} | {r['mode']} | {r['error']} | | | | | | | | | | |")
            continue
        pct = 100 * r["tok_per_s"] / base["tok_per_s"]
        loop = (f"{100 * base['loop_step_s'] / r['loop_step_s']:.1f}"
                if r.get("loop_step_s") and base.get("loop_step_s") else "")
        mfu = f"{100 * r['mfu']:.1f}%" if r.get("mfu") else "-"
        plan = r.get("plan")
        streamed = f", {plan['optimizer_streamed']} streamed" if plan and plan.get("optimizer_streamed") else ""
        plan_s = (", ".join(f"{v} {k}" for k, v in plan["blocks"].items()) + f"; optimizer {plan['optimizer_on_host']} "
                  f"blocks on host{streamed}; {plan['weights']}" + ("; fused loss" if plan["fused_loss"] else "")
                  ) if plan else ""
        print(
            f"| {r['workload']} | {r['mode']} | {r['tok_per_s']:,} | {pct:.1f} | {loop} | {r['tflops']} | {mfu} | "
            f"{r['peak_GiB']} | {r.get('reserved_peak_GiB', '')} | "
            f"{' / '.join(str(r[k]) for k in ('pred_alloc_GiB', 'pred_peak_GiB') if k in r)} | "
            f"{r.get('pred_step_s', '')} | "
            f"{r.get('step_vs_pred', '')} | {plan_s} |"
        )


if __name__ == "__main__":
    main()
