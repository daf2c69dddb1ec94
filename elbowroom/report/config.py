"""RecordConfig: which steps a run records, and what it records for them (``--profile.*`` on the CLI)."""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["RecordConfig", "parse_steps"]


def parse_steps(spec: str) -> frozenset[int]:
    """The step numbers of a ``--profile.steps`` value.

    Args:
        spec: ``""`` (none), ``"3"``, ``"3-4"`` (inclusive), ``"3,5"``, or a mix such as ``"2,4-6"``.

    Returns:
        The set of step numbers.

    Raises:
        ValueError: on anything else, naming the accepted forms.
    """
    steps: set[int] = set()
    for part in (p.strip() for p in spec.split(",")):
        if not part:
            continue
        lo_s, sep, hi_s = part.partition("-")
        try:
            lo = int(lo_s)
            hi = int(hi_s) if sep else lo
        except ValueError:
            raise ValueError(
                f"profile steps must look like '3', '3-4' or '3,5' (step numbers as in metrics.jsonl), got {spec!r}"
            ) from None
        if lo < 0 or hi < lo:
            raise ValueError(
                f"profile steps: a range is 'low-high' with 0 <= low <= high such as '3-4', got {part!r} in {spec!r}"
            )
        steps.update(range(lo, hi + 1))
    return frozenset(steps)


@dataclass(frozen=True)
class RecordConfig:
    """What ``elbowroom.report.record`` captures; recording is off (and costs nothing) while ``steps`` is empty."""

    steps: str = ""
    """Steps to record, numbered as in metrics.jsonl: "3-4" (inclusive), "3,5", or "" for none."""
    snapshot: bool = True
    """On CUDA: record allocation history with Python stacks and dump torch's memory snapshot pickle."""
    trace: bool = True
    """Run torch.profiler (CPU and CUDA activities) over the steps and export a Chrome/Perfetto trace."""
    timeline: bool = True
    """Sample live bytes by category at every block's forward and backward and around the optimizer step."""
    max_entries: int = 100_000
    """Allocation events the CUDA history keeps (a ring buffer): bounds the snapshot's size and cost."""

    def __post_init__(self) -> None:
        if not isinstance(self.steps, str):
            raise ValueError(f"steps must be a string such as '3-4' or '3,5', got {self.steps!r}")
        parse_steps(self.steps)  # raises with the accepted forms
        if isinstance(self.max_entries, bool) or not isinstance(self.max_entries, int) or self.max_entries < 1:
            raise ValueError(f"max_entries must be a positive int (e.g. 100000), got {self.max_entries!r}")
        for name in ("snapshot", "trace", "timeline"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be true or false, got {getattr(self, name)!r}")
        if self.steps and not (self.snapshot or self.trace or self.timeline):
            raise ValueError(
                "profile steps are set but snapshot, trace and timeline are all off: turn one on or clear steps"
            )

    @property
    def enabled(self) -> bool:
        """Whether any step is recorded."""
        return bool(parse_steps(self.steps))

    @property
    def step_set(self) -> frozenset[int]:
        """The recorded step numbers."""
        return parse_steps(self.steps)
