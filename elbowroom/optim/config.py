"""The settings of one :class:`~elbowroom.optim.CPUOffloadOptimizer`, as one frozen dataclass.

Every knob of the optimizer lives here (no class attributes, no environment variables), so that two
optimizers in one process can differ and a Plan or the CLI config can set all of them from one object:
``CPUOffloadOptimizer(params, config=CPUOffloadConfig(offload_fraction=0.4, bucket_bytes=32 << 20))``. The
keyword arguments of the optimizer (``offload_fraction=...``) override the fields of the same name.

What the defaults rest on:

- ``bucket_bytes``: with Adam/AdamW a parameter bigger than a bucket travels and steps piece by piece, so
  staging stays within a few buckets; set it to the largest parameter's gradient bytes to stage everything
  whole (on W2 ~7 points of plain faster at the median, for ~1.8 more host bytes per offloaded parameter:
  ``BENCHMARKS.md``).
- ``cpu_threads``: the training thread (kernel launches), autograd's device thread and the copy thread need
  cores of their own. The step is memory-bound, so two threads fewer cost it little: on the lent H100 host
  (16 cores), 7B hybrid at F=0.4, four runs gave 169 and 202 model TFLOP/s with 16 threads, 235 and 200 with
  14 (CPU step 0.78 s with 16; 0.62 and 0.79 s with 14): noisy, never worse.
- ``cast_on_device``: the host step is then torch's fused kernel on fp32 (28 B of host memory traffic per
  parameter, as for fp32 weights) instead of an upcast, the step and a downcast on the CPU (40 B, or ~30 B
  chunked); the link carries 4 B per parameter each way instead of 2 (10.8 GB each way for 2.7B offloaded
  parameters: ~0.2 s at the link's speed, overlapped).
- ``chunked_host_step``: upcast, fused step and cast back while the chunk is in cache
  (``elbowroom.optim._host_adam``) instead of three passes over the whole bucket; same arithmetic, bitwise.
- ``scale_in_kernel`` (off by default): with clipping or a grad scaler the host scales each gradient before its
  step, a pass of its own (36 B of host memory traffic per parameter against 28). On, the scale goes into torch's
  fused kernel instead (its ``grad_scale``, the way torch's GradScaler hands it over), which divides by the
  inverse instead of multiplying: not bitwise torch's ``clip_grad_norm_`` + AdamW. A few gradient elements differ
  in their last bit; Adam can carry that into a near-zero parameter (a bias 3.8e-4 relative apart after a few
  steps in the tests), so it is a choice, not the default. 4 ranks on one host stepping at once: 2.0 G params/s
  scaled against 2.6 unscaled (``benchmarks/host_adam.py``, the sixteenth session).
- ``trace_steps``: ``stats()["trace"]`` holds ``(what, first parameter index of the bucket, t0, t1)`` in seconds
  from the previous ``step()`` call, host clock; what is ``flush`` (a bucket's final gradients handed over by
  backward), ``copied`` (the step thread waited for that copy), ``step`` (its CPU step), ``piece_wait`` and
  ``piece_step`` (the same per piece), ``fwd_wait`` (a forward pre-hook waited for it), ``step_call``.
"""

from __future__ import annotations

import dataclasses
import math
import os
from typing import Any

import torch

from elbowroom.optim import _host_adam

__all__ = ["CPUOffloadConfig", "default_step_threads"]


def default_step_threads(processes: int = 1) -> int:
    """Threads for the host optimizer step: this process's share of the cores it may run on, less two, at least one.

    The training thread (kernel launches), autograd's device thread and the copy thread need cores of their own.
    torch's own thread count is not read: a DataLoader with ``pin_memory=True`` sets it to 1 for the whole
    process from its pinning thread, which left the trainer's host step on one thread (W1, 12 GiB plan: the host
    AdamW at 0.76 G params/s against 2.0 on 16 threads, and a 2.3 s step, ``BENCHMARKS.md``).
    ``processes`` ranks on one host share its cores. A rank bound to some of them (``torchrun --numa-binding``:
    its GPU's NUMA node) shares them with the ranks bound alike, about ``processes`` x its cores / all cores.
    """
    mine = _affinity(0)
    if mine is None:  # not on Linux
        return max(1, (os.cpu_count() or 1) // max(1, processes) - 2)
    allowed = max(_affinity(os.getppid()) or 0, mine)  # the launcher's cores: every rank's together, unbound
    sharing = max(1, round(max(1, processes) * mine / allowed))
    return max(1, mine // sharing - 2)


def _affinity(pid: int) -> int | None:
    """How many cores process ``pid`` may run on (None where that cannot be read)."""
    try:
        return len(os.sched_getaffinity(pid))
    except (AttributeError, OSError):
        return None


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def dtype_name(dtype: torch.dtype) -> str:
    """``torch.bfloat16`` -> ``"bfloat16"`` (the config's spelling of a dtype)."""
    return str(dtype).removeprefix("torch.")


@dataclasses.dataclass(frozen=True)
class CPUOffloadConfig:
    """Placement, precision and engine settings of one CPU-offloaded optimizer (``--optimizer.<field>``)."""

    offload_fraction: float = 1.0
    """Share of the trainable parameter bytes, in parameter order, whose state lives and steps on the host."""
    offload_gradients: bool = False
    """Free each device gradient of an offloaded parameter once copied; micro-batches accumulate on the host."""
    param_dtype: str | None = None
    """Device dtype of the offloaded weight matrices ("bfloat16"); fp32 masters stay on the host. None: as is."""
    master_weights: bool = False
    """fp32 masters for low-precision parameters (host for offloaded, device for the rest); set by param_dtype."""
    overlap: bool = True
    """Copy and step each bucket as soon as its gradients are final; False does all the work in step()."""
    bucket_bytes: int = 64 << 20
    """Gradient bytes of one bucket (one CPU optimizer call, one staging slot); bigger Adam params go in pieces."""
    num_staging_slots: int = 3
    """Pinned gradient staging slots: copies of later buckets overlap the CPU step of earlier ones."""
    cpu_threads: int | None = None
    """Intra-op threads of the CPU step; None: :func:`default_step_threads` (this process's cores less two)."""
    cast_on_device: bool = True
    """With low-precision device weights, upcast gradients and cast updated masters on the device, not the host."""
    chunked_host_step: bool = True
    """Upcast, step and cast back host-cast Adam/AdamW buckets chunk by chunk (bitwise the whole-bucket step)."""
    host_chunk_numel: int = _host_adam.CHUNK_NUMEL
    """Elements per chunk of the chunked host step (a multiple of 64: chunk ends on vector boundaries)."""
    cast_chunk_bytes: int = 64 << 20
    """Bytes of the device buffer each copy stream casts through, a chunk at a time, with ``cast_on_device`` (one per
    stream, instead of an fp32 copy of each whole tensor, which the copy stream's pool then kept and the compute
    stream could not reuse: on the 7B shape 0.49 GiB on each of the two streams). A multiple of 8."""
    device_chunk_numel: int = 1 << 25
    """Elements per chunk of the device step of fp32 masters kept on the device (the fp32 scratch it upcasts into)."""
    step_order: str = "needed_first"
    """With ``offload_gradients``, which of the jobs whose gradients have landed the host steps next:
    ``"needed_first"`` (the lowest parameter index, which the next forward needs first) or ``"arrival"`` (as their
    gradients became final: late layers first). Without ``offload_gradients`` the staging slots pace the copies and
    jobs step as they arrive. On W1 at 8 GiB ``"needed_first"`` ran at 75-81% of plain where ``"arrival"`` ran at
    58-64%, in one call (``BENCHMARKS.md``): the next forward starts once the first weights are back and goes on as
    the rest land, instead of waiting for the late layers' steps before its first block."""
    stream_slot_numel: int = 1 << 24
    """Elements per slot of the device ring that streamed parameters (``stream_params``) step through: each slot holds
    that many fp32 elements of master, both moments and the upcast gradient (16 B each); a bigger parameter steps chunk
    by chunk. A multiple of 64."""
    stream_slots: int = 2
    """Slots of that ring: the states of one chunk come up while the one before steps and goes back."""
    scale_in_kernel: bool = False
    """Apply the clip coefficient (and a grad scaler's inverse scale) inside torch's fused Adam/AdamW kernel on the
    host: one pass over host memory fewer, results equal to torch's clipped step within rounding, not bitwise."""
    trace_steps: bool = False
    """Record each step's timeline in ``stats()["trace"]`` (hand-over, copy, CPU step, forward waits)."""
    join_timeout_s: float = 10.0
    """Seconds close() waits for each worker thread before it raises an error naming the stuck thread."""

    def __post_init__(self) -> None:
        f = self.offload_fraction
        if not _is_number(f) or not 0.0 <= float(f) <= 1.0:
            raise ValueError(f"offload_fraction must be a number in [0, 1], got {f!r}")
        for name in ("offload_gradients", "master_weights", "overlap", "cast_on_device", "chunked_host_step",
                     "scale_in_kernel", "trace_steps"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be True or False, got {getattr(self, name)!r}")
        if self.step_order not in ("needed_first", "arrival"):
            raise ValueError(f'step_order must be "needed_first" or "arrival", got {self.step_order!r}')
        if self.param_dtype is not None:
            dt = getattr(torch, self.param_dtype, None) if isinstance(self.param_dtype, str) else None
            if not (isinstance(dt, torch.dtype) and dt.is_floating_point):
                raise ValueError(
                    f'param_dtype must name a floating-point dtype such as "bfloat16" (or be None), '
                    f"got {self.param_dtype!r}"
                )
        if not _is_int(self.bucket_bytes) or self.bucket_bytes < 1:
            raise ValueError(f"bucket_bytes must be a positive int (e.g. 64 << 20), got {self.bucket_bytes!r}")
        if not _is_int(self.num_staging_slots) or self.num_staging_slots < 1:
            raise ValueError(
                f"num_staging_slots must be an int >= 1 (2 or more lets copies overlap steps), "
                f"got {self.num_staging_slots!r}"
            )
        if self.cpu_threads is not None and (not _is_int(self.cpu_threads) or self.cpu_threads < 1):
            raise ValueError(f"cpu_threads must be an int >= 1, or None for the default, got {self.cpu_threads!r}")
        if not _is_int(self.host_chunk_numel) or self.host_chunk_numel < 64 or self.host_chunk_numel % 64:
            raise ValueError(f"host_chunk_numel must be a positive multiple of 64, got {self.host_chunk_numel!r}")
        if not _is_int(self.cast_chunk_bytes) or self.cast_chunk_bytes < 8 or self.cast_chunk_bytes % 8:
            raise ValueError(f"cast_chunk_bytes must be a positive multiple of 8 (e.g. 64 << 20), "
                             f"got {self.cast_chunk_bytes!r}")
        if not _is_int(self.stream_slot_numel) or self.stream_slot_numel < 64 or self.stream_slot_numel % 64:
            raise ValueError(f"stream_slot_numel must be a positive multiple of 64, got {self.stream_slot_numel!r}")
        if not _is_int(self.stream_slots) or self.stream_slots < 1:
            raise ValueError(f"stream_slots must be an int >= 1 (2 lets a chunk's copies overlap the next), "
                             f"got {self.stream_slots!r}")
        if not _is_int(self.device_chunk_numel) or self.device_chunk_numel < 1:
            raise ValueError(f"device_chunk_numel must be a positive int, got {self.device_chunk_numel!r}")
        t = self.join_timeout_s
        if not _is_number(t) or not t > 0 or math.isinf(t):
            raise ValueError(f"join_timeout_s must be a positive number of seconds, got {t!r}")

    @property
    def param_torch_dtype(self) -> torch.dtype | None:
        """``param_dtype`` as a ``torch.dtype`` (None when unset)."""
        return None if self.param_dtype is None else getattr(torch, self.param_dtype)

    @property
    def uses_master_weights(self) -> bool:
        """Whether low-precision parameters get fp32 masters (``master_weights``, implied by ``param_dtype``)."""
        return self.master_weights or self.param_dtype is not None

    def as_dict(self) -> dict[str, Any]:
        """The fields as a plain dict (for logs and benchmark rows)."""
        return dataclasses.asdict(self)
