"""Data parallel on torch's own engines: process groups, the device mesh, DDP, FSDP2 and HSDP.

- ``dp_shard 1``: DDP (gradient buckets all-reduced while backward runs, optional compression hooks);
- ``dp_replicate 1``: FSDP2 (``fully_shard`` per block and at the root: ZeRO-3);
- both above 1: HSDP (``fully_shard`` on the 2-D mesh: sharded within a replica group, all-reduced across).

Accumulation turns gradient synchronisation off for every micro-batch but the last, around forward *and*
backward (:func:`gradient_sync`). The loss of each rank is normalised by the tokens of the *global* step, and
since both engines average gradients over the data-parallel ranks it is multiplied by their number
(:func:`loss_scale`): the gradients then equal one process's over the whole global batch.

Set-up takes the rank and world size as arguments: the CLI reads torchrun's environment, the library never does.
"""

from __future__ import annotations

import collections
import contextlib
import datetime
import logging
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn

from elbowroom.distributed.config import ParallelConfig

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Topology:
    """Where this process sits: its rank, the world, and the mesh (None in a single process)."""

    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    mesh: Any = None
    """A ``DeviceMesh`` with dimensions ``pp``, ``dp_replicate``, ``dp_shard`` and ``tp`` (outer to inner)."""
    parallel: ParallelConfig = ParallelConfig()

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def dp_rank(self) -> int:
        """This rank's index among the data-parallel ranks (its slice of each global batch)."""
        if self.mesh is None:
            return self.rank
        return self.mesh.get_local_rank("dp_replicate") * self.parallel.dp_shard + self.mesh.get_local_rank("dp_shard")

    @property
    def dp_size(self) -> int:
        return self.parallel.dp_size


def init_distributed(
    parallel: ParallelConfig, *, rank: int, world_size: int, local_rank: int, device: torch.device,
    timeout_s: float = 600.0,
) -> Topology:
    """Start the process group and build the mesh ``parallel`` asks for.

    Args:
        parallel: the mesh sizes; their product must equal ``world_size``.
        rank, world_size, local_rank: this process's place (torchrun's RANK, WORLD_SIZE, LOCAL_RANK).
        device: the device this rank computes on (``cuda:LOCAL_RANK`` or ``cpu``).
        timeout_s: collective timeout.

    Returns:
        The :class:`Topology`; a single process without FSDP gets one with no mesh and no process group.

    Raises:
        ValueError: the mesh does not match the world size.
    """
    if parallel.world_size != world_size:
        raise ValueError(
            f"the mesh needs dp_replicate x dp_shard x tp x pp = {parallel.dp_replicate} x {parallel.dp_shard} x "
            f"{parallel.tp} x {parallel.pp} = {parallel.world_size} processes, but the world size is {world_size}; "
            f"launch with `torchrun --nproc-per-node {parallel.world_size}` or change --parallel.*"
        )
    if world_size == 1 and parallel.mode == "single":
        return Topology(parallel=parallel)
    if not dist.is_initialized():
        # CUDA tensors over NCCL, host tensors (the CPU-offloaded optimizer's norms, metrics) over gloo
        backend = "cuda:nccl,cpu:gloo" if device.type == "cuda" else "gloo"
        dist.init_process_group(
            backend, rank=rank, world_size=world_size, timeout=datetime.timedelta(seconds=timeout_s),
            device_id=device if device.type == "cuda" else None,
        )
    from torch.distributed.device_mesh import init_device_mesh

    # torchtitan's order: tensor parallel innermost (the most traffic, on the fastest links), pipeline outermost
    mesh = init_device_mesh(
        device.type, (parallel.pp, parallel.dp_replicate, parallel.dp_shard, parallel.tp),
        mesh_dim_names=("pp", "dp_replicate", "dp_shard", "tp"),
    )
    return Topology(rank=rank, world_size=world_size, local_rank=local_rank, mesh=mesh, parallel=parallel)


def shutdown() -> None:
    """Destroy the process group if this process made one (idempotent)."""
    if dist.is_initialized():
        dist.destroy_process_group()


def apply_data_parallel(
    model: nn.Module,
    topo: Topology,
    *,
    blocks: list[nn.Module] | None = None,
    param_dtype: torch.dtype | None = None,
    reduce_dtype: torch.dtype | None = torch.float32,
    bucket_cap_mb: float | None = None,
    seed: int = 0,
    after_reduction: Any = None,
    shard_placement_fn: Any = None,
) -> tuple[nn.Module, Any]:
    """Wrap ``model`` for the topology's data-parallel mode.

    Args:
        model: the model, already on its device, memory policies applied (recompute and offload wrap the
            blocks' forwards, which DDP and FSDP2 call through).
        topo: from :func:`init_distributed`.
        blocks: FSDP2's units (default: ``find_blocks(model)``).
        param_dtype: FSDP2's compute dtype for parameters (None: as stored).
        reduce_dtype: FSDP2's gradient reduction dtype.
        bucket_cap_mb: DDP's bucket size in MiB (None: the topology's ``parallel.ddp_bucket_mb``).
        seed: seeds the compression hooks' randomness.
        after_reduction: DDP: called with each bucket's parameters once their gradients are all-reduced (the
            CPU-offloaded optimizer's :meth:`~elbowroom.optim.CPUOffloadOptimizer.after_reduction`).
        shard_placement_fn: FSDP2's per-parameter choice of sharded dimension (None: dimension 0), for
            tensor-parallel parameters split in strides (:func:`elbowroom.distributed.tensor_parallel.fsdp_placement`).

    Returns:
        ``(model, comm_state)``: the model to call (a ``DistributedDataParallel`` under DDP, the same module
        under FSDP2, whose class gains FSDP2's methods) and the comm hook's state (``take_bytes()``; None
        under FSDP2 and in a single process).
    """
    mode = topo.parallel.mode
    if mode == "single":
        return model, None
    if mode == "ddp":
        from torch.nn.parallel import DistributedDataParallel as DDP

        from elbowroom.distributed.comm_hooks import register_comm_hook

        device = next(model.parameters()).device
        group = topo.mesh["dp_replicate"].get_group()
        ddp = DDP(
            model, process_group=group, device_ids=[device] if device.type == "cuda" else None,
            bucket_cap_mb=topo.parallel.ddp_bucket_mb if bucket_cap_mb is None else bucket_cap_mb,
            gradient_as_bucket_view=True, broadcast_buffers=topo.parallel.ddp_broadcast_buffers,
        )
        p = topo.parallel
        state = register_comm_hook(ddp, p.comm_hook, process_group=group, powersgd_rank=p.powersgd_rank,
                                   topk_ratio=p.topk_ratio, seed=seed, then=after_reduction)
        return ddp, state
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy, fully_shard

    from elbowroom.activations.recompute import find_blocks

    mesh = topo.mesh["dp_shard"] if mode == "fsdp" else topo.mesh["dp_replicate", "dp_shard"]
    kw: dict[str, Any] = {
        "mesh": mesh,
        "mp_policy": MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=reduce_dtype),
        # pinned host copies only where there is a device to copy to (pinning needs CUDA)
        "offload_policy": (CPUOffloadPolicy(pin_memory=next(model.parameters()).device.type == "cuda")
                           if topo.parallel.fsdp_cpu_offload else OffloadPolicy()),
        "shard_placement_fn": shard_placement_fn,
    }
    units = list(blocks if blocks is not None else find_blocks(model))
    for blk in units:
        fully_shard(blk, **kw)
    for part in _outer_units(model, units):
        fully_shard(part, **kw)
    fully_shard(model, **kw)
    set_prefetch(units, topo.parallel.fsdp_prefetch)
    return model, None


PREFETCHED = "_elbowroom_forward_prefetch"
"""The attribute of an FSDP2 unit that lists the units it all-gathers ahead in forward (:func:`set_prefetch`):
an offloading optimizer's wait on that unit waits for their updated shards too."""


def set_prefetch(units: list[nn.Module], ahead: int) -> None:
    """Each of the FSDP2 block ``units`` all-gathers the next ``ahead`` units in its forward and the ``ahead`` before
    it in backward (0: FSDP2's default, nothing set). The forward's all-gathers then leave when the unit before
    starts, not when the host reaches each unit: a host-bound step (per-block hooks, recompute) stops holding them
    back, at ``ahead`` more units' gathered parameters in memory."""
    if ahead <= 0:
        return
    for i, unit in enumerate(units):
        later = units[i + 1:i + 1 + ahead]
        unit.set_modules_to_forward_prefetch(later)
        unit.set_modules_to_backward_prefetch(units[max(0, i - ahead):i][::-1])
        setattr(unit, PREFETCHED, later)


def _outer_units(model: nn.Module, blocks: list[nn.Module]) -> list[nn.Module]:
    """The modules outside the blocks that hold parameters (embedding, final norm, head), each to be its own FSDP2
    unit: the root's children, and inside a child that holds blocks too (a Hugging Face model's inner ``model``) its
    own such children. Each is all-gathered when its own forward starts and freed after it, not held all step by the
    root or by a unit around the blocks, and the CPU-offloaded optimizer's step of the head may still run while the
    blocks compute (the root would wait for every weight it holds before its first block). A module sharing a
    parameter with another (tied embeddings) stays with the root."""
    in_blocks = {id(p) for b in blocks for p in b.parameters()}
    block_ids = {id(b) for b in blocks}

    def holders(mod: nn.Module) -> list[nn.Module]:
        out: list[nn.Module] = []
        for c in mod.children():
            if id(c) in block_ids or all(id(p) in in_blocks for p in c.parameters()):
                continue
            if any(id(m) in block_ids for m in c.modules()):
                out.extend(holders(c))  # a container of blocks: the parts beside them
            else:
                out.append(c)
        return out

    children = holders(model)
    owners = collections.Counter(id(p) for c in children for p in c.parameters())
    return [c for c in children if all(owners[id(p)] == 1 for p in c.parameters())]


def root_apart_share(model: nn.Module, blocks: list[nn.Module] | None = None) -> float:
    """The share of the parameters outside the blocks (by count) that :func:`apply_data_parallel` puts in FSDP2 units
    of their own holding no block: each is gathered at its own forward and freed after its own backward, not while
    the blocks run (``elbowroom.plan.ranks.per_rank_profile(root_apart=...)``). Untied (our decoder, a Hugging Face
    causal LM): 1.0 (embedding, final norm, head); a weight tied across two of them is left out (it stays with the
    root, gathered all step)."""
    from elbowroom.activations.recompute import find_blocks

    units = list(blocks if blocks is not None else find_blocks(model))
    in_blocks = {id(p) for b in units for p in b.parameters()}
    outside = {id(p): p.numel() for p in model.parameters() if id(p) not in in_blocks}
    if not outside:
        return 0.0
    # (an outer unit never holds a block: _outer_units looks inside a container of blocks for the parts beside them)
    apart = {id(p) for part in _outer_units(model, units) for p in part.parameters()}
    return sum(n for i, n in outside.items() if i in apart) / sum(outside.values())


def unwrap(model: nn.Module) -> nn.Module:
    """The user's module inside a DDP wrapper (FSDP2 keeps the module itself)."""
    return model.module if isinstance(model, torch.nn.parallel.DistributedDataParallel) else model


def state_owner(model: nn.Module) -> nn.Module:
    """The module whose ``state_dict`` keys are its own attribute paths, which torch.distributed.checkpoint walks:
    the user's module inside DDP, and inside that a wrapper's ``state_dict_owner`` where it has one (the trainer's
    Hugging Face wrapper writes the Hugging Face model's own keys, without its ``model.`` prefix)."""
    inner = unwrap(model)
    return getattr(inner, "state_dict_owner", inner)


@contextlib.contextmanager
def gradient_sync(model: nn.Module, enabled: bool) -> Iterator[None]:
    """Turn gradient synchronisation off (``enabled=False``) for a micro-batch's forward *and* backward.

    DDP decides in forward whether the coming backward reduces, so the context must hold both; FSDP2 reads
    its flag in backward. Outside any data-parallel wrapper this does nothing.
    """
    if enabled:
        yield
        return
    if isinstance(model, torch.nn.parallel.DistributedDataParallel):
        with model.no_sync():
            yield
        return
    if hasattr(model, "set_requires_gradient_sync"):  # an FSDP2 module
        model.set_requires_gradient_sync(False)
        try:
            yield
        finally:
            model.set_requires_gradient_sync(True)
        return
    yield


def loss_scale(topo: Topology) -> float:
    """Factor on each rank's loss (already divided by the global step's tokens) so that the averaged
    gradients equal a single process's over the global batch: the data-parallel size."""
    return float(topo.dp_size) if topo.parallel.mode != "single" else 1.0


def all_reduce_sum(value: float | int, topo: Topology, device: torch.device) -> float:
    """Sum a host number over the data-parallel ranks (a host-device sync where the group is NCCL).

    Every tensor-parallel rank holds its group's number, and so does every pipeline rank once the last
    stage has shared its loss, so the sum over the world is divided by their count."""
    if topo.parallel.mode == "single" or not dist.is_initialized():
        return value
    t = torch.tensor(float(value), dtype=torch.float64, device=device)
    dist.all_reduce(t)
    return t.item() / (topo.parallel.tp * topo.parallel.pp)


def global_grad_norm(model: nn.Module, topo: Topology) -> torch.Tensor:
    """The L2 norm of all gradients across ranks (FSDP2's sharded gradients are DTensors: their
    ``full_tensor`` norm; DDP's are replicated, so the local norm is already global)."""
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    return torch.nn.utils.get_total_norm(grads)
