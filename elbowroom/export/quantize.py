"""Post-training quantisation with torchao: one method name per recipe, the model in and the quantised one out.

Methods (the ``Linear`` layers are quantised; embeddings and norms stay in fp32):

- ``int8-dynamic``: ``Int8DynamicActivationInt8WeightConfig`` (int8 weights per channel, activations
  quantised per token at run time).
- ``int8-weight``: ``Int8WeightOnlyConfig`` (int8 weights, fp32 activations).
- ``int4-weight``: ``IntxWeightOnlyConfig(int4, PerGroup(32))`` on the blocks, the output head int8
  weight-only (int4 on the head alone costs ~4 dB of logit SQNR on the tiny model). torchao 0.18 has no
  packed int4 layout on the CPU: the int4 values are stored one per byte, so the file is no smaller than
  int8's (the accuracy is int4's).
- ``float8``: ``Float8DynamicActivationFloat8WeightConfig``; needs a CUDA GPU of compute capability 8.9 or
  newer (Ada, Hopper): elsewhere an :class:`ExportError`.
- ``int8-static``: static int8 through ``torchao.quantization.pt2e`` for the CPU: ``torch.export``, the x86
  quantizer's annotations, calibration on the run's validation batches, ``convert_pt2e``; the result is a
  ``torch.export`` program (q/dq reference graph, int8 weights) saved as ``model.pt2``. Eagerly it runs the
  reference q/dq ops (int8 numerics, fp32 speed); ``torch.compile`` of the loaded module lets inductor lower
  the pattern to int8 CPU kernels, which is what the x86 quantizer targets.

The other methods save ``model.pt``: the quantised ``state_dict`` (torchao tensor subclasses, which
``torch.load(weights_only=True)`` accepts), loaded back into a model of the saved config by
:func:`load_quantized`.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import torch
from torch import nn

from elbowroom.export._deps import require
from elbowroom.export.source import ExportError
from elbowroom.models import DecoderLM, ModelConfig, build_model

__all__ = ["METHODS", "check_float8", "quantize_model", "save_quantized", "load_quantized", "sqnr"]

METHODS = ("int8-dynamic", "int8-weight", "int4-weight", "float8", "int8-static")
"""The quantisation methods, as named on the command line."""

INT4_GROUP_SIZE = 32
"""Weights per int4 scale (along the input dimension)."""


def sqnr(reference: torch.Tensor, approx: torch.Tensor) -> float:
    """Signal-to-quantisation-noise ratio in dB: ``10 log10(sum(ref^2) / sum((ref - approx)^2))``."""
    ref = reference.double()
    noise = (ref - approx.double()).pow(2).sum()
    return float(10 * torch.log10(ref.pow(2).sum() / noise)) if noise > 0 else float("inf")


def check_float8(device: torch.device | None) -> torch.device:
    """The CUDA device float8 runs on; :class:`ExportError` where there is none of compute capability 8.9+."""
    if not torch.cuda.is_available():
        raise ExportError("float8 needs a CUDA GPU of compute capability 8.9 or newer (Ada, Hopper) and none is "
                          "visible here; on the CPU use int8-dynamic, int8-weight, int4-weight or int8-static")
    dev = torch.device(device or "cuda")
    cap = torch.cuda.get_device_capability(dev)
    if cap < (8, 9):
        raise ExportError(f"float8 needs compute capability 8.9 or newer, and {torch.cuda.get_device_name(dev)} "
                          f"has {cap[0]}.{cap[1]}; use int8-dynamic or int8-weight instead")
    return dev


def _is_linear(module: nn.Module, fqn: str) -> bool:
    return isinstance(module, nn.Linear)


def quantize_model(model: DecoderLM, method: str, *, calibration: list[torch.Tensor] | None = None,
                   device: torch.device | str | None = None) -> nn.Module:
    """Quantise ``model`` in place (torchao methods) or into a new exported program (``int8-static``).

    Args:
        model: the fp32 model, in eval mode.
        method: one of :data:`METHODS`.
        calibration: input ids for ``int8-static``'s observers (the run's validation batches).
        device: where ``float8`` runs (a CUDA device; the model is moved there).

    Returns:
        The quantised model (``model`` itself for the torchao methods; a ``torch.fx.GraphModule`` from
        ``torch.export`` for ``int8-static``).

    Raises:
        ExportError: an unknown method, float8 without a GPU that has it, int8-static without calibration
            data, or torchao missing.
    """
    if method not in METHODS:
        raise ExportError(f"unknown quantisation method {method!r}; choose one of {', '.join(METHODS)}")
    if method == "float8":
        dev = check_float8(torch.device(device) if device is not None else None)
    ao = require("torchao.quantization", f"quantize {method}")
    model.eval()
    if method == "int8-dynamic":
        ao.quantize_(model, ao.Int8DynamicActivationInt8WeightConfig(), filter_fn=_is_linear)
    elif method == "int8-weight":
        ao.quantize_(model, ao.Int8WeightOnlyConfig(), filter_fn=_is_linear)
    elif method == "int4-weight":
        from torchao.quantization.granularity import PerGroup

        int4 = ao.IntxWeightOnlyConfig(weight_dtype=torch.int4, granularity=PerGroup(INT4_GROUP_SIZE))
        for name, mod in model.named_modules():
            if isinstance(mod, nn.Linear) and mod.in_features % INT4_GROUP_SIZE:
                raise ExportError(f"int4-weight groups {INT4_GROUP_SIZE} input features, and {name} has "
                                  f"{mod.in_features}; use int8-weight for this model")
        ao.quantize_(model, int4, filter_fn=lambda m, fqn: isinstance(m, nn.Linear) and fqn != "output")
        ao.quantize_(model, ao.Int8WeightOnlyConfig(), filter_fn=lambda m, fqn: fqn == "output")
    elif method == "float8":
        model.to(dev)
        ao.quantize_(model, ao.Float8DynamicActivationFloat8WeightConfig(granularity=ao.PerRow()),
                     filter_fn=_is_linear)
    else:
        return _static_int8(model, calibration)
    return model


def _static_int8(model: DecoderLM, calibration: list[torch.Tensor] | None) -> nn.Module:
    if not calibration:
        raise ExportError("int8-static calibrates on the run's validation data, and none was found (the "
                          "checkpoint's run config names no readable data); use int8-dynamic instead")
    require("torchao.quantization.pt2e", "quantize int8-static")
    from torchao.quantization.pt2e.quantize_pt2e import convert_pt2e, prepare_pt2e
    from torchao.quantization.pt2e.quantizer.x86_inductor_quantizer import (
        X86InductorQuantizer,
        get_default_x86_inductor_quantization_config,
    )

    from elbowroom.export.onnx_export import dynamic_shapes, traceable

    with traceable(model), torch.no_grad():
        graph = torch.export.export(model, (calibration[0],), dynamic_shapes=dynamic_shapes(model)).module()
    quantizer = X86InductorQuantizer().set_global(get_default_x86_inductor_quantization_config())
    prepared = prepare_pt2e(graph, quantizer)
    with torch.no_grad():
        for ids in calibration:  # the observers record the activation ranges
            prepared(ids)
    return _drop_unused_tensors(convert_pt2e(prepared))


def _drop_unused_tensors(gm: torch.fx.GraphModule) -> torch.fx.GraphModule:
    """Delete parameters and buffers the graph no longer reads.

    convert_pt2e folds each quantised weight into a new int8 constant, but the fp32 original stays registered
    on the module: saved as it is, the "int8" program was larger than the fp32 model (5.2 MB against 3.7).
    """
    used = {n.target for n in gm.graph.nodes if n.op == "get_attr"}
    for name, _ in [*gm.named_parameters(), *gm.named_buffers()]:
        if name in used:
            continue
        owner_name, _, attr = name.rpartition(".")
        owner = gm.get_submodule(owner_name) if owner_name else gm
        delattr(owner, attr)
    return gm


def save_quantized(qmodel: nn.Module, cfg: ModelConfig, method: str, out: str | os.PathLike[str],
                   example: torch.Tensor) -> Path:
    """Write the quantised model into the directory ``out``: ``model.pt`` (state dict) or ``model.pt2``
    (``int8-static``'s exported program), beside ``config.json`` (model config and method).

    Returns:
        The weight file written.
    """
    out = Path(out)
    (out / "config.json").write_text(json.dumps({"model": cfg.to_dict(), "quantization": method}, indent=1) + "\n")
    if method == "int8-static":
        path = out / "model.pt2"
        program = torch.export.export(qmodel, (example,), dynamic_shapes=(dynamic_shapes_of(cfg),))
        torch.export.save(program, path)
        return path
    path = out / "model.pt"
    torch.save(qmodel.state_dict(), path)
    return path


def dynamic_shapes_of(cfg: ModelConfig) -> dict[int, Any]:
    """``idx``'s dynamic dims for a model of shape ``cfg`` (batch, and sequence up to ``max_seq_len``)."""
    return {0: torch.export.Dim("batch"), 1: torch.export.Dim("seq", max=cfg.max_seq_len)}


def load_quantized(path: str | os.PathLike[str]) -> nn.Module:
    """Load what :func:`save_quantized` wrote: a module called as ``model(input_ids) -> logits``."""
    path = Path(path)
    info = json.loads((path / "config.json").read_text())
    if info["quantization"] == "int8-static":
        require("torchao.quantization.pt2e", "loading an int8-static export")  # registers the q/dq ops
        return torch.export.load(path / "model.pt2").module()
    require("torchao.quantization", "loading a quantised export")  # registers the tensor subclasses
    model = build_model(ModelConfig(**info["model"]))
    model.load_state_dict(torch.load(path / "model.pt", map_location="cpu", weights_only=True), assign=True)
    return model.eval()
