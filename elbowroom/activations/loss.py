"""Output head and cross-entropy in one pass over sequence chunks: the logits never exist whole.

A language model's last step, ``F.cross_entropy(head(h).float(), targets)``, is the largest activation of a
training step: for W1 (16k tokens, 32k vocabulary) the bf16 logits, their fp32 copy and the softmax that
cross-entropy keeps for backward are ~5 GiB, alive at the forward's end, when every block's activations are
too. :func:`linear_cross_entropy` computes the same loss chunk by chunk, and since the loss is the last
operation of the graph it also computes the chunk's gradients right away (``softmax - onehot`` times the
head), keeping only ``d loss / d h`` (the size of ``h``) and ``d loss / d W`` (the size of the head) for
backward, which scales them by the incoming gradient. Nothing is recomputed: the FLOPs are those of the
plain head (forward matmul, two backward matmuls), done in forward.

Numerics: the matmuls run in the autocast dtype when autocast is on (as ``nn.Linear`` would), the
log-softmax in fp32, the head gradient accumulates in fp32 over chunks.
"""

from __future__ import annotations

import torch
from torch import nn

__all__ = ["linear_cross_entropy", "LinearCrossEntropy"]


def _compute_dtype(t: torch.Tensor) -> torch.dtype:
    dev = t.device.type
    if torch.is_autocast_enabled(dev):
        return torch.get_autocast_dtype(dev)
    return t.dtype


class _LinearCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(  # type: ignore[override]
        ctx,
        h: torch.Tensor,
        weight: torch.Tensor,
        targets: torch.Tensor,
        ignore_index: int,
        reduction: str,
        chunk_tokens: int,
        cdtype: torch.dtype,
    ) -> torch.Tensor:
        n = h.shape[0]
        ctx.weight_dtype = weight.dtype
        w = weight.to(cdtype)
        need_h, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        dh = torch.empty_like(h) if need_h else None
        dw = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) if need_w else None
        valid = targets != ignore_index
        scale = valid.sum().float().reciprocal() if reduction == "mean" else torch.ones((), device=h.device)
        total = torch.zeros((), dtype=torch.float32, device=h.device)
        with torch.autocast(h.device.type, enabled=False):
            for lo in range(0, n, chunk_tokens):
                hi = min(n, lo + chunk_tokens)
                hc = h[lo:hi].to(cdtype)
                logits = (hc @ w.t()).float()
                lse = torch.logsumexp(logits, dim=-1)
                tgt, ok = targets[lo:hi], valid[lo:hi]
                safe = torch.where(ok, tgt, 0)
                picked = logits.gather(1, safe[:, None]).squeeze(1)
                total += torch.where(ok, lse - picked, 0.0).sum()
                if not (need_h or need_w):
                    continue
                # d loss / d logits = (softmax - onehot) * scale on valid rows: reuse the logits' memory
                g = logits.sub_(lse[:, None]).exp_()
                g.scatter_add_(1, safe[:, None], torch.full_like(lse[:, None], -1.0))
                g.mul_((ok.float() * scale)[:, None])
                g = g.to(cdtype)
                if need_h:
                    dh[lo:hi] = g @ w
                if need_w:
                    dw.add_(g.t() @ hc)
        ctx.save_for_backward(dh, dw)
        return total * scale

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor):  # type: ignore[override]
        dh, dw = ctx.saved_tensors
        gh = dh * grad_out.to(dh.dtype) if dh is not None else None
        gw = None
        if dw is not None:
            gw = (dw * grad_out.float()).to(ctx.weight_dtype)
        return gh, gw, None, None, None, None, None


def linear_cross_entropy(
    h: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    *,
    ignore_index: int = -100,
    reduction: str = "mean",
    chunk_tokens: int = 4096,
) -> torch.Tensor:
    """``F.cross_entropy(F.linear(h, weight).float(), targets)`` without materialising the logits.

    Args:
        h: hidden states before the output head, ``(..., d)``.
        weight: the head's weight, ``(vocab, d)`` (a bias-free head, as in Llama and GPT-2).
        targets: class indices, ``h.shape[:-1]``; ``ignore_index`` marks positions without a target.
        ignore_index: target value that contributes neither loss nor gradient.
        reduction: ``"mean"`` over valid targets, or ``"sum"``.
        chunk_tokens: tokens per chunk: the chunk's fp32 logits (``chunk_tokens x vocab x 4`` bytes) are the
            largest temporary.

    Returns:
        The scalar loss (fp32).

    Raises:
        ValueError: mismatched shapes, an unknown reduction, or a chunk size below 1.
    """
    if reduction not in ("mean", "sum"):
        raise ValueError(f"reduction must be 'mean' or 'sum', got {reduction!r}")
    if not isinstance(chunk_tokens, int) or chunk_tokens < 1:
        raise ValueError(f"chunk_tokens must be an int >= 1, got {chunk_tokens!r}")
    if weight.dim() != 2 or h.shape[-1] != weight.shape[1]:
        raise ValueError(f"weight must be (vocab, {h.shape[-1]}) for hidden states {tuple(h.shape)}, got "
                         f"{tuple(weight.shape)}")
    if targets.shape != h.shape[:-1]:
        raise ValueError(f"targets must have shape {tuple(h.shape[:-1])}, got {tuple(targets.shape)}")
    cdtype = _compute_dtype(h)
    return _LinearCrossEntropy.apply(
        h.reshape(-1, h.shape[-1]), weight, targets.reshape(-1), ignore_index, reduction, chunk_tokens, cdtype
    )


class LinearCrossEntropy(nn.Module):
    """Module form of :func:`linear_cross_entropy` for a given head (``nn.Linear`` without bias)."""

    def __init__(self, head: nn.Linear, *, ignore_index: int = -100, reduction: str = "mean",
                 chunk_tokens: int = 4096) -> None:
        super().__init__()
        if head.bias is not None:
            raise ValueError("LinearCrossEntropy supports a head without bias")
        self.head = head
        self.ignore_index, self.reduction, self.chunk_tokens = ignore_index, reduction, chunk_tokens

    def forward(self, h: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return linear_cross_entropy(h, self.head.weight, targets, ignore_index=self.ignore_index,
                                    reduction=self.reduction, chunk_tokens=self.chunk_tokens)
