"""CPU-offloaded and hybrid optimizer: fp32 master weights and optimizer state in host memory.

``CPUOffloadOptimizer`` wraps a torch optimizer class. The parameters it offloads keep their master
weights and optimizer state on the host and step there with the torch CPU kernel of that class (fused
AdamW by default, one call per bucket of parameters, using torch's intra-op threads); the rest step on the
device with the class's fused device kernel, at the same time.

Gradients leave the device as soon as they are final (post-accumulate-grad hooks, bucket by bucket), are
copied into a bounded pinned staging pool by a copy thread on a D2H stream, stepped on the CPU by a step
thread and copied back on an H2D stream; ``step()`` waits for the step thread (a host wait for the CPU, not
for the device) and makes the compute stream wait on the H2D stream (the pipeline in detail:
:mod:`elbowroom.optim.engine`).

When the step needs every gradient before any update (gradient clipping, GradScaler, gradients edited
after backward), the CPU steps start in ``step()``; otherwise they start during backward. Which of the two
applies is learned from the first step, or set with :attr:`CPUOffloadOptimizer.step_in_backward`. With
:meth:`CPUOffloadOptimizer.overlap_with_forward`, ``step()`` does not wait at all: each module waits for
its own weights in a forward pre-hook, so the CPU step of the late blocks runs behind the next forward.

Host memory per offloaded fp32 parameter (AdamW): 12 bytes (4 master, pinned; 8 moments, pageable), plus
``num_staging_slots`` pinned slots of the largest bucket and two piece buffers; ``offload_gradients`` adds a
pinned host gradient (+4 bytes: 16 in all), so that gradients leave the device at link speed whatever the CPU
step's pace, and accumulate there over micro-batches.

With low-precision device weights (``param_dtype=torch.bfloat16``) the casts run on the device by default
(:attr:`CPUOffloadConfig.cast_on_device`): a gradient is upcast there and travels in fp32, an updated
master travels from pinned memory into device scratch and is cast into the parameter there; the host step is
the same fused fp32 kernel as for fp32 weights (28 B of host memory traffic per parameter instead of 40 with
the casts on the host).

The code is split by concept: this module is the facade (what a ``torch.optim.Optimizer`` offers, and
``step()`` itself); :mod:`~elbowroom.optim.config` holds every setting, :mod:`~elbowroom.optim.placement`
decides where each parameter steps, :mod:`~elbowroom.optim.handover` turns gradients into jobs,
:mod:`~elbowroom.optim.engine` runs the copy and step threads (its docstring says which thread owns what),
:mod:`~elbowroom.optim.host_step` is the CPU step itself, :mod:`~elbowroom.optim.masters` the master weights,
:mod:`~elbowroom.optim.clipping` the global norm and :mod:`~elbowroom.optim.state_dict` the checkpoint layout.

On a CPU-only machine the same code runs with the "device" parameters on the CPU: copies are plain copies
and events are ``None``, so the bookkeeping is the same and is what the CPU tests exercise.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import time
import weakref
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch
from torch.optim import Optimizer
from torch.utils.weak import WeakIdKeyDictionary

from elbowroom.optim import clipping, early_state, masters, shards
from elbowroom.optim import state_dict as sd_mapping
from elbowroom.optim.buffers import HostMemory, Streams
from elbowroom.optim.clipping import ClipRequest
from elbowroom.optim.config import CPUOffloadConfig, dtype_name
from elbowroom.optim.engine import Engine, finalize, shutdown
from elbowroom.optim.handover import Handover, grad_hook
from elbowroom.optim.placement import (
    IMPL_KEYS,
    Bucket,
    Placement,
    check_host_memory,
    param_groups_on_one_device,
    probe_optimizer_class,
    select_offloaded,
    select_streamed,
)
from elbowroom.optim.stats import StepStats

__all__ = ["CPUOffloadConfig", "CPUOffloadOptimizer"]

logger = logging.getLogger(__name__)


_OWNERS: WeakIdKeyDictionary = WeakIdKeyDictionary()
"""The CPUOffloadOptimizer, weakly, whose gradient hook each hooked parameter carries."""


def _check_unowned(optimizer: CPUOffloadOptimizer, params: list[torch.Tensor]) -> None:
    """Refuse ``params`` where an open CPUOffloadOptimizer hooks one: its hook would still fire on this optimizer's
    gradients (a second ``elbowroom.apply`` of a plan to the same model, the first optimizer kept, failed in its
    second step with "became final twice before step()", which sent the user to gradient accumulation)."""
    for i, p in enumerate(params):
        owner = _OWNERS.get(p)
        other = owner() if owner is not None else None
        finalizer = getattr(other, "_finalizer", None)  # (None: its construction failed before its hooks)
        if other is not None and other is not optimizer and finalizer is not None and finalizer.alive:
            raise ValueError(
                f"parameter {i} ({tuple(p.shape)}) already belongs to an open CPUOffloadOptimizer, whose gradient "
                "hooks it carries: call that optimizer's close() (or drop every reference to it) before building "
                "another over the same parameters, such as elbowroom.apply of another plan to the same model"
            )


class CPUOffloadOptimizer(Optimizer):
    """A torch optimizer whose state (all of it, or a fraction) lives and steps in host memory.

    Example::

        opt = CPUOffloadOptimizer(model.parameters(), torch.optim.AdamW, lr=3e-4, weight_decay=0.1)
        for micro_batches in loader:
            for i, mb in enumerate(micro_batches):
                with opt.accumulating(i < len(micro_batches) - 1):
                    loss_fn(model, mb).backward()
            opt.clip_grad_norm_(1.0)
            opt.step()
            opt.zero_grad()

    Host memory per offloaded fp32 parameter with AdamW: 12 bytes (master weight, two moments), plus a
    bounded pinned staging pool: ``num_staging_slots`` slots of at most ``bucket_bytes`` and two more for
    parameters bigger than that, which Adam/AdamW step piece by piece (elementwise, so exactly as whole;
    other optimizers, and ``offload_gradients``, widen every slot to the largest gradient instead).
    ``offload_gradients=True`` adds a host gradient (4 more bytes per offloaded parameter,
    pinned, allocated at set-up): gradients leave the device at link speed, whatever the pace of the CPU
    step, and later micro-batches are added to it on the host. With ``master_weights=True`` and bf16
    device parameters (or ``param_dtype=torch.bfloat16``, which casts them) the device keeps 2 bytes per
    offloaded parameter and its gradient, the host the same 12 (the master pinned); the casts run on the
    device (``CPUOffloadConfig.cast_on_device``), so the host step is the same fused fp32 kernel as for fp32
    weights; a host gradient is then fp32 too (4 bytes: the upcast on the host ran the step at half its
    pace). This is the configuration that trains the 7B shape at 226 model TFLOP/s
    on one H100 with 40% of the parameters offloaded, at 12.8 host bytes per offloaded parameter.

    Every setting is a field of :class:`~elbowroom.optim.CPUOffloadConfig` (``config=``); the keyword arguments
    below override the fields of the same name, so two optimizers in one process can differ in any of them.
    ``close()`` stops the worker threads (and raises if one is stuck); if the optimizer is collected without
    it, the same shutdown runs then, its errors reported as unraisable, except at interpreter exit.

    Limits: with DDP, gradients are final only after their all-reduce, which the post-accumulate-grad
    hooks do not wait for; use ``overlap=False`` there. A parameter read by backward after its own
    gradient is final (a ``detach()``-ed use) would see the updated weights when the CPU step runs during
    backward; set ``step_in_backward = False`` for such models.

    Args:
        params: parameters or parameter groups, as for any torch optimizer; extra keys in a group are kept
            and passed to the inner optimizers.
        optimizer_class: the torch optimizer class; it must be able to step CPU tensors. Fused kernels are
            used on both sides when the class has them (``fused`` is set unless given).
        config: all settings at once (default: ``CPUOffloadConfig()``); the arguments below override its fields.
        offload_fraction: share of the trainable parameter bytes, taken in parameter order, whose state
            lives on the host. 0 keeps everything on the device, 1 offloads everything.
        overlap: copy each gradient to the host as soon as it is final (post-accumulate-grad hooks) and
            start the CPU step as early as the step allows; False does all the work inside ``step()``.
        offload_gradients: free each device gradient of an offloaded parameter as soon as it is copied;
            gradients of later micro-batches accumulate on the host.
        offload_params: which parameters go to the host instead of the first ``offload_fraction``: a
            predicate on a parameter or a collection of parameters. Offloading the last blocks hides the
            CPU step best: their gradients are final first and their weights are needed last.
        master_weights: keep fp32 master weights for low-precision (bf16/fp16) parameters: on the host for
            offloaded ones (the device copy is updated by casting), on the device for the others. The
            masters start from the parameters' current values.
        param_dtype: keep the offloaded weight matrices on the device in this dtype (e.g. ``torch.bfloat16``):
            each one's current (fp32) value becomes its host master, then the device copy is cast in place
            (the same ``Parameter`` object). Vectors (norm weights, biases: tiny, and read by fp32 kernels)
            keep their dtype. An embedding table cast this way returns ``param_dtype`` activations. The
            matrices' device memory, their gradients and their bytes on the link halve; the model must run in
            that dtype or under autocast. Gradients arrive and accumulate over micro-batches in
            ``param_dtype``: under bf16 autocast a matmul weight's gradient is a bf16 value either way, so with
            one micro-batch per step the update is the same; across micro-batches the sum is rounded to bf16
            on the device (with ``offload_gradients`` and the casts on the device it is formed in fp32 on the
            host instead).
            Implies ``master_weights``.
        keep_dtype: offloaded parameters whose device copy keeps its dtype under ``param_dtype``, for example the
            embedding tables, whose output would otherwise carry ``param_dtype`` into a residual stream that
            autocast keeps in fp32 (:func:`elbowroom.plan.apply` passes every ``nn.Embedding``'s weight).
        stream_params: offloaded parameters whose state stays on the host but steps on the device: each step their
            fp32 master and moments come up into a small device ring (``CPUOffloadConfig.stream_slots`` x
            ``stream_slot_numel`` x 16 B), torch's fused Adam(W) steps them next to the gradient, and they go back
            (:mod:`elbowroom.optim.stream_step`). 12 B per parameter each way on the link instead of 4, no host CPU
            work, no host gradient; their gradients stay on the device until their step, also with
            ``offload_gradients``. Torch's Adam/AdamW only (fused, no AMSGrad).
        **optimizer_kwargs: passed to ``optimizer_class`` (``lr``, ``betas``, ``weight_decay``...).

    Raises:
        ValueError: a setting outside its range, or an optimizer class that cannot step on the CPU.
        TypeError: ``optimizer_class`` is not a torch optimizer class, or ``config`` not a ``CPUOffloadConfig``.
        RuntimeError: host memory is too small, or pinned memory cannot be allocated.
    """

    _step_supports_amp_scaling = True  # GradScaler hands us grad_scale / found_inf instead of unscaling

    def __init__(
        self,
        params: Iterable[torch.Tensor] | Iterable[dict[str, Any]],
        optimizer_class: type[Optimizer] = torch.optim.AdamW,
        *,
        config: CPUOffloadConfig | None = None,
        offload_fraction: float | None = None,
        overlap: bool | None = None,
        offload_gradients: bool | None = None,
        offload_params: Callable[[torch.Tensor], bool] | Iterable[torch.Tensor] | None = None,
        master_weights: bool | None = None,
        param_dtype: torch.dtype | None = None,
        keep_dtype: Iterable[torch.Tensor] | None = None,
        stream_params: Iterable[torch.Tensor] | None = None,
        **optimizer_kwargs: Any,
    ) -> None:
        if not (isinstance(optimizer_class, type) and issubclass(optimizer_class, Optimizer)):
            raise TypeError(f"optimizer_class must be a torch.optim.Optimizer subclass, got {optimizer_class!r}")
        if config is not None and not isinstance(config, CPUOffloadConfig):
            raise TypeError(f"config must be a CPUOffloadConfig, got {type(config).__name__}")
        if param_dtype is not None and not (isinstance(param_dtype, torch.dtype) and param_dtype.is_floating_point):
            raise ValueError(
                f"param_dtype must be a floating-point torch.dtype such as torch.bfloat16, got {param_dtype!r}"
            )
        given = {
            "offload_fraction": offload_fraction,
            "overlap": None if overlap is None else bool(overlap),
            "offload_gradients": None if offload_gradients is None else bool(offload_gradients),
            "master_weights": None if master_weights is None else bool(master_weights),
            "param_dtype": None if param_dtype is None else dtype_name(param_dtype),
        }
        overrides = {k: v for k, v in given.items() if v is not None}
        cfg = config or CPUOffloadConfig()
        if overrides:
            cfg = dataclasses.replace(cfg, **overrides)  # validated again in __post_init__
        if offload_params is not None and cfg.offload_fraction != 1.0:
            raise ValueError(
                "offload_params chooses the offloaded parameters itself; leave offload_fraction at its default"
            )
        self._ready = False
        self.config = cfg
        """The settings of this optimizer (frozen)."""
        self.optimizer_class = optimizer_class
        self._offload_params = offload_params
        self.sync_gradients = True
        """False while accumulating: the gradients of this backward are not the step's final ones."""

        groups, self.device = param_groups_on_one_device(params)

        cpu_kwargs, dev_kwargs, defaults, state_ratio = probe_optimizer_class(
            optimizer_class, optimizer_kwargs, self.device
        )
        super().__init__(groups, defaults)
        all_params = [p for g in self.param_groups for p in g["params"]]
        _check_unowned(self, all_params)

        self._streams = Streams(self.device, cfg.cast_chunk_bytes)
        self._host = HostMemory(pin=self._streams.cuda)
        self._placement = Placement(
            cfg, optimizer_class, self.device, cpu_kwargs, dev_kwargs, dict(optimizer_kwargs), self._host
        )
        self._placement.keep_dtype = {id(p) for p in keep_dtype or ()}
        self._hooks: list[Any] = []
        self._grad_hooks: list[Any] = []  # the post-accumulate-grad hooks (DDP replaces them: after_reduction)
        self._after_reduction = False
        # FSDP2: the ranks whose shards make up the global gradient norm (None: unsharded parameters)
        self._norm_group = shards.norm_group(all_params)
        self._clip: ClipRequest | None = None
        self._learning: dict[str, bool] = {}
        self._stats = StepStats()

        offloaded = select_offloaded(all_params, cfg.offload_fraction, offload_params)
        self._placement.streamed = select_streamed(stream_params, all_params, offloaded, optimizer_class, cpu_kwargs)
        check_host_memory(sum(p.numel() for p in all_params if id(p) in offloaded), state_ratio, cfg)
        for gi, group in enumerate(self.param_groups):
            self._place(gi, group["params"], offloaded)
        if self._placement.dev_opt is not None:
            # the device moments beside the weights before the first forward, not in the first step's freed
            # ranges (early_state)
            early_state.create_state(self._placement.dev_opt)
        staging = self._placement.staging()
        self._slot_bytes, self._staging_bytes = staging.slot_bytes, staging.total_bytes
        self._engine = Engine(self._streams, staging, cfg)
        hyper = weakref.WeakMethod(self._hyper)  # no reference cycle: the optimizer stays collectable by refcount
        self._handover = Handover(cfg, self._placement, self._engine, self._streams, lambda: hyper()())
        self._finalizer = weakref.finalize(self, finalize, self._engine, self._hooks, self._host, cfg.join_timeout_s)
        self._ready = True
        hps = self._placement.hps
        n_off = sum(hp.param.numel() for hp in hps)
        n_all = sum(p.numel() for p in all_params)
        logger.info(
            "CPUOffloadOptimizer: %d of %d parameters (%.1f%% of elements) on the host, %d buckets, %.2f GiB pinned",
            len(hps),
            len(all_params),
            100 * n_off / max(n_all, 1),
            len(self._placement.buckets),
            self._host.pinned_bytes / 2**30,
        )

    # ------------------------------------------------------------------------------------ settings
    @property
    def step_in_backward(self) -> bool | None:
        """True: CPU steps start during backward; False: in ``step()``; None: learned from the first step
        (True when that step used no clipping, no GradScaler and did not edit gradients after backward)."""
        return self._handover.step_in_backward

    @step_in_backward.setter
    def step_in_backward(self, value: bool | None) -> None:
        self._handover.step_in_backward = value

    # ------------------------------------------------------------------------------------ set-up
    def _place(self, gi: int, params: list[torch.Tensor], offloaded: set[int]) -> list[Bucket]:
        """Place user group ``gi`` (host buckets or the device optimizer) and hook its offloaded parameters."""
        base = sum(len(g["params"]) for g in self.param_groups[:gi])
        new = self._placement.place(gi, base, params, offloaded, self._hyper_of(gi))
        for hp in sorted((hp for b in new for hp in b.params), key=lambda h: h.index):
            if hp.owner.requires_grad and self.config.overlap and not self._after_reduction:
                self._grad_hooks.append(hp.owner.register_post_accumulate_grad_hook(grad_hook(self, hp)))
                self._hooks.append(self._grad_hooks[-1])
                _OWNERS[hp.owner] = weakref.ref(self)
        return new

    def close(self) -> None:
        """Stop and join the worker threads, remove the hooks, then unpin host memory; the optimizer is unusable
        after. Calling it again does nothing.

        Raises:
            RuntimeError: a worker thread did not finish within ``config.join_timeout_s`` (named in the message);
                its pinned memory is kept, and a later ``close()`` (or the collection of the optimizer) tries again.
        """
        detached = self._finalizer.detach()
        if detached is None:
            return  # closed already
        _, _, args, _ = detached
        try:
            shutdown(*args)
        except BaseException:
            self._finalizer = weakref.finalize(self, finalize, *args)  # retried by close() or at collection
            raise

    # ------------------------------------------------------------------------------------ user API
    @contextlib.contextmanager
    def accumulating(self, enabled: bool = True) -> Iterator[None]:
        """Mark the backward passes inside as non-final micro-batches of gradient accumulation.

        Gradients stay on the device and accumulate there as usual (on the host with
        ``offload_gradients=True``); nothing is copied for the CPU step until a backward outside this
        context. Equivalent to setting ``opt.sync_gradients = not enabled`` around them.

        Args:
            enabled: False makes the context a no-op, for ``with opt.accumulating(i < n - 1):`` loops.
        """
        prev = self.sync_gradients
        self.sync_gradients = not enabled
        try:
            yield
        finally:
            self.sync_gradients = prev

    def _hyper_of(self, gi: int) -> dict[str, Any]:
        return {k: v for k, v in self.param_groups[gi].items() if k not in IMPL_KEYS}

    def _hyper(self) -> list[dict[str, Any]]:
        return [self._hyper_of(gi) for gi in range(len(self.param_groups))]

    @torch.no_grad()
    def clip_grad_norm_(
        self,
        max_norm: float,
        norm_type: float = 2.0,
        *,
        error_if_nonfinite: bool = False,
        skip_if_nonfinite: bool = False,
    ) -> torch.Tensor:
        """Clip all gradients of this optimizer by their global norm, as torch.nn.utils.clip_grad_norm_.

        Call it after the last backward and before ``step()`` (after ``scaler.unscale_(opt)`` when a
        GradScaler is used). Norms come from the device (offloaded gradients freed by
        ``offload_gradients=True`` had theirs taken on the device as they finished; host-accumulated ones
        are taken on the host). The device gradients of parameters that step on the device are scaled
        here; offloaded gradients are scaled on the host right before their CPU step (their device copies,
        if kept, are left as they are).

        Args:
            max_norm: the largest allowed global norm.
            norm_type: the p of the p-norm (``inf`` for the max norm); 2 only with ``offload_gradients``.
            error_if_nonfinite: raise if the total norm is nan or inf (a host-device sync).
            skip_if_nonfinite: make the coming ``step()`` skip the update when the norm is not finite.

        Returns:
            The total norm of the gradients before clipping (a device tensor).
        """
        norm_type = float(norm_type)
        if self.step_in_backward is True and self.config.overlap:
            raise RuntimeError(
                "clip_grad_norm_ after CPU steps started during backward; set opt.step_in_backward = False "
                "(or leave it None so that the first step decides)"
            )
        self._learning["global"] = True
        self._handover.collect(self.sync_gradients)
        self._clip = clipping.clip_by_global_norm(
            [g["params"] for g in self.param_groups],
            self._placement.hp_of,
            self._placement.dev_params,
            self.device,
            offload_gradients=self.config.offload_gradients,
            wait_host=self._engine.wait_pre,  # host wait (the gate is closed: nothing steps meanwhile)
            max_norm=max_norm,
            norm_type=norm_type,
            error_if_nonfinite=error_if_nonfinite,
            skip_if_nonfinite=skip_if_nonfinite,
            group=self._norm_group,
        )
        return self._clip.total_norm

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:  # type: ignore[override]
        """Update all parameters: offloaded ones on the CPU, the others on the device, at the same time.

        Args:
            closure: re-evaluates the model and returns the loss (its backward runs inside this call).

        Returns:
            The closure's loss, or None.
        """
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        engine = self._engine
        engine.raise_error()
        t_start = time.perf_counter()
        ho = self._handover
        ho.collect(self.sync_gradients)
        skip, dev_mults, hyper = ho.start_step(
            grad_scale=getattr(self, "grad_scale", None),  # set by GradScaler (our fused-optimizer contract)
            found_inf=getattr(self, "found_inf", None),
            clip=self._clip,
            learning=self._learning,
        )

        # --- the device part, on the compute stream, concurrent with the CPU steps
        pl = self._placement
        if pl.dev_opt is not None and not skip:
            grads: dict[tuple[torch.device, torch.dtype], list[torch.Tensor]] = {}
            for p in pl.dev_params:
                if p.grad is not None:
                    g = shards.local(p.grad)  # FSDP2: scale the shard in place (its DTensor wraps it)
                    grads.setdefault((g.device, g.dtype), []).append(g)
            for m in dev_mults:
                for gs in grads.values():
                    torch._foreach_mul_(gs, m.to(gs[0].device))
            for inner, gi in zip(pl.dev_opt.param_groups, pl.dev_group_map):
                inner.update(hyper[gi])
            masters.step_device(pl.dev_opt, pl.dev_masters, self.config.device_chunk_numel)

        jobs, ho.step_jobs = ho.step_jobs, []
        wait_s: float | None = None
        if ho.lazy:
            # return now: each module waits for its own buckets in a forward pre-hook (overlap_with_forward)
            for b in list(ho.inflight):
                ho.inflight[b] = engine.unfinished(ho.inflight[b])
            for job in jobs:
                ho.inflight.setdefault(job.bucket, []).append(job)
        else:
            t_wait = time.perf_counter()
            engine.wait_idle()  # host wait for the CPU steps (their H2D copies are enqueued, maybe not done)
            wait_s = time.perf_counter() - t_wait
            if self._streams.cuda:
                # stream wait: later work on the compute stream (the next forward) reads the new weights
                self._streams.after_updates()
                self._handover.release_grads(self._placement.buckets)

        self._end_step()
        if wait_s is None:  # lazy: what forward pre-hooks waited since the last step (one step behind)
            wait_s, ho.lazy_wait_s = ho.lazy_wait_s, 0.0
        self._stats.record(engine, skip, wait_s, t_start)
        return loss

    def _end_step(self) -> None:
        ho = self._handover
        ho.end_step()
        self._clip = None
        if self.step_in_backward is None and self.config.overlap and self._placement.hps:
            self.step_in_backward = not (self._learning.get("global") or self._learning.get("edited"))
            logger.info(
                "CPUOffloadOptimizer: CPU steps will start %s",
                "during backward" if self.step_in_backward else "in step() (the step needs all gradients first)",
            )
        self._learning.clear()
        if not ho.lazy:
            sd_mapping.link_state(self.state, self._placement)  # lazy: the CPU steps still run; state_dict() links

    def overlap_with_forward(self, model: torch.nn.Module) -> None:
        """Let ``step()`` return before the CPU updates land; each module waits for its own weights.

        Every module of ``model`` that owns offloaded parameters gets a forward pre-hook that waits (on
        the host, then with a stream wait) for the CPU step of exactly those parameters, and steps that
        need all gradients first (clipping, GradScaler) copy and step the buckets in forward order. So
        the CPU step of the late blocks runs behind the next forward of the early ones: offload the late
        blocks (``offload_params=last_fraction(...)``) for this to pay.

        Anything that reads offloaded weights outside the forward of the module that owns them (a fused
        head + loss that takes the head's weight, a functional use of a tied weight, ``model.parameters()``
        read directly, evaluation code that bypasses ``forward``) must call :meth:`wait_for` (those
        weights) or :meth:`wait_for_weights` (all) first; a gradient that arrives for an update no forward
        waited for is logged once and waited for then. ``model.state_dict()`` (a state_dict pre-hook on each
        module owning offloaded weights), the optimizer's ``state_dict()``, ``load_state_dict()`` and
        ``zero_grad(set_to_none=False)`` wait by themselves. The numbers of :meth:`stats` lag one
        step. Without ``offload_gradients``, gradients of offloaded parameters stay on the device until
        their copy (which may now run into the next forward).

        Args:
            model: the module whose forward uses this optimizer's parameters.

        Raises:
            ValueError: an offloaded parameter is not owned by any module of ``model``.
        """
        self._hooks.extend(self._handover.hook_forward(model, self))  # lazy from here

    def after_reduction(self) -> Callable[[list[torch.Tensor]], None]:
        """Take gradients once a data-parallel all-reduce finished, not as backward produces them (DDP).

        Under DDP the post-accumulate-grad hooks fire before the gradient's bucket is all-reduced, so they would
        copy this rank's own gradient to the host. This removes them and returns the callback a DDP comm hook
        calls with a bucket's parameters once their ``.grad`` holds the reduced values
        (``elbowroom.distributed.comm_hooks.register_comm_hook(..., then=...)``). Callbacks may run on the
        collectives' threads while backward goes on: they hand over under a lock (nothing else touches the
        hand-over during backward). Gradients no callback handed over are collected by ``step()`` as before.
        FSDP2 needs none of this: it runs the post-accumulate-grad hooks of its sharded parameters itself,
        after the reduce-scatter.

        Returns:
            The callback (it holds the optimizer weakly).

        Raises:
            ValueError: with ``offload_gradients`` (DDP keeps every gradient in its own device buckets, so freeing
                them there frees nothing), or with ``stream_params`` (not measured under DDP: a streamed step reads the
                gradient on a stream of its own, which nothing here orders after the collectives' callbacks).
        """
        if any(hp.streamed for hp in self._placement.hps):
            raise ValueError("stream_params is not supported under DDP (after_reduction) yet; leave it out there "
                             "(elbowroom.fit does when torch.distributed is initialized)")
        if self.config.offload_gradients and self._placement.hps:
            raise ValueError(
                "offload_gradients frees device gradients, but DDP keeps them in its own buckets; use it with FSDP2 "
                "or a single process, or drop it"
            )
        import threading

        for h in self._grad_hooks:
            h.remove()
        self._grad_hooks.clear()
        self._after_reduction = True
        ref, lock = weakref.ref(self), threading.Lock()

        def reduced(params: list[torch.Tensor]) -> None:
            o = ref()
            if o is None or not o.sync_gradients:
                return
            with lock:  # buckets may finish on several threads of the collectives' backend at once
                for p in params:
                    hp = o._placement.hp_of.get(p)
                    if hp is not None and p.grad is not None and not hp.final:
                        o._handover.on_grad(hp, "final", p.grad, early=True)

        return reduced

    def reload_weights(self) -> None:
        """Re-read the offloaded master weights from the device parameters.

        Call it after changing the weights outside the optimizer once training started (loading a model
        checkpoint without ``load_state_dict``, an EMA swap); otherwise the next CPU step would write the
        old masters back. (Before the first step, and after ``load_state_dict``, this happens by itself.)
        """
        self._handover.settle()  # the masters belong to the step thread while a step runs
        masters.reload_masters(self._placement.hps, self._placement.dev_masters)

    def wait_for(self, params: torch.Tensor | Iterable[torch.Tensor]) -> None:
        """Wait until these offloaded weights are updated (with :meth:`overlap_with_forward`), and order the
        current stream after their copies: call it before reading a weight outside its module's forward,
        e.g. the head weight of a fused linear + cross-entropy. Parameters that are not offloaded are
        ignored.

        Args:
            params: a parameter or parameters of this optimizer.
        """
        if isinstance(params, torch.Tensor):
            params = [params]
        buckets: list[Bucket] = []
        for p in params:
            hp = self._placement.hp_of.get(p)
            if hp is not None and hp.bucket not in buckets:
                buckets.append(hp.bucket)
        if buckets and self._handover.inflight:
            self._handover.await_buckets(buckets)

    def wait_for_weights(self) -> None:
        """Wait until every offloaded weight is updated (only needed with :meth:`overlap_with_forward`)."""
        t0 = time.perf_counter()
        self._handover.settle()
        self._handover.lazy_wait_s += time.perf_counter() - t0
        # idle now: ``state`` shows the inner state again (torch utilities such as torch.distributed.checkpoint read
        # it directly, and take an empty one for an optimizer that never stepped)
        sd_mapping.link_state(self.state, self._placement)

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Reset the gradients of the device parameters and the host accumulators.

        Args:
            set_to_none: free the gradients instead of zeroing them (as torch's default).
        """
        if self._ready:
            self._handover.discard(wait=not set_to_none)
        super().zero_grad(set_to_none=set_to_none)

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """Add a parameter group; its parameters are placed by ``offload_params`` or by the fraction rule
        applied to the new group alone.

        Args:
            param_group: the group, as for any torch optimizer.

        Raises:
            ValueError: after ``overlap_with_forward``, or for parameters the staging allocated at set-up
                cannot carry (pass them to the constructor instead).
        """
        handover = getattr(self, "_handover", None)
        if handover is not None and handover.lazy:
            raise ValueError("add_param_group after overlap_with_forward: add all groups first")
        super().add_param_group(param_group)
        if not getattr(self, "_ready", False):
            return  # during __init__: placement happens once all groups are known
        self._handover.settle()
        gi = len(self.param_groups) - 1
        params = self.param_groups[gi]["params"]
        offloaded = select_offloaded(params, self.config.offload_fraction, self._offload_params)
        new = self._place(gi, params, offloaded)
        for b in new:
            b.piece_numel = self._placement.piece_numel(b) if self._engine.piece_slots else 0
        if any(b.staging_bytes > self._slot_bytes and not b.piece_numel for b in new):
            raise ValueError(
                "a parameter of the new group needs a bigger staging slot than the optimizer allocated; pass "
                "it in the constructor instead"
            )
        if any(not hp.same_dtype for b in new for hp in b.params) and not self._engine.h2d_buffers:
            raise ValueError("master_weights for a new low-precision group: pass it in the constructor instead")

    # ------------------------------------------------------------------------------------ state dict
    def state_dict(self) -> dict[str, Any]:
        """The optimizer state in torch's layout: state keyed by parameter index, tensors where they live.

        Host state stays on the CPU (a checkpoint of a 7B model does not pass through the device). With
        ``master_weights``, each low-precision parameter's entry also holds its fp32 ``master_weight``.

        Returns:
            ``{"state": {index: {...}}, "param_groups": [...]}``, loadable by this class or by
            ``optimizer_class`` itself.
        """
        self._handover.settle()  # the inner state belongs to the step thread while a step runs
        sd_mapping.link_state(self.state, self._placement)
        sd = super().state_dict()
        if self.config.uses_master_weights:
            sd_mapping.add_master_weights(sd, self.param_groups, self._placement)
        sd_mapping.shard_host_state(sd, self._placement)
        return sd

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore a state saved by this class (any offload fraction) or by ``optimizer_class``.

        Host-resident entries are moved to the host, device-resident ones to the device, always as copies:
        the optimizer never shares state tensors with ``state_dict`` (so a source optimizer may keep
        stepping). Master weights are re-read from the device parameters at the next step (or taken from
        ``master_weight`` entries).

        Args:
            state_dict: as returned by :meth:`state_dict`.

        Raises:
            ValueError: its parameter groups do not match this optimizer's.
        """
        self._handover.settle()  # from here no job is outstanding: the inner state is the training thread's
        sd_mapping.load_into(state_dict, self.param_groups, self._placement, self._hyper_of)
        for b in self._placement.buckets:
            self._engine.note_state(b)
        self.state.clear()
        sd_mapping.link_state(self.state, self._placement)

    # ------------------------------------------------------------------------------------ stats
    def offloaded_parameters(self) -> list[torch.Tensor]:
        """The parameters whose state lives and steps on the host, in parameter order.

        Returns:
            The offloaded parameters (the others step on the device).
        """
        return [hp.owner for hp in self._placement.hps]

    def memory_tensors(self) -> dict[str, list[torch.Tensor]]:
        """The optimizer's own tensors in device memory, by what they are (for memory reports).

        Returns:
            ``{"optimizer_state": [...], "master_weights": [...]}``: the device part's optimizer state (Adam's
            moments, its ``step``, and the ring streamed parameters step through) and the fp32 masters of
            low-precision parameters kept on the device. What lives on the host (offloaded parameters' masters
            and state) is counted by ``stats()["host_bytes"]``.
        """
        pl = self._placement
        state: list[torch.Tensor] = []
        if pl.dev_opt is not None:
            for st in list(pl.dev_opt.state.values()):  # the training thread steps the device part: no race here
                state += [v for v in list(st.values()) if isinstance(v, torch.Tensor)]
        state += self._engine.stream_ring  # the device slots streamed parameters' state steps through
        return {"optimizer_state": state, "master_weights": list(pl.dev_masters.values())}

    def stats(self) -> dict[str, Any]:
        """Numbers for benchmarks and logs: settings in use, placement, host memory, the last step's CPU timing.

        Safe to call at any time (the counters are read as one snapshot, also while CPU steps run).

        Returns:
            A dict: ``offloaded_params``, ``offloaded_numel``, ``device_numel``, ``buckets``, ``host_bytes``
            (masters, host optimizer state, staging, accumulators), ``pinned_bytes``,
            ``host_bytes_per_offloaded_param``, ``staging_bytes`` and ``scratch_bytes`` (the bounded buffers),
            ``num_staging_slots`` and ``slot_bytes`` (the staging pool as allocated), ``cpu_threads``,
            ``cpu_step_s`` (CPU time of the last step's host work), ``cpu_wait_s`` (time ``step()`` waited for
            it), ``hidden_fraction`` (1 - wait / CPU time: the share that ran behind other work),
            ``d2h_bytes``/``h2d_bytes`` of the last step, ``step_in_backward``, ``steps``.
        """
        return self._stats.report(
            self._engine, self._placement, self._host, self._staging_bytes, self.step_in_backward
        )
