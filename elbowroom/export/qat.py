"""Quantisation-aware training with torchao: fake-quantised ``Linear`` layers to train, then real int weights.

``prepare_qat(model, "int8" | "int4")`` swaps every block ``Linear`` for torchao's ``FakeQuantizedLinear``
(activations fake-quantised to int8 per token, weights to int8 per channel or int4 in groups of 32, with
straight-through gradients); training goes on as usual. ``convert_qat(model)`` then replaces them with the
quantised weights of the matching post-training recipe
(``Int8DynamicActivationIntxWeightConfig``), whose outputs equal the fake-quantised model's (tested). The
output head stays in fp32, as in :mod:`elbowroom.export.quantize`'s int4 recipe.

The trainer's ``--train.qat int8|int4`` is two calls around the loop::

    model = build_model(cfg)
    prepare_qat(model, "int8")      # before the optimizer is built (the swapped layers keep the parameters)
    ...train...
    convert_qat(model)              # before saving/exporting the quantised model

A QAT run's checkpoints hold the float weights under the float model's keys (the swapped layers keep their
parameters) and its config records the scheme: :func:`load_trained` rebuilds the model as it trained, which
``elbowroom export quantize RUN --method qat`` then converts.
"""

from __future__ import annotations

import torch
from torch import nn

from elbowroom.export._deps import require
from elbowroom.export.source import ExportError, Source
from elbowroom.models import build_model

__all__ = ["SCHEMES", "prepare_qat", "convert_qat", "run_scheme", "load_trained"]

SCHEMES = ("int8", "int4")
"""The QAT schemes: int8 activations per token with int8 (per channel) or int4 (groups of 32) weights."""

GROUP_SIZE = 32
"""Weights per int4 scale."""


def _base_config(scheme: str):
    ao = require("torchao.quantization", "QAT")
    from torchao.quantization.granularity import PerAxis, PerGroup

    if scheme == "int8":
        return ao.Int8DynamicActivationIntxWeightConfig(weight_dtype=torch.int8, weight_granularity=PerAxis(0))
    if scheme == "int4":
        return ao.Int8DynamicActivationIntxWeightConfig(weight_dtype=torch.int4,
                                                        weight_granularity=PerGroup(GROUP_SIZE))
    raise ExportError(f"unknown QAT scheme {scheme!r}; choose one of {', '.join(SCHEMES)}")


def _in_blocks(module: nn.Module, fqn: str) -> bool:
    return isinstance(module, nn.Linear) and fqn != "output"


def prepare_qat(model: nn.Module, scheme: str = "int8") -> nn.Module:
    """Swap the block ``Linear`` layers for fake-quantised ones (in place); remembers the scheme for
    :func:`convert_qat`.

    Args:
        model: the model to train (a :class:`~elbowroom.models.DecoderLM` or any module of ``Linear`` layers;
            a layer named ``output`` is left alone).
        scheme: ``"int8"`` or ``"int4"`` weights, int8 activations either way.

    Returns:
        ``model``.

    Raises:
        ExportError: an unknown scheme, int4 on a layer whose input width is not a multiple of 32, or
            torchao missing.
    """
    base = _base_config(scheme)
    if scheme == "int4":
        for name, mod in model.named_modules():
            if _in_blocks(mod, name) and mod.in_features % GROUP_SIZE:
                raise ExportError(f"int4 QAT groups {GROUP_SIZE} input features, and {name} has {mod.in_features}")
    ao = require("torchao.quantization", "QAT")
    from torchao.quantization.qat import QATConfig

    ao.quantize_(model, QATConfig(base, step="prepare"), filter_fn=_in_blocks)
    model._elbowroom_qat_scheme = scheme  # read by convert_qat
    return model


def convert_qat(model: nn.Module) -> nn.Module:
    """Replace the fake-quantised layers of a :func:`prepare_qat` model by quantised weights (in place).

    Returns:
        ``model``, whose outputs equal the fake-quantised model's.

    Raises:
        ExportError: the model was not prepared with :func:`prepare_qat`.
    """
    scheme = getattr(model, "_elbowroom_qat_scheme", None)
    if scheme is None:
        raise ExportError("convert_qat needs a model prepared by prepare_qat(model, 'int8' | 'int4')")
    ao = require("torchao.quantization", "QAT")
    from torchao.quantization.qat import FakeQuantizedLinear, QATConfig

    ao.quantize_(model, QATConfig(_base_config(scheme), step="convert"),
                 filter_fn=lambda m, fqn: isinstance(m, FakeQuantizedLinear))
    del model._elbowroom_qat_scheme
    return model


def run_scheme(meta: dict) -> str | None:
    """The ``--train.qat`` scheme a checkpoint was trained with (None: none), from the run config in its metadata."""
    return ((meta.get("config") or {}).get("train") or {}).get("qat")


def load_trained(source: Source) -> nn.Module:
    """A QAT run's model as it trained: built in the checkpoint's shape, prepared with the run's scheme, given
    the checkpoint's weights; in eval mode, its outputs fake-quantised. :func:`convert_qat` quantises it.

    Raises:
        ExportError: the run was not trained with ``--train.qat``, or torchao is missing.
    """
    scheme = run_scheme(source.meta)
    if scheme is None:
        raise ExportError(f"{source.path} was not trained with --train.qat; quantise it after training with "
                          "--method int8-dynamic, int8-weight or int4-weight")
    model = prepare_qat(build_model(source.config), scheme)
    model.load_state_dict(source.model.state_dict())
    return model.eval()
