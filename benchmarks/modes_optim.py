"""Optimizer-offload modes for ``bench.py``: elbowroom's CPUOffloadOptimizer, whole and hybrid.

    python benchmarks/bench.py --workload w1 --modes plain,torchao_optim,er_optim,er_optim_late0.4
    python benchmarks/bench.py --workload w3 --modes er_optim+ckpt,er_optim_late0.4+ckpt,torchao_optim+ckpt
    ELBOWROOM_BENCH_OFFLOAD_FRACTION=0.35 python benchmarks/bench.py --workload w3 --modes er_optim_late+ckpt

Modes (each also with ``+ckpt``: per-block checkpoint, and ``+clip``: global-norm clipping at 1.0 in a
step pre-hook, as a training run would):

- ``er_optim``: everything offloaded (``offload_fraction=1.0``), fused CPU AdamW.
- ``er_optim_grads``: the same with ``offload_gradients=True`` (device gradients freed once copied).
- ``er_optim_late<F>``: hybrid, the last F of the parameter bytes (the late blocks and the head) on the
  host, the rest fused AdamW on the GPU; ``er_optim_late`` takes F from ``--offload-fraction`` when the
  harness has it, else from ``ELBOWROOM_BENCH_OFFLOAD_FRACTION`` (default 0.4).
  ``ELBOWROOM_BENCH_CPU_THREADS=N`` sets the CPU step's threads (``CPUOffloadConfig.cpu_threads``) for any of
  our modes, ``ELBOWROOM_BENCH_STAGING_SLOTS=N`` the number of staging slots (``num_staging_slots``),
  ``ELBOWROOM_BENCH_BUCKET_MB=N`` the bucket size (``bucket_bytes``; a parameter bigger than that steps piece by
  piece, so one as big as the largest parameter stages everything whole). Each mode builds its own
  ``CPUOffloadConfig`` from these and records all of its fields in the row (``settings``).
- ``er_optim_grads_late<F>[_fwd]``: the hybrid with ``offload_gradients=True``: the device gradients of
  the offloaded part leave as they are copied (less device memory, so a smaller F fits; +4 B/param host).
- ``er_optim_late<F>_fwd``: the same with ``overlap_with_forward(model)``: ``step()`` returns at once and
  each block waits for its own weights in the next forward (hides the CPU step of the late blocks behind
  the forward of the early ones, also when clipping makes the CPU step wait for the whole backward).
- ``er_optim_bf16_late<F>[_fwd]``, ``er_optim_bf16_grads_late<F>_fwd``: the same with
  ``param_dtype=torch.bfloat16``: the offloaded parameters live on the GPU in bf16 (fp32 masters on the host),
  so they and their gradients take half the device memory and half the link.
- ``er_optim_bf16all_late<F>_fwd``: the whole model in bf16 on the device (``model.to(torch.bfloat16)``,
  no autocast), ``master_weights=True``: fp32 masters on the host for the offloaded part, on the device
  for the rest (stepped chunk by chunk from the bf16 gradients). The device part then takes 2 + 2 + 12 B
  per parameter as fp32 weights do (4 + 4 + 8), but no autocast casts run and no fp32 gradient is
  accumulated: ~13% less GPU time per 7B micro-batch (``benchmarks/microbatch.py``). Gradients accumulate
  over micro-batches in bf16, as the offloaded part's already do with ``param_dtype``.
- ``ELBOWROOM_BENCH_CKPT_BLOCKS=K`` makes ``+ckpt`` checkpoint only the first K blocks (memory for speed).
- ``...+eckpt``: elbowroom's own per-block recompute instead of torch's (``apply_block_policies``: the first K
  blocks recompute, K from ``ELBOWROOM_BENCH_CKPT_BLOCKS``, default all; the blocks kept whole recast their
  bf16 weight casts in backward and no block holds autocast's weight cache). ``ELBOWROOM_BENCH_REST=selective``
  makes the other blocks selective (keep matmul and attention outputs) instead of kept whole, and
  ``ELBOWROOM_BENCH_REST_OFFLOAD=r`` sends that share of their saved bytes to host memory.
- ``ELBOWROOM_BENCH_COMPILE=1`` (with ``+eckpt``) compiles each block whose parameters all stay on the device
  (``nn.Module.compile``, after the recompute policies: the offloaded blocks keep their optimizer hooks eager).
- ``ELBOWROOM_BENCH_TRACE=1`` adds the optimizer's timeline of the last step to each of our rows (``trace``).
- ``plain+clip``: the plain fused AdamW baseline with the same clipping.
- ``...+nocache`` (after ``+ckpt``): bf16 autocast without its weight cache. With per-block checkpoint
  the cache keeps a bf16 copy of every fp32 weight from its first use to the end of forward (2 B/param:
  12.6 GiB on the 7B, while accumulated gradients are resident); without it each block casts its weights
  when it runs (forward and recompute cast once each either way). A memory choice outside the optimizer,
  named in the row so that it is never mistaken for one.

Each of our rows adds the optimizer's numbers: the CPU step time of the last step, how much of it ran
behind GPU work (``hidden_fraction``), host and pinned memory and bytes per offloaded parameter as the
optimizer counts them, and as the process's resident set shows them (``rss_*``: growth of VmRSS now and of
its high-water mark VmHWM over the RSS just before the optimizer was built, per offloaded parameter: the
steady-state and set-up footprints).
"""

from __future__ import annotations

import contextlib
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from elbowroom.optim import CPUOffloadConfig, CPUOffloadOptimizer, last_fraction  # noqa: E402

LATE_FRACTIONS = (0.25, 0.3, 0.4, 0.45, 0.5, 0.55, 0.6, 0.65, 0.7, 0.75, 0.8, 0.85, 0.9)
DEFAULT_LATE_FRACTION = 0.4


def _bench() -> Any:
    """The harness module: ``__main__`` when bench.py runs as a script (importing it again would recurse)."""
    main = sys.modules.get("__main__")
    if main is not None and hasattr(main, "Setup") and hasattr(main, "WORKLOADS"):
        return main
    import bench

    return bench


def _accum(args: Any) -> int:
    acc = getattr(args, "accum", 0) or 0
    if not acc:
        acc = _bench().WORKLOADS.get(getattr(args, "workload", ""), (None, None, None, 1))[3]
    return max(1, int(acc))


class _MicroBatches:
    """The harness enters ``Setup.context`` around each micro-batch's forward and runs backward just after:
    mark all but the last micro-batch of a step as accumulating (the flag stays set through that backward)."""

    def __init__(self, opt: CPUOffloadOptimizer, accum: int) -> None:
        self.opt, self.accum, self.i = opt, accum, 0
        opt.register_step_post_hook(lambda *_: self._reset())

    def _reset(self) -> None:
        self.i = 0

    def __call__(self) -> contextlib.AbstractContextManager:
        self.opt.sync_gradients = self.i % self.accum == self.accum - 1
        self.i += 1
        return contextlib.nullcontext()


def _proc_status_bytes(key: str) -> int:
    """A ``kB`` field of /proc/self/status (VmRSS, VmHWM) in bytes; 0 where there is no /proc."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(key + ":"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def _stats(opt: CPUOffloadOptimizer, rss0: int) -> Callable[[], dict[str, Any]]:
    def read() -> dict[str, Any]:
        s = opt.stats()
        total = s["offloaded_numel"] + s["device_numel"]
        n_off = max(s["offloaded_numel"], 1)
        rss, hwm = _proc_status_bytes("VmRSS"), _proc_status_bytes("VmHWM")
        return {
            "offloaded_share": round(s["offloaded_numel"] / total, 3) if total else 0.0,
            "cpu_step_s": round(s.get("cpu_step_s", 0.0), 4),
            "cpu_wait_s": round(s.get("cpu_wait_s", 0.0), 4),
            "copy_wait_s": round(s.get("copy_wait_s", 0.0), 4),
            "chunked": s.get("chunked"),
            "trace": s.get("trace"),
            "hidden_fraction": round(s.get("hidden_fraction", 0.0), 3),
            "step_in_backward": s["step_in_backward"],
            "host_GiB": round(s["host_bytes"] / 2**30, 2),
            "pinned_GiB": round(s["pinned_bytes"] / 2**30, 2),
            "staging_GiB": round(s["staging_bytes"] / 2**30, 3),
            "host_B_per_offloaded_param": round(s["host_bytes_per_offloaded_param"], 2),
            "d2h_GB": round(s.get("d2h_bytes", 0) / 1e9, 2),
            "h2d_GB": round(s.get("h2d_bytes", 0) / 1e9, 2),
            "cpu_threads": s["cpu_threads"],
            "settings": opt.config.as_dict(),  # every CPUOffloadConfig field this row ran with
            "rss_before_opt_GiB": round(rss0 / 2**30, 2),
            "rss_GiB": round(rss / 2**30, 2),
            "rss_peak_GiB": round(hwm / 2**30, 2),
            "rss_B_per_offloaded_param": round((rss - rss0) / n_off, 2),
            "rss_peak_B_per_offloaded_param": round((hwm - rss0) / n_off, 2),
        }

    return read


def _late_fraction(args: Any) -> float:
    f = getattr(args, "offload_fraction", None)
    if f is None:
        f = float(os.environ.get("ELBOWROOM_BENCH_OFFLOAD_FRACTION", DEFAULT_LATE_FRACTION))
    return float(f)


def _ours(
    model: torch.nn.Module,
    args: Any,
    *,
    late: float | None = None,
    offload_gradients: bool = False,
    lazy: bool = False,
    bf16: bool = False,
    all_bf16: bool = False,
) -> Any:
    if all_bf16:
        model.to(torch.bfloat16)  # every weight bf16 on the device, fp32 masters on both sides
    params = list(model.parameters())
    kwargs: dict[str, Any] = {"lr": 1e-4, "fused": True}
    if late is not None:
        kwargs["offload_params"] = last_fraction(params, late)
    config = _config(offload_gradients=offload_gradients, bf16=bf16, all_bf16=all_bf16)
    rss0 = _proc_status_bytes("VmRSS")  # the host footprint before the optimizer (CUDA context, model code)
    opt = CPUOffloadOptimizer(params, torch.optim.AdamW, config=config, **kwargs)
    if lazy:
        opt.overlap_with_forward(model)  # the next forward waits per module, not step()
    accum = _accum(args)
    context = _MicroBatches(opt, accum) if accum > 1 else contextlib.nullcontext
    if all_bf16:
        # the harness's autocast off: a bf16 model runs in bf16 as it is (autocast would run the norms in fp32
        # and save fp32 activations)
        dev = next(model.parameters()).device.type
        context = _inside(context, lambda: torch.autocast(dev, enabled=False))
    notes = {"late_fraction": late, "param_dtype": "bf16 (all)" if all_bf16 else "bf16" if bf16 else "fp32"}
    return _bench().Setup(opt, context=context, stats=_stats(opt, rss0), notes=notes)


def _config(*, offload_gradients: bool, bf16: bool, all_bf16: bool) -> CPUOffloadConfig:
    """The optimizer's settings for one of our modes: the mode's own, and the engine's knobs from the
    ``ELBOWROOM_BENCH_*`` variables (read here, in the harness: the library reads no environment)."""
    fields: dict[str, Any] = {
        "offload_gradients": offload_gradients,
        "param_dtype": "bfloat16" if bf16 else None,
        "master_weights": all_bf16,  # fp32 masters on both sides for a bf16 model
    }
    threads = os.environ.get("ELBOWROOM_BENCH_CPU_THREADS")
    if threads:
        fields["cpu_threads"] = int(threads)
    slots = os.environ.get("ELBOWROOM_BENCH_STAGING_SLOTS")
    if slots:
        fields["num_staging_slots"] = int(slots)
    bucket_mb = os.environ.get("ELBOWROOM_BENCH_BUCKET_MB")
    if bucket_mb:
        fields["bucket_bytes"] = int(bucket_mb) << 20
    if os.environ.get("ELBOWROOM_BENCH_TRACE"):
        fields["trace_steps"] = True  # stats()["trace"]: the last step's timeline, into the row
    return CPUOffloadConfig(**fields)


def _inside(
    inner: Callable[[], Any], autocast: Callable[[], torch.autocast]
) -> Callable[[], contextlib.AbstractContextManager]:
    """A Setup context: ``inner()`` and, nested inside the harness's autocast, a fresh ``autocast()`` (the
    harness's setting is restored on exit)."""

    def context() -> contextlib.AbstractContextManager:
        stack = contextlib.ExitStack()
        stack.enter_context(inner())
        stack.enter_context(autocast())
        return stack

    return context


def _with_ckpt(make: Callable[[torch.nn.Module, Any], Any]) -> Callable[[torch.nn.Module, Any], Any]:
    def setup(model: torch.nn.Module, args: Any) -> Any:
        k = os.environ.get("ELBOWROOM_BENCH_CKPT_BLOCKS")
        if k is None:
            _bench().setup_torch_ckpt(model, args)  # wraps each block in torch's non-reentrant checkpoint
        else:
            from torch.utils.checkpoint import checkpoint

            for blk in list(model.blocks)[: int(k)]:  # the first K blocks only: the rest keep their activations
                orig = blk.forward
                blk.forward = lambda x, _orig=orig: checkpoint(_orig, x, use_reentrant=False)
        return make(model, args)

    return setup


def _with_our_ckpt(make: Callable[[torch.nn.Module, Any], Any]) -> Callable[[torch.nn.Module, Any], Any]:
    def setup(model: torch.nn.Module, args: Any) -> Any:
        from elbowroom.activations import BlockPolicy, apply_block_policies

        n = len(model.blocks)
        k = int(os.environ.get("ELBOWROOM_BENCH_CKPT_BLOCKS", n))
        # the first K blocks recompute, the rest are kept whole (their weight casts recast, no autocast cache)
        # or, with ELBOWROOM_BENCH_REST=selective, keep only their matmul/attention outputs; a share of
        # the rest's saved bytes may go to host memory (ELBOWROOM_BENCH_REST_OFFLOAD=ratio): with the
        # optimizer's traffic only at the last micro-batch, the link is idle during the others
        rest = BlockPolicy(
            os.environ.get("ELBOWROOM_BENCH_REST", "none"),
            offload_ratio=float(os.environ.get("ELBOWROOM_BENCH_REST_OFFLOAD", 0.0)),
        )
        apply_block_policies(model, [BlockPolicy("full")] * k + [rest] * (n - k))
        s = make(model, args)
        s.notes.update(ckpt_blocks=k, rest=rest.checkpoint, rest_offload=rest.offload_ratio)
        if os.environ.get("ELBOWROOM_BENCH_COMPILE"):
            # torch.compile each block whose weights stay on the device (no optimizer hooks inside it)
            offloaded = {id(p) for p in s.optimizer.offloaded_parameters()}
            blocks = list(model.blocks)
            compiled = [i for i, b in enumerate(blocks) if not any(id(p) in offloaded for p in b.parameters())]
            for i in compiled:
                model.blocks[i].compile()
            s.notes.update(compiled_blocks=len(compiled))
        return s

    return setup


def _with_clip(make: Callable[[torch.nn.Module, Any], Any]) -> Callable[[torch.nn.Module, Any], Any]:
    def setup(model: torch.nn.Module, args: Any) -> Any:
        s = make(model, args)
        opt = s.optimizer

        def clip(o: torch.optim.Optimizer, *_: Any) -> None:  # a step pre-hook must return None
            if isinstance(o, CPUOffloadOptimizer):
                o.clip_grad_norm_(1.0)
            else:
                torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)

        opt.register_step_pre_hook(clip)
        return s

    return setup


def _with_nocache(make: Callable[[torch.nn.Module, Any], Any]) -> Callable[[torch.nn.Module, Any], Any]:
    def setup(model: torch.nn.Module, args: Any) -> Any:
        s = make(model, args)
        device = next(model.parameters()).device.type
        # same dtype as the harness's autocast, no weight cache
        s.context = _inside(s.context, lambda: torch.autocast(device, dtype=torch.bfloat16, cache_enabled=False))
        return s

    return setup


def _plain(model: torch.nn.Module, args: Any) -> Any:
    return _bench().Setup(torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True))


_BASE: dict[str, Callable[[torch.nn.Module, Any], Any]] = {
    "er_optim": lambda m, a: _ours(m, a),
    "er_optim_grads": lambda m, a: _ours(m, a, offload_gradients=True),
    "er_optim_late": lambda m, a: _ours(m, a, late=_late_fraction(a)),
}
for _f in LATE_FRACTIONS:
    _BASE[f"er_optim_late{_f:g}"] = lambda m, a, _f=_f: _ours(m, a, late=_f)
    _BASE[f"er_optim_late{_f:g}_fwd"] = lambda m, a, _f=_f: _ours(m, a, late=_f, lazy=True)
    _BASE[f"er_optim_grads_late{_f:g}"] = lambda m, a, _f=_f: _ours(m, a, late=_f, offload_gradients=True)
    _BASE[f"er_optim_grads_late{_f:g}_fwd"] = lambda m, a, _f=_f: _ours(
        m, a, late=_f, offload_gradients=True, lazy=True
    )
    _BASE[f"er_optim_bf16_late{_f:g}"] = lambda m, a, _f=_f: _ours(m, a, late=_f, bf16=True)
    _BASE[f"er_optim_bf16_late{_f:g}_fwd"] = lambda m, a, _f=_f: _ours(m, a, late=_f, lazy=True, bf16=True)
    _BASE[f"er_optim_bf16all_late{_f:g}_fwd"] = lambda m, a, _f=_f: _ours(m, a, late=_f, lazy=True, all_bf16=True)
    _BASE[f"er_optim_bf16_grads_late{_f:g}_fwd"] = lambda m, a, _f=_f: _ours(
        m, a, late=_f, offload_gradients=True, lazy=True, bf16=True
    )
_BASE["er_optim_late_fwd"] = lambda m, a: _ours(m, a, late=_late_fraction(a), lazy=True)

MODES: dict[str, Callable[[torch.nn.Module, Any], Any]] = {"plain+clip": _with_clip(_plain)}
for _name, _make in _BASE.items():
    MODES[_name] = _make
    MODES[f"{_name}+ckpt"] = _with_ckpt(_make)
    MODES[f"{_name}+clip"] = _with_clip(_make)
    MODES[f"{_name}+ckpt+clip"] = _with_clip(_with_ckpt(_make))
    MODES[f"{_name}+eckpt"] = _with_our_ckpt(_make)
MODES["plain+ckpt+clip"] = _with_clip(_with_ckpt(_plain))
for _name in [n for n in MODES if n.endswith("+ckpt") or n.endswith("+ckpt+clip")]:
    _parts = _name.split("+")
    MODES["+".join([*_parts[:2], "nocache", *_parts[2:]])] = _with_nocache(MODES[_name])
