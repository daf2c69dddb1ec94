"""Per-step metrics: the JSONL file other tools read, the log line, the progress bar, TensorBoard.

Everything here runs on rank 0 only and only at log steps: the trainer hands it numbers it has already
synchronised, so nothing in this module touches the device.
"""

from __future__ import annotations

import json
import logging
import os
import resource
import statistics
import sys
from pathlib import Path
from typing import Any

import torch

log = logging.getLogger("elbowroom.train")

# Dense bf16/fp16 tensor-core peaks in FLOP/s, for MFU. Matched by substring of the device name, first hit wins.
PEAK_FLOPS: list[tuple[str, float]] = [
    ("H200", 989e12),
    ("H100 PCIe", 756e12),
    ("H100 NVL", 835e12),
    ("H100", 989e12),
    ("H800", 989e12),
    ("GH200", 989e12),
    ("B200", 2250e12),
    ("B100", 1750e12),
    ("A100", 312e12),
    ("A800", 312e12),
    ("L40S", 362e12),
    ("L40", 181e12),
    ("L4", 121e12),
    ("A10G", 125e12),
    ("A10", 125e12),
    ("RTX 4090", 165e12),
    ("RTX 3090", 71e12),
    ("V100", 125e12),
    ("T4", 65e12),
]


def peak_flops(device: torch.device) -> float | None:
    """The device's dense half-precision peak FLOP/s, or None where unknown (CPU, unlisted GPUs)."""
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    for key, value in PEAK_FLOPS:
        if key in name:
            return value
    return None


def peak_memory(device: torch.device) -> dict[str, int]:
    """Peak memory so far: allocated and reserved on CUDA, and how many times the allocator found no room and freed
    its cache to retry (``alloc_retries``, host-side counters, no sync); RSS on CPU."""
    if device.type == "cuda":
        return {
            "peak_memory_bytes": torch.cuda.max_memory_allocated(device),
            "peak_reserved_bytes": torch.cuda.max_memory_reserved(device),
            "alloc_retries": int(torch.cuda.memory_stats(device).get("num_alloc_retries", 0)),
        }
    # ru_maxrss is KiB on Linux, bytes on macOS
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return {"peak_memory_bytes": rss if sys.platform == "darwin" else rss * 1024}


def host_step(optimizer: Any) -> dict[str, Any]:
    """The last step's host optimizer figures, for a CPU-offloaded optimizer (none for torch's own): the CPU
    time of its host work (``host_step_s``), how long the step waited for it (``host_wait_s``) and how long the
    step thread waited for gradient copies (``host_copy_wait_s``); a host step longer than the GPU's work is the
    step's floor. With ``--offload.trace_steps`` also ``host_trace``: per kind of event of the optimizer's timeline
    (``CPUOffloadConfig.trace_steps``: ``step``, ``copied``, ``fwd_wait``, ...) its count, busy seconds, and first
    start and last end in seconds from the previous ``step()``, so that a slow host step shows whether it computed
    or waited."""
    stats = getattr(optimizer, "stats", None)
    if not callable(stats):
        return {}
    s = stats()
    if not s.get("offloaded_params"):
        return {}
    out: dict[str, Any] = {"host_step_s": float(s["cpu_step_s"]), "host_wait_s": float(s["cpu_wait_s"]),
                           "host_copy_wait_s": float(s.get("copy_wait_s", 0.0)), "host_threads": int(s["cpu_threads"])}
    if s.get("trace") is not None:
        from elbowroom.optim.stats import trace_summary

        out["host_trace"] = trace_summary(s["trace"])
    return out


def _budget_flag(n: int) -> str:
    """A budget as ``--budget`` reads it: GiB to one decimal, or bytes below 1 GiB (a small model's)."""
    return f"{n / 2**30:.1f}GiB" if n >= 1 << 30 else f"{n}B"


class BudgetWatch:
    """Warns once when a planned run's allocator reserves more than the plan's budget (what a device of the
    budget's size would not have): the plan's margin missed something, and ``--budget`` needs that much less.

    And once when the allocator keeps retrying after the first logged row: on a device (or under a memory cap) the
    budget fills, each retry frees the allocator's cache, which first waits for all the device's work, copies in flight
    included (the 7B shape's streaming plans at a 76 GiB cap: 200 ms a step, ``BENCHMARKS.md``, twelfth session)."""

    RETRY_MARGIN = 0.05
    """The share of the budget the retry warning suggests planning below it (:meth:`lower_budget`): the allocator's
    cap cut the reserved peak, so how far it would have gone is not known. On the 7B shape (H200, 76 GiB cap,
    ``BENCHMARKS.md`` twenty-fifth session) the 76 GiB plans held 3.2-5.0 GiB beyond their allocated peak and
    retried 9-37 times in 10 steps (1.28-1.51x their predicted step), where a plan for 72 GiB (5% less) reserved
    74.5 GiB and never retried; 2% (the earlier figure) would have left it retrying."""

    def __init__(self, plan: Any, limit: int | None = None, suggest: str = "--budget {}") -> None:
        self.suggest = suggest  # how the retry warning names a lower budget (fit's own loop: "fit(budget='{}')")
        self.budget = getattr(plan, "budget_bytes", None)
        # what the reserved peak may reach: --budget, where the plan was made again below it (planning.with_replans)
        self.limit = self.budget if limit is None or self.budget is None else limit
        self.predicted = getattr(plan, "predicted_peak_bytes", None)
        self.predicted_step = getattr(plan, "predicted_step_seconds", None)
        self._last_step: int | None = None  # the last row keeps_retrying saw
        self._paces: list[float] = []  # seconds a step of each row keeps_retrying saw after the first
        self.pace_s: float | None = None  # their median, once there are PaceWatch.ROWS of them
        self.warned = False
        self.retries: tuple[Any, int] | None = None  # (step, count) of the first row that counted retries
        self.warned_retries = False

    def check(self, row: dict[str, Any]) -> str | None:
        """The warning for a metrics row whose reserved peak passed the budget, or after which the allocator retried
        (logged), each once; else None."""
        reserved, retries = self._check_reserved(row), self._check_retries(row)  # both: the first row is a baseline
        return reserved or retries

    def _check_retries(self, row: dict[str, Any]) -> str | None:
        count = row.get("alloc_retries")
        if self.warned_retries or self.budget is None or count is None:
            return None
        if self.retries is None:  # the first step's own (warm-up, profiling) set the baseline
            self.retries = (row.get("step"), count)
            return None
        since, base = self.retries
        if count <= base:
            return None
        self.warned_retries = True
        lower = self.lower_budget()
        msg = (f"step {row.get('step')}: the allocator found no room {count - base} times since step {since} and freed "
               f"its cache to retry, which waits for all the device's work each time (reserved "
               f"{row.get('peak_reserved_bytes', 0) / 2**30:.2f} GiB, allocated "
               f"{row.get('peak_memory_bytes', 0) / 2**30:.2f}, the plan's predicted peak "
               f"{(self.predicted or 0) / 2**30:.2f} of {self.budget / 2**30:.2f} GiB): the plan sits at this device's "
               f"edge; plan for less, e.g. {self.suggest.format(_budget_flag(lower))}")
        log.warning("%s", msg)
        return msg

    def keeps_retrying(self, row: dict[str, Any]) -> bool:
        """Whether, by this logged row (pass every one, after :meth:`check`), the allocator has retried at least once
        a step since the first row, over at least :data:`PaceWatch.ROWS` rows, and those rows' median step ran slow
        as :class:`PaceWatch` counts slow: what the trainer plans again for.

        A few retries in the first steps, or retries a long step hides, are left alone: the 7B shape at eight
        sequences a step retried 33 times in 8 steps and ran at 0.99x its prediction, at one sequence 24-37 times in
        10 steps at 1.32-1.51x (``BENCHMARKS.md``, twenty-fourth and twenty-fifth sessions). One slow row is not
        enough either: the 7B's second step waits 2.4 s for the host optimizer's first step (twenty-sixth session)."""
        step, elapsed, count = row.get("step"), row.get("elapsed_s"), row.get("alloc_retries")
        last, self._last_step = self._last_step, step
        if self.retries is None or not self.predicted_step or None in (step, elapsed, count, last) or step <= last:
            return False
        since, base = self.retries
        if since is None or step <= since:
            return False
        self._paces.append(elapsed / (step - last))
        if len(self._paces) < PaceWatch.ROWS:
            return False
        step_s = self.pace_s = statistics.median(self._paces)
        if count - base < step - since:
            return False
        return (step_s > (1.0 + PaceWatch.TOLERANCE) * self.predicted_step
                and step_s - self.predicted_step >= PaceWatch.MIN_EXCESS_S)

    def lower_budget(self, budget: int | None = None) -> int:
        """The budget the retry warning suggests for ``budget`` (default: the plan's): :data:`RETRY_MARGIN` below it,
        and at least 0.5 GiB (or a tenth of it, where that is less) below it."""
        b = self.budget if budget is None else budget
        assert b is not None
        return b - max(int(self.RETRY_MARGIN * b), min(1 << 29, b // 10))

    def _check_reserved(self, row: dict[str, Any]) -> str | None:
        reserved = row.get("peak_reserved_bytes")
        if self.warned or self.limit is None or reserved is None or reserved <= self.limit:
            return None
        self.warned = True
        over = reserved - self.limit
        # (an overshoot of a few MiB, an expandable segment's granule, reads in MiB: "0.00 GiB above" said nothing)
        by = f"{over / 2**20:.0f} MiB" if over < 2**30 // 10 else f"{over / 2**30:.2f} GiB"
        msg = (f"step {row.get('step')}: the allocator reserved {reserved / 2**30:.2f} GiB, {by} "
               f"above the budget of {self.limit / 2**30:.2f} GiB (the plan's {self.budget / 2**30:.2f}, predicted "
               f"peak {(self.predicted or 0) / 2**30:.2f} GiB, allocated "
               f"{row.get('peak_memory_bytes', 0) / 2**30:.2f}); on a device of the budget's size plan for about "
               f"{max(self.budget - over, 0) / 2**30:.2f} GiB")
        log.warning("%s", msg)
        return msg


class PaceWatch:
    """Warns once when a planned run's steps keep taking longer than the plan predicted, beyond :data:`TOLERANCE`,
    and names the host optimizer when its step ran slower than the plan priced it: the planner measured the host's
    pace once, and on a shared host it can run at 0.6 of that in training (W1 at 8 GiB: 0.79 s steps against 0.54
    predicted on one machine, 0.43 on another whose profile measured the same pace; ``BENCHMARKS.md``, thirteenth
    session). The first logged row (warm-up, compilation, the first forward's waits) is left out; the median of the
    next :data:`ROWS` rows decides."""

    TOLERANCE = 0.15
    """How much slower than predicted a step may run before the warning (the planner's own check: within 15%)."""
    ROWS = 3
    """Logged rows after the first whose median step time is compared with the prediction."""
    MIN_EXCESS_S = 0.05
    """Seconds a step (or the host step) must run over its prediction before the warning, whatever the ratio: below
    that the loop's own costs per step, which no plan prices (the next batch, the logging's sync), are the gap (the
    tiny model on the H100: 27 ms steps against 15 ms predicted)."""

    def __init__(self, plan: Any) -> None:
        self.predicted = getattr(plan, "predicted_step_seconds", None)
        times = getattr(plan, "time", None) or {}
        self.host_predicted = times.get("host optimizer step (whole)")
        self.last_step: int | None = None
        self.seen: list[tuple[float, float | None]] = []  # (seconds per step, host step seconds) per row
        self.done = False

    def check(self, row: dict[str, Any]) -> str | None:
        """The warning, once, when the median of the rows after the first runs slow; else None."""
        step, elapsed = row.get("step"), row.get("elapsed_s")
        if self.done or not self.predicted or step is None or elapsed is None:
            return None
        last, self.last_step = self.last_step, step
        if last is None or step <= last:  # the first row: warm-up
            return None
        return self._add(elapsed / (step - last), row.get("host_step_s"))

    def _add(self, step_s: float, host_s: float | None) -> str | None:
        self.seen.append((step_s, host_s))
        if len(self.seen) < self.ROWS:
            return None
        self.done = True
        median = sorted(t for t, _ in self.seen)[len(self.seen) // 2]
        ratio = median / self.predicted
        if ratio <= 1.0 + self.TOLERANCE or median - self.predicted < self.MIN_EXCESS_S:
            log.info("steps take %.3f s, %.2fx the plan's prediction of %.3f s", median, ratio, self.predicted)
            return None
        msg = f"steps take {median:.3f} s, {ratio:.2f}x the plan's prediction of {self.predicted:.3f} s"
        hosts = sorted(h for _, h in self.seen if h is not None)
        if hosts and self.host_predicted:
            host = hosts[len(hosts) // 2]
            if host > (1.0 + self.TOLERANCE) * self.host_predicted and host - self.host_predicted >= self.MIN_EXCESS_S:
                msg += (f": the host optimizer stepped in {host:.2f} s against {self.host_predicted:.2f} s priced, "
                        f"{self.host_predicted / host:.2f} of the pace the planner measured on this machine (a "
                        f"shared host's memory bandwidth varies); a larger --budget puts fewer blocks' optimizer "
                        f"on the host")
        log.warning("%s", msg)
        return msg


def check_tensorboard() -> None:
    """Raise ValueError naming the extra to install when TensorBoard logging cannot work here."""
    try:
        from torch.utils.tensorboard import SummaryWriter  # noqa: F401
    except ImportError:
        raise ValueError(
            "logging.tensorboard needs the tensorboard package, which is not installed: "
            "pip install 'elbowroom[tensorboard]', or drop --logging.tensorboard"
        ) from None


class MetricsLogger:
    """Appends one JSON object per logged step to ``metrics.jsonl`` and mirrors it to log and TensorBoard.

    Nothing is written, and the run directory is not created, before the first :meth:`write`: a run that
    fails before its first step leaves nothing behind. Rows are only ever appended; no logged row is lost.

    Args:
        out_dir: the run directory.
        resume_step: when resuming, rows after this step (written after the checkpoint by an earlier,
            interrupted run, or by a run whose newer checkpoints were corrupt) move to
            ``metrics.rewound-<resume_step>.jsonl`` so that the main file continues one curve; None: a new run.
        tensorboard: also write TensorBoard scalars (needs the ``tensorboard`` package; see
            :func:`check_tensorboard`).
    """

    def __init__(self, out_dir: Path, *, resume_step: int | None, tensorboard: bool = False) -> None:
        self.out_dir = out_dir
        self.path = out_dir / "metrics.jsonl"
        self.resume_step = resume_step
        self.tensorboard = tensorboard
        self._f: Any = None
        self._tb: Any = None

    def _open(self) -> None:
        self.out_dir.mkdir(parents=True, exist_ok=True)
        if self.resume_step is not None and self.path.exists():
            self._rewind(self.resume_step)
        self._f = open(self.path, "a", buffering=1)  # line buffered: a crash loses at most one line
        if self.tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            self._tb = SummaryWriter(str(self.out_dir / "tensorboard"))

    def _rewind(self, step: int) -> None:
        """Move the rows after ``step`` (and lines cut by a crash) to a side file; keep the rest in place."""
        keep, moved = [], []
        for line in self.path.read_text().splitlines():
            try:
                row = json.loads(line)
            except json.JSONDecodeError:  # a line cut by a crash: kept aside, it would break readers here
                moved.append(line)
                continue
            (keep if row.get("step", 0) <= step else moved).append(line)
        if not moved:
            return
        side = self.out_dir / f"metrics.rewound-{step}.jsonl"
        with open(side, "a") as f:  # written before the main file shrinks: no row exists nowhere
            f.write("".join(x + "\n" for x in moved))
            f.flush()
            os.fsync(f.fileno())
        tmp = self.path.with_suffix(".jsonl.tmp")
        tmp.write_text("".join(x + "\n" for x in keep))
        os.replace(tmp, self.path)
        log.warning("resuming at step %d: moved %d logged rows after it from %s to %s", step, len(moved),
                    self.path.name, side.name)

    def write(self, row: dict[str, Any]) -> None:
        if self._f is None:
            self._open()
        self._f.write(json.dumps(row) + "\n")
        if self._tb is not None:
            for k, v in row.items():
                if k != "step" and isinstance(v, (int, float)) and v is not None:
                    self._tb.add_scalar(k, v, row["step"])
        log.info(format_row(row))

    def close(self) -> None:
        if self._f is not None:
            self._f.close()
        if self._tb is not None:
            self._tb.close()


def format_row(row: dict[str, Any]) -> str:
    """The torchtitan-shaped log line: step, loss, lr, grad norm, speed, memory."""
    parts = [f"step {row['step']:>6}"]
    if "loss" in row:
        parts.append(f"loss {row['loss']:.4f}")
    if "val_loss" in row:
        parts.append(f"val {row['val_loss']:.4f}")
    if "lr" in row:
        parts.append(f"lr {row['lr']:.2e}")
    if row.get("grad_norm") is not None:
        parts.append(f"gnorm {row['grad_norm']:.3f}")
    if "tokens_per_s" in row:
        parts.append(f"tok/s {row['tokens_per_s']:,.0f}")
    if row.get("tflops") is not None:
        parts.append(f"TFLOP/s {row['tflops']:.1f}")
    if row.get("mfu") is not None:
        parts.append(f"MFU {100 * row['mfu']:.1f}%")
    if "peak_memory_bytes" in row:
        parts.append(f"mem {row['peak_memory_bytes'] / 2**30:.2f}GiB")
    if "host_step_s" in row:
        parts.append(f"host step {row['host_step_s']:.2f}s (waited {row['host_wait_s']:.2f}s)")
    return "  ".join(parts)
