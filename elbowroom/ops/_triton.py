"""The one place that imports Triton: the fused kernels ask here whether they can run.

Triton is optional (it ships with CUDA builds of torch, not with the CPU build). Each kernel module builds
its ``@triton.jit`` functions lazily on first use through :func:`triton_modules`, and falls back to eager
torch where it returns None.
"""

from __future__ import annotations

import functools
from types import ModuleType


@functools.cache
def triton_modules() -> tuple[ModuleType, ModuleType] | None:
    """``(triton, triton.language)``, or None where Triton is not installed."""
    try:
        import triton
        import triton.language as tl
    except ImportError:
        return None
    return triton, tl
