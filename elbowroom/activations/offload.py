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
  host-to-device stream while the block's backward runs (both link directions busy at once); blocks wrapped
  by a plan reach further back, to the nearest offloading block up to ``prefetch_lead_blocks`` before
  (:class:`~elbowroom.activations._wrap.PrefetchChain`), so kept blocks in between lend it their backward.

Ratios follow haiscale's CPUOffload: the first entry of a tag offloads every eligible tensor and
measures their sizes; later entries offload the largest tensors until ``ratio`` of those bytes.

One engine serves one device. Given none, it adopts the device of the first tensor it packs (CPU
tensors of an accelerator model, such as RNG seeds, are already in host memory: they stay and adopt
nothing). A saved tensor on another accelerator than the engine's raises a ValueError naming both devices
(it is never skipped silently); CPU tensors of an accelerator engine stay where they are.

On the CPU there is nothing to offload to: the tensors already live in host memory. An engine whose
device is the CPU offloads nothing, allocates no host pool and says so once (a logged warning); it still
recasts parameter casts, which needs no host. ``OffloadEngine(simulate_host=True)`` runs the whole
bookkeeping on the CPU anyway, copying into a separate host buffer with synchronous copies, so that every
path (dedup, slots, ratios, prefetch, deferred release) is exercised by the CPU tests.

Threads. The training thread runs forward: region entry and exit (:meth:`OffloadGroup.__enter__`,
``__exit__``) and the pack hooks. Autograd's backward threads run the unpack hooks, the prefetch hooks and
the selective-cache restores: on CUDA, backward runs on a device thread of its own (one per device), and
a graph that mixes devices runs its CPU nodes on the calling thread at the same time. A handle is dropped
(``_Packed.__del__``) by whichever thread frees autograd's graph: a backward thread, or the training thread
for a graph freed without backward. So the rule: all of the engine's shared state (``_live``,
``_pending``, ``_open``, ``_stack``, ``_states``, the counters, every record, a region's prefetch cursor
and flags) is read and written only under the engine's one re-entrant lock ``_lock``, which every entry
point from either side takes (:meth:`OffloadEngine._enter`, ``_exit``, ``_pack``, ``_unpack``,
``_restore``, ``_prefetch``, ``_drop_handle``, :meth:`OffloadGroup.prefetch`, ``backward_reached``,
:meth:`OffloadEngine.stats`, ``reserve``). Re-entrant, because an unpack starts prefetches and a
handle may be dropped while its own thread holds the lock. The copy streams are only used under it;
the host pool has its own lock, always taken after the engine's. A region's ratio entries and kept
pointers are the training thread's alone (forward only).

In-place safety: with saved-tensor hooks autograd no longer checks saved tensors' version counters,
so the engine does: each packed tensor remembers its version, and unpacking one that was modified
in place raises the error autograd would have raised.

This module holds the engine and the verbs; its parts live beside it: the regions in
:mod:`~elbowroom.activations.region`, the copy streams in :mod:`~elbowroom.activations.copier`, the host
pool in :mod:`~elbowroom.activations.pool`, what autograd holds per saved tensor in
:mod:`~elbowroom.activations.handles`, the ratio plan in :mod:`~elbowroom.activations.ratio`. A selective
checkpoint's kept outputs (:mod:`~elbowroom.activations.selective`) go through ``_pack`` and ``_restore`` too.
"""

from __future__ import annotations

import collections
import contextlib
import functools
import logging
import threading
import weakref
from collections.abc import Callable, Hashable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn as nn

from elbowroom.activations import _wrap
from elbowroom.activations.copier import _CpuCopier, _CudaCopier
from elbowroom.activations.handles import _cast_source, _Kept, _Packed, _Recast, _Record, _version_error
from elbowroom.activations.pool import _DEFAULT_CHUNK_BYTES, _HostPool
from elbowroom.activations.ratio import _RatioState
from elbowroom.activations.region import OffloadGroup

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

def _locked(method: Callable[..., Any]) -> Callable[..., Any]:
    """Run an engine method under the engine's lock (an entry point from the training or a backward thread)."""

    @functools.wraps(method)
    def run(self: OffloadEngine, *args: Any) -> Any:
        with self._lock:
            return method(self, *args)

    return run


def _accelerator_available() -> bool:
    """Whether this process has an accelerator (without initialising it)."""
    acc = getattr(torch, "accelerator", None)
    if acc is not None and hasattr(acc, "is_available"):
        return acc.is_available()
    return torch.cuda.is_available()


def _validate_ratio(name: str, ratio: float) -> float:
    if isinstance(ratio, bool) or not isinstance(ratio, (int, float)) or not 0.0 <= ratio <= 1.0:
        raise ValueError(f"{name} must be in [0, 1], got {ratio!r}")
    return float(ratio)


# ---------------------------------------------------------------------------------------------- engine
@dataclass(frozen=True)
class OffloadStats:
    """Counters of an :class:`OffloadEngine` since it was created."""

    host_pool_bytes: int
    """Host bytes the pool holds (pinned on CUDA; 0 on the CPU, which has no pool)."""
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
    """Saved tensors that stayed on the device (parameters, small, last block, ratio; every one on the CPU)."""
    pending: int
    """Transfers whose device memory is still held, waiting for the copy to finish."""
    recast: int = 0
    """Saved casts of parameters dropped in forward and cast again in backward."""


class OffloadEngine:
    """Offloads saved activations to a host pool and prefetches them back in backward.

    One engine per model (it owns the host pool and the copy streams); regions come from
    :meth:`group`. Creating an engine touches no device: streams and the pool appear on first use.

    Args:
        device: the device whose tensors are offloaded; None adopts the device of the first tensor it
            packs (a device without an index, the index of the first tensor of its type). A saved tensor
            on another accelerator raises ValueError; CPU tensors stay. On the CPU nothing is offloaded
            (see ``simulate_host``).
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
        simulate_host: on the CPU, offload anyway into a separate host buffer (synchronous copies, the
            same bookkeeping as on CUDA): saves no memory, exists so that tests exercise the engine on the
            CPU. False (the default): an engine on the CPU offloads nothing and allocates no pool. Has no
            effect on other devices.
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
        simulate_host: bool = False,
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
        if not isinstance(simulate_host, bool):
            raise TypeError(f"simulate_host must be a bool, got {simulate_host!r}")
        self.simulate_host = simulate_host
        self.device = torch.device(device) if device is not None else None
        self._device_given = device is not None
        self.min_offload_bytes = min_offload_bytes
        self.host_memory_limit_bytes = host_memory_limit_bytes
        self.chunk_bytes = chunk_bytes
        self._keep_module = weakref.ref(keep_module) if keep_module is not None else None
        self._keep_ptrs: frozenset[int] = frozenset()
        self._cpu_event_delay = _cpu_event_delay
        # see the module docstring: every field below is touched only under this lock
        self._lock = threading.RLock()
        self._ready = False  # _setup ran: copier and pool made, or the engine found nothing to offload to
        self._copier: _CpuCopier | _CudaCopier | None = None  # None once ready: a CPU engine, offloading nothing
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
        """Allocate ``nbytes`` of host pool up front (the planner knows the need before step 1).

        On the CPU (without ``simulate_host``) there is no pool, and this allocates nothing.
        """
        with self._lock:
            if device is not None and self.device is None:
                self.device = torch.device(device)
            self._setup(self.device or torch.device("cpu"))
            if self._pool is not None:
                self._pool.reserve(nbytes)

    def stats(self) -> OffloadStats:
        """The engine's counters (see :class:`OffloadStats`)."""
        with self._lock:  # one consistent snapshot, whichever thread asks
            pool = self._pool
            return OffloadStats(
                host_pool_bytes=pool.reserved_bytes if pool else 0,
                host_pool_in_use_bytes=pool.in_use_bytes if pool else 0,
                host_allocations=pool.allocations if pool else 0,
                pending=len(self._pending),
                **self._counters,
            )

    # -- regions -----------------------------------------------------------------------------------
    @_locked
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

    @_locked
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
            if t.device.type == "meta" or not t.numel():
                continue
            local = t.to_local() if hasattr(t, "to_local") else t  # a DTensor: this rank's shard
            try:
                ptrs.add(local.untyped_storage().data_ptr())
            except RuntimeError:  # FSDP2's unsharded parameter between its all-gathers: its storage is freed
                continue
        self._keep_ptrs = frozenset(ptrs)

    def _warn_once(self, key: str, msg: str) -> None:
        with self._lock:
            if key in self._warned:
                return
            self._warned.add(key)
        logger.warning(msg)

    # -- pack --------------------------------------------------------------------------------------
    def _setup(self, device: torch.device) -> None:
        """Make the copier and the host pool for ``device``; on the CPU, unless simulating, make nothing."""
        if self._ready:
            return
        if device.type == "cuda" and device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        self.device = device
        self._ready = True
        if device.type == "cpu" and not self.simulate_host:
            self._warn_once(
                "cpu",
                "activation offload: the tensors are on the CPU, already in host memory, so nothing is offloaded "
                "and no host pool is allocated (parameter casts are still recast); offload settings only save "
                "memory on an accelerator",
            )
            return
        if device.type == "cuda":
            self._copier = _CudaCopier(device)
        else:
            self._copier = _CpuCopier(self._cpu_event_delay)
        self._pool = _HostPool(pin=device.type == "cuda", limit=self.host_memory_limit_bytes,
                               chunk_bytes=self.chunk_bytes)

    def _admits(self, device: torch.device) -> bool:
        """Whether saved tensors on ``device`` are this engine's to offload; adopts a device when it has none.

        Raises:
            ValueError: for a device other than the engine's, unless it is the CPU (host memory already).
        """
        own = self.device
        if own is None:
            if device.type == "cpu" and _accelerator_available():
                # an accelerator model may save small CPU tensors (RNG seeds) first: host memory already,
                # and adopting the CPU would refuse the model's own tensors after it
                return False
            self.device = device
            return True
        if device == own:
            return True
        if own.index is None and device.type == own.type:
            self.device = device  # "cuda" given: the first tensor of the type fixes the index
            return True
        if device.type == "cpu":
            return False  # already in host memory: nothing to offload
        how = "was given" if self._device_given else "adopted it from the first saved tensor"
        raise ValueError(
            f"activation offload: a saved tensor is on {device}, but this offload engine serves {own} (it {how}); "
            "one engine offloads one device. Give the blocks on each device an engine of their own, e.g. "
            f"offload_module(block, engine=OffloadEngine(device='{device}')), or keep the offloaded blocks on one "
            "device"
        )

    def _eligible(self, t: torch.Tensor) -> bool:
        if type(t) is not torch.Tensor:
            return False  # parameters (alive anyway) and tensor subclasses stay
        if t.layout is not torch.strided or t.is_conj() or t.is_neg() or t.device.type == "meta":
            return False
        if not self._admits(t.device):
            return False
        if not self._ready:
            self._setup(self.device)
        if self._copier is None:
            return False  # a CPU engine: nothing to offload to (said once, in _setup)
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

    @_locked
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
    @_locked
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

    @_locked
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

    @_locked
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

    @_locked
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
