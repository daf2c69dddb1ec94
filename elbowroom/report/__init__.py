"""elbowroom.report: record chosen training steps, then draw what happened beside what the plan predicted.

Recording, around any training loop (nothing is installed outside the chosen steps)::

    from elbowroom.report import record
    with record("runs/a", steps="3-4", model=model, optimizer=opt) as rec:
        for step in ...:
            ...                      # forward, backward, opt.step(), opt.zero_grad()
            rec.step()

A trainer builds a :class:`Recorder` from a :class:`RecordConfig` (``--profile.steps 3-4``) and calls
``step_begin(step)`` / ``step_end(step)``; on ``torch.OutOfMemoryError`` it calls :func:`write_oom_report`.
Afterwards ``elbowroom report RUN_DIR`` (:func:`cmd_report`, :func:`write_report`) writes ``RUN_DIR/report/``.

Importing this package imports neither matplotlib nor the drawing code, and never initialises CUDA.
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "RecordConfig": "elbowroom.report.config",
    "parse_steps": "elbowroom.report.config",
    "Recorder": "elbowroom.report.recorder",
    "record": "elbowroom.report.recorder",
    "write_oom_report": "elbowroom.report.oom",
    "write_report": "elbowroom.report.cli",
    "cmd_report": "elbowroom.report.cli",
    "CATEGORIES": "elbowroom.report.categories",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'elbowroom.report' has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)


def __dir__() -> list[str]:
    return __all__
