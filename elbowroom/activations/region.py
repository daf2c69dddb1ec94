"""An offload region: the saved-tensor hooks of one piece of forward (usually one block), and its way back.

Regions come from :meth:`~elbowroom.activations.offload.OffloadEngine.group`; the engine does the work,
a region holds what belongs to one pass through one block: its records (weakly), its ratio entries, and
its prefetch cursor. Thread ownership follows the engine's rule (see :mod:`elbowroom.activations.offload`):
the prefetch flags and cursor change only under the engine's lock; the ratio entries and kept pointers
belong to the training thread (forward only).
"""

from __future__ import annotations

import weakref
from collections.abc import Hashable
from typing import TYPE_CHECKING, Any

import torch

from elbowroom.activations.handles import _Kept, _Record
from elbowroom.activations.ratio import _Entry

if TYPE_CHECKING:
    from elbowroom.activations.offload import OffloadEngine


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

    def keep_tensors(self, tensors: list[Any]) -> None:
        """Keep the storages of these tensors (the region's inputs) on the device, whatever the ratio says: they
        are not counted among the sizes the ratio picks from."""
        for t in tensors:
            if isinstance(t, torch.Tensor) and t.device.type != "meta":
                self._kept_ptrs.add(t.untyped_storage().data_ptr())

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
        with self.engine._lock:  # backward threads: the check and the set are one step
            if self.prefetched:
                return
            self.prefetched = True
            self.engine._prefetch(self)

    def backward_reached(self) -> None:
        """Backward is in this region: make sure it is on its way back, and start the previous one."""
        with self.engine._lock:  # backward threads: the check and the set are one step
            if self.backward_started:
                return
            self.backward_started = True
            self.prefetch()
            if self.prev is not None:
                self.prev.prefetch()
