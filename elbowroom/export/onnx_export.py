"""Export to ONNX through ``torch.onnx.export(..., dynamo=True)``, with dynamic batch and sequence length.

The graph takes ``input_ids`` (int64, ``(batch, seq)``, ``seq <= max_seq_len``) and returns ``logits``
(fp32, ``(batch, seq, vocab)``). It is checked with ``onnx.checker`` and can be run in ONNX Runtime, whose
outputs equal torch's within 1e-4 at different shapes (tested). Optionally a second file holds ONNX Runtime's
int8 dynamic quantisation of it (weights int8, activations quantised per call).

torch.export cannot trace :meth:`elbowroom.ops.rope.RotaryEmbedding.tables` as it is: its cast cache is keyed
by the table's data pointer, which a traced (fake) tensor does not have. While exporting, the model's rotary
embedding reads its tables directly (the same values, no cache), see :func:`traceable`.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from pathlib import Path

import torch

from elbowroom.export._deps import require
from elbowroom.models import DecoderLM

__all__ = ["traceable", "export_onnx", "quantize_onnx_int8", "run_onnx"]


@contextlib.contextmanager
def traceable(model: DecoderLM) -> Iterator[DecoderLM]:
    """The model with a RoPE table lookup that torch.export can trace (restored on exit).

    The cached lookup keys on ``cos.data_ptr()``, which fake tensors refuse; the replacement slices and casts
    the same tables on every call (what the cache saves is a cast, not a value).
    """
    rope = getattr(model, "rope", None)
    if rope is None:
        yield model
        return
    rope.tables = lambda s, dtype: (rope.cos[:s].to(dtype), rope.sin[:s].to(dtype))
    try:
        yield model
    finally:
        del rope.tables


def dynamic_shapes(model: DecoderLM) -> dict[str, dict[int, torch.export.Dim]]:
    """``idx``'s dynamic dims for torch.export: batch, and sequence up to the model's ``max_seq_len``."""
    from elbowroom.export.quantize import dynamic_shapes_of

    return {"idx": dynamic_shapes_of(model.config)}


def export_onnx(model: DecoderLM, path: str | os.PathLike[str], *, opset_version: int | None = None) -> Path:
    """Write ``model`` as an ONNX file and check it with ``onnx.checker``.

    Args:
        model: the model (exported in eval mode, fp32, on the CPU).
        path: the ``.onnx`` file to write.
        opset_version: ONNX opset; torch's default when None.

    Returns:
        ``path``.
    """
    onnx = require("onnx", "the onnx export")
    require("onnxscript", "the onnx export")  # the dynamo exporter's translation library
    model = model.eval()
    example = torch.randint(0, model.config.vocab_size, (2, min(16, model.config.max_seq_len)))
    kwargs = {} if opset_version is None else {"opset_version": opset_version}
    with traceable(model), torch.no_grad():
        torch.onnx.export(model, (example,), str(path), dynamo=True, dynamic_shapes=dynamic_shapes(model),
                          input_names=["input_ids"], output_names=["logits"], verbose=False, **kwargs)
    onnx.checker.check_model(str(path))
    return Path(path)


def quantize_onnx_int8(src: str | os.PathLike[str], dst: str | os.PathLike[str]) -> Path:
    """ONNX Runtime's dynamic int8 quantisation of ``src`` (int8 weights, activations quantised at run time).

    Returns:
        ``dst``.
    """
    q = require("onnxruntime.quantization", "the onnx int8 export")
    # external data: the weights in a file beside the graph, as the fp32 export has them (ONNX stops at 2 GB)
    q.quantize_dynamic(str(src), str(dst), weight_type=q.QuantType.QInt8, use_external_data_format=True)
    return Path(dst)


def run_onnx(path: str | os.PathLike[str]):
    """A callable ``input_ids -> logits`` (torch tensors in and out) running ``path`` in ONNX Runtime (CPU)."""
    ort = require("onnxruntime", "running an onnx export")
    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])

    def run(input_ids: torch.Tensor) -> torch.Tensor:
        (logits,) = session.run(["logits"], {"input_ids": input_ids.cpu().numpy()})
        return torch.from_numpy(logits)

    return run
