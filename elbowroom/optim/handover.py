"""The training thread's side of the pipeline: gradients handed over, buckets filled, jobs sent to the engine.

During backward a post-accumulate-grad hook hands each offloaded parameter's gradient over as soon as it is
final (or, with ``offload_gradients``, as each micro-batch's gradient arrives, to be added on the host); a
bucket whose gradients all arrived becomes a :class:`~elbowroom.optim.engine.Job` for the engine. ``step()``
hands over what the hooks did not see (:meth:`Handover.collect`). Each step's final jobs share one
:class:`~elbowroom.optim.engine.Gate`, which ``step()`` (:meth:`Handover.start_step`: GradScaler's scale, the
clip coefficient, gradients edited after their hand-over) or, when steps run in backward, the first hook opens
with the values the CPU steps apply.

With ``overlap_with_forward`` (the lazy mode) ``step()`` does not wait for the CPU steps: their jobs stay
``inflight`` per bucket, and each module's forward pre-hook waits for its own buckets
(:meth:`Handover.await_buckets`); final jobs whose gate is closed are held and copied at ``step()`` in forward
order.

Everything here runs on the training thread and owns the bookkeeping it touches (see the engine's docstring);
the hooks hold the optimizer weakly, so a module or a parameter never keeps an optimizer alive.
"""

from __future__ import annotations

import logging
import math
import time
import weakref
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

from elbowroom.optim import shards
from elbowroom.optim.buffers import Streams
from elbowroom.optim.clipping import ClipRequest
from elbowroom.optim.config import CPUOffloadConfig
from elbowroom.optim.engine import Engine, Gate, Job, StepPlan
from elbowroom.optim.placement import Bucket, HostParam, Placement

if TYPE_CHECKING:
    from elbowroom.optim.offload import CPUOffloadOptimizer

__all__ = ["Handover", "forward_hook", "grad_hook"]

logger = logging.getLogger(__name__)


def _same_value(a: Any, b: Any) -> bool:
    """Whether a hyperparameter kept its value since the step's first hand-over (device tensors: only if the
    same object, since comparing them would sync)."""
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        if a is b:
            return True
        if not (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)):
            return False
        if a.device.type != "cpu" or b.device.type != "cpu":
            return False  # comparing device tensors would sync; treat a new tensor as a change
        return a.shape == b.shape and bool(torch.equal(a, b))
    try:
        return bool(a == b)
    except (RuntimeError, ValueError):
        return a is b


class Handover:
    """Hands gradients to the engine and keeps the current step's jobs (training thread only).

    Args:
        config: the optimizer's settings.
        placement: where the parameters step.
        engine: the copy and step threads.
        streams: the device's streams (events on the compute stream).
        hyper: the current hyperparameters of every user group.
    """

    def __init__(
        self,
        config: CPUOffloadConfig,
        placement: Placement,
        engine: Engine,
        streams: Streams,
        hyper: Callable[[], list[dict[str, Any]]],
    ) -> None:
        self.config = config
        self.placement = placement
        self.engine = engine
        self.streams = streams
        self.hyper = hyper
        self.step_in_backward: bool | None = None  # CPUOffloadOptimizer.step_in_backward (a property over this)
        self.gate: Gate | None = None  # the current step's
        self.hook_hyper: list[dict[str, Any]] | None = None  # the hyperparameters when the step's first grad arrived
        self.lazy = False  # overlap_with_forward
        self.held: list[Job] = []  # lazy + deferred: final jobs submitted in forward order at step()
        self.step_jobs: list[Job] = []  # final jobs of the current step
        self.inflight: dict[Bucket, list[Job]] = {}  # lazy: last step's jobs not yet waited for
        self.lazy_wait_s = 0.0
        self._warned_unawaited = False
        self._sharded: bool | None = None

    @property
    def sharded(self) -> bool:
        """Whether the offloaded parameters are FSDP2 shards (their copies must land before FSDP2's all-gather,
        which runs on streams of its own)."""
        if self._sharded is None and self.placement.hps:
            self._sharded = any(shards.is_sharded(hp.owner) for hp in self.placement.hps)
        return bool(self._sharded)

    def on_grad(self, hp: HostParam, kind: str, grad: torch.Tensor | None, early: bool = False) -> None:
        """Hand one gradient over (called by the hook during backward, or by step() for the rest).

        Args:
            hp: the offloaded parameter.
            kind: ``"final"`` (this step's gradient) or ``"accumulate"`` (an earlier micro-batch's).
            grad: the device gradient (None: nothing new since earlier micro-batches).
            early: handed over by the hook during backward, before any post-backward edit.
        """
        if hp.streamed and kind == "accumulate":
            return  # it steps on the device: earlier micro-batches accumulate there, as torch's own
        p = hp.owner
        grad = None if grad is None else shards.local(grad)  # FSDP2: this rank's shard of the reduced gradient
        offload_gradients = self.config.offload_gradients
        if self.inflight and hp.bucket in self.inflight:
            # lazy mode: a gradient of a parameter whose last update no forward pre-hook waited for; it was
            # read outside its module's forward (a functional use) without wait_for()
            if not self._warned_unawaited:
                self._warned_unawaited = True
                logger.warning(
                    "CPUOffloadOptimizer: parameter %d was used outside the forward of its module before its "
                    "update landed (overlap_with_forward); call opt.wait_for(params) before such uses",
                    hp.index,
                )
            self.await_buckets([hp.bucket])
        if kind == "final":
            if hp.final:
                raise RuntimeError(
                    f"the gradient of parameter {hp.index} became final twice before step(): wrap the "
                    "backward passes of all but the last micro-batch in `with opt.accumulating():` (or set "
                    "opt.sync_gradients = False for them)"
                )
            hp.final = True
            self.open_step()
            if grad is not None and not offload_gradients:
                # lifetime extension until the end of step(): the reference detects edits after backward
                hp.grad_ref, hp.grad_version = grad, grad._version
                hp.early = early
        else:
            hp.accumulated = True
        if grad is not None and offload_gradients:
            # the optimizer owns the grad from here until its copy is enqueued (lifetime extension)
            p.grad = None
            if kind == "final" and not hp.accumulated and self.step_in_backward is not True:
                with torch.no_grad():
                    hp.norm = torch.linalg.vector_norm(grad)  # on the device, as the grads finish: no sync
        b = hp.bucket
        if b.arrived and (b.arrived_kind != kind or hp.in_arrival):
            self.flush(b)
        hp.in_arrival = True
        b.arrived.append((hp, grad))
        b.arrived_kind = kind
        if len(b.arrived) == len(b.params):
            self.flush(b)

    def flush(self, b: Bucket) -> None:
        """Turn the gradients that arrived for bucket ``b`` into a job (held, or submitted to the engine)."""
        if not b.arrived:
            return
        items, b.arrived = b.arrived, []
        kind = b.arrived_kind
        refresh = []
        for hp, _ in items:
            hp.in_arrival = False
            if kind == "final" and hp.master_stale:
                refresh.append(hp)
                hp.master_stale = False
        job = Job(
            kind=kind,
            bucket=b,
            params=[hp for hp, _ in items],
            grads=[g for _, g in items],
            fresh=[g is not None for _, g in items],
            ready=self.streams.record(),  # the grads are complete at this point of the compute stream
            gate=self.gate if kind == "final" else None,
            refresh=refresh,
            staged=[False] * len(items),
        )
        if kind == "final":
            self.step_jobs.append(job)
            now = time.perf_counter()
            self.engine.note("flush", job.params[0].index, now, now)
            if self.lazy and not self.config.offload_gradients and not (job.gate is not None and job.gate.open):
                self.held.append(job)  # copied at step() in forward order (see overlap_with_forward)
                return
        self.engine.submit(job)

    def open_step(self) -> None:
        """Start the current step's gate (opened at once when CPU steps run during backward)."""
        if self.gate is not None:
            return
        self.gate = Gate()
        self.hook_hyper = self.hyper()
        if self.step_in_backward is True and self.config.overlap:
            self.engine.open_gate(self.gate, StepPlan(hyper=self.hook_hyper))

    def start_step(
        self,
        *,
        grad_scale: torch.Tensor | None,
        found_inf: torch.Tensor | float | None,
        clip: ClipRequest | None,
        learning: dict[str, bool],
    ) -> tuple[bool, list[torch.Tensor], list[dict[str, Any]]]:
        """Fix what this step's CPU updates apply and let them run (called by ``step()``, after ``collect``).

        The values: GradScaler's scale and inf check, the clip coefficient, gradients edited after their hand-over
        (re-copied) and the hyperparameters. If the CPU steps already ran during backward, a step that needed
        any of these raises instead.

        Args:
            grad_scale: GradScaler's scale, if the gradients are still scaled.
            found_inf: GradScaler's inf check (a host-device sync when it is a device tensor).
            clip: this step's clip request, if ``clip_grad_norm_`` ran.
            learning: the optimizer's notes for learning ``step_in_backward`` (updated).

        Returns:
            ``(skip, device multipliers, hyperparameters)``: whether the update is skipped, what the resident
            gradients are multiplied with, each user group's hyperparameters.

        Raises:
            ValueError: a GradScaler with ``offload_gradients``.
            RuntimeError: this step needed every gradient before any update, but its CPU updates already ran.
        """
        self.open_step()
        gate = self.gate
        assert gate is not None
        eager = gate.open  # the CPU steps already run with the values fixed at the first hook

        scaler = grad_scale is not None or found_inf is not None
        if scaler and self.config.offload_gradients and self.placement.hps:
            raise ValueError(
                "GradScaler cannot check gradients that offload_gradients=True moved off the device; use bf16 "
                "autocast without a scaler, or offload_gradients=False"
            )
        skip = False
        mults: list[torch.Tensor] = []
        dev_mults: list[torch.Tensor] = []
        if found_inf is not None:
            skip = bool(found_inf.item() if isinstance(found_inf, torch.Tensor) else found_inf)  # host-device sync
        if grad_scale is not None:  # gradients still scaled (GradScaler's fused-optimizer contract)
            inv = grad_scale.double().reciprocal().float()
            dev_mults.append(inv)
            mults.append(inv.to("cpu"))  # host-device sync
        if clip is not None:
            mults.append(clip.coef.to("cpu"))  # host-device sync: the CPU step needs the coefficient
            if clip.skip_if_nonfinite and not math.isfinite(float(clip.total_norm)):  # synced just above
                skip = True
        hyper = self.hyper()
        changed: dict[int, torch.Tensor | None] = {}
        if not self.config.offload_gradients:
            unscaled_in_place = found_inf is not None and grad_scale is None  # scaler.unscale_(opt) ran
            for hp in self.placement.hps:
                if hp.final and hp.grad_ref is not None:
                    g = None if hp.owner.grad is None else shards.local(hp.owner.grad)
                    if (unscaled_in_place and hp.early) or g is not hp.grad_ref or g._version != hp.grad_version:
                        changed[hp.index] = g  # a reference: zero_grad() may drop .grad before the re-copy
        hyper_changed = self.hook_hyper is not None and not all(
            a.keys() == b.keys() and all(_same_value(a[k], b[k]) for k in a) for a, b in zip(hyper, self.hook_hyper)
        )
        if scaler:
            learning["global"] = True
        if changed or hyper_changed:
            learning["edited"] = True

        if eager:
            problems = [
                name
                for name, bad in (
                    ("clip_grad_norm_", clip is not None),
                    ("a GradScaler", scaler),
                    ("gradients edited after backward", bool(changed)),
                    ("hyperparameters changed after backward", hyper_changed),
                )
                if bad
            ]
            if problems:
                self.engine.wait_idle()
                raise RuntimeError(
                    f"this step used {', '.join(problems)}, but its CPU updates already ran during backward; "
                    "set opt.step_in_backward = False for steps that need every gradient before any update"
                )
        else:
            plan = StepPlan(
                hyper=hyper,
                mults=mults,
                skip=skip,
                recopy=changed,
                ready=self.streams.record() if changed else None,
            )
            self.engine.open_gate(gate, plan)  # the CPU steps start now, while step() runs the device part
            held, self.held = self.held, []
            # streamed first (their device work only needs enqueueing), then forward order
            for job in sorted(held, key=lambda j: (not j.bucket.streamed, j.params[0].index)):
                self.engine.submit(job)
        return skip, dev_mults, hyper

    def collect(self, sync_gradients: bool) -> None:
        """Hand over every final gradient the hooks did not see, and flush partial buckets.

        Args:
            sync_gradients: the optimizer's flag (False: step() runs inside ``accumulating()``).
        """
        if not sync_gradients:
            logger.warning("step() called inside accumulating(): treating the gradients as final")
        for hp in self.placement.hps:
            if hp.final:
                continue
            g = hp.owner.grad
            if g is not None:
                self.on_grad(hp, "final", g)
            elif hp.accumulated:
                self.on_grad(hp, "final", None)
        for b in self.placement.buckets:
            self.flush(b)

    def end_step(self) -> None:
        """Forget the step that ended: the parameters' per-step marks, its gate and hyperparameters."""
        for hp in self.placement.hps:
            hp.final = hp.accumulated = hp.early = False
            hp.grad_ref = hp.norm = None
        self.gate = None
        self.hook_hyper = None

    def discard(self, wait: bool) -> None:
        """``zero_grad``: drop the gradients handed over since the last step (host accumulators included).

        Args:
            wait: wait for the CPU work even in lazy mode (``zero_grad(set_to_none=False)`` zeroes in place).
        """
        pending = bool(self.held) or any(hp.accumulated or hp.in_arrival for hp in self.placement.hps)
        if not self.lazy or wait or pending:
            # (lazy mode, the usual case: in-flight copies own references to the grads they read and
            # record_stream protects their memory, so dropping .grad here needs no wait)
            self.settle()  # from here no job is outstanding: the host gradients are the training thread's
            for b in self.placement.buckets:
                for hp, _ in b.arrived:
                    hp.in_arrival = False
                b.arrived = []
            self.held, self.step_jobs = [], []
            for hp in self.placement.hps:
                hp.hgrad_valid = False  # discard gradients accumulated on the host
        self.end_step()

    def hook_forward(self, model: torch.nn.Module, opt: CPUOffloadOptimizer) -> list[Any]:
        """Give every module of ``model`` that owns offloaded parameters a forward pre-hook that waits for
        exactly those, and switch to the lazy mode.

        Args:
            model: the module whose forward uses the optimizer's parameters.
            opt: the optimizer (held weakly by the hooks).

        Returns:
            The hooks' handles.

        Raises:
            ValueError: an offloaded parameter is not owned by any module of ``model``.
        """
        owned: set[int] = set()
        readers = _fsdp_readers(model)
        waits: dict[int, tuple[torch.nn.Module, list[Bucket]]] = {}
        owners: list[tuple[torch.nn.Module, list[Bucket]]] = []
        for mod in model.modules():
            buckets: list[Bucket] = []
            for p in mod.parameters(recurse=False):
                hp = self.placement.hp_of.get(p)
                if hp is not None:
                    owned.add(id(p))
                    if hp.bucket not in buckets:
                        buckets.append(hp.bucket)
            if buckets:
                # FSDP2 all-gathers a unit's shards in its own pre-forward hook, before any module inside it runs:
                # the wait goes on the unit, ahead of that hook
                reader = readers.get(id(mod), mod)
                _, have = waits.setdefault(id(reader), (reader, []))
                have.extend(b for b in buckets if b not in have)
                # model.state_dict() (or a block's) right after step() would hand out weights whose update has not
                # landed: saved, they are the step before's, or half of it
                owners.append((mod, buckets))
        # a unit that all-gathers later units ahead in forward (parallel.fsdp_prefetch) reads their shards from its
        # own pre-forward: it waits for their updates too
        from elbowroom.distributed.data_parallel import PREFETCHED

        for reader, have in list(waits.values()):
            for later in getattr(reader, PREFETCHED, ()):
                have.extend(b for b in waits.get(id(later), (later, []))[1] if b not in have)
        hooks = [reader.register_forward_pre_hook(forward_hook(opt, buckets), prepend=_is_fsdp(reader))
                 for reader, buckets in waits.values()]
        hooks += [mod.register_state_dict_pre_hook(state_dict_hook(opt, buckets)) for mod, buckets in owners]
        missing = [hp.index for hp in self.placement.hps if id(hp.owner) not in owned]
        if missing:
            for h in hooks:
                h.remove()
            raise ValueError(f"offloaded parameters {missing[:8]} are not parameters of the given model")
        self.lazy = True
        return hooks

    def settle(self) -> None:
        """Wait for all CPU work; later work on the compute stream sees the updated weights."""
        self.engine.wait_idle()  # host wait for the CPU steps
        self.inflight.clear()
        for b in self.placement.buckets:
            if b.d2h_event is not None:  # streamed: written by the step thread before its job finished (waited above)
                b.d2h_event.synchronize()  # host wait: the state read next is the one the device step wrote back
        if self.streams.cuda:
            self.streams.after_updates()  # stream wait
            self.release_grads(self.placement.buckets)
            if self.sharded:  # FSDP2's all-gather stream reads the shards, and waits for no stream of ours
                self.streams.sync_updates()  # host wait for the copies

    def await_buckets(self, buckets: list[Bucket]) -> None:
        """Lazy mode: wait until these buckets' last CPU steps are done and order the current stream after
        their weights' copies (a forward pre-hook, or ``wait_for``).

        Args:
            buckets: the buckets whose weights are about to be read.
        """
        jobs = [j for b in buckets for j in self.inflight.pop(b, ())]
        if not jobs:
            return
        t0 = time.perf_counter()
        self.engine.wait_jobs(jobs)  # host wait for these buckets' CPU steps (not a device sync)
        t1 = time.perf_counter()
        self.lazy_wait_s += t1 - t0
        self.engine.note("fwd_wait", jobs[0].params[0].index, t0, t1)
        if self.streams.cuda:
            cur = torch.cuda.current_stream(self.streams.device)
            for b in buckets:
                if b.h2d_event is not None:  # written by the step thread before the jobs finished (waited above)
                    cur.wait_event(b.h2d_event)  # stream wait: the forward reads the weights after their copy
                    self.release_grads([b])
                    if self.sharded:
                        # FSDP2 reads shards on its own all-gather stream, which waits for no stream of ours
                        b.h2d_event.synchronize()  # host wait for this bucket's copy


    @staticmethod
    def release_grads(buckets: list[Bucket]) -> None:
        """Free the streamed gradients these buckets' steps read, once the current stream waits for those steps (a
        stream wait on ``Bucket.h2d_event``, after ``wait_jobs``/``wait_idle``): the allocator may then hand their
        memory to the current stream's next work, which runs after the reads."""
        for b in buckets:
            if b.held_grads:
                b.held_grads = []


def _is_fsdp(module: torch.nn.Module) -> bool:
    """Whether ``module`` is an FSDP2 unit (``fully_shard`` gave its class FSDP2's methods)."""
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:  # a torch without FSDP2
        return False
    return isinstance(module, FSDPModule)


def _fsdp_readers(model: torch.nn.Module) -> dict[int, torch.nn.Module]:
    """Module id -> the innermost FSDP2 unit around it (itself included), whose pre-forward hook all-gathers its
    parameters; modules outside any unit are left out."""
    readers: dict[int, torch.nn.Module] = {}

    def walk(mod: torch.nn.Module, unit: torch.nn.Module | None) -> None:
        unit = mod if _is_fsdp(mod) else unit
        if unit is not None:
            readers[id(mod)] = unit
        for child in mod.children():
            walk(child, unit)

    walk(model, None)
    return readers


WEIGHT_WAIT = "elbowroom_waits_for_weights"
"""The attribute that marks a forward pre-hook as a wait for updated weights: ``compile_blocks`` moves such hooks
from a block's submodules to the block, outside its compiled forward."""


def forward_hook(opt: CPUOffloadOptimizer, buckets: list[Bucket]) -> Callable[..., None]:
    """A forward pre-hook that waits for ``buckets`` (lazy mode), holding the optimizer weakly. Never traced by
    torch.compile: it waits on the host for other threads, which a compiled graph cannot (traced, it would guard on
    the optimizer's state and recompile at every step)."""
    ref = weakref.ref(opt)  # a module's hook must not keep the optimizer alive

    @torch.compiler.disable
    def hook(module: torch.nn.Module, args: Any) -> None:
        o = ref()
        if o is not None and o._handover.inflight:
            o._handover.await_buckets(buckets)

    setattr(hook, WEIGHT_WAIT, True)
    return hook


def state_dict_hook(opt: CPUOffloadOptimizer, buckets: list[Bucket]) -> Callable[..., None]:
    """A state_dict pre-hook that waits for ``buckets`` (lazy mode), holding the optimizer weakly."""
    ref = weakref.ref(opt)

    def hook(module: torch.nn.Module, prefix: str, keep_vars: bool) -> None:
        o = ref()
        if o is not None and o._handover.inflight:
            o._handover.await_buckets(buckets)

    return hook


def grad_hook(opt: CPUOffloadOptimizer, hp: HostParam) -> Callable[[torch.Tensor], None]:
    """A post-accumulate-grad hook that hands ``hp``'s gradient over, holding the optimizer weakly."""
    ref = weakref.ref(opt)  # the parameter's hook must not keep the optimizer alive

    def hook(param: torch.Tensor) -> None:
        o = ref()
        if o is None or param.grad is None:
            return
        if o.sync_gradients:
            o._handover.on_grad(hp, "final", param.grad, early=True)
        elif o.config.offload_gradients:
            o._handover.on_grad(hp, "accumulate", param.grad)

    return hook
