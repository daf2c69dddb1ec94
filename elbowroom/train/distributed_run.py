"""The trainer on several processes: what a step, a log line and a checkpoint do differently under data parallel.

``torchrun --nproc-per-node N -m elbowroom train --parallel.dp_replicate R --parallel.dp_shard S`` starts N
copies of the trainer; each builds a :class:`DistributedRun` and the loop calls it at the few places where
ranks differ or must agree. A single process gets one whose every method is the plain thing, so the loop
reads the same either way.

- **Set-up**: the launch (rank, world size) is checked against ``[parallel]`` and ``data.batch_size`` before
  anything starts; a bad set-up is a :class:`~elbowroom.config.ConfigError` (exit 2) that writes nothing.
  The process group is ``cuda:nccl,cpu:gloo`` on GPU, gloo on CPU; the mesh's dimensions are ``dp_replicate``
  and ``dp_shard``; each rank computes on ``cuda:LOCAL_RANK``.
- **Wrapping**: DDP wraps the model after the memory policies (recompute and offload wrap the blocks'
  forwards, which DDP calls through) and after the optimizer, so that a CPU-offloaded optimizer takes its
  gradients from DDP's comm hook once they are all-reduced; FSDP2 shards first and the optimizer steps the
  shards (``step()`` returns at once; each FSDP2 unit waits for its own shards' CPU steps ahead of its
  all-gather).
- **Planning** (``--budget``, ``--plan``): rank 0 profiles and plans, every rank applies the same plan. Under
  DDP the plan is one process's; under FSDP2/HSDP it is one rank's (its shards plus FSDP2's gathers, see
  :mod:`elbowroom.train.planning`), its policies installed before ``fully_shard`` and its optimizer built over
  the shards after.
- **A step**: ``data.batch_size`` is the global batch of one micro-step; each rank reads its part. The loss
  is normalised by the target tokens of the whole global step (padding excluded from the count, as in one
  process), times the data-parallel size since DDP and FSDP2 average gradients; gradient sync is off for
  every micro-batch but the last, from its forward through its backward.
- **Agreement**: the logged loss, validation loss and tokens/s are sums over ranks; a stop signal seen by
  any rank stops all of them at the same step; rank 0 alone writes logs, metrics and checkpoint metadata,
  while every rank writes its shards of a checkpoint (torch.distributed.checkpoint).
- **Tensor and pipeline parallel** (``--parallel.tp``, ``--parallel.pp``): the same calls, answered by
  :mod:`elbowroom.train.model_parallel_run` (the split, the loss context or the pipeline step, the norm over the
  whole model, validation through the schedule); ranks that share a data-parallel rank's batch count once.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn

from elbowroom.config import Config, ConfigError
from elbowroom.distributed.data_parallel import (
    Topology,
    apply_data_parallel,
    gradient_sync,
    init_distributed,
    loss_scale,
    shutdown,
)
from elbowroom.train.checkpoint import CheckpointError, CheckpointManager, Loaded

log = logging.getLogger("elbowroom.train")


@dataclass(frozen=True)
class Launch:
    """Where torchrun placed this process (its RANK, WORLD_SIZE and LOCAL_RANK)."""

    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    rendezvous: bool = False
    """The launcher gave a rendezvous (``MASTER_ADDR``): the process group starts from it (``env://``)."""
    local_world_size: int = 1
    """Processes on this host (torchrun's LOCAL_WORLD_SIZE): they share its cores for host optimizer steps."""


def resolve_launch(launch: Launch | None) -> Launch | None:
    """The launch to use: the one given, else an initialised process group's, else None (one process)."""
    if launch is not None:
        return launch
    if dist.is_available() and dist.is_initialized():
        gpus = max(torch.cuda.device_count(), 1)  # ranks of one host: one per GPU (one host on a CPU machine)
        world = dist.get_world_size()
        return Launch(dist.get_rank(), world, dist.get_rank() % gpus, rendezvous=True,
                      local_world_size=min(world, gpus) if torch.cuda.is_available() else world)
    return None


def check_setup(cfg: Config, launch: Launch | None) -> None:
    """Refuse a set-up that cannot work, before anything starts (ConfigError: exit 2, nothing written)."""
    p = cfg.parallel
    world = launch.world_size if launch is not None else 1
    mesh = (f"--parallel.dp_replicate {p.dp_replicate} x --parallel.dp_shard {p.dp_shard}"
            + "".join(f" x --parallel.{k} {v}" for k, v in (("tp", p.tp), ("pp", p.pp)) if v > 1)
            + f" = {p.world_size} processes")
    if launch is None and p.world_size > 1:
        raise ConfigError(
            f"{mesh}, but this process was not started by torchrun (no WORLD_SIZE); launch it with "
            f"`torchrun --nproc-per-node {p.world_size} -m elbowroom train ...` (from Python: initialise the process "
            "group first, or pass train(cfg, Launch(rank, world_size, local_rank))), or drop the --parallel flags"
        )
    if world != p.world_size:
        hint = (f"set --parallel.dp_replicate {world} (DDP) or --parallel.dp_shard {world} (FSDP2)"
                if p.world_size == 1 else f"launch with `torchrun --nproc-per-node {p.world_size}`")
        raise ConfigError(f"the mesh needs {mesh}, but the world size is {world}; {hint}")
    if cfg.data.batch_size % p.dp_size:
        raise ConfigError(
            f"data.batch_size {cfg.data.batch_size} is the global batch of one micro-step and must divide by the "
            f"data-parallel size {p.dp_size}; use a multiple of {p.dp_size}"
        )
    if p.tp > 1 or p.pp > 1:
        from elbowroom.train import model_parallel_run

        model_parallel_run.check_setup(cfg)
    mode = p.mode
    if mode == "single":
        return
    # the fused loss runs in the head's own forward (DDP's reducer takes the head's gradient as any other, FSDP2
    # gathers the head's weight for it); distillation reads the head weight outside it, where FSDP2 has freed the
    # unsharded weight
    if cfg.distill.teacher:
        raise ConfigError(
            f"--distill.teacher reads the output head outside the model's forward, which {mode.upper()} does not see "
            f"(no gradient sync); drop --distill.teacher under {mode.upper()}"
        )
    if mode == "ddp" and cfg.optimizer.offload_gradients:
        raise ConfigError(
            "optimizer.offload_gradients frees device gradients, but DDP keeps them in its own buckets; drop "
            "--optimizer.offload_gradients, or shard with --parallel.dp_shard"
        )
    if mode in ("fsdp", "hsdp"):
        if cfg.optimizer.offload_param_dtype != "float32":
            raise ConfigError(
                "--optimizer.offload_param_dtype bfloat16 swaps device copies in for fp32 weights, which FSDP2's "
                "shards do not allow; shard bf16 weights with fp32 masters instead (--optimizer.param_dtype "
                "bfloat16)"
            )
        if p.fsdp_cpu_offload and cfg.optimizer.offload_fraction > 0:
            raise ConfigError(
                "parallel.fsdp_cpu_offload and optimizer.offload_fraction both move the optimizer to the host; "
                "choose one (elbowroom's --optimizer.offload_fraction is the faster)"
            )
        if p.fsdp_cpu_offload and (cfg.budget is not None or cfg.plan is not None):
            raise ConfigError(
                f"{'--budget' if cfg.budget is not None else '--plan'} places the optimizer itself, and "
                "parallel.fsdp_cpu_offload would move every shard to the host behind the plan's back; drop "
                "--parallel.fsdp_cpu_offload"
            )


class _NoMetrics:
    """What ranks other than 0 log: nothing."""

    def write(self, row: dict[str, Any]) -> None:
        pass

    def close(self) -> None:
        pass


class DistributedRun:
    """The trainer's data-parallel side (see the module docstring); in one process every method is the plain
    thing. Build it with :func:`start_run`."""

    def __init__(self, cfg: Config, topo: Topology, device: torch.device | None, owns_group: bool) -> None:
        self.cfg = cfg
        self.topo = topo
        self.device = device
        """The rank's device under data parallel (``cuda:LOCAL_RANK`` or cpu); None in one process."""
        self.owns_group = owns_group
        self.comm: Any = None  # the DDP comm hook's state (bytes on the wire)
        self.mp: Any = None  # the ModelParallel under tensor or pipeline parallel
        self.model_ranks = topo.parallel.tp * topo.parallel.pp
        """Ranks that hold the same data-parallel rank's numbers (its loss, its tokens): sums over the world
        are divided by it."""
        self.pipeline_divisor = 1.0  # the pipeline loss's divisor for the current step (global tokens / scale)
        self._warned_fused = False
        self._steps = 0  # optimizer steps since the last log line (for comm bytes per step)

    # ---------------------------------------------------------------- who and where
    @property
    def enabled(self) -> bool:
        return self.topo.parallel.mode != "single" or self.topo.parallel.world_size > 1

    @property
    def is_main(self) -> bool:
        return self.topo.is_main

    @property
    def dp_size(self) -> int:
        return self.topo.dp_size if self.enabled else 1

    def place(self, device: torch.device) -> torch.device:
        """The device this rank computes on (``--train.device`` in one process)."""
        return self.device if self.device is not None else device

    def same_on_all(self, value: Any) -> Any:
        """Rank 0's ``value`` on every rank (the run directory's default name, a timestamp)."""
        if not self.enabled:
            return value
        box = [value]
        dist.broadcast_object_list(box, src=0)
        return box[0]

    def _sum(self, values: list[float]) -> list[float]:
        """Host numbers summed over ranks (over the gloo side of the group: no device sync)."""
        if not self.enabled:
            return values
        t = torch.tensor(values, dtype=torch.float64)
        dist.all_reduce(t)
        return t.tolist()

    def any_rank(self, flag: bool) -> bool:
        """True on every rank when it is True on any (a stop signal that reached some ranks stops all)."""
        return bool(self._sum([float(flag)])[0]) if self.enabled else flag

    # ---------------------------------------------------------------- data
    def data_slice(self) -> dict[str, int]:
        """This rank's part of every global batch (keywords of ``build_dataloader``)."""
        return {"dp_rank": self.topo.dp_rank, "dp_size": self.dp_size} if self.enabled else {}

    def eval_loader(self, dataset: Any, batch_size: int, num_batches: int, collate: Callable) -> Any:
        """The validation batches: in one process the first ``num_batches`` global batches; under data parallel
        each rank takes its consecutive share of the same samples (a multiple of the ranks, so that every rank
        runs as many forwards: FSDP2 all-gathers in each), in batches of ``batch_size / dp``."""
        from elbowroom.train import data as D

        if not self.enabled:
            return D.build_eval_loader(dataset, batch_size=batch_size, num_batches=num_batches, collate_fn=collate)
        from torch.utils.data import DataLoader

        n = min(len(dataset), batch_size * num_batches)
        n -= n % self.dp_size
        share = n // self.dp_size
        lo = self.topo.dp_rank * share
        return DataLoader(dataset, batch_size=batch_size // self.dp_size, sampler=range(lo, lo + share),
                          drop_last=False, collate_fn=collate, generator=torch.Generator().manual_seed(0))

    def reduce_eval(self, total: torch.Tensor, n: int) -> tuple[torch.Tensor, int]:
        """The validation loss sum and target tokens over all ranks."""
        if not self.enabled:
            return total, n
        s, count = self._sum([total.item(), float(n)])  # host-device sync: evaluation result
        return torch.tensor(s / self.model_ranks, dtype=torch.float64), round(count / self.model_ranks)

    # ---------------------------------------------------------------- model and optimizer
    def wrap(self, model: nn.Module, build_optimizer: Callable[..., Any] | None = None,
             optimizer: Any = None, plan: Any = None) -> tuple[nn.Module, Any]:
        """Wrap ``model`` for data parallel and build (or take) its optimizer.

        Args:
            model: the model, memory policies applied.
            build_optimizer: ``build_optimizer(model, overlap_forward)``; or pass ``optimizer`` already built
                (DDP only: FSDP2 must shard before the optimizer sees the parameters).
            plan: the plan the run follows: under FSDP2, where ``optimizer`` is None, its optimizer is built over
                the shards (``elbowroom.train.planning.plan_optimizer``).

        Returns:
            ``(model to call, optimizer)``; ``model`` itself stays the module whose state is saved.
        """
        mode = self.topo.parallel.mode
        if self.model_ranks > 1:
            from elbowroom.train import model_parallel_run

            self.mp, module, optimizer = model_parallel_run.wrap(self, model, build_optimizer)
            return module, optimizer
        if mode == "single":
            return model, optimizer if optimizer is not None else build_optimizer(model, True)
        if mode == "ddp":
            if optimizer is None:
                optimizer = build_optimizer(model, True)
            then = optimizer.after_reduction() if hasattr(optimizer, "after_reduction") else None
            wrapped, self.comm = apply_data_parallel(model, self.topo, seed=self.cfg.train.seed, after_reduction=then)
            return wrapped, optimizer
        assert optimizer is None, "FSDP2 shards the parameters before the optimizer is built"
        if build_optimizer is None:  # a planned run: the plan's optimizer, over the local shards
            from elbowroom.train.planning import plan_optimizer

            assert plan is not None, "a planned FSDP2 run passes its plan"

            def build_optimizer(m: nn.Module, overlap: bool) -> Any:
                return plan_optimizer(m, plan, self.cfg, overlap)
        from elbowroom.activations.recompute import find_blocks

        mp = _fsdp_param_dtype(self.cfg, self.place(torch.device("cpu")))
        blocks = find_blocks(model)
        apply_data_parallel(model, self.topo, blocks=blocks or None, param_dtype=mp)
        # step() returns at once; each FSDP2 unit waits for its own shards' CPU steps (and their copies) before
        # its pre-forward all-gather reads them
        return model, build_optimizer(model, True)

    def plan_once(self, plan_fn: Callable[..., Any], apply_fn: Callable[..., Any], model: nn.Module,
                  sample: dict[str, Any], cfg: Config, **kwargs: Any) -> tuple[nn.Module, Any, Any]:
        """``--budget`` on several ranks: rank 0 profiles and plans (``plan_fn``, the trainer's
        ``plan_for_budget``), every other rank applies the same plan (``apply_fn``), so that all ranks hold the
        same layout (measured timings differ from rank to rank; a plan of another precision would not reduce).
        Under DDP every rank holds the whole model, so one rank's plan is each rank's. Under FSDP2 rank 0 plans one
        rank's memory (the whole model profiled, its per-rank profile planned) and every rank installs the plan's
        policies before sharding; the optimizer is None here, built over the shards by :meth:`wrap`."""
        if not self.enabled:
            return plan_fn(model, sample, cfg, **kwargs)
        from elbowroom.plan import Plan

        made = error = None
        if self.is_main:
            try:
                model, optimizer, plan = plan_fn(model, sample, cfg, **kwargs)
                made = plan.to_dict()
            except ConfigError as e:
                error = str(e)
        made, error = self.same_on_all((made, error))
        if error is not None:
            raise ConfigError(error)
        if self.is_main:
            return model, optimizer, plan
        plan = Plan.from_dict(made)
        model, optimizer = apply_fn(model, plan, cfg)
        return model, optimizer, plan

    def accumulate(self, fn: Callable[..., torch.Tensor], model: nn.Module, micro: list[dict[str, Any]],
                   *args: Any, **kwargs: Any) -> torch.Tensor:
        """``fn(model, micro, ...)`` (the trainer's ``accumulate_gradients``) as one data-parallel step.

        ``fn`` divides each micro-batch's summed loss by the sum of the micro-batches' ``num_tokens``; here
        that sum is made the global step's target tokens over the data-parallel size (one tiny all-reduce of
        host counts), so the gradients DDP/FSDP2 average equal one process's over the global batch. Gradient
        sync is off from the forward of every micro-batch but the last through its backward.

        Returns:
            This rank's share of the step's loss (summed over ranks it is the step's loss: :meth:`global_loss`).
        """
        self._steps += 1
        if not self.enabled:
            return fn(model, micro, *args, **kwargs)
        local_tokens = sum(b["num_tokens"] for b in micro)
        (global_tokens,) = self._sum([float(local_tokens)])
        global_tokens /= self.model_ranks  # tensor- and pipeline-parallel ranks read the same batch
        if self.mp is not None and self.mp.pipeline is not None:
            from elbowroom.train.model_parallel_run import pipeline_accumulate

            return pipeline_accumulate(self, micro, args[0], global_tokens)  # args[0]: the autocast
        share = global_tokens / loss_scale(self.topo)
        micro = [{**b, "num_tokens": share if i == 0 else 0} for i, b in enumerate(micro)]
        if self.mp is None:
            with self._sync_on_last(model, len(micro)):
                return fn(model, micro, *args, **kwargs)
        if kwargs.get("fused_loss"):
            from elbowroom.distributed.tensor_parallel import fused_loss_applies

            if not self._warned_fused:  # the fallback is logged once
                fused_loss_applies(self.topo.parallel.tp, True)
                self._warned_fused = True
            kwargs["fused_loss"] = False
        with self._sync_on_last(model, len(micro)), self.mp.loss_context():
            loss = fn(model, micro, *args, **kwargs)
        return loss.full_tensor() if hasattr(loss, "full_tensor") else loss

    @contextlib.contextmanager
    def _sync_on_last(self, model: nn.Module, n: int) -> Iterator[None]:
        """Gradient sync only for the ``n``-th forward's micro-batch: each forward sets the flag its backward
        reads (DDP decides in forward, FSDP2 in backward, so the flag holds from one forward to the next)."""
        calls = [0]
        state: dict[str, Any] = {}
        wrapper = getattr(model, "_orig_mod", model)  # under torch.compile: the DDP / FSDP2 module it compiled

        def before_forward(module: nn.Module, args: Any) -> None:
            calls[0] += 1
            if "ctx" in state:
                state.pop("ctx").__exit__(None, None, None)
            if calls[0] < n:
                ctx = gradient_sync(wrapper, False)
                ctx.__enter__()
                state["ctx"] = ctx

        handle = model.register_forward_pre_hook(before_forward)
        try:
            yield
        finally:
            handle.remove()
            if "ctx" in state:
                state.pop("ctx").__exit__(None, None, None)

    def global_loss(self, loss: torch.Tensor) -> float:
        """The step's loss from each rank's share (a host-device sync: logging asks for it)."""
        value = loss.item()
        return self._sum([value])[0] / loss_scale(self.topo) / self.model_ranks if self.enabled else value

    def gradient_norm(self, fn: Callable[..., Any], params: list[torch.Tensor], optimizer: Any,
                      max_norm: float | None) -> Any:
        """``fn(params, optimizer[, max_norm])`` (the trainer's ``clip_gradients`` or ``gradient_norm``); under
        tensor or pipeline parallel the norm over the whole model (clipped to ``max_norm`` unless None)."""
        if self.mp is not None:
            return self.mp.clip_grad_norm_(max_norm if max_norm is not None else float("inf"))
        return fn(params, optimizer) if max_norm is None else fn(params, optimizer, max_norm)

    def evaluate(self, fn: Callable[..., float | None], model: nn.Module, loader: Any, device: torch.device,
                 autocast: Any) -> float | None:
        """The validation loss: ``fn`` (the trainer's ``evaluate``), summed over ranks; under tensor parallel on
        whole logits, under pipeline parallel through the schedule."""
        from elbowroom.train import model_parallel_run as M

        if self.mp is not None and self.mp.pipeline is not None:
            return M.pipeline_evaluate(self, loader, device, autocast)
        if self.mp is not None and self.mp.loss_parallel:
            model = M.FullLogits(model)
        return fn(model, loader, device, autocast, self.reduce_eval)

    def norm_value(self, norm: torch.Tensor | None) -> float | None:
        """A logged gradient norm as a number (FSDP2's is a DTensor: its global value)."""
        if norm is None:
            return None
        if hasattr(norm, "full_tensor"):
            norm = norm.full_tensor()
        return norm.item()

    def log_numbers(self, tokens: int) -> dict[str, Any]:
        """At a log line: the tokens of every rank since the last one, and the comm hook's bytes per step."""
        (total,) = self._sum([float(tokens)])
        steps, self._steps = max(self._steps, 1), 0
        out: dict[str, Any] = {"tokens_all_ranks": round(total / self.model_ranks)}
        if self.comm is not None:
            out["comm_bytes_per_step"] = self.comm.take_bytes() / steps
        return out

    # ---------------------------------------------------------------- checkpoints
    def check_resume(self, loaded: Loaded | None, global_batch: int) -> None:
        """Refuse a data position that cannot be carried over: another data-parallel size with another
        global batch."""
        if loaded is None:
            return
        if self.topo.parallel.pp > 1 and not loaded.state.get("sharded"):
            raise CheckpointError(
                f"checkpoint {loaded.path} was written by one process (optimizer state by parameter index, for the "
                "whole model), which a pipeline stage cannot pick its part of; resume it with --parallel.pp 1 (under "
                "torchrun: its sharded checkpoints then load at any pp)"
            )
        saved_dp = loaded.state.get("dp_size", 1)
        saved_batch = loaded.state.get("global_batch", ((loaded.meta.get("config") or {}).get("data") or {})
                                       .get("batch_size", global_batch))
        if saved_dp != self.dp_size and saved_batch != global_batch:
            raise CheckpointError(
                f"checkpoint {loaded.path} was written by {saved_dp} data-parallel rank(s) at a global batch of "
                f"{saved_batch}; at {self.dp_size} rank(s) its data position carries over only with the same global "
                f"batch: resume with --data.batch_size {saved_batch}"
            )

    def restore(self, loaded: Loaded, model: nn.Module, optimizer: Any) -> None:
        """Load a checkpoint's model and optimizer state, whichever world wrote it."""
        from elbowroom.train import sharded_checkpoint as S

        if loaded.state.get("sharded"):
            S.load_sharded(loaded.path, model, optimizer)
        elif self.enabled:
            S.load_full(loaded.state, model, optimizer)
        else:
            model.load_state_dict(loaded.state["model"])
            optimizer.load_state_dict(loaded.state["optimizer"])
        self._restore_comm(loaded)

    def _restore_comm(self, loaded: Loaded) -> None:
        """The compression hook's state of this rank (its error-feedback residuals), from a checkpoint the same
        world wrote: each rank's residuals are its own, so at another world size they start from zero."""
        if not hasattr(self.comm, "load_state_dict"):
            return
        from elbowroom.train import sharded_checkpoint as S

        path = S.rank_state_file(loaded.path, self.topo.rank)
        if loaded.state.get("world_size") != self.topo.world_size or not path.is_file():
            log.warning("%s holds no compression state of this rank at world size %d: the error feedback of "
                        "--parallel.comm_hook %s starts from zero", loaded.path, self.topo.world_size,
                        self.cfg.parallel.comm_hook)
            return
        # on the host: the residuals move to the device with their first bucket
        self.comm.load_state_dict(torch.load(path, map_location="cpu", weights_only=True)["comm"])

    def save(self, ckpts: CheckpointManager, step: int, model: nn.Module, optimizer: Any,
             extra: dict[str, Any], meta: dict[str, Any]) -> Path | None:
        """Save a checkpoint (every rank calls this); returns its path on rank 0 (None elsewhere).

        Args:
            extra: the state besides the model and optimizer (schedule, scaler, RNG, data position).
        """
        if not self.enabled:
            return ckpts.save(step, {"model": model.state_dict(), "optimizer": optimizer.state_dict(), **extra}, meta)
        from elbowroom.train import sharded_checkpoint as S

        extra = {**extra, "dp_size": self.dp_size, "global_batch": self.cfg.data.batch_size,
                 "world_size": self.topo.world_size}
        rank_state = {"comm": self.comm.state_dict()} if hasattr(self.comm, "state_dict") else None
        return S.save_sharded(ckpts, step, model, optimizer, extra, meta, is_main=self.is_main, rank=self.topo.rank,
                              rank_state=rank_state)

    def metrics(self, out: Path, **kwargs: Any) -> Any:
        """The metrics logger: rank 0's, nothing elsewhere."""
        from elbowroom.train.metrics import MetricsLogger

        return MetricsLogger(out, **kwargs) if self.is_main else _NoMetrics()


def _fsdp_param_dtype(cfg: Config, device: torch.device) -> torch.dtype | None:
    """FSDP2's compute dtype: the run's autocast dtype (bf16 on CUDA by default), fp32 stays fp32."""
    from elbowroom.train.trainer import resolve_dtype

    dtype = resolve_dtype(cfg.train.dtype, device)
    return None if dtype == torch.float32 else dtype


@contextlib.contextmanager
def start_run(cfg: Config, launch: Launch | None) -> Iterator[DistributedRun]:
    """Check the set-up, start the process group if this run needs one, and give it back when the run ends.

    Args:
        cfg: the run's config (``[parallel]``, ``data.batch_size``).
        launch: where this process sits, or None (see :func:`resolve_launch`).

    Raises:
        ConfigError: a bad set-up (the message says which flag to change), before anything starts.
    """
    launch = resolve_launch(launch)
    check_setup(cfg, launch)
    p = cfg.parallel
    if p.mode == "single" and p.world_size == 1:
        yield DistributedRun(cfg, Topology(parallel=p), None, False)
        return
    assert launch is not None or p.world_size == 1
    launch = launch or Launch()
    want = cfg.train.device
    cuda = want.startswith("cuda") or (want == "auto" and torch.cuda.is_available())
    device = torch.device("cuda", launch.local_rank) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    owns = not dist.is_initialized()
    if owns and launch.world_size == 1 and not launch.rendezvous:
        # FSDP2 at world size 1 (e.g. its CPUOffloadPolicy, for comparison) needs a group of one: no rendezvous
        dist.init_process_group("cuda:nccl,cpu:gloo" if cuda else "gloo", store=dist.HashStore(), rank=0,
                                world_size=1)
    try:
        topo = init_distributed(p, rank=launch.rank, world_size=launch.world_size, local_rank=launch.local_rank,
                                device=device)
    except ValueError as e:
        if owns:
            shutdown()
        raise ConfigError(str(e)) from None
    run = DistributedRun(cfg, topo, device, owns)
    if run.is_main:
        log.info("data parallel: %s over %d processes (mesh pp %d x dp_replicate %d x dp_shard %d x tp %d), %s",
                 p.mode.upper() if p.mode != "single" else "none", launch.world_size, p.pp, p.dp_replicate,
                 p.dp_shard, p.tp, device)
    t0 = time.perf_counter()
    try:
        yield run
    finally:
        if owns:
            shutdown()
        log.debug("distributed run ended after %.1f s", time.perf_counter() - t0)
