"""Recording chosen training steps: memory snapshot, profiler trace and live bytes by category over time.

Around any training loop::

    with elbowroom.report.record("runs/a", steps="3-4", model=model, optimizer=opt) as rec:
        for step in range(1, n + 1):          # steps numbered as in metrics.jsonl (the first is 1)
            loss = model(x).mean(); loss.backward(); opt.step(); opt.zero_grad()
            rec.step()                        # the step that just ran is over; the next one begins

or, from a trainer that knows its step numbers, ``rec.step_begin(step)`` / ``rec.step_end(step)`` around each
step. Nothing is installed while no step is recorded: the hooks are added at the first recorded step's begin
and removed at the last one's end, so recording off costs nothing and only the recorded steps pay.

What it writes under ``OUT/profile/``:

- ``memory.jsonl``: one row per sample (``"kind": "sample"``): step, seconds since the step began, phase
  (``step``, ``forward``, ``recompute``, ``backward``, ``optimizer``), event (``begin``/``end``), block index
  (or null), ``total_bytes`` and ``bytes`` by category (:mod:`elbowroom.report.categories`; they add up to the
  total), ``host_bytes`` (host memory outside the total on CUDA: the offload pool, the optimizer's host part);
  and one row per step (``"kind": "step"``): its seconds, ``peak_bytes`` (CUDA: ``max_memory_allocated``, the
  run's peak so far, never reset here since the trainer's ``peak_memory_bytes`` reads the same counter; CPU: the
  largest RSS sampled), ``sampled_peak_bytes`` (the largest total among the step's samples), device.
- ``memory_snapshot.pickle`` (CUDA): ``torch.cuda.memory._snapshot()`` of the recorded steps, with Python
  stacks; open it at https://pytorch.org/memory_viz.
- ``trace.json``: ``torch.profiler`` Chrome trace (CPU and CUDA activities, copy streams included); open it in
  https://ui.perfetto.dev.

Where samples are taken: each block's forward begin/end (module pre/post hooks on the blocks that
``find_blocks`` finds), its backward begin (a hook on the block's output gradient) and end (a hook on its input
gradient), the optimizer step's begin/end (``register_step_pre_hook``/``register_step_post_hook``), and the step's
own begin and end. A block forward that runs inside backward is labelled a recompute. A sample costs a walk
over the parameters, gradients and optimizer state (no device sync: ``memory_allocated`` is the allocator's
host-side count, so the time axis is the host's).
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch
from torch import nn

from elbowroom.report.categories import SavedTensorCounter, categorise
from elbowroom.report.config import RecordConfig, parse_steps

__all__ = ["Recorder", "record", "PROFILE_DIR"]

logger = logging.getLogger(__name__)

PROFILE_DIR = "profile"
"""Subdirectory of the run directory the recordings go to."""


def _steps_of(steps: str | Iterable[int]) -> frozenset[int]:
    if isinstance(steps, str):
        return parse_steps(steps)
    out = frozenset(int(s) for s in steps)
    if any(s < 0 for s in out):
        raise ValueError(f"steps must be non-negative step numbers, got {sorted(out)}")
    return out


def _in_backward() -> bool:
    """Whether autograd's engine is running a backward on this thread (a forward now is a recompute).

    torch exposes no public query; ``_current_graph_task_id`` (what torch's own checkpoint uses) is -1 outside
    backward. Without it, no forward is called a recompute.
    """
    task = getattr(torch._C, "_current_graph_task_id", None)
    return callable(task) and task() != -1


def _first_tensor(x: Any) -> torch.Tensor | None:
    if isinstance(x, torch.Tensor):
        return x
    if isinstance(x, (tuple, list)):
        for v in x:
            t = _first_tensor(v)
            if t is not None:
                return t
    if isinstance(x, dict):
        for v in x.values():
            t = _first_tensor(v)
            if t is not None:
                return t
    return None


class Recorder:
    """Records the chosen steps of a training loop (see the module docstring); use :func:`record` to make one.

    Args:
        out_dir: the run directory; recordings go to ``out_dir/profile/``.
        config: what to record and when.
        model: the model (its blocks get the sampling hooks); None samples only at step and optimizer bounds.
        optimizer: the optimizer (its state is categorised, its step bounds sampled); may be None.
        start_step: the number :meth:`step` gives the first step (1, as in metrics.jsonl).
        device: the device measured; None: the model's parameters' device (CPU without a model).
    """

    def __init__(
        self,
        out_dir: str | Path,
        config: RecordConfig,
        *,
        model: nn.Module | None = None,
        optimizer: torch.optim.Optimizer | None = None,
        start_step: int = 1,
        device: torch.device | str | None = None,
    ) -> None:
        self.out_dir = Path(out_dir)
        self.config = config
        self.steps = config.step_set
        self.model = model
        self.optimizer = optimizer
        if device is None and model is not None:
            p = next(iter(model.parameters()), None)
            device = p.device if p is not None else None
        self.device = torch.device(device) if device is not None else torch.device("cpu")
        self._next = start_step
        self.writing_seconds = 0.0
        """Host time spent writing the recording's files (trace, snapshot) after the last recorded step: the
        trainer leaves it out of the logged throughput, which is the step's own."""
        self._current: int | None = None  # the recorded step being run, None outside recorded steps
        self._active = False  # hooks, history and profiler installed
        self._handles: list[Any] = []
        self._t0 = 0.0
        self._phase = "step"
        self._baseline_other = 0
        self._static: dict[str, Any] = {}  # categorise's cache of what changes only when the optimizer steps
        self._file: Any = None
        self._profiler: Any = None
        self._step_range: Any = None
        self._saved: SavedTensorCounter | None = None
        self._history = False
        self._params: list[torch.Tensor] = []
        self._engine: Any = None
        self._last_sample: dict[str, Any] | None = None
        self._step_peak = 0
        self._peak_rss = 0

    # -- the loop's calls ----------------------------------------------------------------------------------
    @property
    def recording(self) -> bool:
        """Whether the current step is being recorded."""
        return self._current is not None

    def step_begin(self, step: int) -> None:
        """Call before step ``step`` runs (its first forward). Starts recording when the step is chosen.

        Args:
            step: the step number, as the metrics rows will number it.
        """
        self._next = step
        if step not in self.steps:
            return
        if not self._active:
            self._start()
        self._current = step
        self._phase = "step"
        self._step_peak = 0
        self._static.clear()  # the optimizer stepped since the last sample
        if self._saved is not None:
            self._saved.__enter__()
        if self._profiler is not None:
            self._step_range = torch.profiler.record_function(f"elbowroom step {step}")
            self._step_range.__enter__()
        self._t0 = time.perf_counter()
        if self.config.timeline:
            first = self._sample("begin", None, baseline=True)
            self._baseline_other = first["bytes"]["other"] if self.device.type == "cuda" else 0

    def step_end(self, step: int | None = None) -> None:
        """Call after step ``step`` (its optimizer step and zero_grad). Stops recording after the last chosen step.

        Args:
            step: the step number given to :meth:`step_begin` (None: the current one).
        """
        step = self._current if step is None else step
        self._next = (step if step is not None else self._next) + 1
        if self._current is None or step != self._current:
            return
        self._phase = "step"
        if self.config.timeline:
            self._sample("end", None)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)  # host-device sync: the step's time and peak include its kernels
        seconds = time.perf_counter() - self._t0
        if self._step_range is not None:
            self._step_range.__exit__(None, None, None)
            self._step_range = None
        if self._saved is not None:
            self._saved.__exit__(None, None, None)
        if self._file is not None:
            if self.device.type == "cuda":
                # the allocator's peak since the run began: not reset here, because the trainer's
                # peak_memory_bytes reads the same counter as "peak so far"
                peak = torch.cuda.max_memory_allocated(self.device)
                reserved = torch.cuda.max_memory_reserved(self.device)
            else:
                peak = self._peak_rss
                reserved = None
            row = {
                "kind": "step",
                "step": step,
                "seconds": seconds,
                "peak_bytes": peak,
                "reserved_peak_bytes": reserved,
                "sampled_peak_bytes": self._step_peak,
                "device": self.device.type,
            }
            self._file.write(json.dumps(row) + "\n")
            self._file.flush()
        self._current = None
        if not any(s > step for s in self.steps):
            t0 = time.perf_counter()
            self._stop()
            self.writing_seconds += time.perf_counter() - t0

    def step(self) -> None:
        """End the step that just ran and begin the next (for loops that do not number their steps)."""
        if self._current is not None:
            self.step_end(self._current)
        else:
            self._next += 1
        self.step_begin(self._next)

    # -- context manager -----------------------------------------------------------------------------------
    def __enter__(self) -> Recorder:
        self.step_begin(self._next)
        return self

    def __exit__(self, *exc: Any) -> None:
        # with step(), the loop's last call begins a step that never runs: it gets no "step" row (readers
        # use only steps that have one), and everything is closed so that the files are complete
        self._current = None
        self._stop()

    def close(self) -> None:
        """Remove every hook and finish the files (also done when the last recorded step ends)."""
        self._stop()

    # -- set-up and tear-down ------------------------------------------------------------------------------
    def _start(self) -> None:
        self._active = True
        prof_dir = self.out_dir / PROFILE_DIR
        prof_dir.mkdir(parents=True, exist_ok=True)
        cuda = self.device.type == "cuda"
        if self.model is not None:
            self._params = list(self.model.parameters())
            from elbowroom.activations.policy import get_offload_engine

            self._engine = get_offload_engine(self.model)
        if self.config.timeline:
            # a new recording replaces an earlier one of this run directory, as the trace and snapshot do
            # (appending would mix a resumed run's samples with the first run's under the same step numbers)
            self._file = open(prof_dir / "memory.jsonl", "w")  # noqa: SIM115 - closed in _stop
            self._install_hooks()
            if not cuda:
                self._saved = SavedTensorCounter()
        if cuda and self.config.snapshot:
            # allocation history with Python stacks only ("python", not "all": C++ frames make each entry and
            # the pickle several times larger), stacks of allocations only (context "alloc", not "all": free
            # stacks double the size and say little); max_entries bounds the ring buffer
            torch.cuda.memory._record_memory_history(
                enabled="all",
                context="alloc",
                stacks="python",
                max_entries=self.config.max_entries,
                device=self.device,
                clear_history=True,  # only the recorded steps: earlier events would crowd the ring buffer
            )
            self._history = True
        if self.config.trace:
            activities = [torch.profiler.ProfilerActivity.CPU]
            if cuda:
                activities.append(torch.profiler.ProfilerActivity.CUDA)
            self._profiler = torch.profiler.profile(activities=activities, record_shapes=False, with_stack=False)
            self._profiler.__enter__()

    def _stop(self) -> None:
        if not self._active:
            return
        self._active = False
        prof_dir = self.out_dir / PROFILE_DIR
        for h in self._handles:
            h.remove()
        self._handles = []
        if self._step_range is not None:
            self._step_range.__exit__(None, None, None)
            self._step_range = None
        if self._profiler is not None:
            self._profiler.__exit__(None, None, None)
            self._profiler.export_chrome_trace(str(prof_dir / "trace.json"))
            self._profiler = None
        if self._history:
            snapshot = torch.cuda.memory._snapshot()
            torch.cuda.memory._record_memory_history(enabled=None)
            self._history = False
            _dump_pickle(snapshot, prof_dir / "memory_snapshot.pickle")
        if self._saved is not None:
            self._saved.__exit__(None, None, None)
            self._saved = None
        if self._file is not None:
            self._file.close()
            self._file = None
        self._params = []
        self._engine = None
        self._current = None

    def _install_hooks(self) -> None:
        if self.model is not None:
            from elbowroom.activations.recompute import find_blocks

            try:
                blocks = list(find_blocks(self.model))
            except ValueError:
                blocks = []
                logger.warning(
                    "report: %s has no repeated blocks; sampling at step bounds only", type(self.model).__name__
                )
            for i, blk in enumerate(blocks):
                self._handles.append(blk.register_forward_pre_hook(self._fwd_pre(i)))
                self._handles.append(blk.register_forward_hook(self._fwd_post(i)))
        if self.optimizer is not None:
            self._handles.append(self.optimizer.register_step_pre_hook(self._opt_hook("begin")))
            self._handles.append(self.optimizer.register_step_post_hook(self._opt_hook("end")))

    # -- hooks ---------------------------------------------------------------------------------------------
    def _fwd_pre(self, i: int) -> Any:
        def hook(module: nn.Module, args: Any) -> None:
            if self._current is None:
                return
            self._phase = "recompute" if _in_backward() else "forward"
            self._sample("begin", i)
            x = _first_tensor(args)
            if self._phase == "forward" and x is not None and x.requires_grad:
                # the gradient of the block's input is computed when the block's backward is done
                x.register_hook(self._bwd(i, "end"))

        return hook

    def _fwd_post(self, i: int) -> Any:
        def hook(module: nn.Module, args: Any, output: Any) -> None:
            if self._current is None:
                return
            self._sample("end", i)
            y = _first_tensor(output)
            if self._phase == "forward" and y is not None and y.requires_grad:
                # the gradient of the block's output arrives when its backward begins
                y.register_hook(self._bwd(i, "begin"))
            if self._phase == "recompute":
                self._phase = "backward"

        return hook

    def _bwd(self, i: int, event: str) -> Any:
        def hook(grad: torch.Tensor) -> None:
            if self._current is None:
                return
            self._phase = "backward"
            self._sample(event, i)

        return hook

    def _opt_hook(self, event: str) -> Any:
        def hook(optimizer: Any, args: Any, kwargs: Any = None) -> None:
            if self._current is None:
                return
            self._phase = "optimizer"
            self._static.clear()  # its step may create state (the first step) and change what it holds
            self._sample(event, None)
            if event == "end":
                self._phase = "step"

        return hook

    # -- sampling ------------------------------------------------------------------------------------------
    def _sample(self, event: str, block: int | None, *, baseline: bool = False) -> dict[str, Any]:
        t = time.perf_counter() - self._t0
        total, by, host = categorise(
            self.device,
            self._params,
            self.optimizer,
            self._engine,
            self._saved,
            None if baseline else self._baseline_other,
            static=self._static,
        )
        dev = self.device.type
        self._step_peak = max(self._step_peak, total)
        if dev != "cuda":
            self._peak_rss = max(self._peak_rss, total)
        row = {
            "kind": "sample",
            "step": self._current,
            "t": round(t, 6),
            "phase": self._phase,
            "event": event,
            "block": block,
            "device": dev,
            "total_bytes": total,
            "bytes": by,
            "host_bytes": host,
        }
        if self._file is not None:
            self._file.write(json.dumps(row) + "\n")
        self._last_sample = row
        return row


def _dump_pickle(obj: Any, path: Path) -> None:
    import pickle

    with open(path, "wb") as f:
        pickle.dump(obj, f)


def record(
    out_dir: str | Path,
    steps: str | Iterable[int] = "",
    *,
    model: nn.Module | None = None,
    optimizer: torch.optim.Optimizer | None = None,
    config: RecordConfig | None = None,
    start_step: int = 1,
    device: torch.device | str | None = None,
) -> Recorder:
    """A :class:`Recorder` for the given steps, to use as a context manager around the training loop.

    Args:
        out_dir: the run directory; files go to ``out_dir/profile/``.
        steps: the steps to record: ``"3-4"``, ``"3,5"``, ``range(3, 5)``; ignored when ``config`` is given.
        model: the model whose blocks are sampled.
        optimizer: its optimizer.
        config: the full settings (``RecordConfig``); default: snapshot, trace and timeline of ``steps``.
        start_step: number of the first step (the one running when the ``with`` is entered).
        device: the device measured (default: the model's).

    Returns:
        The recorder; call ``rec.step()`` after each step, or ``step_begin``/``step_end`` with step numbers.
    """
    if config is None:
        if not isinstance(steps, str):
            steps = ",".join(str(s) for s in sorted(_steps_of(steps)))
        config = RecordConfig(steps=steps)
    return Recorder(out_dir, config, model=model, optimizer=optimizer, start_step=start_step, device=device)
