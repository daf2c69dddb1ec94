"""Rotary position embedding (RoPE): the tables, an eager rotation and a fused CUDA kernel.

The eager rotation costs four elementwise passes over q and k (and autograd's matching passes in
backward); on W1 that is ~10% of a training step. On CUDA the rotation runs as one Triton kernel per
direction: it reads x once, writes the rotated copy once, and saves nothing for backward (the gradient is
the inverse rotation of the incoming gradient, computed from the tables alone).
"""

from __future__ import annotations

import functools

import torch
import torch.nn as nn

from elbowroom.ops._triton import triton_modules


class RotaryEmbedding(nn.Module):
    """Precomputed RoPE tables (buffers, not parameters), rotate-half convention.

    ``cos`` holds cos(t * f) twice over the head dim, ``sin`` holds (-sin, +sin), so a rotation is
    ``x * cos + swap_halves(x) * sin``.
    """

    def __init__(self, head_dim: int, max_seq_len: int, theta: float) -> None:
        super().__init__()
        inv = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
        freqs = torch.outer(torch.arange(max_seq_len, dtype=torch.float32), inv)  # (s, hd/2)
        self.register_buffer("cos", torch.cat((freqs.cos(), freqs.cos()), dim=-1), persistent=False)
        self.register_buffer("sin", torch.cat((-freqs.sin(), freqs.sin()), dim=-1), persistent=False)
        self._cast: dict[tuple, tuple[torch.Tensor, torch.Tensor]] = {}
        self.fused = True
        """Use the fused kernel where it applies (CUDA, Triton present, power-of-two head dim)."""

    def tables(self, s: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin for the first ``s`` positions in ``dtype``, cast once and cached."""
        if torch.compiler.is_compiling():  # the compiler fuses the cast; a cache would be a side effect to trace
            return self.cos[:s].to(dtype), self.sin[:s].to(dtype)
        key = (dtype, self.cos.device, self.cos.data_ptr())
        if key not in self._cast:
            self._cast = {key: (self.cos.to(dtype), self.sin.to(dtype))}
        cos, sin = self._cast[key]
        return cos[:s], sin[:s]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Rotate x of shape (b, s, ..., hd) by its position along dim 1."""
        if self.fused and _fused_applies(x):
            return _FusedRope.apply(x, self.cos, self.sin)
        return rotate_eager(x, *self.tables(x.shape[1], x.dtype))


def rotate_eager(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """``x * cos + swap_halves(x) * sin`` with (s, hd) tables broadcast over x's (b, s, ..., hd)."""
    s, hd = x.shape[1], x.shape[-1]
    shape = (s,) + (1,) * (x.dim() - 3) + (hd,)
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos.view(shape) + torch.cat((x2, x1), dim=-1) * sin.view(shape)


@functools.cache
def _triton_kernel():
    modules = triton_modules()
    if modules is None:
        return None
    triton, tl = modules

    @triton.jit
    def rope_kernel(X, Y, COS, SIN, S, N, sxb, sxs, sxn, syb, sys, syn, cos_stride,
                    HALF: tl.constexpr, BLOCK_N: tl.constexpr, SIGN: tl.constexpr):
        # one program per (batch, position): all heads of that token, one table row
        pid = tl.program_id(0)
        b = pid // S
        s = pid % S
        rows = tl.arange(0, BLOCK_N)[:, None]
        cols = tl.arange(0, HALF)[None, :]
        mask = rows < N
        c = tl.load(COS + s * cos_stride + cols)
        sn = tl.load(SIN + s * cos_stride + HALF + cols) * SIGN
        xp = X + b.to(tl.int64) * sxb + s.to(tl.int64) * sxs + rows * sxn
        x1 = tl.load(xp + cols, mask=mask).to(tl.float32)
        x2 = tl.load(xp + HALF + cols, mask=mask).to(tl.float32)
        yp = Y + b.to(tl.int64) * syb + s.to(tl.int64) * sys + rows * syn
        tl.store(yp + cols, (x1 * c - x2 * sn).to(Y.dtype.element_ty), mask=mask)
        tl.store(yp + HALF + cols, (x2 * c + x1 * sn).to(Y.dtype.element_ty), mask=mask)

    return rope_kernel


def _fused_applies(x: torch.Tensor) -> bool:
    half = x.shape[-1] // 2
    return (
        x.is_cuda
        and x.dim() >= 3
        and half >= 1
        and half & (half - 1) == 0
        and not torch.compiler.is_compiling()  # under compile, inductor fuses the eager form itself
        and _triton_kernel() is not None
    )


def _as_rows(x: torch.Tensor) -> torch.Tensor:
    """View (b, s, ..., hd) as (b, s, n, hd) with a unit last stride, copying only if it must."""
    b, s, hd = x.shape[0], x.shape[1], x.shape[-1]
    try:
        v = x.view(b, s, -1, hd)
    except RuntimeError:
        v = x.contiguous().view(b, s, -1, hd)
    return v if v.stride(-1) == 1 else v.contiguous()


def _launch(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, sign: float) -> torch.Tensor:
    xr = _as_rows(x)
    b, s, n, hd = xr.shape
    # allocated in x's shape and returned as is: an autograd Function's output that is a view of an
    # internal buffer has that untracked buffer as its base, which tools walking views (activation
    # offload, checkpoint policies) take for a leaf
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    y = out.view(b, s, n, hd)
    import triton

    _triton_kernel()[(b * s,)](
        xr, y, cos, sin, s, n, xr.stride(0), xr.stride(1), xr.stride(2), y.stride(0), y.stride(1), y.stride(2),
        cos.stride(0), HALF=hd // 2, BLOCK_N=triton.next_power_of_2(n), SIGN=sign,
    )
    return out


class _FusedRope(torch.autograd.Function):
    """y = rotate(x, +theta); dx = rotate(dy, -theta). Nothing is saved for backward but the tables,
    which are module buffers held on ctx as plain attributes (not saved tensors), so activation hooks
    (offload, checkpoint) never see them."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        ctx.tables = (cos, sin)
        return _launch(x, cos, sin, 1.0)

    @staticmethod
    def backward(ctx, dy: torch.Tensor):
        cos, sin = ctx.tables
        return _launch(dy, cos, sin, -1.0), None, None
