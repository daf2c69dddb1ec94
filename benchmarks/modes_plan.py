"""The planner as a bench mode: ``fit`` at a budget, its prediction beside the measurement.

    python benchmarks/bench.py --workload w1 --modes plain,fit@24GiB+fl,fit_bf16@16GiB+fl,fit@8GiB+fl
    python benchmarks/bench.py --workload w1 --modes plan@runs/w1-24.toml       # a saved (or hand-edited) Plan

- ``fit@<budget>``: ``elbowroom.plan.fit`` with the measured profile (a few warm-up steps on this GPU), fp32
  weights under autocast; ``fit_bf16@<budget>`` also allows bf16 device weights with fp32 masters (the row says
  which the plan chose). ``+fl`` lets the planner use the fused head and loss; the row follows the plan's choice.
- ``plan@<file>``: apply a Plan file (TOML or JSON) as it is: a hand plan is a file, not a mode name
  (``plan@<file>+cap``: capped at the plan's budget, as below; ``+compile``: its blocks compiled after it is
  applied, for a plan priced on compiled blocks)
  (``ELBOWROOM_BENCH_CPU_THREADS=N``: its host optimizer step on N threads; for ``fit`` modes too;
  ``ELBOWROOM_BENCH_STEP_ORDER=arrival|needed_first``: the order of the host steps with offloaded gradients,
  ``CPUOffloadConfig.step_order``).
- ``uniform@<option>``: every block under one option of the planner (``keep``, ``keep:0.5``, ``selective``,
  ``selective:0.25``, ``selective:all``, ``full``, ``full:input``), the optimizer on the device, fp32 weights:
  the cost model's price of that one option against the measurement (the calibration of its per-option terms).
  ``ELBOWROOM_BENCH_PROFILE=FILE`` keeps the measured profile in FILE (JSON) for the next rows of the workload.
- ``ELBOWROOM_BENCH_PROFILES=DIR`` (``fit`` modes): each profile ``fit`` takes is written to DIR as
  ``<workload>-<precision>-<n>.json`` (n: its order within the call) and read from there by the next rows of the
  same workload and precision: the rows then plan on one measurement, and the cost model can be replayed on CPU
  against the measured rows (``Plan.repredicted``).
- ``...@<budget>+clip``: the loop clips gradients at global norm 1.0 (as the trainer does), and the planner plans
  for it; whether gradients leave during the backward is the plan's decision (``plan.offload_gradients``;
  ``+og`` is kept for old command lines and changes nothing; ``+nog`` forbids it, to measure a plan without
  them; ``+fl`` may stand anywhere among the flags);
  ``+gb`` gives the planner the workload's batch as the global batch, so that it may choose a smaller
  micro-batch with accumulation (the loop then runs the plan's micro-batches);
  ``+host=32GiB`` gives the planner that much host memory (``fit(host_memory=...)``; the row's
  ``host_B_per_offloaded_param`` is the optimizer's own count);
  ``+compile`` compiles the blocks in place and prices the plan on them compiled (``fit(compile=True)``, which
  recomputes pointwise results in backward: ``elbowroom.plan.fit.PLANNED_COMPILE``; ``+rpw`` says so explicitly);
  ``+compile+norpw`` compiles them with the partitioner's defaults (``fit(compile={"recompute_pointwise": False})``);
  ``+cap`` caps the process's CUDA allocator at the budget once the plan is applied (``+cap=78GiB``: at that
  instead, above the plan's budget: what a plan does with room under its cap)
  (``torch.cuda.set_per_process_memory_fraction``), as on a device of the budget's size: the allocator then frees
  its cache and retries (``alloc_retries``) or runs out of memory, where an uncapped row only reports what it
  reserved on the larger card.

Each row adds the plan's predictions (``pred_peak_GiB``, ``pred_step_s``, their ratios to the measurement), the
same plan's predictions from the analytic profile (the device table, no measurement: ``analytic_*``), and the
plan itself under ``settings.mechanism``, so that ``--reproduce`` or ``plan@`` can run it again.
"""

from __future__ import annotations

import contextlib
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from common import Setup  # noqa: E402

PREFIXES = ("fit@", "fit_bf16@", "plan@", "uniform@")


def resolve(name: str) -> Callable[..., Setup] | None:
    """The setup of a parametric planner mode name, or None when ``name`` is not one."""
    for prefix in PREFIXES:
        if name.startswith(prefix):
            arg = name[len(prefix):]
            if prefix == "plan@":
                path, _, rest = arg.partition("+")
                capped, compiled = "cap" in rest.split("+"), _compiled(rest.split("+"))
                return lambda model, args: _setup(model, args, plan_file=path, fused=False, cap=capped,
                                                 compiled=compiled)
            if prefix == "uniform@":
                return lambda model, args: _setup(model, args, uniform=arg.split("+")[0],
                                                 fused=getattr(args, "fused_loss", False))
            flags = arg.split("+")
            cap_at = next((f[4:] for f in flags if f.startswith("cap=")), None)
            return lambda model, args: _setup(model, args, budget=flags[0],
                                             precision="bf16" if "bf16" in prefix else "fp32",
                                             fused=getattr(args, "fused_loss", False), clip="clip" in flags,
                                             split="gb" in flags, cap=cap_at or "cap" in flags,
                                             og="nog" not in flags,
                                             host=next((f[5:] for f in flags if f.startswith("host=")), None),
                                             compiled=_compiled(flags))
    return None


def _compiled(flags: list[str]) -> dict[str, Any] | None:
    """``compile_blocks``' options for ``+compile`` (the planned default), ``+compile+rpw`` and ``+compile+norpw``
    (explicit); None without ``+compile``."""
    if "compile" not in flags:
        return None
    from elbowroom.plan.fit import planned_compile_options

    return planned_compile_options({"recompute_pointwise": False} if "norpw" in flags else {})


def _cap_at(budget_bytes: int) -> float | None:
    """Cap this process's CUDA allocator at ``budget_bytes`` (its cache emptied first, so that what the profile
    left cached does not count); the cap in GiB, or None without CUDA."""
    if not torch.cuda.is_available():
        return None
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    total = torch.cuda.get_device_properties(torch.cuda.current_device()).total_memory
    torch.cuda.set_per_process_memory_fraction(min(1.0, budget_bytes / total))
    return round(budget_bytes / 2**30, 2)


def _setup(model: torch.nn.Module, args: Any, *, budget: str | None = None, precision: str = "fp32",
           plan_file: str | None = None, fused: bool = False, clip: bool = False,
           split: bool = False, uniform: str | None = None, cap: bool | str = False, og: bool = True,
           host: str | None = None, compiled: dict[str, Any] | None = None) -> Setup:
    import os

    from elbowroom.plan import Plan, apply, fit

    idx, tgt = args.sample
    t0 = time.perf_counter()
    if uniform is not None:
        plan = _uniform_plan(model, (idx, tgt), uniform, fused)
        model, opt = apply(model, plan, torch.optim.AdamW, lr=1e-4, fused=True)
    elif plan_file is not None:
        plan = Plan.load(plan_file)
        with _split_streams(model):
            model, opt = apply(model, plan, torch.optim.AdamW, lr=1e-4, fused=True, **_offload_config(plan))
        if compiled is not None:  # plan@FILE+compile: compiled after the plan is applied, as fit(compile=True) does
            from elbowroom.activations import compile_blocks

            compile_blocks(model, **compiled)
    else:
        # the harness's loss (cross-entropy over its own targets) and loop (no clipping: the host step may start
        # as soon as the late blocks' gradients are final)
        kept = precision + ("-compiled" if compiled is not None else "") + (
            "-rpw" if compiled is not None and compiled.get("recompute_pointwise") else "")
        with _kept_profiles(getattr(args, "workload", "model"), kept):
            model, opt, plan = fit(model, (idx, tgt), budget=budget, precision=precision, fused_loss=fused,
                                   source="measured", grad_clipping=clip, lr=1e-4, fused=True,
                                   # the workload's step as the global batch: with +gb, or when it accumulates
                                   global_batch=idx.shape[0] * getattr(args, "step_accum", 1)
                                   if split or getattr(args, "step_accum", 1) > 1 else None,
                                   # the harness clips through the optimizer, which sees gradients already on the host:
                                   # the planner may send them there where that fits and nothing faster does
                                   gradient_offload=og,
                                   # ELBOWROOM_BENCH_NO_STREAM=1: no block streams its optimizer state (the host or
                                   # the device only, as before streaming existed)
                                   stream=False if os.environ.get("ELBOWROOM_BENCH_NO_STREAM") else None,
                                   host_memory=host,  # +host=32GiB: the host memory the plan may use
                                   # +compile: the blocks compiled, the plan priced on them so
                                   compile=compiled if compiled is not None else False,
                                   **_threads())
        if clip:
            def clip_now(o: torch.optim.Optimizer, *_: Any) -> None:  # a step pre-hook must return None
                if hasattr(o, "clip_grad_norm_"):
                    o.clip_grad_norm_(1.0)
                else:
                    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)

            opt.register_step_pre_hook(clip_now)
    plan_s = time.perf_counter() - t0
    notes: dict[str, Any] = {"plan_seconds": round(plan_s, 2), "weights": plan.weight_dtype,
                             "fused_loss": plan.fused_loss}
    if cap:
        from elbowroom.plan import parse_budget

        notes["capped_GiB"] = _cap_at(parse_budget(cap) if isinstance(cap, str) else plan.budget_bytes)
    context: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext
    if plan.weight_dtype == "bfloat16":
        # a bf16 model runs as it is: the harness's autocast would run the norms in fp32 and save fp32 outputs
        context = lambda: torch.autocast("cuda" if torch.cuda.is_available() else "cpu", enabled=False)  # noqa: E731

    def stats() -> dict[str, Any]:
        out = {
            "pred_peak_GiB": round(plan.predicted_peak_bytes / 2**30, 2),  # reserved: allocated + allocator margin
            "pred_alloc_GiB": round((plan.predicted_peak_bytes - plan.memory.get("allocator margin", 0)) / 2**30, 2),
            "pred_step_s": round(plan.predicted_step_seconds, 4),
            "budget_GiB": round(plan.budget_bytes / 2**30, 2),
            "plan": _summary(plan),
            "settings": {"plan": plan.to_dict()},
        }
        out.update(_analytic(model, plan, idx, compiled))
        if hasattr(opt, "stats"):
            s = opt.stats()
            out["host_GiB"] = round(s.get("host_bytes", 0) / 2**30, 2)
            out["host_B_per_offloaded_param"] = round(float(s.get("host_bytes_per_offloaded_param", 0.0)), 2)
            if s.get("offloaded_params"):  # the last step's host work and how long the step waited for it
                out["host_step_s"] = round(float(s["cpu_step_s"]), 4)
                out["host_wait_s"] = round(float(s["cpu_wait_s"]), 4)
        return out

    return Setup(opt, context=context, stats=stats, notes=notes, fused_loss=plan.fused_loss,
                 micro_batch=plan.micro_batch)


@contextlib.contextmanager
def _split_streams(model: torch.nn.Module) -> Any:
    """``ELBOWROOM_BENCH_SPLIT=w13,w2`` (a trial, ``plan@FILE`` rows): every parameter the plan takes off the device
    whose name holds one of these steps on the host, and every other one of the blocks streams, whatever the plan
    said of its block: each block's optimizer split between the host and the link, so that both keep pace with the
    backward instead of the link waiting for the early blocks' gradients at its end."""
    import os

    keys = [k for k in os.environ.get("ELBOWROOM_BENCH_SPLIT", "").split(",") if k]
    if not keys:
        yield
        return
    from elbowroom.optim import offload

    names = {id(p): n for n, p in model.named_parameters()}
    init = offload.CPUOffloadOptimizer.__init__

    def split_init(self: Any, params: Any, *a: Any, offload_params: Any = None, stream_params: Any = None,
                   **k: Any) -> None:
        if offload_params is not None and stream_params is not None:
            offload_params = list(offload_params)
            stream_params = [p for p in offload_params if ".blocks." in "." + names.get(id(p), "")
                             and not any(key in names.get(id(p), "") for key in keys)]
        init(self, params, *a, offload_params=offload_params, stream_params=stream_params, **k)

    offload.CPUOffloadOptimizer.__init__ = split_init
    try:
        yield
    finally:
        offload.CPUOffloadOptimizer.__init__ = init


@contextlib.contextmanager
def _kept_profiles(workload: str, precision: str) -> Any:
    """``ELBOWROOM_BENCH_PROFILES=DIR``: the profiles ``fit`` takes in this block, written to DIR (or read back
    from there when an earlier row of the same workload and precision wrote them)."""
    import json
    import os

    folder = os.environ.get("ELBOWROOM_BENCH_PROFILES")
    if not folder:
        yield
        return
    from elbowroom.plan import profiler
    from elbowroom.plan.types import profile_from_dict

    Path(folder).mkdir(parents=True, exist_ok=True)
    take, count = profiler.profile, [0]

    def kept(*a: Any, **k: Any) -> Any:
        path = Path(folder) / f"{workload}-{precision}-{count[0]}.json"
        count[0] += 1
        if path.exists():
            return profile_from_dict(json.loads(path.read_text()))
        prof = take(*a, **k)
        if prof.source == "measured":
            path.write_text(json.dumps(prof.to_dict()))
        return prof

    profiler.profile = kept
    try:
        yield
    finally:
        profiler.profile = take


def _summary(plan: Any) -> dict[str, Any]:
    counts: dict[str, int] = {}
    for b in plan.blocks:
        counts[b.policy_label] = counts.get(b.policy_label, 0) + 1
    return {"blocks": counts, "optimizer_on_host": len(plan.optimizer_offload_blocks),
            "optimizer_streamed": len(plan.optimizer_stream_blocks), "weights": plan.weight_dtype,
            "micro_batch": plan.micro_batch, "accumulation": plan.gradient_accumulation_steps,
            "fused_loss": plan.fused_loss}


def _analytic(model: torch.nn.Module, plan: Any, idx: torch.Tensor,
              compiled: dict[str, Any] | None = None) -> dict[str, Any]:
    """The same plan priced on the analytic profile of the same shape (meta device, H100 or H200 table), its blocks
    compiled as the row compiles them where the analytic profile can price that (pointwise recomputed)."""
    try:
        from elbowroom.models import build_model
        from elbowroom.plan import get_device, profile

        cfg = getattr(model, "config", None)
        if cfg is None or not torch.cuda.is_available():
            return {}
        meta = build_model(cfg, device="meta")
        name = "h200" if "H200" in torch.cuda.get_device_name() else "h100-80gb"
        rpw = compiled is not None and compiled.get("recompute_pointwise")
        prof = profile(meta, torch.zeros_like(idx, device="meta"), source="analytic", machine=get_device(name),
                       compiled=compiled if rpw else False)  # this host's memory
        again = plan.repredicted(prof)
        return {"analytic_peak_GiB": round(again.predicted_peak_bytes / 2**30, 2),
                "analytic_step_s": round(again.predicted_step_seconds, 4)}
    except Exception as e:  # noqa: BLE001 - a side figure; the row stands without it
        return {"analytic_error": f"{type(e).__name__}: {e}"[:200]}


def _offload_config(plan: Any) -> dict[str, Any]:
    """``ELBOWROOM_BENCH_CPU_THREADS=N``: the host step of a plan that offloads the optimizer runs on N threads."""
    return _threads() if plan.offloads_optimizer else {}


def _threads() -> dict[str, Any]:
    """``ELBOWROOM_BENCH_CPU_THREADS=N``: the offloaded optimizer's config with its host step on N threads, and
    ``ELBOWROOM_BENCH_STEP_ORDER=arrival``: its host steps in arrival order (for ``fit``, which plans with that
    config and applies it); else nothing."""
    import os

    fields: dict[str, Any] = {}
    if os.environ.get("ELBOWROOM_BENCH_CPU_THREADS"):
        fields["cpu_threads"] = int(os.environ["ELBOWROOM_BENCH_CPU_THREADS"])
    if os.environ.get("ELBOWROOM_BENCH_STEP_ORDER"):
        fields["step_order"] = os.environ["ELBOWROOM_BENCH_STEP_ORDER"]
    if not fields:
        return {}
    from elbowroom.optim import CPUOffloadConfig

    return {"offload_config": CPUOffloadConfig(**fields)}


def _option(text: str) -> Any:
    """A planner option from its short name: ``keep``, ``keep:0.5``, ``selective:0.25``, ``selective:all``,
    ``full``, ``full:input``."""
    from elbowroom.plan.cost import OPTIONS, Option

    name, _, arg = text.partition(":")
    checkpoint = {"keep": "none", "selective": "selective", "full": "full"}.get(name)
    if checkpoint is None:
        raise SystemExit(f"uniform@{text}: the option is keep, selective or full, with :ratio, :all or :input")
    if arg in ("all", "input"):
        option = Option(checkpoint, 1.0 if checkpoint == "selective" else 0.0, True)
    else:
        option = Option(checkpoint, float(arg or 0.0))
    if option not in OPTIONS:
        raise SystemExit(f"uniform@{text}: not one of the planner's options ({', '.join(o.label for o in OPTIONS)})")
    return option


def _uniform_plan(model: torch.nn.Module, sample: Any, text: str, fused: bool) -> Any:
    """Every block under one option, the optimizer on the device, fp32 weights; priced on a measured profile."""
    import json
    import os

    from elbowroom.plan.cost import Decisions
    from elbowroom.plan.profiler import profile
    from elbowroom.plan.search import plan_from_decisions
    from elbowroom.plan.types import profile_from_dict

    cache = os.environ.get("ELBOWROOM_BENCH_PROFILE")
    if cache and Path(cache).exists():
        prof = profile_from_dict(json.loads(Path(cache).read_text()))
    else:
        prof = profile(model, sample, source="measured")
        if cache:
            Path(cache).write_text(json.dumps(prof.to_dict()))
    n = len(prof.blocks)
    d = Decisions(options=(_option(text),) * n, offload_blocks=(False,) * n, micro_batch=prof.micro_batch,
                  fused_loss=fused, grad_clipping=False)
    return plan_from_decisions(prof, d, prof.machine.device_memory_bytes)
