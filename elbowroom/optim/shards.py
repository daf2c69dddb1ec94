"""FSDP2 parameters: the optimizer steps each rank's local shard, and clips by the norm over all shards.

Under FSDP2 (``fully_shard``) every parameter is a ``DTensor`` whose rank-local part is a plain tensor. The
host side of ``CPUOffloadOptimizer`` works on plain tensors (staging slots, pinned masters, copies), so an
offloaded parameter keeps its ``DTensor`` for what identifies it (its hooks, its place in ``state_dict``) and
steps its local shard: masters, host state and gradient copies have the shard's shape. Under no-grad,
``to_local()`` returns the very tensor the ``DTensor`` wraps, so in-place updates of it update the parameter.

The global gradient norm is the p-norm over every rank's shards: each rank's sum of ``|g|^p`` over its local
gradients (device and host-resident alike) is summed over the ranks that hold different shards (the mesh
dimensions the parameters are sharded on; replicated dimensions hold the same numbers and are left out).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist


def is_sharded(t: torch.Tensor | None) -> bool:
    """Whether ``t`` is a ``DTensor`` (a parameter or gradient under FSDP2)."""
    if t is None or not dist.is_available():
        return False
    from torch.distributed.tensor import DTensor

    return isinstance(t, DTensor)


@torch.no_grad()
def local(t: torch.Tensor) -> torch.Tensor:
    """This rank's part of ``t`` (the tensor a ``DTensor`` wraps, not a copy); other tensors as they are."""
    return t.to_local() if is_sharded(t) else t


def _mesh_key(mesh: Any) -> tuple:
    return mesh.device_type, tuple(mesh.mesh.flatten().tolist()), tuple(mesh.mesh.shape), mesh.mesh_dim_names


def norm_group(params: list[torch.Tensor]) -> Any:
    """The process group over which sharded ``params`` hold different elements, or None (no ``DTensor``).

    Raises:
        ValueError: the parameters are sharded over different meshes or mesh dimensions (one optimizer, one
            FSDP2 layout).
    """
    # meshes compared by what they are (device type, ranks, names), not by object: fully_shard without a mesh
    # makes a new default mesh for each call
    layouts = {(_mesh_key(p.device_mesh), tuple(i for i, pl in enumerate(p.placements) if pl.is_shard()))
               for p in params if is_sharded(p)}
    if not layouts:
        return None
    if len(layouts) != 1:
        raise ValueError("CPUOffloadOptimizer needs all its sharded parameters on one mesh with one placement")
    p = next(p for p in params if is_sharded(p))
    dims = [i for i, pl in enumerate(p.placements) if pl.is_shard()]
    if not dims:
        return None  # replicated on every dimension: the local norm is already the global one
    if len(dims) != 1:
        raise ValueError("CPUOffloadOptimizer supports parameters sharded over one mesh dimension (FSDP2, HSDP)")
    return p.device_mesh.get_group(dims[0])


def reduce_norm(total: torch.Tensor, norm_type: float, group: Any) -> torch.Tensor:
    """The global norm from this rank's norm ``total`` of its shards (a collective; a host-device sync where
    the group runs over the host)."""
    if group is None:
        return total
    if norm_type == float("inf"):
        dist.all_reduce(total, op=dist.ReduceOp.MAX, group=group)
        return total
    powered = total.double() ** norm_type
    dist.all_reduce(powered, group=group)
    return (powered ** (1.0 / norm_type)).to(total.dtype)


def as_sharded_like(value: Any, owner: torch.Tensor, local_shape: torch.Size) -> Any:
    """A state tensor of a sharded parameter's local shard as a ``DTensor`` laid out like ``owner`` (so that a
    distributed checkpoint reshards it); scalars and other values as they are."""
    if not is_sharded(owner) or not isinstance(value, torch.Tensor) or value.shape != local_shape:
        return value
    from torch.distributed.tensor import DTensor

    return DTensor.from_local(value, owner.device_mesh, owner.placements, run_check=False,
                              shape=owner.shape, stride=owner.stride())
