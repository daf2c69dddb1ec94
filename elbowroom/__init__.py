"""elbowroom: train PyTorch models bigger than your GPU at nearly full speed.

Importing elbowroom never initialises CUDA; the public verbs are re-exported lazily so that
``import elbowroom`` stays cheap.
"""

from __future__ import annotations

import importlib
from typing import Any

__version__ = "0.1.0"

# public name -> module that defines it
_EXPORTS = {
    "checkpoint": "elbowroom.activations.recompute",
    "gradient_checkpointing_enable": "elbowroom.activations.recompute",
    "offload": "elbowroom.activations.offload",
    "compile_blocks": "elbowroom.activations.compiled",
    "linear_cross_entropy": "elbowroom.ops.linear_cross_entropy",
    "CPUOffloadOptimizer": "elbowroom.optim.offload",
    "CPUOffloadConfig": "elbowroom.optim.config",
    "ActivationConfig": "elbowroom.activations.policy",
    "fit": "elbowroom.plan",
    "plan_for": "elbowroom.plan",
    "profile": "elbowroom.plan",
    "apply": "elbowroom.plan",
    "Plan": "elbowroom.plan",
    "BudgetError": "elbowroom.plan",
    "ModelConfig": "elbowroom.models",
    "build_model": "elbowroom.models",
}

__all__ = sorted(_EXPORTS) + ["__version__"]


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'elbowroom' has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)


def __dir__() -> list[str]:
    return __all__
