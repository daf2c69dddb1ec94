"""What every benchmark mode returns to the harness (``bench.py``); shared so that mode modules need not
import the harness that imports them."""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any


@dataclass
class Setup:
    """How a mode trains: its optimizer, a context entered around each micro-batch's forward+backward."""

    optimizer: Any
    context: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext
    stats: Callable[[], dict[str, Any]] | None = None
    """Extra numbers the mode reports after the run (e.g. CPU step time)."""
    notes: dict[str, Any] = field(default_factory=dict)
    backward: Callable[[Any], None] | None = None
    """Runs each micro-batch's backward in place of ``loss.backward()`` (DeepSpeed's engine must see it)."""
    fused_loss: bool | None = None
    """The mode's own choice of the fused head and loss (a plan's); None: the ``+fl`` suffix decides."""
    micro_batch: int | None = None
    """Samples per forward when the mode splits the workload's batch (a plan's micro-batch); None: the whole batch.
    The micro-batches of one step accumulate (the optimizer is told which backward passes are not the last)."""
