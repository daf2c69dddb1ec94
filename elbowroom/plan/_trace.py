"""The tracing machinery of the profile: who produced each tensor, what each block saves, when it runs.

Private to :mod:`elbowroom.plan.profiler`. Three instruments share one :class:`Tracer`:

- an op recorder (a ``TorchDispatchMode``, below autograd) that notes, for every new storage an op writes,
  the kind of op that produced it (matmul, attention, a pure function of model state such as a weight
  cast, or anything else = pointwise) and counts FLOPs with torch's own formulas
  (``torch.utils.flop_counter.flop_registry``, what ``FlopCounterMode`` uses);
- saved-tensor hooks (``torch.autograd.graph.saved_tensors_hooks``) that classify every tensor autograd
  saves by the producer of its storage, counting each storage once per block (views of one storage are
  one allocation, as the offload engine counts them);
- forward pre/post hooks on the blocks and gradient hooks on their input and output tensors that say which
  block runs, forward and backward, and mark its start and end on a clock.

Storages are keyed by :class:`torch.multiprocessing.reductions.StorageWeakRef` (the storage's address),
which works on the meta device (where ``data_ptr`` is 0) and tells whether a storage is still alive: that
is how the outputs a selective checkpoint keeps (held in torch's checkpoint cache, not in saved-tensor
hooks) are measured, as the storages a block produced that are still alive after its forward.

The analytic source traces on the meta device, where two things differ from a real device; both are
emulated here (:class:`MetaEmulation`): autocast does not apply to meta tensors (so matmul-like functions
get their floating inputs cast as CUDA/CPU autocast would), and ``scaled_dot_product_attention`` falls back
to the math path (so it is routed to the fused kernel torch picks on the target device).
"""

from __future__ import annotations

import time
from collections import defaultdict
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch.multiprocessing.reductions import StorageWeakRef
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves
from torch.utils.flop_counter import flop_registry

from elbowroom.activations.selective import _ATTENTION_OPS, _MATMUL_OPS
from elbowroom.plan import kernels

HEAD = -1
"""Region index of everything outside the blocks (embeddings, final norm, head, loss)."""

KINDS = ("matmul", "attention", "pointwise", "input")


def skey(t: torch.Tensor) -> StorageWeakRef:
    """The identity of ``t``'s storage (shared by all its views), valid on every device including meta."""
    return StorageWeakRef(t.untyped_storage())


def storage_bytes(t: torch.Tensor) -> int:
    return t.untyped_storage().nbytes()


def main_tensor(obj: Any) -> torch.Tensor | None:
    """The first floating tensor in ``obj`` (args, kwargs or output): a block's residual-stream input/output."""
    for leaf in tree_leaves(obj):
        if isinstance(leaf, torch.Tensor) and leaf.is_floating_point():
            return leaf
    return None


class Clock:
    """Marks on the host clock (CPU, meta) or CUDA events (recorded on the current stream, read after a sync)."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"

    def mark(self) -> Any:
        if self.cuda:
            ev = torch.cuda.Event(enable_timing=True)
            ev.record()
            return ev
        return time.perf_counter()

    def sync(self) -> None:
        if self.cuda:
            torch.cuda.synchronize()  # host-device sync: the events are read next

    def seconds(self, a: Any, b: Any) -> float:
        if a is None or b is None:
            return 0.0
        return a.elapsed_time(b) / 1e3 if self.cuda else b - a


class _Region:
    """What one block (or the head) did in one traced step."""

    def __init__(self) -> None:
        self.saved: dict[str, int] = defaultdict(int)  # kind -> bytes (plus "state", "shared")
        self.seen: set[StorageWeakRef] = set()
        self.largest = 0
        self.fwd_flops = 0.0
        self.bwd_flops = 0.0
        self.fwd_kernels: list[tuple] = []  # kernels.describe of each op with FLOPs, forward and backward apart
        self.bwd_kernels: list[tuple] = []
        self.input_keys: set[StorageWeakRef] = set()
        self.main_input: StorageWeakRef | None = None
        self.input_bytes = 0
        self.produced: list[tuple[StorageWeakRef, int, str]] = []  # new storages of its forward, in order
        self.kept_alive = 0  # bytes of produced storages still alive after forward (selective cache)
        self.sizes: list[int] = []  # each saved activation storage's bytes, in the order saved
        self.kept_sizes: list[int] = []  # each storage the selective cache keeps, in the order produced
        self.fwd: list[Any] = [None, None]  # clock marks
        self.bwd: list[Any] = [None, None]


class Tracer:
    """One profiling step's bookkeeping. Install with :meth:`install`; read the regions after backward.

    Args:
        blocks: the model's blocks, in forward order.
        state: storages of the model's parameters and buffers (model state, never counted as activations).
        clock: the clock for forward/backward marks.
        record_ops: run the op recorder (bytes and FLOPs); off for pure timing steps.
        track_liveness: after each block's forward, measure which of its new storages are still alive
            (the selective checkpoint's cache).
    """

    def __init__(self, blocks: list[torch.nn.Module], state: set[StorageWeakRef], clock: Clock, *,
                 record_ops: bool = True, track_liveness: bool = False) -> None:
        self.blocks = blocks
        self.state = state
        self.clock = clock
        self.record_ops = record_ops
        self.track_liveness = track_liveness
        self.regions = {i: _Region() for i in range(len(blocks))}
        self.regions[HEAD] = _Region()
        self.producer: dict[StorageWeakRef, str] = {}
        self.fwd_block = HEAD
        self.bwd_block = HEAD
        self.backward = False
        self.vocab = 0

    # ---- op recorder -------------------------------------------------------------------------------
    def on_op(self, func: Any, args: tuple, kwargs: dict, out: Any) -> None:
        region = self.regions[self.bwd_block if self.backward else self.fwd_block]
        count = flop_registry.get(func._overloadpacket)
        if count is not None:
            try:
                flops = count(*args, **kwargs, out_val=out)
            except AssertionError:  # torch's attention counter refuses grouped-query shapes (fewer k/v heads)
                flops = _grouped_attention_flops(func, args)
            if self.backward:
                region.bwd_flops += flops
                region.bwd_kernels.append(kernels.describe(func, args, kwargs, flops))
            else:
                region.fwd_flops += flops
                region.fwd_kernels.append(kernels.describe(func, args, kwargs, flops))
        ins = [t for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
        in_keys = {skey(t) for t in ins}
        name = func._overloadpacket.__name__
        if name in _ATTENTION_OPS:
            kind = "attention"
        elif name in _MATMUL_OPS:
            kind = "matmul"
        elif ins and all(k in self.state for k in in_keys):
            # a pure function of model state (a weight's autocast copy, a RoPE table cast): model state too
            kind = "state"
            self.state.update(
                skey(o) for o in tree_leaves(out) if isinstance(o, torch.Tensor) and skey(o) not in in_keys
            )
        else:
            kind = "pointwise"
        for o in tree_leaves(out):
            if not isinstance(o, torch.Tensor):
                continue
            k = skey(o)
            if k in in_keys:
                continue  # a view or an in-place op: the storage keeps its producer
            # a new storage: any earlier entry under this key was a storage since freed, whose address the
            # allocator reused (parameters and buffers live throughout, so they are never "new")
            if kind != "state":
                self.state.discard(k)
            self.producer[k] = kind
            if self.track_liveness and not self.backward and self.fwd_block != HEAD:
                region.produced.append((k, storage_bytes(o), kind))

    # ---- saved-tensor hooks ------------------------------------------------------------------------
    def pack(self, t: torch.Tensor) -> torch.Tensor:
        if self.backward:
            return t
        region = self.regions[self.fwd_block]
        k = skey(t)
        if k in region.seen:
            return t
        region.seen.add(k)
        n = storage_bytes(t)
        if region.main_input is not None and k == region.main_input:
            kind = "input"
        elif k in self.state:
            kind = "state"
        elif k in region.input_keys:
            kind = "shared"  # another input of the block (HF's rotary tables, a mask), made once for all blocks
        else:
            # a storage no op of this step produced existed before it (a module's cache of cast tables, the
            # batch): model state or data, not an activation of this step. Without the op recorder (compiled
            # blocks, whose ops it cannot see) every other storage is an activation, counted as pointwise
            kind = self.producer.get(k, "state" if self.record_ops else "pointwise")
        region.saved[kind] += n
        if kind in KINDS:
            region.largest = max(region.largest, n)
            region.sizes.append(n)
        return t  # the tensor itself: the hooks observe, they change nothing

    # ---- block hooks -------------------------------------------------------------------------------
    def _pre(self, i: int) -> Callable[..., None]:
        def hook(module: torch.nn.Module, args: tuple, kwargs: dict) -> None:
            region = self.regions[i]
            self.fwd_block = i
            leaves = [t for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
            region.input_keys = {skey(t) for t in leaves}
            x = main_tensor((args, kwargs))
            if x is not None:
                region.main_input = skey(x)
                region.input_bytes = storage_bytes(x)
                if x.requires_grad and torch.is_grad_enabled():
                    x.register_hook(self._bwd_end(i))
            region.fwd[0] = self.clock.mark()

        return hook

    def _post(self, i: int) -> Callable[..., None]:
        def hook(module: torch.nn.Module, args: tuple, kwargs: dict, out: Any) -> None:
            region = self.regions[i]
            region.fwd[1] = self.clock.mark()
            self.fwd_block = HEAD
            y = main_tensor(out)
            if y is not None and y.requires_grad and torch.is_grad_enabled():
                y.register_hook(self._bwd_start(i))
            if self.track_liveness:
                outs = {skey(t) for t in tree_leaves(out) if isinstance(t, torch.Tensor)}
                seen: set[StorageWeakRef] = set()
                for k, n, kind in region.produced:
                    if k.expired() or k in seen or k in outs or k in region.input_keys or kind == "state":
                        continue
                    if k in self.state:
                        continue
                    seen.add(k)
                    region.kept_alive += n
                    region.kept_sizes.append(n)
                region.produced.clear()

        return hook

    def _bwd_start(self, i: int) -> Callable[[torch.Tensor], None]:
        def hook(grad: torch.Tensor) -> None:
            # the gradient of block i's output is complete: block i's backward starts now
            self.bwd_block = i
            self.regions[i].bwd[0] = self.clock.mark()

        return hook

    def _bwd_end(self, i: int) -> Callable[[torch.Tensor], None]:
        def hook(grad: torch.Tensor) -> None:
            # the gradient of block i's input is complete: block i's backward is done. The same tensor is
            # block i-1's output, whose hook may fire first: only leave the block if we are still in it.
            self.regions[i].bwd[1] = self.clock.mark()
            if self.bwd_block == i:
                self.bwd_block = HEAD

        return hook

    def install(self) -> list[Any]:
        """Register the block hooks; returns the handles (remove them when done)."""
        handles = []
        for i, blk in enumerate(self.blocks):
            handles.append(blk.register_forward_pre_hook(self._pre(i), with_kwargs=True))
            handles.append(blk.register_forward_hook(self._post(i), with_kwargs=True))
        return handles


class OpRecorder(TorchDispatchMode):
    """Feeds every op and its outputs to :meth:`Tracer.on_op`."""

    def __init__(self, tracer: Tracer) -> None:
        super().__init__()
        self.tracer = tracer

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        self.tracer.on_op(func, args, kwargs, out)
        return out


# ---- meta-device emulation ---------------------------------------------------------------------------

# Functions autocast runs in the low-precision dtype (CUDA's and CPU's lists agree on these).
_LOWER = {
    torch._C._nn.linear, torch.matmul, torch.mm, torch.bmm, torch.addmm, torch.baddbmm,
    torch.Tensor.matmul, torch.Tensor.__matmul__, torch.Tensor.mm, torch.Tensor.bmm,
    F.conv1d, F.conv2d, F.conv3d,
}
# Functions CUDA autocast runs in fp32 (CPU autocast leaves norms and softmax in their input dtype).
_FP32_CUDA = {
    F.layer_norm, torch.layer_norm, F.group_norm, F.softmax, F.log_softmax, torch.softmax, torch.log_softmax,
    torch.Tensor.softmax, torch.Tensor.log_softmax,
}
# Losses both run in fp32.
_FP32 = {F.cross_entropy, F.nll_loss, F.mse_loss, F.l1_loss, F.smooth_l1_loss, F.binary_cross_entropy_with_logits,
         F.kl_div}
_SDPA = {F.scaled_dot_product_attention, torch._C._nn.scaled_dot_product_attention}
_RMS_NORM = {F.rms_norm, torch.rms_norm}


class _FusedRMSNormOnMeta(torch.autograd.Function):
    """CUDA's ``_fused_rms_norm`` as autograd sees it, on meta tensors: the output, and saved for backward
    the input, the per-row rstd (fp32 for 16-bit inputs) and the weight (derivatives.yaml). On meta the op
    itself decomposes (it has kernels for CUDA only), so the node is built here."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, normalized_shape: tuple, weight: torch.Tensor | None) -> torch.Tensor:
        n = len(normalized_shape)
        stat = x.new_empty(tuple(x.shape[: x.dim() - n]) + (1,) * n,
                           dtype=torch.float32 if x.dtype in (torch.float16, torch.bfloat16) else x.dtype)
        ctx.save_for_backward(x, stat, weight)
        return torch.empty_like(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple:
        x, _, weight = ctx.saved_tensors
        return torch.empty_like(x), None, None if weight is None else torch.empty_like(weight)


def _cast(obj: Any, dtype: torch.dtype) -> Any:
    if isinstance(obj, torch.Tensor):
        return obj.to(dtype) if obj.is_floating_point() and obj.dtype != dtype else obj
    if isinstance(obj, (list, tuple)):
        return type(obj)(_cast(o, dtype) for o in obj)
    return obj


class MetaEmulation(TorchFunctionMode):
    """On meta tensors: autocast as the target device would apply it, and the target's attention kernel.

    Autocast is emulated at the function level, above autograd (as autocast itself sits above autograd), so
    the casts are part of the graph and autograd saves the cast tensors, as on the device. The lists are
    the functions our models and Hugging Face decoders call; an unlisted function runs in its inputs' dtype.
    For a CUDA target, two more functions run as on CUDA: dropout (one kernel saving a bool mask) and
    ``rms_norm`` (the fused kernel). Not emulated: elbowroom's own fused RoPE and SwiGLU (``elbowroom.ops``),
    which pick their Triton kernels by ``x.is_cuda``; their eager forms run on meta (RoPE saves the same,
    SwiGLU saves one more ``tokens x ffn`` activation than its fused kernel).

    Args:
        dtype: the autocast dtype, or None for no autocast.
        target: "cuda" or "cpu": whose autocast lists and attention-kernel choice to follow.
    """

    def __init__(self, dtype: torch.dtype | None, target: str) -> None:
        super().__init__()
        self.dtype = dtype
        self.target = target

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        if func is torch.Tensor.__bool__ and args and args[0].device.type == "meta":
            # a data-dependent branch on meta (Hugging Face's mask preparation asks whether a batch is packed):
            # there is no data; answer True, the ordinary case of those checks (an all-ones mask, no packing)
            return True
        if self.dtype is not None:
            if func in _LOWER or func in _SDPA:
                args, kwargs = _cast(args, self.dtype), {k: _cast(v, self.dtype) for k, v in kwargs.items()}
            elif func in _FP32 or (self.target == "cuda" and func in _FP32_CUDA):
                args = _cast(args, torch.float32)
        if func in _SDPA:
            return self._sdpa(func, *args, **kwargs)
        if self.target == "cuda" and func is F.dropout:
            return self._dropout(func, *args, **kwargs)
        if self.target == "cuda" and func in _RMS_NORM:
            return self._rms_norm(func, *args, **kwargs)
        return func(*args, **kwargs)

    @staticmethod
    def _dropout(func: Any, x: torch.Tensor, p: float = 0.5, training: bool = True, inplace: bool = False) -> Any:
        # CUDA runs dropout as one kernel that saves a bool mask; elsewhere (CPU, meta) it multiplies by a
        # noise tensor of the input's dtype and saves that
        if x.device.type != "meta" or not training or not 0.0 < p < 1.0 or inplace:
            return func(x, p, training, inplace)
        return torch.ops.aten.native_dropout(x, p, True)[0]

    @staticmethod
    def _rms_norm(func: Any, x: torch.Tensor, normalized_shape: Any, weight: torch.Tensor | None = None,
                  eps: float | None = None) -> Any:
        # CUDA runs rms_norm as the fused kernel (input, rstd and weight saved); elsewhere it decomposes into
        # pow/mean/rsqrt/mul, which also saves the normalised input. torch falls back to the decomposition
        # itself when the weight's dtype differs from the input's.
        if x.device.type != "meta" or (weight is not None and weight.dtype != x.dtype) or x.is_complex():
            return func(x, normalized_shape, weight, eps)
        return _FusedRMSNormOnMeta.apply(x, tuple(normalized_shape), weight)

    def _sdpa(self, func: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, attn_mask: Any = None,
              dropout_p: float = 0.0, is_causal: bool = False, scale: float | None = None,
              enable_gqa: bool = False) -> torch.Tensor:
        aten = torch.ops.aten
        if q.device.type != "meta":
            return func(q, k, v, attn_mask=attn_mask, dropout_p=dropout_p, is_causal=is_causal, scale=scale,
                        enable_gqa=enable_gqa)
        gqa = enable_gqa and q.shape[-3] != k.shape[-3]
        backend = self._backend(q, k, v, attn_mask, dropout_p, is_causal, enable_gqa)
        # the fused kernels take grouped k and v as they are (no repeat), as torch's dispatch passes them
        if backend == "flash_cpu":
            return aten._scaled_dot_product_flash_attention_for_cpu(
                q, k, v, dropout_p, is_causal, attn_mask=attn_mask, scale=scale)[0]
        if backend == "flash":
            return aten._scaled_dot_product_flash_attention(q, k, v, dropout_p, is_causal, False, scale=scale)[0]
        if backend == "efficient" and not gqa:
            need_lse = q.requires_grad or k.requires_grad or v.requires_grad
            return aten._scaled_dot_product_efficient_attention(
                q, k, v, attn_mask, need_lse, dropout_p, is_causal, scale=scale)[0]
        return func(q, k, v, attn_mask=attn_mask, dropout_p=dropout_p, is_causal=is_causal, scale=scale,
                    enable_gqa=enable_gqa)

    def _backend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: Any, dropout_p: float,
                 is_causal: bool, enable_gqa: bool) -> str:
        if self.target == "cpu":
            # ask torch's own CPU choice on stand-ins of the same shapes and dtypes (stride-0 expansions of one
            # row: no memory), so the rules (dropout -> math, head sizes, masks, GQA) are torch's
            def stand_in(t: torch.Tensor) -> torch.Tensor:
                return torch.empty(t.shape[-1], dtype=t.dtype, requires_grad=t.requires_grad).expand(t.shape)

            m = None if mask is None else torch.empty(mask.shape[-1], dtype=mask.dtype).expand(mask.shape)
            choice = torch._fused_sdp_choice(stand_in(q), stand_in(k), stand_in(v), m, dropout_p, is_causal,
                                             enable_gqa=enable_gqa)
            return "flash_cpu" if choice == int(torch.nn.attention.SDPBackend.FLASH_ATTENTION) else "math"
        # CUDA (sm80+), as torch's choice runs on an H100: flash for fp16/bf16 without a mask and head dim
        # <= 256 in steps of 8 (grouped k/v included), the memory-efficient kernel for fp32 or a mask (math
        # when k/v are grouped: the efficient kernel does not take them)
        hd = q.shape[-1]
        if mask is None and q.dtype in (torch.float16, torch.bfloat16) and hd <= 256 and hd % 8 == 0:
            return "flash"
        return "efficient"


def _grouped_attention_flops(func: Any, args: tuple) -> int:
    """FLOPs of an attention op whose keys and values have fewer heads than its queries (grouped-query): the
    query heads' count, as if k and v were repeated; 2 matmuls forward, 4 backward (torch's own convention)."""
    q, k = args[0], args[1]
    b, h, s_q, d = q.shape
    s_k = k.shape[-2]
    per_matmul = 2 * b * h * s_q * s_k * d
    return (4 if "backward" in func._overloadpacket.__name__ else 2) * per_matmul
