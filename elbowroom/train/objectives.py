"""The student's loss over one micro-batch: cross-entropy, the fused head + cross-entropy, or distillation.

Each objective returns the *sum* over the micro-batch's target tokens; :func:`~elbowroom.train.trainer.
accumulate_gradients` divides it by the target tokens of the whole optimizer step, so gradient accumulation
treats all three alike (k micro-batches of b samples give the gradients of one batch of k*b).

Distillation (``--distill.teacher PATH``) mixes the two terms of :func:`elbowroom.export.distill.distillation_loss`,
``(1 - a) * CE + a * T^2 * KL(teacher || student)``, with the student's head chunk by chunk (its logits never
exist whole) and the teacher's head chunk by chunk too. The teacher is frozen: it runs in eval mode under
``torch.no_grad``, is no attribute of the student (so it is in neither the optimizer nor the checkpoint) and
consumes no random numbers, so a run at ratio 0 follows the plain run's loss curve exactly. The memory engines
([activations], [optimizer], a saved ``--plan``) apply to the student only; the teacher's weights (halved by
``--distill.dtype bfloat16``) and one micro-batch of its hidden states come on top, which is why ``--budget``
(whose planner does not price them) is refused. The logged training loss is the mixed objective; validation
stays plain cross-entropy.
"""

from __future__ import annotations

import logging
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F
from torch import nn

from elbowroom.config import ConfigError, DistillSection
from elbowroom.distributed.data_parallel import unwrap

if TYPE_CHECKING:
    from elbowroom.export.distill import Teacher

__all__ = ["Distillation", "load_distillation", "micro_batch_loss", "token_loss_sum"]

log = logging.getLogger("elbowroom.train")


def token_loss_sum(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Summed cross-entropy over target tokens (-100 = padding, ignored); the caller divides."""
    return F.cross_entropy(
        logits.float().view(-1, logits.size(-1)), targets.view(-1), ignore_index=-100, reduction="sum"
    )


@dataclass(frozen=True)
class Distillation:
    """A frozen teacher and how much its soft targets weigh."""

    teacher: Teacher
    ratio: float
    """Weight ``a`` of the KL term, in [0, 1]."""
    temperature: float
    """Softmax temperature ``T`` of both distributions in the KL term."""


def micro_batch_loss(model: nn.Module, batch: dict[str, Any], optimizer: Any = None, *, fused_loss: bool = False,
                     distill: Distillation | None = None) -> torch.Tensor:
    """The student's loss summed over the target tokens of one micro-batch (call it under the run's autocast).

    Args:
        model: the student, or the DDP or FSDP2 wrapper around it; the fused head and distillation need its
            ``forward(ids, head=False)`` (the hidden states) and ``output`` head (the fused loss runs in the
            head's forward: :class:`~elbowroom.models.decoder.OutputHead`).
        batch: ``{"input_ids", "targets", ...}`` on the model's device.
        optimizer: an optimizer with ``wait_for`` (the CPU-offloaded one) is asked for the head weight before
            distillation reads it outside the head's forward.
        fused_loss: the head and cross-entropy chunk by chunk (the logits never exist whole).
        distill: mix in the teacher's soft targets (always chunk by chunk; ``fused_loss`` is then implied).
    """
    ids, targets = batch["input_ids"], batch["targets"]
    if distill is None and not fused_loss:
        return token_loss_sum(model(ids), targets)
    inner = unwrap(model)
    # through the wrapper's forward (DDP's reducer then expects this step's gradients, the head's included, which
    # the loss's backward gives it; FSDP2's root prepares the step there)
    h = model(ids, head=False)
    if distill is None:
        # the head's own forward: FSDP2 all-gathers its weight there, an offloading optimizer waits for it there
        return inner.output(h, targets)
    head = inner.output.weight  # read outside the head's forward (not under FSDP2: the trainer refuses it)
    if hasattr(optimizer, "wait_for"):
        optimizer.wait_for(head)
    from elbowroom.export.distill import distillation_loss

    # the teacher's body runs once here (no grad); its head per chunk, inside the loss, twice (forward, recompute)
    teacher_logits = distill.teacher.logits_fn(ids)
    return distillation_loss(h, head, teacher_logits, targets, distill.ratio, distill.temperature,
                             reduction="sum")


def load_distillation(cfg: DistillSection, *, vocab_size: int, seq_len: int, device: torch.device,
                      resumed: dict[str, Any] | None = None) -> Distillation | None:
    """The run's frozen teacher on ``device``, checked against the student; None without ``--distill.teacher``.

    The teacher is not in the checkpoint: a resumed run distils only when ``[distill]`` is given again, and a
    warning says so when it differs from the checkpoint's (``resumed``: the checkpoint's metadata).

    Raises:
        ConfigError: no teacher at the path, one that does not load (or needs a missing extra), a vocabulary that
            is not the student's, or fewer positions than ``--data.seq_len``.
    """
    saved = ((resumed or {}).get("config") or {}).get("distill") or asdict(DistillSection())  # older runs: none
    if resumed is not None and saved != asdict(cfg):
        log.warning("the checkpoint was trained with [distill] %s and this run continues with %s; the loss curve "
                    "changes (pass the checkpoint's --distill.* settings to continue it)", saved, asdict(cfg))
    if cfg.teacher is None:
        return None
    path = Path(cfg.teacher)
    if not path.is_dir():
        what = "is a file, not a directory" if path.exists() else "does not exist"
        raise ConfigError(f"distill.teacher {path} {what}; give an elbowroom run or checkpoint directory, "
                          "or a local Hugging Face model directory")
    from elbowroom.export.distill import load_teacher
    from elbowroom.export.source import ExportError

    dtype = torch.bfloat16 if cfg.dtype == "bfloat16" else torch.float32
    try:
        teacher = load_teacher(path, dtype=dtype, device=device)
    except ExportError as e:  # a checkpoint that does not verify, a missing extra (named with its install line)
        raise ConfigError(f"distill.teacher: {e}") from None
    teacher_vocab = teacher.head_weight.shape[0]
    if teacher_vocab != vocab_size:
        raise ConfigError(f"distill.teacher {path} has vocab_size {teacher_vocab} and the student {vocab_size}; "
                          "distil from a teacher with the student's tokenizer and vocabulary")
    positions = _max_positions(teacher.model)
    if positions is not None and positions < seq_len:
        raise ConfigError(f"distill.teacher {path} holds {positions} positions, fewer than --data.seq_len "
                          f"{seq_len}; pass --data.seq_len {positions} or less")
    return Distillation(teacher=teacher, ratio=cfg.ratio, temperature=cfg.temperature)


def _max_positions(model: nn.Module) -> int | None:
    from elbowroom.train.hf import hf_max_positions

    config = getattr(model, "config", None)
    if config is None:
        return None
    return getattr(config, "max_seq_len", None) or hf_max_positions(config)
