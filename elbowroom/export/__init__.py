"""Export a trained model: Hugging Face, ONNX, quantised (torchao), pruned; QAT and distillation for training.

``elbowroom export hf|onnx|quantize|prune RUN_DIR_OR_CHECKPOINT --out PATH`` (:mod:`elbowroom.export.cli`)
and the library verbs below. The packages these need (torchao, onnx, onnxscript, onnxruntime, safetensors,
transformers) are the ``export`` extra and are imported only when an export runs: importing this package
imports none of them, and a missing one exits 2 naming ``pip install 'elbowroom[export]'``.

Modules, one concept each: ``source`` (checkpoint in, validation split, staged output), ``hf``,
``onnx_export``, ``quantize``, ``prune``, ``qat``, ``distill``, ``cli``.
"""

from __future__ import annotations

import importlib
from typing import Any

__all__ = [
    "ExportError",
    "load_source",
    "save_hf",
    "export_onnx",
    "quantize_model",
    "prune_model",
    "prepare_qat",
    "convert_qat",
    "distillation_loss",
    "load_teacher",
]

_WHERE = {
    "ExportError": "source",
    "load_source": "source",
    "save_hf": "hf",
    "export_onnx": "onnx_export",
    "quantize_model": "quantize",
    "prune_model": "prune",
    "prepare_qat": "qat",
    "convert_qat": "qat",
    "distillation_loss": "distill",
    "load_teacher": "distill",
}


def __getattr__(name: str) -> Any:
    # lazy: the verbs' modules are light, but importing them on first use keeps `import elbowroom.export` cheap
    if name in _WHERE:
        return getattr(importlib.import_module(f"elbowroom.export.{_WHERE[name]}"), name)
    raise AttributeError(f"module 'elbowroom.export' has no attribute {name!r}")
