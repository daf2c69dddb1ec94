"""The selective checkpoint's cache (its kept matmul and attention outputs), offloaded through a region.

:meth:`~elbowroom.activations.offload.OffloadGroup.offload_selective_cache` swaps torch's cache storage
for a :class:`_CacheStorage`, whose buckets pack each tensor as it is cached and restore it when the
recompute asks for it. Threads: a bucket is filled by the training thread in forward and read by a backward
thread in the recompute, never both at once; the packing and restoring it calls take the engine's lock.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import torch
from torch.utils._pytree import tree_map

from elbowroom.activations.handles import _Packed, _version_error

if TYPE_CHECKING:
    from elbowroom.activations.offload import OffloadGroup


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
