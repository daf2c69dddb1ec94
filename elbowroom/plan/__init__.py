"""elbowroom.plan: profile -> cost -> planner -> Plan -> apply.

Profiling (this round): :func:`profile` measures or traces a model into a :class:`Profile`;
:func:`get_device` reads the device table, :func:`measure_machine` measures the machine.
Imports are lazy so that ``import elbowroom.plan`` stays cheap and never initialises CUDA.
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "profile": "elbowroom.plan.profiler",
    "get_device": "elbowroom.plan.devices",
    "DEVICES": "elbowroom.plan.devices",
    "measure_machine": "elbowroom.plan.machine",
    "BlockProfile": "elbowroom.plan.types",
    "HeadProfile": "elbowroom.plan.types",
    "MachineProfile": "elbowroom.plan.types",
    "Profile": "elbowroom.plan.types",
    "profile_from_dict": "elbowroom.plan.types",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'elbowroom.plan' has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)


def __dir__() -> list[str]:
    return __all__
