"""The analytic profile's time of one matmul or attention kernel, from its shape and the device table's two rates.

A block's analytic time was its FLOPs over ``matmul_flops``: every matmul at the rate of a large square one, and
attention at that rate over FLOPs counted without the causal mask's saving. Measured on an H200 (``BENCHMARKS.md``,
2026-11-29 twenty-fifth session, ``benchmarks/matmul_shapes.py``), the reference workloads' GEMMs ran at 444-761
TFLOP/s (GPT-2-XL's 1600-wide ones lowest) and causal flash attention's forward at 563-1187 and its backward at
341-762 "counted" TFLOP/s, so the analytic step of GPT-2-XL came out 0.78x the measured one. Two shapes' models
replace that, each with the table's rates only:

- **GEMM** (``mm``, ``addmm``, ``bmm``, ``baddbmm``; ``(m, k) x (k, n)``, ``batch`` of them)::

      t = 2 batch m n k / matmul_flops + itemsize batch (m k + k n + m n) / memory_bandwidth

  the arithmetic, and the operands read and the output written once, one after the other (a kernel's ramp and tail
  do not overlap the two). On the H200's table rates (779 TFLOP/s, 3.74 TB/s) it predicts the 80 measured GEMMs
  of 40 us and more within 0.87-1.23x of their times.
- **Attention** (flash-style, ``(b, h, s_q, d)`` queries against ``s_k`` keys): the kernel walks 128 x 128 tiles of
  scores, all of them, or under a causal mask those on and below the diagonal; each costs its two matmuls
  (``4 x 128 x 128 x d`` FLOPs) and a softmax that does not shrink with ``d`` (:data:`SCORE_FLOPS` FLOP-equivalents
  per score: the exponent units run far below the tensor cores)::

      t_forward  = b h tiles 128^2 (4 d + SCORE_FLOPS) / matmul_flops
      t_backward = BACKWARD_RATIO t_forward

  Within 0.84-1.19x of the ten measured forwards (head dims 64 and 128, 1024-8192 tokens), and of their backwards
  within 0.74-1.24x (the backward measured 3.0-3.7x its forward).

Other ops with FLOPs (convolutions, fp8 matmuls) keep FLOPs over ``matmul_flops``. Every rate is the table's bf16
one, whatever the operands' dtype: an analytic profile taken in fp32 (``dtype=torch.float32``) prices its matmuls as
bf16 ones, far faster than a GPU runs fp32 matmuls (the table has no fp32 rate; planned runs compute in bf16).
"""

from __future__ import annotations

import math
from typing import Any

from elbowroom.plan.types import MachineProfile

__all__ = ["BACKWARD_RATIO", "SCORE_FLOPS", "TILE", "describe", "seconds"]

TILE = 128
"""Query and key rows per tile of a flash-style attention kernel."""

SCORE_FLOPS = 276
"""The softmax's cost per score, in FLOPs at ``matmul_flops``: fitted to causal flash attention on an H200 with head
dims 64 and 128 (efficiency ``4 d / (4 d + 276)`` of the matmul rate: 0.65 at 128, 0.48 at 64, measured 0.65 and
0.45). About the ratio of the H100 die's tensor-core rate to its exponent units' (16 a clock per SM); an A100 has
half that ratio, so its attention is priced somewhat slow."""

BACKWARD_RATIO = 3.25
"""Attention's backward over its forward: five matmuls where the forward has two (the scores again, and the
gradients of queries, keys and values), the softmax's gradient, and atomics on the queries' gradient; measured
3.0-3.7 on the H200's ten shapes."""

_GEMM = {"mm": 0, "addmm": 1, "bmm": 0, "baddbmm": 1}  # op -> index of its first matrix operand
_ATTENTION = {  # forward op -> (query layout, name of its causal flag)
    "_scaled_dot_product_flash_attention": ("bhsd", "is_causal"),
    "_scaled_dot_product_efficient_attention": ("bhsd", "is_causal"),
    "_scaled_dot_product_cudnn_attention": ("bhsd", "is_causal"),
    "_scaled_dot_product_flash_attention_for_cpu": ("bhsd", "is_causal"),
    "_scaled_dot_product_fused_attention_overrideable": ("bhsd", "is_causal"),
    "_flash_attention_forward": ("bshd", "is_causal"),
    "_efficient_attention_forward": ("bshd", "custom_mask_type"),
}


def describe(func: Any, args: tuple, kwargs: dict, flops: float) -> tuple:
    """What :func:`seconds` needs of one op with ``flops`` FLOPs (torch's count): ``("gemm", batch, m, n, k,
    itemsize)``, ``("attention", b, h, s_q, s_k, d, causal, backward)``, or ``("flops", flops)`` for another op."""
    name = func._overloadpacket.__name__
    try:
        if name in _GEMM:
            a, b = args[_GEMM[name]], args[_GEMM[name] + 1]
            batch = a.shape[0] if a.dim() == 3 else 1
            return ("gemm", batch, a.shape[-2], b.shape[-1], a.shape[-1], a.element_size())
        backward = name.endswith("_backward")
        base = name[: -len("_backward")] if backward else name
        if base in _ATTENTION:
            layout, flag = _ATTENTION[base]
            named = dict(zip((x.name for x in func._schema.arguments), args))
            named.update(kwargs)
            q, k = named["query"], named["key"]
            if layout == "bhsd":
                b, h, s_q, d = q.shape
                s_k = k.shape[-2]
            else:
                b, s_q, h, d = q.shape
                s_k = k.shape[1]
            return ("attention", b, h, s_q, s_k, d, bool(named.get(flag, False)), backward)
    except (AttributeError, IndexError, KeyError, TypeError, ValueError):
        pass  # a form of the op this does not know: its FLOPs at the matmul rate
    return ("flops", flops)


def seconds(kernel: tuple, machine: MachineProfile) -> float:
    """The time of one kernel (:func:`describe`) on ``machine`` (its ``matmul_flops`` and ``memory_bandwidth``)."""
    rate, bw = machine.matmul_flops, machine.memory_bandwidth
    kind = kernel[0]
    if kind == "gemm":
        _, batch, m, n, k, itemsize = kernel
        return 2.0 * batch * m * n * k / rate + itemsize * batch * (m * k + k * n + m * n) / bw
    if kind == "attention":
        _, b, h, s_q, s_k, d, causal, backward = kernel
        nq, nk = math.ceil(s_q / TILE), math.ceil(s_k / TILE)
        # causal: query tile i sees the key tiles up to its diagonal (the keys' end aligned with the queries')
        tiles = sum(min(nk, i + 1 + nk - nq) for i in range(nq)) if causal else nq * nk
        t = b * h * tiles * TILE * TILE * (4.0 * d + SCORE_FLOPS) / rate
        return BACKWARD_RATIO * t if backward else t
    return kernel[1] / rate
