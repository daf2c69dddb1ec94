"""Does a busy host slow the device's step? A model's forward + backward timed with CUDA events, quiet and while a
background thread runs torch's fused CPU AdamW on the optimizer's thread count (what the host optimizer step does
beside the training thread), plain and with every block recomputed. With ``--load churn`` the background thread
instead does what the offloaded optimizer's copy and step threads do per parameter: short Python between small
tensor ops, each of which gives the interpreter's lock up and takes it back (``--churn-gap`` seconds of sleep between
bursts of ``--churn-ops`` ops: 0 keeps it busy).

    python3 benchmarks/host_load.py --workload gpt2-xl
    python3 benchmarks/host_load.py --workload w1 --precision bf16

A row per (mode, load): the median step seconds and the slowdown under load. Where the step is bound by the
training or autograd thread's dispatch (many small kernels), the load shows; where the GPU bounds it, it does not.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import threading
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from elbowroom.activations.recompute import checkpoint, uncheckpoint  # noqa: E402
from elbowroom.models import build_model  # noqa: E402
from elbowroom.models.decoder import PRESETS  # noqa: E402
from elbowroom.models.workloads import WORKLOADS  # noqa: E402
from elbowroom.optim.config import default_step_threads  # noqa: E402


class _Background:
    """A thread running ``_work`` over and over from ``with`` to its end, counting the rounds in ``steps``."""

    def __init__(self) -> None:
        self.stop = threading.Event()
        self.steps = 0
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _setup(self) -> None:
        """Once, on the thread, before the first round."""

    def _work(self) -> None:
        raise NotImplementedError

    def _run(self) -> None:
        self._setup()
        while not self.stop.is_set():
            self._work()

    def __enter__(self) -> _Background:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        self.thread.join()


class HostLoad(_Background):
    """A thread stepping fused CPU AdamW on ``numel`` parameters on the optimizer's thread count until stopped."""

    def __init__(self, numel: int) -> None:
        super().__init__()
        self.p = torch.nn.Parameter(torch.zeros(numel))
        self.p.grad = torch.full((numel,), 1e-3)
        self.opt = torch.optim.AdamW([self.p], lr=1e-4, fused=True)

    def _setup(self) -> None:
        torch.set_num_threads(default_step_threads())

    def _work(self) -> None:
        self.opt.step()
        self.steps += 1


class Churn(_Background):
    """A thread doing what the optimizer's workers do per parameter until stopped: a view, a small copy and a few
    lines of Python, over and over (each tensor op releases the interpreter's lock and takes it back)."""

    def __init__(self, ops: int, gap: float) -> None:
        super().__init__()
        self.src = torch.zeros(1 << 16)
        self.dst = torch.zeros(1 << 16)
        self.ops, self.gap = ops, gap

    def _setup(self) -> None:
        torch.set_grad_enabled(False)

    def _work(self) -> None:
        for i in range(self.ops):
            a = (i * 64) % 4096
            view = self.dst[a : a + 64].view(8, 8)
            view.copy_(self.src[a : a + 64].view(8, 8))
            self.steps += 1
        if self.gap:
            time.sleep(self.gap)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--workload", default="gpt2-xl")
    ap.add_argument("--precision", choices=["fp32", "bf16"], default="fp32",
                    help="fp32 weights under bf16 autocast, or the model in bf16")
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--numel", type=int, default=50_000_000)
    ap.add_argument("--load", choices=["adamw", "churn"], default="adamw")
    ap.add_argument("--churn-ops", type=int, default=1000)
    ap.add_argument("--churn-gap", type=float, default=0.0)
    args = ap.parse_args()
    w = WORKLOADS[args.workload]
    cfg = PRESETS[w.preset]
    model = build_model(cfg, device="cuda")
    if args.precision == "bf16":
        model = model.to(torch.bfloat16)
    idx = torch.randint(0, cfg.vocab_size, (w.batch_size, w.seq_len), device="cuda")
    amp = torch.autocast("cuda", dtype=torch.bfloat16, enabled=args.precision == "fp32")

    def step() -> float:
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        with amp:
            logits = model(idx)
        F.cross_entropy(logits.float().flatten(0, 1), idx.flatten()).backward()
        b.record()
        b.synchronize()
        model.zero_grad(set_to_none=True)
        return a.elapsed_time(b) / 1e3

    print(f"| {args.workload} {args.precision} | mode | host load | step s | slowdown | load steps |")
    print("|---|---|---|---|---|---|")
    for mode in ("plain", "full"):
        for b in model.blocks:
            if mode == "full":
                checkpoint(b, "full")
            else:
                uncheckpoint(b)
        quiet = None
        for loaded in (False, True, False):
            step()
            load: _Background | None = None
            if loaded:
                load = HostLoad(args.numel) if args.load == "adamw" else Churn(args.churn_ops, args.churn_gap)
            if load is not None:
                load.__enter__()
            try:
                times = [step() for _ in range(args.steps)]
            finally:
                if load is not None:
                    load.__exit__(None, None, None)
            med = statistics.median(times)
            quiet = med if (quiet is None and not loaded) else quiet
            print(f"| | {mode} | {args.load if loaded else 'quiet'} | {med:.4f} | {med / quiet:.2f} | "
                  f"{load.steps if load else ''} |")


if __name__ == "__main__":
    main()
