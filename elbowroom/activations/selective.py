"""Selective recompute's two dispatch modes: keep the outputs of matmuls and attention in forward, hand them back
in the recompute.

torch's :func:`~torch.utils.checkpoint.create_selective_checkpoint_contexts` does the same, but for every op of
the forward and of the recompute it builds a context object, calls the policy, checks for a compiler and files a
storage entry. A W1 block runs 61 ops in its forward, six of them kept: on a 2-core CPU its forward took 3.8 ms
under torch's modes against 1.0 ms plain and 2.2 ms under a mode that does nothing, and a planned W1 step whose
17 selective blocks ran so kept its GPU waiting for launches (``BENCHMARKS.md``, fourteenth session, section 7).

Here an op the block does not keep costs one set lookup. :class:`KeptOutputs` holds one call's kept outputs by
``(op, call index)``, so the recompute asks for exactly the output the forward kept:

- a static set of ops (:func:`default_selective_ops`, or the ops a caller listed) is looked up; a policy
  callable is asked for every op of the forward, as torch asks it;
- an op that draws random numbers (dropout; attention with ``dropout_p > 0``) is never kept, whatever the policy
  says: the recompute restores the RNG state and replays the region's draws in order, and a kept op would skip
  its draw there;
- an output changed in place after it was kept is not read: the recompute runs its op again (torch's modes raise
  there);
- the last kept output, when only ops that save nothing followed it (the MLP's down projection feeding the
  residual add), leaves the cache after forward (:meth:`KeptOutputs.drop_unread_tail`): the recompute stops
  before it (torch's early stop), and without early stop it runs again;
- inside an offload region that offloads the cache, each kept output is packed as it is kept and restored when
  the recompute asks for it.

Under ``torch.compile`` torch's own modes are used (they tag the graph for the compiler's recompute pass).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any

import torch
import torch.utils.checkpoint as torch_ckpt
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten, tree_unflatten

from elbowroom.activations.handles import _Packed

if TYPE_CHECKING:
    from elbowroom.activations.region import OffloadGroup

logger = logging.getLogger(__name__)

__all__ = [
    "SAVE_DECISIONS",
    "KeptOutputs",
    "default_selective_ops",
    "draws_random_numbers",
    "selective_contexts",
]

SAVE_DECISIONS = (torch_ckpt.CheckpointPolicy.MUST_SAVE, torch_ckpt.CheckpointPolicy.PREFER_SAVE, True)
"""Policy answers that keep an op's output."""

# Attention kernels whose outputs "selective" keeps. Names, not objects: which ones exist depends on
# the torch build (the CPU build has the *_for_cpu flash variant, CUDA builds the others).
_ATTENTION_OPS = (
    "_scaled_dot_product_flash_attention",
    "_scaled_dot_product_efficient_attention",
    "_scaled_dot_product_cudnn_attention",
    "_scaled_dot_product_flash_attention_for_cpu",
    "_scaled_dot_product_fused_attention_overrideable",
    "_flash_attention_forward",
    "_efficient_attention_forward",
)
_MATMUL_OPS = ("mm", "addmm", "bmm", "baddbmm", "_scaled_mm")


def default_selective_ops() -> frozenset:
    """The aten ops whose outputs ``mode="selective"`` keeps: matmuls and attention kernels.

    Returns:
        A frozenset of ``torch._ops.OpOverload`` (only the overloads this torch build has).
    """
    aten = torch.ops.aten
    ops = set()
    for name in _MATMUL_OPS + _ATTENTION_OPS:
        packet = getattr(aten, name, None)
        if packet is None:
            continue
        for overload in packet.overloads():
            ops.add(getattr(packet, overload))
    return frozenset(ops)


# op -> position of its ``dropout_p`` argument, None where it has none, -1 where the op draws no random
# numbers at all (filled once per op)
_RANDOM_OPS: dict[Any, int | None] = {}


def _dropout_index(op: Any) -> int | None:
    idx = _RANDOM_OPS.get(op, -2)
    if idx == -2:
        idx = -1
        if torch.Tag.nondeterministic_seeded in getattr(op, "tags", ()):
            idx = next((i for i, a in enumerate(op._schema.arguments) if a.name == "dropout_p"), None)
        _RANDOM_OPS[op] = idx
    return idx


def draws_random_numbers(op: Any, args: tuple, kwargs: dict) -> bool:
    """Whether running ``op(*args, **kwargs)`` consumes the RNG (dropout; attention with dropout_p > 0).

    Args:
        op: an aten ``OpOverload``.
        args: its positional arguments.
        kwargs: its keyword arguments.

    Returns:
        True for ops tagged ``nondeterministic_seeded``, unless their ``dropout_p`` argument is 0.
    """
    idx = _dropout_index(op)
    if idx == -1:
        return False
    if idx is None:
        return True
    p = args[idx] if idx < len(args) else kwargs.get("dropout_p", 0.0)
    return bool(p)


def _non_saving_ops() -> frozenset:
    """Ops whose autograd nodes save no tensor (residual adds, views, copies)."""
    aten = torch.ops.aten
    names = ("add.Tensor", "sub.Tensor", "view.default", "_unsafe_view.default", "alias.default", "detach.default",
             "t.default", "transpose.int", "permute.default", "expand.default", "clone.default", "slice.Tensor",
             "select.int", "unsqueeze.default", "squeeze.dim", "split.Tensor", "split_with_sizes.default")
    ops = set()
    for name in names:
        packet, _, overload = name.partition(".")
        op = getattr(getattr(aten, packet, None), overload, None)
        if op is not None:
            ops.add(op)
    return frozenset(ops)


_NON_SAVING = _non_saving_ops()
# ops a policy is not asked about: the checkpoint itself adds detaches in forward that the recompute does not repeat
_IGNORED = frozenset(op for op in (torch.ops.aten.detach.default, getattr(torch.ops.prim, "device", None))
                     if op is not None and isinstance(op, torch._ops.OpOverload))
_MISSING = object()
_WARNED: set = set()  # ops whose kept output was found changed in place (warned once each)


def _detached(t: torch.Tensor) -> torch.Tensor:
    # beneath autograd a plain detach would not share the version counter: include the view key for it, as torch does
    with torch._C._SetExcludeDispatchKeyGuard(torch._C.DispatchKey.ADInplaceOrView, False):
        return t.detach()


class KeptOutputs:
    """The outputs one call of a selective region keeps, by ``(op, call index)``.

    Filled by the forward mode on the training thread, emptied by the recompute mode on a backward thread, never both
    at once. Each entry is taken once; a second backward through the region (``retain_graph=True``) finds nothing
    and recomputes the op.
    """

    def __init__(self, keep_ops: frozenset | None, policy: Callable[..., Any] | None, group: OffloadGroup | None):
        """``keep_ops``: the ops to keep (looked up); else ``policy`` is asked for every op. ``group``: the offload
        region the kept outputs travel through (None: they stay on the device)."""
        if keep_ops is None and policy is None:
            raise ValueError("a selective region needs the ops to keep or a policy")
        self.keep_ops = keep_ops
        self.policy = policy
        self.group = group
        self._entries: dict[tuple[Any, int], Any] = {}
        self._fwd_calls: dict[Any, int] = {}
        self._rc_calls: dict[Any, int] = {}
        self._last: tuple[Any, int] | None = None  # the last kept output
        self._clean = False  # only ops that save nothing ran since it
        self.dropped: tuple[Any, int] | None = None
        self.mutated = False  # a kept output was changed in place (its op ran again in the recompute)

    # forward
    def after_op(self, op: Any, args: tuple, kwargs: dict, out: Any) -> None:
        """Keep ``out`` if the region keeps ``op`` (the forward mode calls this after every op)."""
        if self.keep_ops is not None:
            if op not in self.keep_ops:
                if self._clean and op not in _NON_SAVING:
                    self._clean = False
                return
            keep = not draws_random_numbers(op, args, kwargs)
        else:
            if op in _IGNORED:
                return
            decision = self.policy(_FORWARD_CTX, op, *args, **kwargs)
            keep = decision in SAVE_DECISIONS and not draws_random_numbers(op, args, kwargs)
        k = self._fwd_calls.get(op, 0)
        self._fwd_calls[op] = k + 1
        if keep:
            self._entries[(op, k)] = self._pack(out)
            self._last, self._clean = (op, k), True
        elif self._clean and op not in _NON_SAVING:
            self._clean = False

    def drop_unread_tail(self) -> None:
        """After forward: forget the last kept output if only ops that save nothing followed it."""
        if self._last is not None and self._clean and self._entries.pop(self._last, None) is not None:
            self.dropped = self._last

    # recompute
    def begin_recompute(self) -> None:
        self._rc_calls.clear()

    def take(self, op: Any) -> Any:
        """The output the forward kept for this call of ``op``, or ``_MISSING`` (run the op)."""
        if self.keep_ops is not None:
            if op not in self.keep_ops:
                return _MISSING
        elif op in _IGNORED:
            return _MISSING
        k = self._rc_calls.get(op, 0)
        self._rc_calls[op] = k + 1
        entry = self._entries.pop((op, k), None)
        if entry is None:
            return _MISSING
        out = self._unpack(entry)
        if out is _MISSING:
            self.mutated = True
            if op not in _WARNED:
                _WARNED.add(op)
                logger.warning("an output a selective checkpoint kept (%s) was modified in place after the op; the "
                               "recompute runs that op again instead of reading it (said once per op)", op)
        return out

    def __len__(self) -> int:
        return len(self._entries)

    # an entry: a tensor output as (tensor, version) or a packed handle; any other output as a _Many
    def _pack_tensor(self, t: torch.Tensor) -> Any:
        t = _detached(t)
        if self.group is not None:
            p = self.group.engine._pack(self.group, t, "cache")
            if p is not None:
                return p
        return (t, t._version)

    def _unpack_tensor(self, e: Any) -> torch.Tensor | None:
        """The kept tensor, or None where it was changed in place after it was kept."""
        if isinstance(e, _Packed):
            t, mutated = self.group.engine._restore(e)
            return None if mutated else t
        t, version = e
        return None if t._version != version else t

    def _pack(self, out: Any) -> Any:
        if isinstance(out, torch.Tensor):
            return self._pack_tensor(out)
        leaves, spec = tree_flatten(out)
        tensors = {i: self._pack_tensor(x) for i, x in enumerate(leaves) if isinstance(x, torch.Tensor)}
        return _Many([None if i in tensors else x for i, x in enumerate(leaves)], tensors, spec)

    def _unpack(self, entry: Any) -> Any:
        if isinstance(entry, _Many):
            leaves = list(entry.leaves)
            for i, e in entry.tensors.items():
                leaves[i] = t = self._unpack_tensor(e)
                if t is None:
                    return _MISSING
            return tree_unflatten(leaves, entry.spec)
        t = self._unpack_tensor(entry)
        return _MISSING if t is None else t


class _Many:
    """A kept output of several leaves (an attention kernel's output, its log-sum-exp, sizes and seeds)."""

    __slots__ = ("leaves", "spec", "tensors")

    def __init__(self, leaves: list, tensors: dict[int, Any], spec: Any) -> None:
        self.leaves = leaves  # the non-tensor leaves, None where a tensor goes
        self.tensors = tensors  # leaf index -> kept tensor entry
        self.spec = spec


_FORWARD_CTX = torch_ckpt.SelectiveCheckpointContext(is_recompute=False)


class _Keep(TorchDispatchMode):
    def __init__(self, kept: KeptOutputs) -> None:
        super().__init__()
        self.kept = kept

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        if kwargs is None:
            kwargs = {}
        out = func(*args, **kwargs)
        self.kept.after_op(func, args, kwargs, out)
        return out


class _Replay(TorchDispatchMode):
    def __init__(self, kept: KeptOutputs) -> None:
        super().__init__()
        self.kept = kept

    def __enter__(self) -> _Replay:
        self.kept.begin_recompute()
        return super().__enter__()

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        out = self.kept.take(func)
        if out is _MISSING:
            return func(*args, **(kwargs or {}))
        return out


def _compiling() -> bool:
    if torch.compiler.is_compiling():
        return True
    key = getattr(torch._C, "_TorchDispatchModeKey", None)
    return key is not None and torch._C._get_dispatch_mode(key.PROXY) is not None


def selective_contexts(policy: Callable[..., Any], group: OffloadGroup | None,
                       record: Callable[[KeptOutputs], None] | None = None) -> tuple[Any, Any]:
    """The forward and recompute modes of one selective call (a ``context_fn`` for torch's checkpoint).

    Args:
        policy: the region's policy; its ``keep_ops`` attribute, where it has one, is looked up instead of calling it.
        group: the offload region around the call, or None; its ``cache_ratio`` says whether the kept outputs travel.
        record: called with the call's :class:`KeptOutputs` (the wrapper drops the unread tail through it).

    Returns:
        ``(forward mode, recompute mode)``; torch's own modes under ``torch.compile``.
    """
    if _compiling():
        return torch_ckpt.create_selective_checkpoint_contexts(policy)
    kept = KeptOutputs(getattr(policy, "keep_ops", None), policy,
                       group if group is not None and group.cache_ratio > 0 else None)
    if record is not None:
        record(kept)
    return _Keep(kept), _Replay(kept)


def resolve_keep_ops(keep: Iterable | None) -> frozenset:
    """``keep`` as a frozenset of OpOverloads (None: :func:`default_selective_ops`); a TypeError names a wrong one."""
    keep_ops = default_selective_ops() if keep is None else frozenset(keep)
    for op in keep_ops:
        if not isinstance(op, torch._ops.OpOverload):
            raise TypeError(
                f"selective checkpoint ops must be OpOverloads such as torch.ops.aten.mm.default, got {op!r}"
            )
    return keep_ops
