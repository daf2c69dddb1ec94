"""The export extra's packages, imported only when an export needs them.

Importing ``elbowroom`` or ``elbowroom.export`` imports none of torchao, onnx, onnxscript, onnxruntime,
safetensors or transformers (tested); each export asks for its own here, and a missing one is an
:class:`~elbowroom.export.source.ExportError` that names the extra to install.
"""

from __future__ import annotations

import importlib
from types import ModuleType

from elbowroom.export.source import ExportError

EXTRA = "pip install 'elbowroom[export]'"
"""The install line named by every missing-package error."""

PACKAGES = {
    "torchao": "torchao",
    "onnx": "onnx",
    "onnxscript": "onnxscript",
    "onnxruntime": "onnxruntime",
    "safetensors": "safetensors",
    "transformers": "transformers",
}
"""Importable module -> distribution name, for the error message."""


class MissingExtraError(ExportError):
    """A package of the export extra is not installed."""


def require(module: str, what: str) -> ModuleType:
    """Import ``module`` (a top-level package of the export extra) or raise with the install line.

    Args:
        module: e.g. "torchao" or "onnxruntime.quantization".
        what: the export that needs it, for the message ("the onnx export").

    Raises:
        MissingExtraError: the package is not installed.
    """
    try:
        return importlib.import_module(module)
    except ImportError as e:
        top = module.split(".")[0]
        raise MissingExtraError(
            f"{what} needs {PACKAGES.get(top, top)}, which is not installed ({e}); run: {EXTRA}"
        ) from None
