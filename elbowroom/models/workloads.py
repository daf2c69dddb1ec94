"""The benchmark workloads of DESIGN.md, defined once: a model preset, a micro-batch and an accumulation.

The benchmarks (``benchmarks/bench.py``), the planner's CLI (``elbowroom plan --model w1``) and the configs
in ``configs/`` all mean these shapes; a change here changes them everywhere.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Workload:
    """A training shape: which model, how many sequences of what length per micro-batch, how many micro-batches."""

    preset: str
    """Model preset (``elbowroom.models.PRESETS``)."""
    batch_size: int
    """Sequences per micro-batch."""
    seq_len: int
    """Tokens per sequence."""
    gradient_accumulation_steps: int = 1
    """Micro-batches per optimizer step."""

    @property
    def tokens_per_step(self) -> int:
        return self.batch_size * self.seq_len * self.gradient_accumulation_steps


WORKLOADS: dict[str, Workload] = {
    "w1": Workload("w1", 4, 4096),
    "w2": Workload("w2", 1, 8192),
    "w3": Workload("7b", 1, 4096),
    "w3-accum8": Workload("7b", 1, 4096, 8),
    "gpt2-xl": Workload("gpt2-xl", 8, 1024),
    # a small shape to check the harness itself, on a CPU too
    "smoke": Workload("tiny", 4, 128),
}
