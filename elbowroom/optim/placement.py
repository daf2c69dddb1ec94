"""Placement: which parameters step on the host, their host memory, buckets and inner optimizers.

A :class:`Placement` gives every parameter of the optimizer its home: an offloaded one gets a host master
(:mod:`elbowroom.optim.masters`), a host gradient with ``offload_gradients``, and a place in a :class:`Bucket`
(consecutive offloaded parameters that travel and step together, one CPU optimizer call); a resident one goes
to the device optimizer (with a device fp32 master where ``master_weights`` asks for it). It also sizes the
pinned staging the engine needs (:meth:`Placement.staging`) and checks that the host has the memory first.

Which parameters: the first ``offload_fraction`` of the trainable bytes in parameter order (Megatron's rule),
or ``offload_params`` (a predicate or a collection; ``elbowroom.optim.last_fraction`` offloads the late blocks,
whose CPU step hides best).

Everything here runs on the training thread, at set-up and in ``add_param_group``. After set-up a bucket's
``arrived`` list is the training thread's; its ``h2d_event`` the step thread's (see the engine's docstring).
"""

from __future__ import annotations

import dataclasses
import inspect
import logging
from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch.optim import Optimizer

from elbowroom.optim import _host_adam, masters, shards
from elbowroom.optim.buffers import HostMemory, align, nbytes
from elbowroom.optim.config import CPUOffloadConfig

__all__ = [
    "Bucket",
    "HostParam",
    "Placement",
    "Staging",
    "check_host_memory",
    "param_groups_on_one_device",
    "probe_optimizer_class",
    "select_offloaded",
]

logger = logging.getLogger(__name__)

# param-group keys that describe how an optimizer runs, not what it computes: each inner optimizer keeps
# its own (a fused CPU kernel here, a fused CUDA kernel there)
IMPL_KEYS = frozenset({"params", "param_names", "fused", "foreach", "capturable", "differentiable"})


def _accepts(cls: type, name: str) -> bool:
    try:
        return name in inspect.signature(cls).parameters
    except (TypeError, ValueError):
        return False


def available_host_bytes() -> int | None:
    """MemAvailable from /proc/meminfo, or None where that is unknown."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


# ------------------------------------------------------------------------------------------- bookkeeping
class HostParam:
    """One offloaded parameter: its device tensor, its host master and where it stages in a slot."""

    def __init__(
        self,
        index: int,
        group: int,
        param: torch.Tensor,
        master: torch.Tensor,
        device_cast: bool = False,
        owner: torch.Tensor | None = None,
    ) -> None:
        self.index = index  # position over all param groups, as in state_dict()
        self.group = group
        self.param = param  # the tensor stepped: the parameter, or its local shard under FSDP2 (see shards)
        self.owner = param if owner is None else owner  # the user's parameter: hooks, .grad, state_dict keys
        self.master = master  # host, same shape; fp32 with master_weights, else the param's dtype
        self.bucket: Bucket
        self.offset = 0  # byte offset of its gradient (param dtype) in a staging slot
        self.elem_offset = 0  # element offset of its fp32 upcast in the step thread's scratch
        self.same_dtype = master.dtype == param.dtype
        # casts between the device dtype and the master's run on the device: gradients travel upcast, weights
        # travel as masters and are cast into the parameter there (host traffic: that of same-dtype params)
        self.device_cast = device_cast and not self.same_dtype
        self.stage_dtype = master.dtype if self.device_cast else param.dtype  # of a staged gradient
        # main-thread state of the current step
        self.final = False  # its final gradient was handed over
        self.accumulated = False  # earlier micro-batches sit in the host accumulator (offload_gradients)
        self.in_arrival = False
        self.early = False  # handed over by the hook during backward (before any post-backward edit)
        self.master_stale = self.same_dtype  # re-read the device weights into the master before stepping
        self.grad_ref: torch.Tensor | None = None  # the device grad handed over, to detect later edits
        self.grad_version = -1
        self.norm: torch.Tensor | None = None  # norm of the final grad, computed on the device in the hook
        # step-thread state
        # pinned host gradient in the staged dtype (offload_gradients only): the first copy of a step lands
        # here directly, at link speed; later micro-batches stage in a slot and are added to it
        self.hgrad: torch.Tensor | None = None
        self.hgrad_valid = False  # holds this step's gradient (set by the copy thread, reset after the step)
        # streamed (``stream_params``): the state stays on the host but steps on the device; its pinned moments
        # (exp_avg, exp_avg_sq), which become the inner optimizer's state at the first step (step thread)
        self.streamed = False
        self.stream_state: tuple[torch.Tensor, torch.Tensor] | None = None

    def staging(self, slot: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
        """Its region of a staging slot, as a tensor of ``dtype`` (default: a staged gradient's)."""
        dtype = dtype or self.stage_dtype
        n = self.param.numel() * dtype.itemsize
        return slot[self.offset : self.offset + n].view(dtype).view(self.param.shape)


class Bucket:
    """Consecutive offloaded parameters that travel and step together (one CPU optimizer call)."""

    def __init__(self, params: list[HostParam], optimizer: Optimizer, group_map: list[int]) -> None:
        self.params = params
        self.optimizer = optimizer
        self.group_map = group_map  # inner param group i -> user param group index
        self.inner_of = {gi: i for i, gi in enumerate(group_map)}
        # Adam/AdamW with low-precision device weights: upcast, step and cast back chunk by chunk (_host_adam)
        self.chunked = _host_adam.supports(optimizer) and any(not hp.same_dtype for hp in params)
        self.arrived: list[tuple[HostParam, torch.Tensor | None]] = []
        self.arrived_kind = "final"
        self.h2d_event: Any = None
        # streamed: its parameters step on the device from host state (all or none of a bucket's)
        self.streamed = bool(params) and params[0].streamed
        self.d2h_event: Any = None  # streamed: the last copy of its state back to the host (step thread writes)
        # streamed, on CUDA: the gradients its last steps read on the state stream, kept referenced until the compute
        # stream is ordered after those reads (Handover.release_grads); the step thread adds, the training thread
        # clears once the bucket's jobs are done
        self.held_grads: list[torch.Tensor] = []
        off = eoff = 0
        for hp in params:
            hp.bucket = self
            hp.offset, hp.elem_offset = off, eoff
            off += align(hp.param.numel() * max(hp.param.element_size(), hp.stage_dtype.itemsize))
            eoff += align(hp.param.numel() * 4) // 4
        self.staging_bytes = off
        self.scratch_numel = eoff
        # a parameter bigger than a staging slot travels and steps piece by piece (set by the optimizer)
        self.piece_numel = 0



def select_offloaded(
    params: list[torch.Tensor],
    fraction: float,
    chosen: Callable[[torch.Tensor], bool] | Iterable[torch.Tensor] | None,
) -> set[int]:
    """ids of the trainable params that go to the CPU."""
    trainable = [p for p in params if p.requires_grad]
    if chosen is not None:
        if callable(chosen):
            return {id(p) for p in trainable if chosen(p)}
        ids = {id(p) for p in chosen}
        known = {id(p) for p in params}
        if not ids <= known:
            raise ValueError("offload_params lists tensors that are not parameters of this optimizer")
        return {id(p) for p in trainable if id(p) in ids}
    total = sum(nbytes(p) for p in trainable)
    limit = fraction * total
    out, taken = set(), 0
    for p in trainable:  # Megatron's rule: offload in parameter order while under the byte budget
        if taken < limit:
            out.add(id(p))
            taken += nbytes(p)
    return out



def select_streamed(
    chosen: Iterable[torch.Tensor] | None,
    params: list[torch.Tensor],
    offloaded: set[int],
    optimizer_class: type[Optimizer],
    cpu_kwargs: dict[str, Any],
) -> set[int]:
    """ids of the offloaded parameters that step on the device from their host state (``stream_params``).

    Raises:
        ValueError: a streamed parameter that is not offloaded, not contiguous, or an optimizer other than
            torch's fused Adam/AdamW without AMSGrad (the device kernel the streamed step calls).
    """
    if chosen is None:
        return set()
    ids = {id(p) for p in chosen}
    if not ids:
        return ids
    if not ids <= offloaded:
        known = {id(p) for p in params}
        what = "are not parameters of this optimizer" if not ids <= known else "are not offloaded (offload_params)"
        raise ValueError(f"stream_params lists tensors that {what}; streamed parameters are offloaded ones")
    probe = optimizer_class([torch.zeros(64, requires_grad=True)], **cpu_kwargs)
    if not _host_adam.supports(probe):
        raise ValueError(
            f"stream_params steps with torch's fused Adam/AdamW kernel; {optimizer_class.__name__} with "
            f"{cpu_kwargs} cannot (use torch.optim.AdamW or Adam without amsgrad, or leave stream_params out)"
        )
    if any(not p.is_contiguous() for p in params if id(p) in ids):
        raise ValueError("stream_params needs contiguous parameters")
    return ids


def probe_optimizer_class(
    cls: type[Optimizer], kwargs: dict[str, Any], device: torch.device
) -> tuple[dict[str, Any], dict[str, Any], dict[str, Any], float]:
    """Check that the class steps on the CPU and choose fused kernels for both sides.

    Args:
        cls: the torch optimizer class.
        kwargs: the user's keyword arguments for it.
        device: the parameters' device.

    Returns:
        ``(cpu_kwargs, device_kwargs, defaults, state_ratio)``: the keyword arguments of the inner host and device
        optimizers, the class's defaults, and its state elements per parameter element (2 for Adam).

    Raises:
        ValueError: the class cannot step CPU tensors.
    """
    master_dtype = torch.float32
    has_fused = _accepts(cls, "fused")
    candidates = [kwargs]
    if has_fused and "fused" not in kwargs:
        candidates = [{**kwargs, "fused": True}, kwargs]
    last_exc: BaseException | None = None
    for cand in candidates:
        probe = torch.zeros(8, dtype=master_dtype, requires_grad=True)
        if cand is kwargs:
            opt = cls([probe], **cand)  # a bad keyword or value raises here, with the class's own message
        else:
            try:  # the fused=True we add ourselves: on failure fall back to the class's default
                opt = cls([probe], **cand)
            except (RuntimeError, ValueError, TypeError) as exc:
                last_exc = exc
                continue
        probe.grad = torch.full_like(probe, 1e-3)
        try:
            opt.step()
        except Exception as exc:  # noqa: BLE001 - any failure means: not runnable on the CPU this way
            last_exc = exc
            continue
        st = opt.state.get(probe, {})
        ratio = sum(v.numel() for v in st.values() if isinstance(v, torch.Tensor) and v.numel() == 8) / 8
        dev_kwargs = dict(kwargs)
        if device.type == "cpu":
            dev_kwargs = dict(cand)  # the "device" is the CPU itself: same kernel as the host part
        elif has_fused and "fused" not in kwargs:
            dev_kwargs["fused"] = True  # falls back below if the class has no fused kernel there
        defaults = dict(opt.defaults)
        return dict(cand), dev_kwargs, defaults, ratio
    raise ValueError(
        f"{cls.__name__} cannot step CPU tensors ({type(last_exc).__name__}: {last_exc}); offloading needs "
        "an optimizer class with a CPU implementation, e.g. torch.optim.AdamW, Adam or SGD"
    ) from last_exc


def param_groups_on_one_device(
    params: Iterable[torch.Tensor] | Iterable[dict[str, Any]],
) -> tuple[list[dict[str, Any]], torch.device]:
    """The user's parameters as a list of group dicts (copies), and the one device they all live on.

    Args:
        params: parameters, ``(name, parameter)`` pairs or parameter groups, as for any torch optimizer.

    Returns:
        ``(groups, device)``.

    Raises:
        ValueError: no parameters, or parameters on several devices.
    """
    groups = list(params)
    if not groups:
        raise ValueError("optimizer got an empty parameter list")
    if not isinstance(groups[0], dict):
        groups = [{"params": groups}]
    groups = [dict(g) for g in groups]
    for g in groups:
        g["params"] = list(g["params"]) if not isinstance(g["params"], torch.Tensor) else [g["params"]]
    raw = [p[1] if isinstance(p, tuple) else p for g in groups for p in g["params"]]  # (name, param) too
    devices = {p.device for p in raw}
    if len(devices) != 1:
        raise ValueError(f"all parameters must be on one device, got {sorted(map(str, devices))}")
    return groups, devices.pop()


def check_host_memory(numel: int, state_ratio: float, config: CPUOffloadConfig) -> None:
    """Raise before allocating if the host cannot hold what offloading ``numel`` parameters needs.

    Args:
        numel: offloaded parameter elements.
        state_ratio: optimizer state elements per parameter element.
        config: the optimizer's settings (gradients on the host, staging sizes).

    Raises:
        RuntimeError: MemAvailable is below the estimate (with what to change).
    """
    if not numel:
        return
    per_param = 4 * (1 + state_ratio) + (4 if config.offload_gradients else 0)
    need = numel * per_param + (config.num_staging_slots + 2) * config.bucket_bytes
    avail = available_host_bytes()
    if avail is not None and need > avail:
        raise RuntimeError(
            f"CPUOffloadOptimizer needs about {need / 2**30:.1f} GiB of host memory for {numel / 1e9:.2f}B "
            f"offloaded parameters ({per_param:.0f} B each), but only {avail / 2**30:.1f} GiB is available; "
            "lower offload_fraction or free host memory"
        )


@dataclasses.dataclass
class Staging:
    """The pinned buffers the engine needs, sized from the buckets (allocated once, at set-up)."""

    slots: list[torch.Tensor]
    """The pool's staging slots (``num_staging_slots`` of ``slot_bytes``)."""
    piece_slots: list[torch.Tensor]
    """The step thread's own two piece buffers (empty without piece-by-piece parameters)."""
    h2d: list[torch.Tensor]
    """Two buffers for weights cast on the host on their way back (empty when casts run on the device)."""
    scratch: torch.Tensor | None
    """fp32 scratch for gradients upcast on the host, or None."""
    slot_bytes: int
    """Bytes of one slot (0 without offloaded parameters)."""
    total_bytes: int
    """Pinned staging bytes in all."""
    chunked: bool
    """Some bucket of low-precision parameters steps chunk by chunk (``chunked_host_step``)."""
    stream_ring: list[torch.Tensor] = dataclasses.field(default_factory=list)
    """Device slots the streamed parameters step through (:meth:`Placement.stream_ring`)."""


class Placement:
    """Where each parameter lives and steps: host buckets with their inner CPU optimizers, or the device.

    Args:
        config: the optimizer's settings.
        optimizer_class: the torch optimizer class of the inner optimizers.
        device: the parameters' device.
        cpu_kwargs: keyword arguments of the inner host optimizers.
        dev_kwargs: keyword arguments of the device optimizer (``fused`` is dropped if the device has none).
        user_kwargs: the user's own keyword arguments (a ``fused`` given there is never dropped).
        host: the host memory the masters and host gradients come from.
    """

    def __init__(
        self,
        config: CPUOffloadConfig,
        optimizer_class: type[Optimizer],
        device: torch.device,
        cpu_kwargs: dict[str, Any],
        dev_kwargs: dict[str, Any],
        user_kwargs: dict[str, Any],
        host: HostMemory,
    ) -> None:
        self.config = config
        self.optimizer_class = optimizer_class
        self.device = device
        self.cpu_kwargs = cpu_kwargs
        self.dev_kwargs = dev_kwargs
        self.user_kwargs = user_kwargs
        self.host = host
        self.hps: list[HostParam] = []  # in parameter order
        self.hp_of: dict[torch.Tensor, HostParam] = {}
        self.buckets: list[Bucket] = []
        self.dev_opt: Optimizer | None = None
        self.dev_group_map: list[int] = []  # device optimizer group -> user group index
        self.dev_params: list[torch.Tensor] = []
        self.dev_masters: dict[torch.Tensor, torch.Tensor] = {}  # resident low-precision param -> fp32 master
        self.keep_dtype: set[int] = set()  # ids of offloaded parameters that param_dtype leaves in their dtype
        self.streamed: set[int] = set()  # ids of offloaded parameters that step on the device (``stream_params``)

    def place(
        self, gi: int, base: int, params: list[torch.Tensor], offloaded: set[int], hyper: dict[str, Any]
    ) -> list[Bucket]:
        """Give each parameter of user group ``gi`` its home: a host bucket or the device optimizer.

        Args:
            gi: the user group's index.
            base: the index of the group's first parameter over all groups.
            params: the group's parameters.
            offloaded: ids of the parameters that go to the host.
            hyper: the group's hyperparameters (for the inner optimizers' groups).

        Returns:
            The new buckets.
        """
        cfg = self.config
        host: list[HostParam] = []
        dev: list[torch.Tensor] = []
        for j, p in enumerate(params):
            if id(p) in offloaded:
                if shards.is_sharded(p) and (cfg.param_torch_dtype is not None or
                                             (p.dtype != torch.float32 and not cfg.uses_master_weights)):
                    raise ValueError(
                        "CPUOffloadOptimizer steps FSDP2 shards of fp32 weights, or of bf16 weights with fp32 "
                        "masters (master_weights=True), not device copies of another dtype (param_dtype)"
                    )
                shard = shards.local(p)  # FSDP2: the host side steps this rank's shard
                master = masters.host_master(
                    shard,
                    self.host,
                    master_weights=cfg.uses_master_weights,
                    param_dtype=None if id(p) in self.keep_dtype else cfg.param_torch_dtype,
                    cast_on_device=cfg.cast_on_device,
                )
                hp = HostParam(base + j, gi, shard, master, device_cast=cfg.cast_on_device, owner=p)
                if id(p) in self.streamed:
                    if shards.is_sharded(p):
                        raise ValueError("stream_params steps whole parameters, not FSDP2 shards")
                    hp.streamed = True
                    hp.stream_state = (self.host.empty(shard.shape, torch.float32, pinned=True),
                                       self.host.empty(shard.shape, torch.float32, pinned=True))
                elif cfg.offload_gradients:
                    # gradients leave the device at link speed, whatever the CPU step's pace, in the dtype they
                    # are staged in: fp32 when the casts run on the device (+4 B/param), so that the host step
                    # is the fused fp32 kernel and not the upcast path (half its pace: ``_host_adam``)
                    hp.hgrad = self.host.empty(shard.shape, hp.stage_dtype, pinned=True)
                host.append(hp)
            else:
                dev.append(p)
        if dev:
            self._add_device_params(gi, dev, hyper)
        if not host:
            return []
        self.hps.extend(host)
        self.hps.sort(key=lambda h: h.index)
        for hp in host:
            self.hp_of[hp.owner] = hp
        return self._make_buckets(host, hyper)

    def _add_device_params(self, gi: int, params: list[torch.Tensor], hyper: dict[str, Any]) -> None:
        inner_params = []
        for p in params:
            m = masters.device_master(p, self.config.uses_master_weights)
            if m is not None:
                self.dev_masters[p] = m
            inner_params.append(p if m is None else m)
        self.dev_params.extend(params)
        group = {**hyper, "params": inner_params}
        if self.dev_opt is None:
            try:
                self.dev_opt = self.optimizer_class([group], **self.dev_kwargs)
            except (RuntimeError, ValueError) as exc:
                if "fused" in self.user_kwargs or "fused" not in self.dev_kwargs:
                    raise
                logger.info(
                    "%s has no fused kernel for %s (%s); using its default",
                    self.optimizer_class.__name__,
                    self.device,
                    exc,
                )
                self.dev_kwargs.pop("fused")
                self.dev_opt = self.optimizer_class([group], **self.dev_kwargs)
        else:
            self.dev_opt.add_param_group(group)
        self.dev_group_map.append(gi)

    def _make_buckets(self, host: list[HostParam], hyper: dict[str, Any]) -> list[Bucket]:
        # gradients become final roughly in reverse parameter order: bucket from the end
        ordered = sorted(host, key=lambda h: h.index, reverse=True)
        new: list[Bucket] = []
        chunk: list[HostParam] = []
        size = 0
        for hp in ordered:
            n = align(nbytes(hp.param))
            if chunk and (size + n > self.config.bucket_bytes or hp.streamed != chunk[0].streamed):
                new.append(self._new_bucket(chunk, hyper))
                chunk, size = [], 0
            chunk.append(hp)
            size += n
        if chunk:
            new.append(self._new_bucket(chunk, hyper))
        self.buckets.extend(new)
        return new

    def _new_bucket(self, hps: list[HostParam], hyper: dict[str, Any]) -> Bucket:
        by_group: dict[int, list[torch.Tensor]] = {}
        for hp in hps:
            by_group.setdefault(hp.group, []).append(hp.master)
        group_map = sorted(by_group)  # one user group per call of place()
        inner = [{**hyper, "params": by_group[gi]} for gi in group_map]
        opt = self.optimizer_class(inner, **self.cpu_kwargs)
        # inner groups list masters in group order; keep hps in the same order for state routing
        order = {id(m): k for k, m in enumerate(m for g in opt.param_groups for m in g["params"])}
        hps = sorted(hps, key=lambda h: order[id(h.master)])
        return Bucket(hps, opt, group_map)

    def piece_numel(self, b: Bucket) -> int:
        """Elements per piece if bucket ``b`` steps piece by piece (0: it stages whole): one parameter bigger
        than ``bucket_bytes``, stepped by Adam/AdamW (elementwise, so pieces step exactly as the whole),
        contiguous, its gradient not kept on the host (``offload_gradients`` accumulates it whole).

        Args:
            b: a bucket.

        Returns:
            Elements per piece, a multiple of 64, or 0.
        """
        hp = b.params[0]
        piece_bytes = align(self.config.bucket_bytes)
        if (
            b.streamed
            or b.staging_bytes <= piece_bytes
            or len(b.params) != 1
            or self.config.offload_gradients
            or not _host_adam.supports(b.optimizer)
            or not hp.param.is_contiguous()
        ):
            return 0
        itemsize = max(hp.param.element_size(), hp.stage_dtype.itemsize)
        return max(64, piece_bytes // itemsize // 64 * 64)

    def staging(self) -> Staging:
        """Decide how each bucket stages and allocate the engine's pinned buffers (once, at set-up).

        Returns:
            The buffers and their sizes.
        """
        cfg = self.config
        # a bucket stages within bucket_bytes; a parameter alone bigger than that travels and steps piece by
        # piece where its optimizer allows (Adam/AdamW, gradients not kept on the host, a contiguous
        # parameter), one piece per slot of that size (plus two of the step thread's own for jobs held at a
        # closed gate: see Engine._streamable), else it widens every slot
        piece_bytes = align(cfg.bucket_bytes)
        for b in self.buckets:
            b.piece_numel = self.piece_numel(b)
        whole = [b.staging_bytes for b in self.buckets if not b.piece_numel and not b.streamed]
        pieces = any(b.piece_numel for b in self.buckets)
        # the pool's slots also carry pieces, which the copy thread streams into them ahead of the step
        slot_bytes = max([*whole, piece_bytes if pieces else 0], default=0)
        slots = [self.host.empty(slot_bytes, torch.uint8, pinned=True) for _ in range(cfg.num_staging_slots)]
        piece_slots = [self.host.empty(piece_bytes, torch.uint8, pinned=True) for _ in range(2)] if pieces else []
        needs_cast = any(not hp.same_dtype and not hp.device_cast and not hp.streamed for hp in self.hps)
        h2d = [self.host.empty(slot_bytes, torch.uint8, pinned=True) for _ in range(2)] if needs_cast else []
        # fp32 scratch for host gradients of another dtype than their master (casts on the host): one chunk when
        # those buckets step chunk by chunk, else room for a bucket's upcast. None when every gradient reaches the
        # host in its master's dtype (casts on the device)
        cast = [h for h in self.hps
                if not h.streamed and h.master.dtype != (h.hgrad.dtype if h.hgrad is not None else h.stage_dtype)]
        scratch = None
        if cast:
            if cfg.chunked_host_step and all(hp.bucket.chunked for hp in cast):
                numel = min(cfg.host_chunk_numel, max(hp.param.numel() for hp in cast))
            else:
                numel = max(b.scratch_numel for b in self.buckets if not b.streamed)
            scratch = self.host.empty(numel, torch.float32, pinned=False)
        total = slot_bytes * (cfg.num_staging_slots + len(h2d)) + piece_bytes * len(piece_slots)
        chunked = cfg.chunked_host_step and any(b.chunked for b in self.buckets if not b.streamed)
        return Staging(slots, piece_slots, h2d, scratch, slot_bytes if self.buckets else 0, total, chunked,
                       self.stream_ring())

    def stream_ring(self) -> list[torch.Tensor]:
        """The device ring the streamed parameters step through: ``stream_slots`` flat fp32 slots, each of four
        regions (master, exp_avg, exp_avg_sq, upcast gradient) of ``stream_slot_numel`` elements, or of the largest
        streamed parameter's when that is smaller (empty without streamed parameters)."""
        streamed = [hp for hp in self.hps if hp.streamed]
        if not streamed:
            return []
        cfg = self.config
        numel = min(cfg.stream_slot_numel, -(-max(hp.param.numel() for hp in streamed) // 64) * 64)
        return [torch.empty(4 * numel, dtype=torch.float32, device=self.device) for _ in range(cfg.stream_slots)]
