"""Fused kernels: rotary embedding, SwiGLU, and the chunked output head with cross-entropy.

Each runs as Triton on CUDA where Triton is installed and as eager torch elsewhere, with the same results.
"""

from elbowroom.ops.linear_cross_entropy import LinearCrossEntropy, linear_cross_entropy
from elbowroom.ops.rope import RotaryEmbedding
from elbowroom.ops.swiglu import swiglu

__all__ = ["LinearCrossEntropy", "RotaryEmbedding", "linear_cross_entropy", "swiglu"]
