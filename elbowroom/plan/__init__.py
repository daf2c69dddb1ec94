"""elbowroom.plan: state a memory budget; elbowroom profiles the model, decides, predicts and applies.

Data flows one way: model + sample batch -> :class:`Profile` (:func:`profile`, measured on the device or traced
on the meta device against the device table) -> cost model (:mod:`elbowroom.plan.cost`) and search
(:func:`plan_for`) -> :class:`Plan` (plain data: printed, saved as TOML/JSON, edited, loaded) -> :func:`apply`
(the mechanisms wired to the model). :func:`fit` does all of it in one call. :func:`get_device` reads the device
table, :func:`measure_machine` measures this machine. Imports are lazy: ``import elbowroom.plan`` stays cheap and
never initialises CUDA.
"""

from __future__ import annotations

import importlib
from typing import Any

# Eager: these submodules share their names with the functions they define (``elbowroom.plan.fit`` the module
# would otherwise shadow ``fit`` the function once imported). They import torch and nothing that touches a device.
from elbowroom.plan.apply import apply
from elbowroom.plan.fit import fit, parse_budget
from elbowroom.plan.plan import BlockPlan, Plan
from elbowroom.plan.search import BudgetError, plan_for

_LAZY = {
    "profile": "elbowroom.plan.profiler",
    "get_device": "elbowroom.plan.devices",
    "DEVICES": "elbowroom.plan.devices",
    "measure_machine": "elbowroom.plan.machine",
    "measure_shared_link": "elbowroom.plan.machine",
    "BlockProfile": "elbowroom.plan.types",
    "HeadProfile": "elbowroom.plan.types",
    "MachineProfile": "elbowroom.plan.types",
    "Profile": "elbowroom.plan.types",
    "profile_from_dict": "elbowroom.plan.types",
}

__all__ = [
    "DEVICES", "BlockPlan", "BlockProfile", "BudgetError", "HeadProfile", "MachineProfile", "Plan", "Profile",
    "apply", "fit", "get_device", "measure_machine", "measure_shared_link", "parse_budget", "plan_for", "profile",
    "profile_from_dict",
]  # fmt: skip


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'elbowroom.plan' has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)


def __dir__() -> list[str]:
    return __all__
