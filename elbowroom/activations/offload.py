"""Activation offload: saved tensors travel to a pinned host pool in forward and back in backward.

The engine (:class:`OffloadEngine`) works through ``torch.autograd.graph.saved_tensors_hooks``. An
offload *region* (:meth:`OffloadEngine.group`, usually one transformer block's forward) packs each
tensor autograd saves:

- parameters, views of leaves, casts of parameters (autocast keeps them alive anyway), module
  buffers, tensors below ``min_offload_bytes`` and tensors of other devices stay where they are;
- views of one storage travel once: the storage (or the used extent of it) is copied, and every view
  comes back with its own dtype, size, stride and offset (a tensor and its transpose, q/k/v slices
  of one projection, a tensor saved by two ops);
- the copy goes into an exact-size slot of a host pool that grows only while the first step runs and
  is reused every step after (pinned memory costs ~0.5 s per GiB to allocate);
- on CUDA the copy runs on a device-to-host stream that first waits for the compute stream. The
  device memory is released only once that copy finished: a later pack polls the copy's event
  without blocking, and the end of the next region makes the compute stream wait for it (a stream
  wait, not a host sync), which bounds the device memory in flight to about one region;
- in backward, when a block's backward starts, the previous region's tensors are copied back on a
  host-to-device stream while the block's backward runs (both link directions busy at once).

Ratios follow haiscale's CPUOffload: the first entry of a tag offloads every eligible tensor and
measures their sizes; later entries offload the largest tensors until ``ratio`` of those bytes.

On a machine without CUDA the same bookkeeping runs with plain host memory and synchronous copies,
so every path (dedup, slots, ratios, prefetch, deferred release) is exercised by the CPU tests.

In-place safety: with saved-tensor hooks autograd no longer checks saved tensors' version counters,
so the engine does: each packed tensor remembers its version, and unpacking one that was modified
in place raises the error autograd would have raised.
"""

from __future__ import annotations

import collections
import contextlib
import logging
import threading
import weakref
from collections.abc import Hashable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn as nn
from torch.utils._pytree import tree_map

from elbowroom.activations import _wrap

logger = logging.getLogger(__name__)

__all__ = [
    "DEFAULT_MIN_OFFLOAD_BYTES",
    "OffloadEngine",
    "OffloadGroup",
    "OffloadStats",
    "offload",
    "offload_module",
]

DEFAULT_MIN_OFFLOAD_BYTES = 1 << 20
"""Saved tensors smaller than this stay on the device: a copy this small is latency, not bandwidth."""

DEFAULT_PREFETCH_WINDOW_BYTES = 2 << 30
"""How many bytes of one region travel back ahead of backward (a W1, W2 or 7B block fits whole)."""

_ALIGN = 512  # slot alignment inside a host chunk (bytes)
_DEFAULT_CHUNK_BYTES = 256 << 20  # a power of two: torch's pinned allocator rounds sizes up to one


def _validate_ratio(name: str, ratio: float) -> float:
    if isinstance(ratio, bool) or not isinstance(ratio, (int, float)) or not 0.0 <= ratio <= 1.0:
        raise ValueError(f"{name} must be in [0, 1], got {ratio!r}")
    return float(ratio)


def _next_pow2(n: int) -> int:
    return 1 << max(0, n - 1).bit_length()


# ---------------------------------------------------------------------------------------------- copies
class _CpuEvent:
    """Stands in for a CUDA event on CPU; ``delay`` > 0 makes it report "not done" that many times."""

    __slots__ = ("left",)

    def __init__(self, delay: int) -> None:
        self.left = delay

    def query(self) -> bool:
        if self.left > 0:
            self.left -= 1
            return False
        return True


class _CpuCopier:
    """Synchronous copies into a separate host buffer: the CPU path of the same bookkeeping."""

    def __init__(self, event_delay: int = 0) -> None:
        self.event_delay = event_delay

    def copy_out(self, dst: torch.Tensor, src: torch.Tensor, after: Any) -> _CpuEvent:
        dst.copy_(src)
        return _CpuEvent(self.event_delay)

    def copy_in(self, dst: torch.Tensor, src: torch.Tensor, after: Any) -> _CpuEvent:
        dst.copy_(src)
        return _CpuEvent(self.event_delay)

    def done(self, ev: _CpuEvent) -> bool:
        return ev.query()

    def wait(self, ev: _CpuEvent | None, stream: Any = None) -> None:
        if ev is not None:
            ev.left = 0

    def current_stream(self) -> None:
        return None


class _CudaCopier:
    """Copies on two side streams: device-to-host and host-to-device, each ordered by events."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.d2h = torch.cuda.Stream(device)
        self.h2d = torch.cuda.Stream(device)

    def current_stream(self) -> torch.cuda.Stream:
        return torch.cuda.current_stream(self.device)

    def copy_out(self, dst: torch.Tensor, src: torch.Tensor, after: torch.cuda.Event | None) -> torch.cuda.Event:
        # STREAM WAIT: the saved tensor was produced by work queued on the compute stream
        self.d2h.wait_stream(self.current_stream())
        if after is not None:
            # STREAM WAIT: the slot's previous content may still be read by a host-to-device copy
            self.d2h.wait_event(after)
        with torch.cuda.stream(self.d2h):
            dst.copy_(src, non_blocking=True)
            return self.d2h.record_event()

    def copy_in(self, dst: torch.Tensor, src: torch.Tensor, after: torch.cuda.Event | None) -> torch.cuda.Event:
        # STREAM WAIT: ``dst`` was just allocated on the compute stream, whose queued work may still be
        # using that memory (the caching allocator reuses blocks in compute-stream order)
        self.h2d.wait_stream(self.current_stream())
        if after is not None:
            # STREAM WAIT: the device-to-host copy that filled the slot must have finished
            self.h2d.wait_event(after)
        with torch.cuda.stream(self.h2d):
            dst.copy_(src, non_blocking=True)
            return self.h2d.record_event()

    def done(self, ev: torch.cuda.Event) -> bool:
        return ev.query()  # non-blocking: no host-device sync

    def wait(self, ev: torch.cuda.Event | None, stream: torch.cuda.Stream | None = None) -> None:
        if ev is not None:
            # STREAM WAIT (no host sync): later work on ``stream`` (the compute stream) runs after ``ev``
            (stream or self.current_stream()).wait_event(ev)


# ------------------------------------------------------------------------------------------- host pool
class _Slot:
    __slots__ = ("buf", "nbytes", "last_read")

    def __init__(self, buf: torch.Tensor) -> None:
        self.buf = buf
        self.nbytes = buf.numel()
        self.last_read: Any = None  # event of the last host-to-device copy out of this slot


class _HostPool:
    """Exact-size slots carved from a few large host chunks; freed slots are reused by size.

    With the same shapes every step, step 2 onward finds every slot it needs in the free lists and
    allocates nothing. Host memory is never returned: the pool is as large as the largest step.
    """

    def __init__(self, pin: bool, limit: int | None, chunk_bytes: int) -> None:
        self.pin = pin
        self.limit = limit
        self.chunk_bytes = chunk_bytes
        self.free: dict[int, list[_Slot]] = {}
        self.chunk: torch.Tensor | None = None
        self.chunk_off = 0
        self.reserved_bytes = 0  # host bytes allocated
        self.in_use_bytes = 0  # bytes of slots handed out and not yet returned
        self.allocations = 0  # host allocations made (each one a cudaHostAlloc when pinned)
        self.lock = threading.Lock()  # slots come back from autograd's threads

    def reserve(self, nbytes: int) -> None:
        with self.lock:
            if self.chunk is None or self.chunk.numel() - self.chunk_off < nbytes:
                self._grow(nbytes, nbytes)

    def acquire(self, nbytes: int) -> _Slot:
        with self.lock:
            lst = self.free.get(nbytes)
            if lst:
                slot = lst.pop()
            else:
                slot = self._carve(nbytes)
            self.in_use_bytes += slot.nbytes
            return slot

    def release(self, slot: _Slot) -> None:
        with self.lock:
            self.in_use_bytes -= slot.nbytes
            self.free.setdefault(slot.nbytes, []).append(slot)

    def _carve(self, nbytes: int) -> _Slot:
        if self.chunk is None or self.chunk.numel() - self.chunk_off < nbytes:
            room = None if self.limit is None else self.limit - self.reserved_bytes
            if room is not None and room < nbytes:
                # no room for a new chunk: a larger free slot will do (shapes changed between steps)
                sizes = [s for s, lst in self.free.items() if lst and s >= nbytes]
                if sizes:
                    return self.free[min(sizes)].pop()
                need = self.in_use_bytes + nbytes
                raise ValueError(
                    f"activation offload needs at least {need} bytes ({need / 2**30:.2f} GiB) of host memory "
                    f"for the tensors saved so far, above host_memory_limit_bytes={self.limit} "
                    f"({self.limit / 2**30:.2f} GiB); raise host_memory_limit_bytes, lower offload_ratio, "
                    "or offload only the inputs of checkpointed blocks"
                )
            self._grow(nbytes, max(self.chunk_bytes, _next_pow2(nbytes)), room)
        buf = self.chunk[self.chunk_off : self.chunk_off + nbytes]
        self.chunk_off += -(-nbytes // _ALIGN) * _ALIGN
        return _Slot(buf)

    def _grow(self, nbytes: int, size: int, room: int | None = None) -> None:
        if room is None and self.limit is not None:
            room = self.limit - self.reserved_bytes
        if room is not None:
            if room < nbytes:
                raise ValueError(
                    f"activation offload needs {nbytes} more bytes of host memory, above "
                    f"host_memory_limit_bytes={self.limit}; raise the limit"
                )
            if size > room:
                # torch's pinned allocator rounds up to a power of two: ask for one that fits
                size = max(nbytes, 1 << (room.bit_length() - 1))
        # HOST ALLOCATION (and, for pinned memory, possibly a device sync inside cudaHostAlloc): slow,
        # ~0.5 s per GiB pinned; it happens while the first step runs, never after for fixed shapes
        self.chunk = torch.empty(size, dtype=torch.uint8, pin_memory=self.pin)
        self.chunk_off = 0
        self.reserved_bytes += size
        self.allocations += 1
        logger.debug("offload host pool: +%d bytes (%d in %d allocations)", size, self.reserved_bytes,
                     self.allocations)


# --------------------------------------------------------------------------------------------- records
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


# ------------------------------------------------------------------------------------------ ratio plan
class _RatioState:
    """Per (tag, kind): sizes measured at the tag's first entry and the indices chosen to offload."""

    def __init__(self, ratio: float) -> None:
        self.ratio = ratio
        self.measured: list[int] | None = None
        self.chosen: frozenset[int] | None = None

    def choose(self, sizes: list[int]) -> None:
        self.measured = list(sizes)
        total = sum(sizes)
        target = self.ratio * total
        picked, acc = [], 0
        for i in sorted(range(len(sizes)), key=lambda i: (-sizes[i], i)):
            if acc >= target:
                break
            picked.append(i)
            acc += sizes[i]
        self.chosen = frozenset(picked)
        logger.debug("offload ratio %.3f: %d of %d tensors, %d of %d bytes", self.ratio, len(picked), len(sizes),
                     acc, total)


class _Entry:
    """One region's pass through a ratio state."""

    __slots__ = ("state", "sizes")

    def __init__(self, state: _RatioState) -> None:
        self.state = state
        self.sizes: list[int] = []

    def decide(self, nbytes: int) -> bool:
        i = len(self.sizes)
        self.sizes.append(nbytes)
        st = self.state
        if st.ratio >= 1.0:
            return True
        if st.ratio <= 0.0:
            return False
        if st.chosen is None:
            return True  # the measuring entry offloads everything, so the pool is sized for any plan
        return i in st.chosen

    def finish(self) -> None:
        st = self.state
        if 0.0 < st.ratio < 1.0:
            if st.chosen is None:
                if self.sizes:
                    st.choose(self.sizes)
            elif self.sizes != st.measured:
                logger.debug("offload region changed its saved tensors; measuring again")
                st.chosen = None


# --------------------------------------------------------------------------------------------- regions
class OffloadGroup:
    """One offload region: a context manager installing the saved-tensor hooks of one forward piece.

    Created by :meth:`OffloadEngine.group`; usually one per block per forward.
    """

    def __init__(self, engine: OffloadEngine, tag: Hashable, ratio: float, cache_ratio: float) -> None:
        self.engine = engine
        self.tag = tag
        self.ratio = ratio
        self.cache_ratio = cache_ratio
        self.id = -1
        self.prev: OffloadGroup | None = None
        self.records: list[weakref.ref[_Record]] = []
        self.prefetched = False
        self.backward_started = False
        self._entries: dict[str, _Entry] = {}
        self._kept_ptrs: set[int] = set()
        self._too_small = 0
        self._hooks: Any = None
        self._cursor = 0  # prefetch: records[_cursor:] have been looked at (walking back from the end)
        self._ahead = 0  # prefetch: bytes fetched and not yet handed to autograd

    def __enter__(self) -> OffloadGroup:
        self.engine._enter(self)
        # made here and dropped at exit: the hooks hold this region, which must not hold them back
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack_hook, self.engine._unpack)
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._hooks.__exit__(*exc)
        self._hooks = None
        self.engine._exit(self)

    def entry(self, kind: str) -> _Entry:
        e = self._entries.get(kind)
        if e is None:
            ratio = self.ratio if kind == "saved" else self.cache_ratio
            e = self._entries[kind] = _Entry(self.engine._ratio_state(self.tag, kind, ratio))
        return e

    def _pack_hook(self, t: torch.Tensor) -> Any:
        packed = self.engine._pack(self, t, "saved")
        return packed if packed is not None else _Kept(t, self)

    def prefetch(self) -> None:
        """Start copying this region's tensors back to the device (idempotent)."""
        if self.prefetched:
            return
        self.prefetched = True
        self.engine._prefetch(self)

    def backward_reached(self) -> None:
        """Backward is in this region: make sure it is on its way back, and start the previous one."""
        if self.backward_started:
            return
        self.backward_started = True
        self.prefetch()
        if self.prev is not None:
            self.prev.prefetch()

    def offload_selective_cache(self, fwd_mode: Any, recompute_mode: Any) -> None:
        """Route the cache of torch's selective checkpoint (the kept outputs) through this region.

        ``fwd_mode`` and ``recompute_mode`` are the two modes of
        :func:`torch.utils.checkpoint.create_selective_checkpoint_contexts`; their shared ``storage``
        (private to torch) is replaced by one that offloads tensors as they are cached and brings
        them back when the recompute asks for them. If this torch keeps the cache differently, the
        kept outputs simply stay on the device (logged once).
        """
        storage = getattr(fwd_mode, "storage", None)
        if not isinstance(storage, dict) or getattr(recompute_mode, "storage", None) is not storage or storage:
            self.engine._warn_once("selective-cache", "this torch's selective checkpoint cache is not recognised; "
                                   "its kept outputs stay on the device")
            return
        cache = _CacheStorage(self)
        fwd_mode.storage = cache
        recompute_mode.storage = cache


class _CacheBucket:
    """One op's entries of the selective-checkpoint cache, offloaded through a region.

    Speaks both dialects torch has used: a dict of call index -> entry, and a list (append / pop(0)).
    """

    def __init__(self, group: OffloadGroup) -> None:
        self._group = group
        self._items: dict[Any, Any] = {}
        self._next = 0

    def _put(self, value: Any) -> Any:
        engine = self._group.engine

        def pack(x: Any) -> Any:
            val = getattr(x, "val", None)
            if isinstance(val, torch.Tensor) and hasattr(x, "version"):
                p = engine._pack(self._group, val, "cache")
                if p is not None:
                    x.val = p  # the wrapper now holds our handle, not the device tensor
                return x
            if isinstance(x, torch.Tensor):
                p = engine._pack(self._group, x, "cache")
                return x if p is None else p
            return x

        return tree_map(pack, value)

    def _get(self, value: Any) -> Any:
        engine = self._group.engine

        def unpack(x: Any) -> Any:
            val = getattr(x, "val", None)
            if isinstance(val, _Packed):
                t, mutated = engine._restore(val)
                x.val = t
                # a mutation shows as a version mismatch, so torch raises its own error (or allows it)
                x.version = -1 if mutated else t._version
                return x
            if isinstance(x, _Packed):
                t, mutated = engine._restore(x)
                if mutated:
                    raise _version_error(t, x.version)
                return t
            return x

        return tree_map(unpack, value)

    # dict dialect
    def __setitem__(self, key: Any, value: Any) -> None:
        self._items[key] = self._put(value)

    def __getitem__(self, key: Any) -> Any:
        return self._get(self._items[key])

    def get(self, key: Any, default: Any = None) -> Any:
        return self[key] if key in self._items else default

    def __contains__(self, key: Any) -> bool:
        return key in self._items

    def __len__(self) -> int:
        return len(self._items)

    def __iter__(self) -> Iterator[Any]:
        return iter(self._items)

    # list dialect
    def append(self, value: Any) -> None:
        self._items[self._next] = self._put(value)
        self._next += 1

    def pop(self, index: int = -1) -> Any:
        key = list(self._items)[index]
        return self._get(self._items.pop(key))

    def discard_last(self) -> None:
        """Forget the newest entry without bringing it back (its host slot is released)."""
        self._items.pop(list(self._items)[-1])


class _CacheStorage(dict):
    def __init__(self, group: OffloadGroup) -> None:
        super().__init__()
        self._group = group

    def __missing__(self, key: Any) -> _CacheBucket:
        bucket = self[key] = _CacheBucket(self._group)
        return bucket


# ---------------------------------------------------------------------------------------------- engine
@dataclass(frozen=True)
class OffloadStats:
    """Counters of an :class:`OffloadEngine` since it was created."""

    host_pool_bytes: int
    """Host bytes the pool holds (pinned on CUDA)."""
    host_pool_in_use_bytes: int
    """Bytes of slots currently holding a saved tensor."""
    host_allocations: int
    """Host allocations made by the pool (each a cudaHostAlloc on CUDA)."""
    offloaded_bytes: int
    """Bytes copied device-to-host."""
    offloaded_tensors: int
    """Transfers device-to-host (one per storage range)."""
    reloaded_bytes: int
    """Bytes copied host-to-device."""
    deduplicated: int
    """Saved tensors that shared an earlier transfer (views, a tensor saved twice)."""
    kept: int
    """Saved tensors that stayed on the device (parameters, small, last block, ratio)."""
    pending: int
    """Transfers whose device memory is still held, waiting for the copy to finish."""
    recast: int = 0
    """Saved casts of parameters dropped in forward and cast again in backward."""


class OffloadEngine:
    """Offloads saved activations to a host pool and prefetches them back in backward.

    One engine per model (it owns the host pool and the copy streams); regions come from
    :meth:`group`. Creating an engine touches no device: streams and the pool appear on first use.

    Args:
        device: the device whose tensors are offloaded; None adopts the device of the first tensor.
        min_offload_bytes: saved tensors smaller than this stay on the device.
        host_memory_limit_bytes: cap on the host pool; exceeding it raises ValueError naming the need.
        keep_module: a module whose parameters and buffers are never offloaded (they stay on the
            device anyway; copying them would only cost bandwidth).
        chunk_bytes: size of each host allocation the pool carves slots from.
        max_inflight_regions: how many regions' copies may still run while the next region computes.
            At the end of a region, older ones are released by making the compute stream wait for
            their copies: 1 bounds the device memory in flight to about one region; more lets a
            region's copies overlap more compute (useful when few regions offload a lot each).
        prefetch_window_bytes: how far ahead of backward a region is copied back: a block's region
            usually fits whole; a region around a whole model comes back piece by piece.
        recast_parameter_casts: a saved dtype cast of a parameter (autocast's bf16 copy of a weight) is not
            kept from forward to backward but cast again when backward needs it: it neither occupies the
            device nor travels. Backward then raises if the parameter was modified in place since forward;
            False keeps such casts on the device instead.
    """

    def __init__(
        self,
        *,
        device: torch.device | str | None = None,
        min_offload_bytes: int = DEFAULT_MIN_OFFLOAD_BYTES,
        host_memory_limit_bytes: int | None = None,
        keep_module: nn.Module | None = None,
        chunk_bytes: int = _DEFAULT_CHUNK_BYTES,
        max_inflight_regions: int = 1,
        prefetch_window_bytes: int = DEFAULT_PREFETCH_WINDOW_BYTES,
        recast_parameter_casts: bool = True,
        _cpu_event_delay: int = 0,
    ) -> None:
        if not isinstance(min_offload_bytes, int) or min_offload_bytes < 0:
            raise ValueError(f"min_offload_bytes must be a non-negative int, got {min_offload_bytes!r}")
        if host_memory_limit_bytes is not None and (
            not isinstance(host_memory_limit_bytes, int) or host_memory_limit_bytes <= 0
        ):
            raise ValueError(f"host_memory_limit_bytes must be a positive int or None, got {host_memory_limit_bytes!r}")
        if not isinstance(chunk_bytes, int) or chunk_bytes <= 0:
            raise ValueError(f"chunk_bytes must be a positive int, got {chunk_bytes!r}")
        if not isinstance(max_inflight_regions, int) or max_inflight_regions < 1:
            raise ValueError(f"max_inflight_regions must be an int >= 1, got {max_inflight_regions!r}")
        self.max_inflight_regions = max_inflight_regions
        if not isinstance(prefetch_window_bytes, int) or prefetch_window_bytes < 1:
            raise ValueError(f"prefetch_window_bytes must be a positive int, got {prefetch_window_bytes!r}")
        self.prefetch_window_bytes = prefetch_window_bytes
        self.recast_parameter_casts = bool(recast_parameter_casts)
        self.device = torch.device(device) if device is not None else None
        self.min_offload_bytes = min_offload_bytes
        self.host_memory_limit_bytes = host_memory_limit_bytes
        self.chunk_bytes = chunk_bytes
        self._keep_module = weakref.ref(keep_module) if keep_module is not None else None
        self._keep_ptrs: frozenset[int] = frozenset()
        self._cpu_event_delay = _cpu_event_delay
        self._copier: _CpuCopier | _CudaCopier | None = None
        self._pool: _HostPool | None = None
        self._live: dict[int, _Record] = {}  # storage ptr -> record still holding that device storage
        self._pending: collections.deque[_Record] = collections.deque()
        self._states: dict[tuple, _RatioState] = {}
        self._stack: list[OffloadGroup] = []
        self._open: set[int] = set()  # ids of regions being run
        self._last: weakref.ref[OffloadGroup] | None = None
        self._next_id = 0
        self._pass_index = 0  # position of the current region in its forward pass
        self._warned: set[str] = set()
        self._counters = dict(
            offloaded_bytes=0, offloaded_tensors=0, reloaded_bytes=0, deduplicated=0, kept=0, recast=0
        )

    def __deepcopy__(self, memo: dict) -> OffloadEngine:
        # an engine is a shared resource (streams, pinned pool): copies of a model share it
        return self

    # -- public ------------------------------------------------------------------------------------
    def group(self, tag: Hashable = None, *, ratio: float = 1.0, cache_ratio: float | None = None) -> OffloadGroup:
        """A new offload region (context manager) for one piece of forward.

        Args:
            tag: regions with one tag share one ratio measurement (haiscale semantics); with None,
                the k-th region of each forward pass shares the measurement of the k-th region of
                the first pass.
            ratio: fraction of the saved bytes to offload, largest tensors first.
            cache_ratio: same for the outputs a selective checkpoint keeps (default: ``ratio``).

        Returns:
            An :class:`OffloadGroup`.
        """
        ratio = _validate_ratio("offload ratio", ratio)
        cache_ratio = ratio if cache_ratio is None else _validate_ratio("offload cache_ratio", cache_ratio)
        return OffloadGroup(self, tag, ratio, cache_ratio)

    def reserve(self, nbytes: int, device: torch.device | str | None = None) -> None:
        """Allocate ``nbytes`` of host pool up front (the planner knows the need before step 1)."""
        self._setup(torch.device(device) if device is not None else (self.device or torch.device("cpu")))
        self._pool.reserve(nbytes)

    def stats(self) -> OffloadStats:
        """The engine's counters (see :class:`OffloadStats`)."""
        pool = self._pool
        return OffloadStats(
            host_pool_bytes=pool.reserved_bytes if pool else 0,
            host_pool_in_use_bytes=pool.in_use_bytes if pool else 0,
            host_allocations=pool.allocations if pool else 0,
            pending=len(self._pending),
            **self._counters,
        )

    # -- regions -----------------------------------------------------------------------------------
    def _enter(self, group: OffloadGroup) -> None:
        group.id = self._next_id
        self._next_id += 1
        last = self._last() if self._last is not None else None
        if last is not None and not last.backward_started:
            group.prev = last
            self._pass_index += 1
        else:
            self._refresh_keep_ptrs()  # a new forward pass starts
            self._pass_index = 0
        if group.tag is None:
            group.tag = ("#region", self._pass_index)
        self._last = weakref.ref(group)
        self._stack.append(group)
        self._open.add(group.id)

    def _exit(self, group: OffloadGroup) -> None:
        popped = self._stack.pop()
        assert popped is group, "offload regions must be exited in the order they were entered"
        if group._too_small and not group.records and (group.ratio > 0 or group.cache_ratio > 0):
            self._warn_once(
                "too-small",
                f"an offload region saved {group._too_small} tensor(s), all below min_offload_bytes="
                f"{self.min_offload_bytes}: nothing was offloaded; lower min_offload_bytes to offload them",
            )
        for e in group._entries.values():
            e.finish()
        group._entries.clear()
        group._kept_ptrs.clear()
        self._open.discard(group.id)
        if group.ratio > 0 or group.cache_ratio > 0:
            # a region that offloads nothing (a kept block's) makes no stream wait: copies of the regions
            # before it keep running under its compute
            self._release_before(group.id + 1 - self.max_inflight_regions)
        self._poll()

    def _ratio_state(self, tag: Hashable, kind: str, ratio: float) -> _RatioState:
        key = (tag, kind, ratio)
        st = self._states.get(key)
        if st is None:
            st = self._states[key] = _RatioState(ratio)
        return st

    def _refresh_keep_ptrs(self) -> None:
        mod = self._keep_module() if self._keep_module is not None else None
        if mod is None:
            return
        ptrs = set()
        for t in (*mod.parameters(), *mod.buffers()):
            if t.device.type != "meta" and t.numel():
                ptrs.add(t.untyped_storage().data_ptr())
        self._keep_ptrs = frozenset(ptrs)

    def _warn_once(self, key: str, msg: str) -> None:
        if key not in self._warned:
            self._warned.add(key)
            logger.warning(msg)

    # -- pack --------------------------------------------------------------------------------------
    def _setup(self, device: torch.device) -> None:
        if self._copier is not None:
            return
        if device.type == "cuda" and device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        self.device = device
        if device.type == "cuda":
            self._copier = _CudaCopier(device)
        else:
            self._copier = _CpuCopier(self._cpu_event_delay)
        self._pool = _HostPool(pin=device.type == "cuda", limit=self.host_memory_limit_bytes,
                               chunk_bytes=self.chunk_bytes)

    def _eligible(self, t: torch.Tensor) -> bool:
        if type(t) is not torch.Tensor:
            return False  # parameters (alive anyway) and tensor subclasses stay
        if t.layout is not torch.strided or t.is_conj() or t.is_neg() or t.device.type == "meta":
            return False
        if self.device is None:
            # a CUDA model may save small CPU tensors (RNG seeds) first: adopt the CPU only without CUDA
            if t.device.type != "cuda" and (t.device.type != "cpu" or torch.cuda.is_available()):
                return False
            self._setup(t.device)
        elif t.device != self.device:
            return False
        elif self._copier is None:
            self._setup(self.device)
        if t.requires_grad and t.grad_fn is None:
            return False  # a leaf that requires grad: a parameter or an input, alive outside autograd
        base = t._base
        if base is not None and base.grad_fn is None and (base.requires_grad or t.grad_fn is None):
            # a view of a leaf: a transposed weight, a slice of an input, a buffer or a cached table.
            # The leaf stays alive outside autograd, so moving the view would free nothing. (A tracked
            # view of an untracked base is not one: a custom autograd Function that returns a view of a
            # buffer it allocated, e.g. a fused kernel's output reshaped; only autograd keeps that alive.)
            return False
        fn = t.grad_fn if base is None else base.grad_fn
        if fn is not None and fn.name() == "ToCopyBackward0":
            nxt = fn.next_functions
            if nxt and nxt[0][0] is not None and nxt[0][0].name() == "torch::autograd::AccumulateGrad":
                # a dtype cast of a parameter (or its transpose): autocast caches it until the autocast
                # region exits, so moving it frees nothing and costs link time (W1: ~0.1 GB per block)
                return False
        return True

    def _pack(self, group: OffloadGroup, t: torch.Tensor, kind: str) -> _Packed | _Recast | None:
        """Offload ``t`` (returns the handle), drop it to be cast again (a parameter's cast), or decide it
        stays (returns None)."""
        with torch.no_grad():
            # only what autograd saves (a selective checkpoint's cache holds detached outputs, never casts)
            if kind == "saved" and self.recast_parameter_casts and type(t) is torch.Tensor and t.grad_fn is not None:
                src = _cast_source(t)
                if src is not None:
                    self._counters["recast"] += 1
                    return _Recast(src[0], src[1], t, group)
            if (group.ratio if kind == "saved" else group.cache_ratio) <= 0.0:
                self._counters["kept"] += 1
                return None  # a region that offloads nothing (a kept block's: it only recasts)
            if not self._eligible(t) or t.numel() == 0:
                self._counters["kept"] += 1
                return None
            st = t.untyped_storage()
            ptr = st.data_ptr()
            if ptr in self._keep_ptrs:
                self._counters["kept"] += 1
                return None
            el = t.element_size()
            lo = t.storage_offset() * el
            hi = lo + el * (1 + sum((s - 1) * d for s, d in zip(t.size(), t.stride())))
            if hi - lo < self.min_offload_bytes:
                group._too_small += 1
                self._counters["kept"] += 1
                return None
            rec = self._live.get(ptr)
            if rec is not None and rec.version == t._version and rec.covers(lo, hi, el):
                self._counters["deduplicated"] += 1
                return _Packed(rec, t, group)
            if ptr in group._kept_ptrs:
                self._counters["kept"] += 1
                return None
            snb = st.nbytes()
            if 2 * (hi - lo) >= snb:
                lo, hi = 0, snb  # most of the storage: send all of it, other views of it ride along
            if not group.entry(kind).decide(hi - lo):
                group._kept_ptrs.add(ptr)
                self._counters["kept"] += 1
                return None
            rec = self._offload(t, st, ptr, lo, hi, group)
            return _Packed(rec, t, group)

    def _offload(self, t: torch.Tensor, st: torch.UntypedStorage, ptr: int, lo: int, hi: int,
                 group: OffloadGroup) -> _Record:
        self._poll()
        slot = self._pool.acquire(hi - lo)
        src = torch.empty(0, dtype=torch.uint8, device=t.device).set_(st, lo, (hi - lo,), (1,))
        ev = self._copier.copy_out(slot.buf, src, slot.last_read)
        slot.last_read = None
        rec = _Record(self, slot, lo, t, ev, ptr, group.id)
        self._live[ptr] = rec
        self._pending.append(rec)
        group.records.append(weakref.ref(rec))
        self._counters["offloaded_bytes"] += hi - lo
        self._counters["offloaded_tensors"] += 1
        return rec

    # -- device memory release ----------------------------------------------------------------------
    def _poll(self) -> None:
        """Release device tensors whose copy has finished (non-blocking event queries, in order)."""
        # a region's tensors stay until it exits: their storage pointers identify them for dedup,
        # and an in-place change inside the region is seen at release
        pending, open_ids = self._pending, self._open
        while pending and pending[0].group_id not in open_ids and self._copier.done(pending[0].d2h):
            self._release(pending.popleft())

    def _release(self, rec: _Record) -> None:
        """``rec`` left the pending queue: its copy finished, or the compute stream waits for it."""
        rec.in_flight = False
        if rec.gpu is not None and rec.gpu._version != rec.version:
            rec.mutated = True  # modified in place after the save: unpacking it will raise
        if not rec.keep_gpu:
            self._drop_gpu(rec)

    def _drop_gpu(self, rec: _Record) -> None:
        rec.gpu = None  # the end of the lifetime extension: the allocator may reuse the memory
        if self._live.get(rec.key) is rec:
            del self._live[rec.key]

    def _release_before(self, group_id: int) -> None:
        """Release the device memory of regions older than ``group_id``, copies done or not.

        The compute stream waits for the last of those copies (a stream wait, not a host sync), so the
        allocator reuses the memory only after the copy read it. This bounds what is in flight.
        """
        pending = self._pending
        n = 0
        while n < len(pending) and pending[n].group_id < group_id:
            n += 1
        if n == 0:
            return
        # STREAM WAIT: copies on one stream finish in order; waiting on the last covers them all
        self._copier.wait(pending[n - 1].d2h)
        for _ in range(n):
            self._release(pending.popleft())

    # -- unpack --------------------------------------------------------------------------------------
    def _unpack(self, packed: Any) -> torch.Tensor:
        if isinstance(packed, _Recast):
            if packed.group is not None:
                packed.group.backward_reached()
            return packed.restore()
        if isinstance(packed, _Kept):
            if packed.group is not None:
                packed.group.backward_reached()
            t = packed.tensor
            if t._version != packed.version:
                raise _version_error(t, packed.version)
            return t
        t, mutated = self._restore(packed)
        if mutated:
            raise _version_error(t, packed.version)
        return t

    def _restore(self, p: _Packed) -> tuple[torch.Tensor, bool]:
        """The tensor ``p`` stands for, on the device; and whether it was modified since saved."""
        if p.group is not None:
            p.group.backward_reached()
        rec = p.record
        root = p.root()
        mutated = rec.mutated or (root is not None and root._version != p.version)
        self._poll()
        el = p.dtype.itemsize
        with torch.no_grad():
            if rec.gpu is not None:
                storage, offset = rec.gpu.untyped_storage(), p.offset
            else:
                if rec.restored is None:
                    self._fetch(rec)
                # STREAM WAIT: the compute stream reads the bytes only after the host-to-device copy
                self._copier.wait(rec.h2d)
                storage, offset = rec.restored.untyped_storage(), (p.offset * el - rec.lo) // el
            out = torch.empty(0, dtype=p.dtype, device=self.device).set_(storage, offset, p.size, p.stride)
        if not p.unpacked:
            p.unpacked = True
            rec.pending_unpacks -= 1
            if rec.pending_unpacks == 0:
                # autograd holds every view now; our references would only extend their lifetime
                rec.restored = None
                rec.keep_gpu = False
                if not rec.in_flight:
                    self._drop_gpu(rec)
                window, rec.window = rec.window, None
                if window is not None:
                    window._ahead -= rec.nbytes
                    self._advance(window)  # backward moved on: the window slides back
        return out, mutated

    def _fetch(self, rec: _Record) -> None:
        """Start the host-to-device copy of ``rec`` into fresh device memory."""
        buf = torch.empty(rec.nbytes, dtype=torch.uint8, device=self.device)  # on the compute stream
        rec.h2d = self._copier.copy_in(buf, rec.slot.buf, rec.d2h)
        rec.slot.last_read = rec.h2d
        rec.restored = buf
        rec.alloc_stream = self._copier.current_stream()
        self._counters["reloaded_bytes"] += rec.nbytes

    def _prefetch(self, group: OffloadGroup) -> None:
        for ref in group.records:
            rec = ref()
            if rec is not None and rec.gpu is not None and rec.pending_unpacks > 0:
                # LIFETIME EXTENSION: still on the device (its region ended just before backward
                # began): keep it there until unpacked, no round trip; the poll below must not free it
                rec.keep_gpu = True
        self._poll()
        group._cursor = len(group.records)
        self._advance(group)

    def _advance(self, group: OffloadGroup) -> None:
        """Fetch the region's records, last-saved first, while less than the window is in flight."""
        records = group.records
        while group._cursor > 0 and group._ahead < self.prefetch_window_bytes:
            group._cursor -= 1
            rec = records[group._cursor]()
            if rec is None or rec.slot is None or rec.pending_unpacks == 0 or rec.restored is not None:
                continue
            if rec.gpu is not None:
                continue  # kept on the device (see _prefetch)
            self._fetch(rec)
            rec.window = group
            group._ahead += rec.nbytes

    def _drop_handle(self, rec: _Record, was_unpacked: bool) -> None:
        rec.handles -= 1
        if not was_unpacked:
            rec.pending_unpacks -= 1
        if rec.handles:
            return
        # autograd freed the last handle: retire the record
        if rec.restored is not None:
            # never unpacked (graph freed unused): the memory goes back to the compute stream's pool,
            # so order that stream after the copy still writing it (STREAM WAIT, no host sync)
            self._copier.wait(rec.h2d, rec.alloc_stream)
            rec.restored = None
        rec.keep_gpu = False
        if not rec.in_flight:
            self._drop_gpu(rec)
        slot, rec.slot = rec.slot, None
        if slot is not None:
            # the next device-to-host copy into this slot is queued behind the one that filled it
            # (same stream) and waits on ``last_read`` for any copy out of it
            self._pool.release(slot)


# --------------------------------------------------------------------------------------------- verbs
_default_engine: OffloadEngine | None = None


def _get_default_engine() -> OffloadEngine:
    global _default_engine
    if _default_engine is None:
        _default_engine = OffloadEngine()
    return _default_engine


def offload(
    ratio: float = 1.0,
    tag: Hashable = None,
    *,
    cache_ratio: float | None = None,
    engine: OffloadEngine | None = None,
) -> contextlib.AbstractContextManager[OffloadGroup]:
    """Offload what autograd saves inside the ``with`` block to host memory (haiscale's CPUOffload).

    ``with elbowroom.offload(0.5, tag="block"):`` around each block of a forward: the first entry of a
    tag measures its saved bytes (offloading everything); later entries offload the largest saved
    tensors until ``ratio`` of those bytes. Each ``with`` is one region; when backward reaches a
    region, the region entered before it is prefetched, so wrap blocks one by one.

    Args:
        ratio: fraction of the region's saved bytes to offload, in [0, 1].
        tag: regions sharing a tag share the measurement; None measures every entry.
        cache_ratio: for selective checkpoint inside the region: fraction of its kept outputs.
        engine: the engine (pool and streams) to use; None uses a process-wide default engine.

    Returns:
        A context manager (an :class:`OffloadGroup`).
    """
    return (engine or _get_default_engine()).group(tag, ratio=ratio, cache_ratio=cache_ratio)


def offload_module(
    module: nn.Module,
    ratio: float = 1.0,
    *,
    engine: OffloadEngine | None = None,
    tag: Hashable = None,
    cache_ratio: float | None = None,
) -> nn.Module:
    """Offload what ``module``'s forward saves, every time it runs (the per-module form).

    Wraps the module in place like :func:`elbowroom.checkpoint` (``state_dict`` keys unchanged) and
    composes with it: on a checkpointed module ``ratio`` applies to the inputs the checkpoint saves
    and ``cache_ratio`` to the outputs a selective checkpoint keeps.

    Args:
        module: the module (typically a transformer block).
        ratio: fraction of saved bytes to offload, in [0, 1]; 0 removes the offload.
        engine: the engine to use; None uses the process-wide default engine.
        tag: ratio-measurement tag; None uses the module's class name.
        cache_ratio: for a selectively checkpointed module: fraction of kept outputs (default ``ratio``).

    Returns:
        ``module`` itself.
    """
    ratio = _validate_ratio("offload ratio", ratio)
    cache_ratio = ratio if cache_ratio is None else _validate_ratio("offload cache_ratio", cache_ratio)
    if ratio == 0.0 and cache_ratio == 0.0:
        _wrap.set_offload(module, None)
        return module
    spec = _wrap.OffloadSpec(
        engine=engine or _get_default_engine(),
        ratio=ratio,
        cache_ratio=cache_ratio,
        tag=tag if tag is not None else type(module).__qualname__,
    )
    _wrap.set_offload(module, spec)
    return module
