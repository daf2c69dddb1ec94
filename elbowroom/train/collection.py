"""Python's garbage collection on the trainer's schedule, not the interpreter's.

The automatic collector runs when allocations cross its thresholds, at a point no one chooses: a full collection
over a model's and optimizer's objects pauses that process for milliseconds. In one process the GPU's queue usually
hides the pause; under data parallel the other ranks wait for the paused one at the next collective, so every
rank's pause costs every rank. With ``train.gc_every N`` the trainer turns the automatic collector off for its loop
and collects the young generations every N steps, on all ranks at the same step (as torchtitan does).

Measured (W1 under DDP on 2 H200s, 30 steps): 93.3% of twice one GPU with collection every 50 steps, 92.8% with
Python's own: no pause showed at two ranks, so the default stays Python's.
"""

from __future__ import annotations

import gc
import logging

logger = logging.getLogger(__name__)


class GarbageCollection:
    """Collect every ``every`` steps with the automatic collector off (``every=0``: leave Python's collector as it is).

    Use as a context manager around the loop, calling :meth:`step` after each optimizer step; on exit the collector
    is as it was before.
    """

    def __init__(self, every: int):
        if every < 0:
            raise ValueError(f"train.gc_every must be >= 0 (0: Python's automatic collection), got {every}")
        self.every = every
        self._was_enabled = False  # read on entry

    def __enter__(self) -> GarbageCollection:
        if self.every:
            self._was_enabled = gc.isenabled()
            gc.collect()  # what setup left behind, once, before the first step
            gc.disable()
        return self

    def step(self, step: int) -> None:
        """After optimizer step ``step`` (counted from 1): collect generation 1 every ``every`` steps."""
        if self.every and step % self.every == 0:
            gc.collect(1)

    def __exit__(self, *exc: object) -> None:
        if self.every and self._was_enabled:
            gc.enable()
