"""Knowledge distillation: a loss that mixes cross-entropy with KL(teacher || student), chunk by chunk, and a
frozen teacher read from an elbowroom checkpoint or a local Hugging Face directory.

``distillation_loss = (1 - ratio) * CE(student, targets) + ratio * T^2 * KL(softmax(t / T) || softmax(s / T))``,
averaged over the tokens that have a target (``T^2`` keeps the soft term's gradient scale independent of the
temperature, as in Hinton et al.). As in :mod:`elbowroom.ops.linear_cross_entropy`, the student's logits
never exist whole: each chunk of tokens runs the head, the two losses and their gradients under
``torch.utils.checkpoint`` (non-reentrant), which keeps only the chunk's inputs for backward and recomputes
its logits there, one chunk at a time. The teacher's logits, when given as a function of the token range,
are made chunk by chunk as well (twice: in forward and in the recompute; a teacher head matmul per chunk),
so a teacher with a 100k vocabulary costs one chunk of logits, not a batch of them.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from elbowroom.export._deps import require
from elbowroom.export.source import ExportError, load_source

__all__ = ["distillation_loss", "Teacher", "load_teacher"]

TeacherLogits = torch.Tensor | Callable[[int, int], torch.Tensor]
"""The teacher's logits ``(..., vocab)`` shaped like the student's tokens, or ``fn(start, end)`` giving the
logits of the flattened tokens ``start:end`` as ``(end - start, vocab)``."""


def _chunk_loss(h: torch.Tensor, weight: torch.Tensor, teacher: TeacherLogits, lo: int, hi: int,
                targets: torch.Tensor, ratio: float, temperature: float, ignore_index: int) -> torch.Tensor:
    logits = (h @ weight.t()).float()
    if callable(teacher):
        with torch.no_grad():
            t = teacher(lo, hi)
    else:
        t = teacher[lo:hi]
    t = t.detach().float()
    if t.shape != logits.shape:
        raise ValueError(f"teacher logits for tokens {lo}:{hi} have shape {tuple(t.shape)}, expected "
                         f"{tuple(logits.shape)} (same tokens and vocabulary as the student)")
    valid = targets != ignore_index
    total = logits.new_zeros(())
    if ratio < 1.0:
        total = total + (1.0 - ratio) * F.cross_entropy(logits, targets, ignore_index=ignore_index, reduction="sum")
    if ratio > 0.0:
        log_s = F.log_softmax(logits / temperature, dim=-1)
        log_t = F.log_softmax(t / temperature, dim=-1)
        kl = (log_t.exp() * (log_t - log_s)).sum(-1)  # KL(teacher || student) per token
        total = total + ratio * temperature**2 * torch.where(valid, kl, 0.0).sum()
    return total


def distillation_loss(
    student_hidden: torch.Tensor,
    head_weight: torch.Tensor,
    teacher_logits_or_fn: TeacherLogits,
    targets: torch.Tensor,
    ratio: float = 0.5,
    temperature: float = 1.0,
    *,
    ignore_index: int = -100,
    chunk_tokens: int = 4096,
    reduction: str = "mean",
) -> torch.Tensor:
    """``(1 - ratio) * CE + ratio * T^2 * KL(teacher || student)`` per target token, chunk by chunk.

    Args:
        student_hidden: the student's hidden states before its (bias-free) head, ``(..., d)``.
        head_weight: the student's head weight, ``(vocab, d)``.
        teacher_logits_or_fn: the teacher's logits ``(..., vocab)`` (detached), or ``fn(start, end)`` returning
            the logits of flattened tokens ``start:end`` (called under ``torch.no_grad``), e.g.
            :meth:`Teacher.logits_fn`.
        targets: next-token ids, ``student_hidden.shape[:-1]``; ``ignore_index`` marks tokens without one
            (they count in neither term).
        ratio: weight ``a`` of the KL term, in [0, 1] (0: plain cross-entropy; 1: pure distillation).
        temperature: softmax temperature ``T > 0`` of both distributions in the KL term.
        ignore_index: target value of tokens left out.
        chunk_tokens: tokens per chunk (the largest temporaries are a few ``chunk_tokens x vocab`` fp32 tensors).
        reduction: ``"mean"`` over tokens with a target, or their ``"sum"`` (the trainer divides by the tokens of
            the whole optimizer step, as it does cross-entropy's).

    Returns:
        The scalar loss (fp32).

    Raises:
        ValueError: shapes that do not match, ``ratio`` outside [0, 1], ``temperature <= 0``, a chunk below 1,
            an unknown reduction.
    """
    if reduction not in ("mean", "sum"):
        raise ValueError(f"reduction must be 'mean' or 'sum', got {reduction!r}")
    if not 0.0 <= ratio <= 1.0:
        raise ValueError(f"ratio must be in [0, 1], got {ratio}")
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    if not isinstance(chunk_tokens, int) or chunk_tokens < 1:
        raise ValueError(f"chunk_tokens must be an int >= 1, got {chunk_tokens!r}")
    if head_weight.dim() != 2 or head_weight.shape[1] != student_hidden.shape[-1]:
        raise ValueError(f"head_weight must be (vocab, {student_hidden.shape[-1]}), got {tuple(head_weight.shape)}")
    if targets.shape != student_hidden.shape[:-1]:
        raise ValueError(f"targets must have shape {tuple(student_hidden.shape[:-1])}, got {tuple(targets.shape)}")
    h = student_hidden.reshape(-1, student_hidden.shape[-1])
    tgt = targets.reshape(-1)
    teacher = teacher_logits_or_fn
    if not callable(teacher):
        teacher = teacher.detach().reshape(-1, teacher.shape[-1])
    total = h.new_zeros((), dtype=torch.float32)
    for lo in range(0, h.shape[0], chunk_tokens):
        hi = min(h.shape[0], lo + chunk_tokens)
        args = (h[lo:hi], head_weight, teacher, lo, hi, tgt[lo:hi], ratio, temperature, ignore_index)
        if torch.is_grad_enabled() and (h.requires_grad or head_weight.requires_grad):
            # keeps the chunk's inputs only; its logits are recomputed in backward, one chunk at a time
            total = total + checkpoint(_chunk_loss, *args, use_reentrant=False)
        else:
            total = total + _chunk_loss(*args)
    if reduction == "sum":
        return total
    # a device scalar: no host sync (all targets ignored gives 0 / 0 = nan, as F.cross_entropy does)
    return total / (tgt != ignore_index).sum()


class Teacher(nn.Module):
    """A frozen model (no gradients, eval mode) that gives logits, or hidden states and its head chunk by chunk.

    Args:
        body: ``input_ids -> last hidden states`` (normalised, the head's input).
        head_weight: the output head's weight ``(vocab, d)``.
        model: the module owning both (kept so its parameters and ``.to()`` follow the teacher).
    """

    def __init__(self, body: Callable[[torch.Tensor], torch.Tensor], head_weight: torch.Tensor,
                 model: nn.Module) -> None:
        super().__init__()
        self.model = model.eval().requires_grad_(False)
        self._body = body
        self.head_weight = head_weight

    def train(self, mode: bool = True) -> Teacher:
        return super().train(False)  # always eval: dropout off

    @torch.no_grad()
    def hidden_states(self, input_ids: torch.Tensor) -> torch.Tensor:
        """The teacher's last hidden states ``(b, s, d)``."""
        return self._body(input_ids)

    @torch.no_grad()
    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        """The teacher's logits ``(b, s, vocab)`` (whole: use :meth:`logits_fn` to keep them chunked)."""
        return self.hidden_states(input_ids) @ self.head_weight.t()

    def logits_fn(self, input_ids: torch.Tensor) -> Callable[[int, int], torch.Tensor]:
        """``fn(start, end)`` for :func:`distillation_loss`: the body runs once now, the head per chunk."""
        h = self.hidden_states(input_ids)
        h = h.reshape(-1, h.shape[-1])
        w = self.head_weight

        def logits(start: int, end: int) -> torch.Tensor:
            return h[start:end] @ w.t()

        return logits


def load_teacher(path: str | os.PathLike[str], *, dtype: torch.dtype | None = None,
                 device: torch.device | str = "cpu") -> Teacher:
    """A frozen teacher from an elbowroom run or checkpoint directory, or a local Hugging Face model directory.

    Only the weights are read (no optimizer state); every parameter has ``requires_grad=False``.

    Args:
        path: a run directory, a checkpoint ``step_NNNNNNNN``, or a directory with a transformers
            ``config.json`` (loaded with ``AutoModelForCausalLM``, local files only).
        dtype: e.g. ``torch.bfloat16`` to halve its memory; fp32 when None.
        device: where it runs.

    Raises:
        ExportError: nothing loadable at ``path``.
    """
    p = Path(path)
    if (p / "config.json").is_file() and not (p / "meta.json").is_file():
        transformers = require("transformers", "a Hugging Face teacher")
        try:
            hf = transformers.AutoModelForCausalLM.from_pretrained(p, local_files_only=True,
                                                                   dtype=dtype or torch.float32)
        except (ValueError, OSError, KeyError) as e:  # a config.json it cannot read, no weights beside it
            raise ExportError(f"{p}: transformers cannot load a causal LM from it ({e})") from None
        hf.to(device)
        base = hf.get_decoder() if hasattr(hf, "get_decoder") else hf.base_model

        def body(ids: torch.Tensor) -> torch.Tensor:
            return base(input_ids=ids).last_hidden_state

        return Teacher(body, hf.get_output_embeddings().weight, hf)
    model = load_source(p).model.to(device=device, dtype=dtype or torch.float32)
    return Teacher(model.hidden_states, model.output.weight, model)

