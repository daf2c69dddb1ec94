"""Magnitude pruning of the ``Linear`` weights with ``torch.nn.utils.prune``, made permanent.

Methods:

- ``l1``: unstructured, per layer: the ``round(amount * numel)`` weights of smallest magnitude are zeroed
  (``prune.l1_unstructured``), so the sparsity of the pruned weights is exactly ``amount`` up to rounding.
- ``channel``: structured: whole output channels (rows) of smallest L2 norm (``prune.ln_structured``,
  ``dim=0``), ``round(amount * out_features)`` of each layer.
- ``2:4``: in every group of 4 consecutive input weights the 2 of smallest magnitude are zeroed (a custom
  mask through ``prune.custom_from_mask``): 50% sparsity in the pattern that NVIDIA's sparse tensor cores
  accelerate (compute capability 8.0+: :func:`to_semi_structured` swaps the weights for
  ``torch.sparse.SparseSemiStructuredTensor`` in memory; the saved weights stay dense with zeros).

The token embedding (a lookup) and the output head (whose rows are the vocabulary) are not pruned. After
``prune.remove`` the mask is folded into the weight: the saved model is a plain checkpoint with zeros.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.nn.utils import prune

from elbowroom.export.source import ExportError

__all__ = ["METHODS", "check_amount", "prunable", "prune_model", "sparsity", "two_four_mask", "to_semi_structured"]

METHODS = ("l1", "channel", "2:4")
"""The pruning methods, as named on the command line."""


def check_amount(method: str, amount: float) -> None:
    """Refuse an amount the method cannot prune (before any model is read).

    Raises:
        ExportError: an unknown method, an amount outside (0, 1), or a ``2:4`` amount other than 0.5 (the pattern
            zeroes exactly 2 of every 4 weights: another amount would be silently ignored).
    """
    if method not in METHODS:
        raise ExportError(f"unknown pruning method {method!r}; choose one of {', '.join(METHODS)}")
    if method == "2:4" and amount != 0.5:
        raise ExportError(f"2:4 pruning zeroes 2 of every 4 weights, so its amount is fixed at 0.5 (50%), got --amount "
                          f"{amount}; drop --amount, or prune another fraction with --method l1 or channel")
    if not 0.0 < amount < 1.0:
        raise ExportError(f"--amount must be in (0, 1), got {amount}")


def prunable(model: nn.Module) -> list[tuple[str, nn.Linear]]:
    """The ``Linear`` layers that pruning touches: every one but the output head."""
    return [(n, m) for n, m in model.named_modules() if isinstance(m, nn.Linear) and n != "output"]


def two_four_mask(weight: torch.Tensor) -> torch.Tensor:
    """A 0/1 mask keeping the 2 largest-magnitude weights of every 4 consecutive along the input dim.

    Raises:
        ExportError: the input dim is not a multiple of 4.
    """
    out_f, in_f = weight.shape
    if in_f % 4:
        raise ExportError(f"2:4 pruning needs input widths divisible by 4, got a weight of shape {tuple(weight.shape)}")
    groups = weight.detach().abs().reshape(out_f, in_f // 4, 4)
    keep = groups.topk(2, dim=-1).indices
    mask = torch.zeros_like(groups).scatter_(-1, keep, 1.0)
    return mask.reshape(out_f, in_f)


def prune_model(model: nn.Module, method: str, amount: float = 0.5) -> dict[str, float]:
    """Prune ``model``'s block ``Linear`` weights in place and make it permanent.

    Args:
        model: the model.
        method: one of :data:`METHODS`.
        amount: fraction pruned, in (0, 1) (``l1``: of each layer's weights; ``channel``: of each layer's
            output channels); ``2:4`` prunes exactly 0.5 and refuses any other amount.

    Returns:
        ``{"sparsity": zeros / weights over the pruned layers, "zeros": int, "weights": int}``.

    Raises:
        ExportError: what :func:`check_amount` refuses.
    """
    check_amount(method, amount)
    layers = prunable(model)
    for _, mod in layers:
        if method == "l1":
            prune.l1_unstructured(mod, "weight", amount=amount)
        elif method == "channel":
            prune.ln_structured(mod, "weight", amount=amount, n=2, dim=0)
        else:
            prune.custom_from_mask(mod, "weight", mask=two_four_mask(mod.weight))
        prune.remove(mod, "weight")  # weight = weight_orig * mask, a plain parameter again
    return sparsity(model)


def sparsity(model: nn.Module) -> dict[str, float]:
    """Exact fraction of zero weights in the layers :func:`prunable` names."""
    zeros = sum(int((m.weight == 0).sum()) for _, m in prunable(model))
    total = sum(m.weight.numel() for _, m in prunable(model))
    return {"sparsity": zeros / total if total else 0.0, "zeros": zeros, "weights": total}


def to_semi_structured(model: nn.Module) -> nn.Module:
    """Swap 2:4-pruned weights for ``SparseSemiStructuredTensor`` (sparse tensor cores; CUDA 8.0+ only).

    The model must already be on that device in fp16 or bf16 (the dtypes the sparse kernels take).

    Raises:
        ExportError: no CUDA device of compute capability 8.0 or newer.
    """
    if not torch.cuda.is_available() or torch.cuda.get_device_capability() < (8, 0):
        raise ExportError("2:4 sparse acceleration needs a CUDA GPU of compute capability 8.0 or newer; the "
                          "pruned weights still work dense (with zeros) everywhere")
    from torch.sparse import to_sparse_semi_structured

    for _, mod in prunable(model):
        mod.weight = nn.Parameter(to_sparse_semi_structured(mod.weight.detach()), requires_grad=False)
    return model
