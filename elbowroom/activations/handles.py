"""What autograd holds for a saved tensor inside an offload region, and the bookkeeping of one transfer.

- :class:`_Record`: one device-to-host transfer (a byte range of one device storage, its host slot,
  its way back); several views of one storage share it.
- :class:`_Packed`: an offloaded tensor, as a view (dtype, size, stride, offset) of a record.
- :class:`_Kept`: a tensor that stays on the device, with its version for the in-place check.
- :class:`_Recast`: a dtype cast of a parameter, cast again when backward needs it.
"""

from __future__ import annotations

import weakref
from typing import TYPE_CHECKING, Any

import torch

from elbowroom.activations.pool import _Slot

if TYPE_CHECKING:
    from elbowroom.activations.offload import OffloadEngine, OffloadGroup


class _Record:
    """One transfer: a byte range of one device storage, its host slot and its way back."""

    __slots__ = (
        "engine", "slot", "lo", "nbytes", "gpu", "d2h", "restored", "h2d", "alloc_stream", "handles",
        "pending_unpacks", "version", "key", "group_id", "keep_gpu", "in_flight", "mutated", "window",
        "__weakref__",
    )  # fmt: skip

    def __init__(self, engine: OffloadEngine, slot: _Slot, lo: int, t: torch.Tensor, d2h: Any, key: int,
                 group_id: int) -> None:
        self.engine = engine
        self.slot: _Slot | None = slot
        self.lo = lo  # byte offset of the copied range in the device storage
        self.nbytes = slot.nbytes
        # LIFETIME EXTENSION: the device tensor lives until its device-to-host copy finished
        self.gpu: torch.Tensor | None = t
        self.d2h = d2h
        # LIFETIME EXTENSION: device bytes copied back (prefetch or unpack), held until every view of
        # them has been handed to autograd
        self.restored: torch.Tensor | None = None
        self.h2d: Any = None
        self.alloc_stream: Any = None
        self.handles = 0
        self.pending_unpacks = 0
        self.version = t._version
        self.key = key
        self.group_id = group_id
        self.keep_gpu = False  # backward is near: keep the device copy instead of fetching it back
        self.in_flight = True  # in the engine's pending queue: the copy may not have finished
        self.mutated = False  # modified in place while we held it (seen when it is released)
        self.window: OffloadGroup | None = None  # the region whose prefetch window counts this record

    def covers(self, lo: int, hi: int, elsize: int) -> bool:
        return self.lo <= lo and hi <= self.lo + self.nbytes and (lo - self.lo) % elsize == 0


class _Packed:
    """What autograd holds for an offloaded tensor: a view of a record."""

    __slots__ = ("record", "group", "dtype", "size", "stride", "offset", "version", "root", "unpacked")

    def __init__(self, record: _Record, t: torch.Tensor, group: OffloadGroup | None) -> None:
        self.record = record
        self.group = group
        self.dtype = t.dtype
        self.size = t.size()
        self.stride = t.stride()
        self.offset = t.storage_offset()
        self.version = t._version
        # views share their base's version counter; the base outlives every view of it
        base = t._base
        self.root = weakref.ref(base if base is not None else t)
        self.unpacked = False
        record.handles += 1
        record.pending_unpacks += 1

    def __del__(self) -> None:
        rec = self.record
        try:
            rec.engine._drop_handle(rec, self.unpacked)
        except Exception:  # interpreter shutdown: nothing left to release
            pass


class _Kept:
    """What autograd holds for a tensor that stays on the device (with its version, for the check)."""

    __slots__ = ("tensor", "version", "group")

    def __init__(self, t: torch.Tensor, group: OffloadGroup | None) -> None:
        self.tensor = t
        self.version = t._version
        self.group = group


class _Recast:
    """What autograd holds for a dtype cast of a parameter (autocast's bf16 weight): the parameter and the
    cast's layout. Unpacking casts again (W1: ~0.1 GB per block read as fp32, written as bf16, ~0.1 ms), so
    the cast lives only while an op uses it, never from forward to backward."""

    __slots__ = ("leaf", "dtype", "base_size", "base_stride", "size", "stride", "offset", "version", "group")

    def __init__(self, leaf: torch.Tensor, base: torch.Tensor, t: torch.Tensor, group: OffloadGroup | None) -> None:
        self.leaf = leaf  # a parameter: alive anyway, this reference extends nothing
        self.dtype = base.dtype
        self.base_size, self.base_stride = base.size(), base.stride()
        self.size, self.stride, self.offset = t.size(), t.stride(), t.storage_offset()
        self.version = leaf._version
        self.group = group

    def restore(self) -> torch.Tensor:
        leaf = self.leaf
        if leaf._version != self.version:
            raise RuntimeError(
                f"a parameter of shape {list(leaf.shape)} was modified in place between forward and backward; its "
                f"{self.dtype} cast was saved for backward and elbowroom's activation offload casts it again when "
                "backward needs it, which would use the new values. Run backward before changing parameters, or "
                "make the engine with recast_parameter_casts=False to keep each cast on the device instead"
            )
        with torch.no_grad():
            base = torch.empty_strided(self.base_size, self.base_stride, dtype=self.dtype, device=leaf.device)
            base.copy_(leaf)
            return base.as_strided(self.size, self.stride, self.offset)


def _cast_source(t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
    """``(leaf, cast)`` when ``t`` is, or views, a same-device dtype cast of a leaf that requires grad (a
    parameter cast by autocast); else None."""
    base = t._base if t._base is not None else t
    fn = base.grad_fn
    if fn is None or fn.name() != "ToCopyBackward0":
        return None
    nxt = fn.next_functions
    acc = nxt[0][0] if nxt else None
    if acc is None or acc.name() != "torch::autograd::AccumulateGrad":
        return None
    leaf = acc.variable
    if leaf.device != base.device or leaf.shape != base.shape or base.storage_offset() != 0:
        return None
    return leaf, base


def _version_error(t: torch.Tensor, saved: int) -> RuntimeError:
    return RuntimeError(
        "one of the variables needed for gradient computation has been modified by an inplace operation: "
        f"[{t.type()} {list(t.shape)}] is at version {t._version}; expected version {saved} instead "
        "(checked by elbowroom's activation offload, since autograd skips this check under saved-tensor hooks)"
    )
