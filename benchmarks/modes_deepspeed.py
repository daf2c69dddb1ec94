"""DeepSpeed ZeRO-Offload as a ``bench.py`` mode: the peer our CPUOffloadOptimizer is judged against, on the
same model, tokens and timer as our rows.

    python benchmarks/bench.py --workload w1 --modes plain,er_optim_late0.4,torchao_optim,ds_zero_offload

Modes (DeepSpeed is imported only when one of them runs):

- ``ds_zero_offload``: ZeRO stage 2 with ``offload_optimizer: cpu`` (pinned), DeepSpeedCPUAdam (AdamW, the
  same lr as every other row), bf16 weights (DeepSpeed casts the model; fp32 masters and moments on the host),
  ``overlap_comm`` and ``contiguous_gradients``, one process. The config of the shared peers' script
  ``ds_anchor.py``; the harness's autocast is off, as DeepSpeed's bf16 mode runs the model in bf16 as it is.
- ``...+ckpt``: per-block torch checkpoint (``ELBOWROOM_BENCH_CKPT_BLOCKS=K``: the first K blocks);
  ``...+clip``: DeepSpeed's own global-norm clipping at 1.0 (``gradient_clipping``).

Each micro-batch's backward runs through ``engine.backward`` and ``engine.step`` (DeepSpeed counts the
micro-batches of a step itself and steps at the boundary); the harness's ``step()`` is then a no-op. The row
adds the process's host memory growth per parameter (all of DeepSpeed's optimizer is on the host) and the
CPU Adam's build time. DeepSpeed is published as source only; ``DS_BUILD_OPS=0 pip wheel --no-deps
--no-build-isolation deepspeed`` builds a pure-Python wheel, and its CPU Adam compiles itself on first use.
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Callable
from typing import Any

import torch
from modes_optim import _bench, _inside, _proc_status_bytes, _with_ckpt


class _EngineSteps:
    """What the harness calls ``optimizer``: DeepSpeed's engine steps inside each backward, so nothing here."""

    def __init__(self, engine: Any) -> None:
        self.engine = engine

    def step(self) -> None:
        pass

    def zero_grad(self, set_to_none: bool = True) -> None:
        pass


def _deepspeed(model: torch.nn.Module, args: Any, *, clip: float = 0.0) -> Any:
    for key, value in (
        ("RANK", "0"),
        ("LOCAL_RANK", "0"),
        ("WORLD_SIZE", "1"),
        ("MASTER_ADDR", "127.0.0.1"),
        ("MASTER_PORT", "29513"),
    ):
        os.environ.setdefault(key, value)  # one process, no launcher
    try:
        import deepspeed
    except ImportError as e:
        raise RuntimeError(
            "the ds_* modes need DeepSpeed: build a wheel with `DS_BUILD_OPS=0 pip wheel --no-deps "
            "--no-build-isolation deepspeed` and install it (with hjson, pydantic, py-cpuinfo, msgpack, ninja)"
        ) from e

    bench = _bench()
    accum = max(1, int(getattr(args, "accum", 0) or bench.WORKLOADS[args.workload][3]))
    batch = bench.WORKLOADS[args.workload][1]
    nparams = sum(p.numel() for p in model.parameters())
    config = {
        "train_micro_batch_size_per_gpu": batch,
        "gradient_accumulation_steps": accum,
        "bf16": {"enabled": True},
        "gradient_clipping": clip,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-4, "weight_decay": 0.0}},
        "zero_optimization": {
            "stage": 2,
            "offload_optimizer": {"device": "cpu", "pin_memory": True},
            "overlap_comm": True,
            "contiguous_gradients": True,
        },
        "steps_per_print": 10**9,
    }
    rss0 = _proc_status_bytes("VmRSS")
    t0 = time.perf_counter()
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
    init_s = time.perf_counter() - t0

    def backward(loss: torch.Tensor) -> None:
        engine.backward(loss)
        engine.step()

    def stats() -> dict[str, Any]:
        rss, hwm = _proc_status_bytes("VmRSS"), _proc_status_bytes("VmHWM")
        return {
            "ds_init_s": round(init_s, 1),  # includes the CPU Adam's build on the first run of a machine
            "rss_before_opt_GiB": round(rss0 / 2**30, 2),
            "rss_GiB": round(rss / 2**30, 2),
            "rss_peak_GiB": round(hwm / 2**30, 2),
            "rss_B_per_offloaded_param": round((rss - rss0) / nparams, 2),
            "rss_peak_B_per_offloaded_param": round((hwm - rss0) / nparams, 2),
        }

    dev = next(model.parameters()).device.type
    context = _inside(contextlib.nullcontext, lambda: torch.autocast(dev, enabled=False))  # bf16 as it is
    notes = {"deepspeed": deepspeed.__version__, "zero_stage": 2, "clip": clip or None}
    return bench.Setup(_EngineSteps(engine), context=context, stats=stats, notes=notes, backward=backward)


_BASE: dict[str, Callable[[torch.nn.Module, Any], Any]] = {
    "ds_zero_offload": lambda m, a: _deepspeed(m, a),
    "ds_zero_offload+clip": lambda m, a: _deepspeed(m, a, clip=1.0),
}
MODES: dict[str, Callable[[torch.nn.Module, Any], Any]] = dict(_BASE)
MODES["ds_zero_offload+ckpt"] = _with_ckpt(_BASE["ds_zero_offload"])
MODES["ds_zero_offload+ckpt+clip"] = _with_ckpt(_BASE["ds_zero_offload+clip"])
