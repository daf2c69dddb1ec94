"""Live bytes by category: what a training step's memory is made of, from what the model and optimizer expose.

Categories (:data:`CATEGORIES`), in the order the pictures stack them:

- ``parameters``: storages of ``model.parameters()`` (views of one storage counted once);
- ``gradients``: storages of ``p.grad``;
- ``optimizer_state``: tensors in ``optimizer.state`` on the measured device;
- ``master_weights``: fp32 masters the optimizer keeps on the measured device (an optimizer that exposes
  ``memory_tensors()``, see :func:`optimizer_tensors`);
- ``activations_kept``: on CUDA, the allocator's total less every other category and less the "other" bytes
  seen at the step's start (no saved-tensor hooks, so recompute and offload hooks stay innermost); on a CPU,
  the tensors autograd saved in this step, seen through a pack hook that records sizes (weak references:
  lifetimes are not extended);
- ``activations_in_flight``: device bytes of saved tensors whose copy to or from the host is still running
  (an offload engine whose stats carry ``pending_bytes``; 0 otherwise);
- ``offload_pool``: the activation offload engine's host pool, counted here on a CPU run (it is process
  memory there); on CUDA it is host memory and goes to :attr:`Sample.host`;
- ``other``: the total less everything above (allocator workspace, temporaries, the loss, caches).

The total is ``torch.cuda.memory_allocated`` on CUDA and the process RSS on a CPU, where the categories are
tensor bytes and "other" is the rest of the process (the interpreter, libraries, freed-but-kept heap).
"""

from __future__ import annotations

import os
import weakref
from collections.abc import Iterable, Iterator
from typing import Any

import torch
from torch.utils._python_dispatch import is_traceable_wrapper_subclass

__all__ = ["CATEGORIES", "CATEGORY_LABELS", "process_rss_bytes", "optimizer_tensors", "SavedTensorCounter"]

CATEGORIES = (
    "parameters",
    "gradients",
    "optimizer_state",
    "master_weights",
    "activations_kept",
    "activations_in_flight",
    "offload_pool",
    "other",
)
"""Category names, in stacking order (bottom first)."""

CATEGORY_LABELS = {
    "parameters": "parameters",
    "gradients": "gradients",
    "optimizer_state": "optimizer state",
    "master_weights": "master weights",
    "activations_kept": "activations kept",
    "activations_in_flight": "activations in flight (host copies)",
    "offload_pool": "offload pool",
    "other": "other",
}
"""How each category is named in the pictures and the HTML."""

_STATIC = ("parameters", "optimizer_state", "master_weights")
"""The categories that change only when the optimizer steps (:func:`categorise`'s ``static`` cache)."""


def process_rss_bytes() -> int | None:
    """Resident set size of this process in bytes (Linux ``/proc/self/statm``, else psutil), None if unknown."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        pass
    try:
        import psutil  # optional
    except ImportError:
        return None
    return int(psutil.Process().memory_info().rss)


def _plain_tensors(t: torch.Tensor) -> Iterator[torch.Tensor]:
    """The tensors that own memory behind ``t``: itself, or the inner tensors of a wrapper subclass such as
    FSDP2's ``DTensor`` parameters (whose own storage is no memory and cannot be read)."""
    if is_traceable_wrapper_subclass(t):
        names, _ = t.__tensor_flatten__()
        for name in names:
            inner = getattr(t, name)
            if isinstance(inner, torch.Tensor):  # a DTensor also names its mesh
                yield from _plain_tensors(inner)
    else:
        yield t


def sum_storages(tensors: Iterable[torch.Tensor], device_type: str, seen: set) -> int:
    """Bytes of the distinct storages of ``tensors`` on devices of ``device_type`` not already in ``seen``.

    Args:
        tensors: any tensors (others are skipped: meta, other devices).
        device_type: ``"cuda"`` or ``"cpu"``.
        seen: storage keys already counted; updated in place, so categories never count a storage twice.

    Returns:
        Bytes.
    """
    total = 0
    for t in tensors:
        if not isinstance(t, torch.Tensor) or t.device.type != device_type:
            continue
        for inner in _plain_tensors(t):
            storage = inner.untyped_storage()
            key = (str(inner.device), storage.data_ptr())
            if key in seen or key[1] == 0:
                continue
            seen.add(key)
            total += storage.nbytes()
    return total


def optimizer_tensors(optimizer: Any) -> dict[str, list[torch.Tensor]]:
    """The optimizer's own tensors, by category (``optimizer_state``, ``master_weights``).

    An optimizer with a ``memory_tensors()`` method returning ``{"optimizer_state": [...], "master_weights":
    [...]}`` (``CPUOffloadOptimizer`` has one: its device state and device fp32 masters) is asked directly.
    Otherwise the state is what ``optimizer.state`` holds (torch's optimizers).

    Args:
        optimizer: a torch optimizer (or None).

    Returns:
        Lists of tensors by category.
    """
    out: dict[str, list[torch.Tensor]] = {"optimizer_state": [], "master_weights": []}
    if optimizer is None:
        return out
    exposed = getattr(optimizer, "memory_tensors", None)
    if callable(exposed):
        got = exposed()
        for k in out:
            out[k] = [t for t in got.get(k, ()) if isinstance(t, torch.Tensor)]
        return out
    for _ in range(3):
        try:
            # CPUOffloadOptimizer's step thread may add state while backward runs: copy, retry on a change
            found = [v for st in list(optimizer.state.values()) if isinstance(st, dict) for v in list(st.values())]
            break
        except RuntimeError:  # "dictionary changed size during iteration"
            found = []
    out["optimizer_state"] = [v for v in found if isinstance(v, torch.Tensor)]
    return out


def optimizer_host_bytes(optimizer: Any) -> int:
    """Host bytes of an optimizer that reports them in ``stats()["host_bytes"]`` (CPUOffloadOptimizer), else 0."""
    stats = getattr(optimizer, "stats", None)
    if not callable(stats):
        return 0
    try:
        got = stats()
    except (RuntimeError, ValueError, AttributeError):  # an optimizer whose stats() is about something else
        return 0
    value = got.get("host_bytes", 0) if isinstance(got, dict) else 0
    return int(value) if isinstance(value, (int, float)) else 0


class SavedTensorCounter:
    """Counts the bytes autograd keeps for backward, through a pack hook (used on CPU, where no allocator counts).

    Enter it around the recorded steps. It sees only what is saved while it is the innermost
    ``saved_tensors_hooks``: tensors saved under a checkpoint or offload region (whose own hooks are innermost
    there) are not seen and fall in "other". It holds weak references, so no saved tensor lives longer.
    """

    def __init__(self) -> None:
        self._refs: list[weakref.ref] = []
        self._ctx: Any = None

    def _pack(self, t: torch.Tensor) -> torch.Tensor:
        try:
            self._refs.append(weakref.ref(t))
        except TypeError:  # a tensor subclass without weakref support: not counted
            pass
        return t

    @staticmethod
    def _unpack(t: torch.Tensor) -> torch.Tensor:
        return t

    def __enter__(self) -> SavedTensorCounter:
        self._ctx = torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)
        self._ctx.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        if self._ctx is not None:
            self._ctx.__exit__(*exc)
            self._ctx = None
        self._refs.clear()

    def live(self) -> list[torch.Tensor]:
        """The saved tensors still alive (dead references are dropped)."""
        alive = []
        keep = []
        for r in self._refs:
            t = r()
            if t is not None:
                alive.append(t)
                keep.append(r)
        self._refs = keep
        return alive


def categorise(
    device: torch.device,
    params: list[torch.Tensor],
    optimizer: Any = None,
    engine: Any = None,
    saved: SavedTensorCounter | None = None,
    baseline_other: int | None = 0,
    static: dict[str, Any] | None = None,
) -> tuple[int, dict[str, int], dict[str, int]]:
    """Live bytes now, by category (see the module docstring); they add up to the total.

    Args:
        device: the measured device (``cuda`` or ``cpu``).
        params: the model's parameters.
        optimizer: its optimizer, or None.
        engine: its activation offload engine (``get_offload_engine(model)``), or None.
        saved: on a CPU, the counter of saved tensors of the current step.
        baseline_other: on CUDA, the "other" bytes of the step's start; None counts every uncategorised byte as
            "other" (activations not told apart, e.g. at the step's start, or at an OOM).
        static: a cache the caller owns (an empty dict to fill) of what does not change between the optimizer's
            steps: the parameters, the optimizer's state and its masters, counted once and then reused (the
            recorder samples at every block's forward and backward, and walking every tensor each time doubled
            a profiled W1 step's time). Gradients are counted at every call. Clear it when the optimizer steps.

    Returns:
        ``(total, bytes by category, host bytes outside the total)``.
    """
    dev = device.type
    by: dict[str, int] = dict.fromkeys(CATEGORIES, 0)
    if static is None or "seen" not in static:
        seen: set = set()
        by["parameters"] = sum_storages(params, dev, seen)
        opt = optimizer_tensors(optimizer)
        by["optimizer_state"] = sum_storages(opt["optimizer_state"], dev, seen)
        by["master_weights"] = sum_storages(opt["master_weights"], dev, seen)
        if static is not None:
            static.update({k: by[k] for k in _STATIC}, seen=frozenset(seen))
    else:
        by.update({k: static[k] for k in _STATIC})
        seen = set(static["seen"])
    by["gradients"] = sum_storages((p.grad for p in params if p.grad is not None), dev, seen)
    host: dict[str, int] = {}
    stats = engine.stats() if engine is not None else None
    if stats is not None:
        by["activations_in_flight"] = int(getattr(stats, "pending_bytes", 0))
    if dev == "cuda":
        total = int(torch.cuda.memory_allocated(device))
        if stats is not None and stats.host_pool_bytes:
            host["offload_pool"] = int(stats.host_pool_bytes)
        opt_host = optimizer_host_bytes(optimizer)
        if opt_host:
            host["optimizer"] = opt_host
        if baseline_other is not None:
            # activations: what the step holds above the uncategorised bytes it began with (workspace, caches)
            by["activations_kept"] = max(0, total - sum(by.values()) - baseline_other)
    else:
        if stats is not None:
            by["offload_pool"] = int(stats.host_pool_bytes)
        if saved is not None:
            by["activations_kept"] = sum_storages(saved.live(), dev, seen)
        rss = process_rss_bytes()
        total = rss if rss is not None else sum(by.values())
    categorised = sum(v for k, v in by.items() if k != "other")
    # a CPU tensor allocated but not yet touched is not resident: the total is at least what is live
    total = max(total, categorised)
    by["other"] = total - categorised
    return total, by, host
