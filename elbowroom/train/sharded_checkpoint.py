"""A run's checkpoints on several processes: torch.distributed.checkpoint under the manager's rules.

Every rank writes its shards of the model and of the optimizer state (``get_state_dict`` names them by
parameter, whatever the wrapper: DDP, FSDP2, a CPU-offloaded optimizer's host state included) into one hidden
directory; rank 0 then adds ``extra.pt`` (schedule, scaler, RNG, data position with the data-parallel size),
hashes every file into ``meta.json`` and renames the directory into place (:meth:`CheckpointManager.publish`):
a crash mid-save leaves no checkpoint under a real name, and rotation and verification work as for one file.

A sharded checkpoint loads at any world size, one process included (DCP reshards on load); a single-process
checkpoint (``state.pt``) loads into a run on several processes, each rank taking its shards of it.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn as nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, set_state_dict

from elbowroom.distributed.checkpoint import load_state, state_for_save
from elbowroom.distributed.data_parallel import state_owner
from elbowroom.distributed.tensor_parallel import checkpoint_view
from elbowroom.train.checkpoint import CheckpointManager


def _distributed() -> bool:
    return dist.is_available() and dist.is_initialized()


def _barrier() -> None:
    if _distributed():
        dist.barrier()


def save_sharded(ckpts: CheckpointManager, step: int, model: nn.Module, optimizer: Any, extra: dict[str, Any],
                 meta: dict[str, Any], *, is_main: bool, rank: int = 0,
                 rank_state: dict[str, Any] | None = None) -> Path | None:
    """Write and publish a sharded checkpoint for ``step`` (a collective: every rank calls it).

    Args:
        rank_state: what this rank alone holds (a compression hook's residuals): written by each rank as
            ``rank-NNNNN.pt`` (:func:`rank_state_file`) beside the shards, hashed and published with them.

    Returns:
        Its path on rank 0, None on the others.
    """
    tmp = ckpts.directory / f".tmp-step_{step:08d}"
    if hasattr(optimizer, "wait_for_weights"):
        optimizer.wait_for_weights()  # host wait: the CPU step of the offloaded weights must have landed
    if is_main:
        ckpts.directory.mkdir(parents=True, exist_ok=True)
        if tmp.exists():
            shutil.rmtree(tmp)
    _barrier()
    # tensor-parallel weights split in strides are written as contiguous chunks: they load at another tp
    dcp.save(checkpoint_view(state_for_save(model, optimizer)), checkpoint_id=str(tmp), no_dist=not _distributed())
    if rank_state is not None:
        torch.save(rank_state, rank_state_file(tmp, rank))
    _barrier()  # every rank's shards are on disk before rank 0 hashes and publishes them
    path = None
    if is_main:
        torch.save(extra, tmp / "extra.pt")
        path = ckpts.publish(step, tmp, meta)
    _barrier()  # no rank goes on (or saves again) before the checkpoint is in place
    return path


def rank_state_file(directory: Path, rank: int) -> Path:
    """The file of one rank's own state in a sharded checkpoint."""
    return Path(directory) / f"rank-{rank:05d}.pt"


def load_sharded(directory: Path, model: nn.Module, optimizer: Any) -> None:
    """Load a sharded checkpoint's model and optimizer state into this world (resharding as needed)."""
    with _learning_kept(optimizer):
        state = state_for_save(model, optimizer)
        load_state(state, directory)  # tensors in place (tensor-parallel strides too), the learning rates
        set_state_dict(state_owner(model), optimizer, model_state_dict=state["model"],
                       optim_state_dict=state["optimizer"], options=StateDictOptions(strict=True))


def load_full(state: dict[str, Any], model: nn.Module, optimizer: Any) -> None:
    """Load a single-process checkpoint (full tensors, optimizer state keyed by parameter index) into a model
    wrapped for data parallel: each rank keeps its shards."""
    inner = state_owner(model)
    names = {id(p): n for n, p in inner.named_parameters()}
    flat = [p for g in optimizer.param_groups for p in g["params"]]
    osd = state["optimizer"]

    def fqn(k: int) -> str:
        return names[id(flat[k])]

    by_name = {
        "state": {fqn(k): v for k, v in osd["state"].items()},
        "param_groups": [{**g, "params": [fqn(k) for k in g["params"]]} for g in osd["param_groups"]],
    }
    with _learning_kept(optimizer):
        set_state_dict(inner, optimizer, model_state_dict=state["model"], optim_state_dict=by_name,
                       options=StateDictOptions(full_state_dict=True, strict=True))


class _learning_kept:
    """Keep a CPU-offloaded optimizer's ``step_in_backward`` across a load: ``get_state_dict`` initialises an
    empty optimizer's state with a zero step, from which the optimizer would learn the wrong lesson (that no
    step clips)."""

    def __init__(self, optimizer: Any) -> None:
        self.optimizer = optimizer

    def __enter__(self) -> None:
        self.before = getattr(self.optimizer, "step_in_backward", None)

    def __exit__(self, *exc: Any) -> None:
        if hasattr(self.optimizer, "step_in_backward"):
            self.optimizer.step_in_backward = self.before
