"""Sharded checkpoints through torch.distributed.checkpoint (DCP), loadable at another world size.

Each rank writes its own shards of the model and optimizer state (``get_state_dict`` gives fully qualified
names whatever the wrapper: DDP, FSDP2 or none), so a checkpoint written by 2 ranks loads in 1 process and
the reverse: DCP reshards on load. The files go into a temporary directory that rank 0 renames into place
after every rank has written (a barrier), so a crash mid-save never leaves a half checkpoint under a real
name. Non-tensor state (schedule, RNG, data position) is small and written once, by rank 0, beside the shards.

The optimizer state is flattened to one entry per parameter name (``state.blocks.3.w2.weight.exp_avg``), so a
rank that holds some pipeline stages saves and loads exactly their entries: checkpoints load across pipeline
degrees. Tensor-parallel weights split in strides (fused q|k|v, gate|up) are written as contiguous chunks
(:func:`elbowroom.distributed.tensor_parallel.checkpoint_view`): checkpoints load across tensor-parallel degrees.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn as nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_state_dict,
    set_state_dict,
)

from elbowroom.distributed.data_parallel import state_owner
from elbowroom.distributed.tensor_parallel import checkpoint_view

_OPTIONS = StateDictOptions(flatten_optimizer_state_dict=True)


def _distributed() -> bool:
    return dist.is_available() and dist.is_initialized()


def state_for_save(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """Model and optimizer state keyed by parameter names (sharded tensors stay sharded)."""
    model_sd, optim_sd = get_state_dict(state_owner(model), optimizer, options=_OPTIONS)
    return {"model": model_sd, "optimizer": optim_sd}


def save(directory: str | os.PathLike, model: nn.Module, optimizer: torch.optim.Optimizer,
         extra: dict[str, Any] | None = None) -> Path:
    """Write a DCP checkpoint to ``directory`` atomically (all ranks call this).

    Args:
        directory: the final checkpoint directory; it must not exist yet.
        model: the (possibly wrapped) model.
        optimizer: its optimizer.
        extra: picklable non-tensor state (schedule, RNG, data position), saved once.

    Returns:
        The directory.
    """
    final = Path(directory)
    tmp = final.with_name(f".tmp-{final.name}")
    state = state_for_save(model, optimizer)
    rank0 = not _distributed() or dist.get_rank() == 0
    if rank0 and tmp.exists():
        import shutil

        shutil.rmtree(tmp)
    if _distributed():
        dist.barrier()
    dcp.save(checkpoint_view(state), checkpoint_id=str(tmp), no_dist=not _distributed())
    if _distributed():
        dist.barrier()  # every rank's shards are on disk before the rename publishes them
    if rank0:
        torch.save(extra or {}, tmp / "extra.pt")  # schedule, RNG, data position: small, written once
        os.replace(tmp, final)
    if _distributed():
        dist.barrier()
    return final


def load_state(state: dict[str, Any], directory: str | os.PathLike) -> None:
    """DCP-load ``directory`` into ``state`` (from :func:`state_for_save`), in place: tensors through
    :func:`~elbowroom.distributed.tensor_parallel.checkpoint_view` (a new dict over the same memory), then the
    values DCP puts in the dict itself (learning rates, betas) copied back from it."""
    view = checkpoint_view(state)
    dcp.load(view, checkpoint_id=str(directory), no_dist=not _distributed())
    _values_back(state, view)


def _values_back(state: Any, view: Any) -> None:
    items = state.items() if isinstance(state, dict) else enumerate(state)
    for k, v in list(items):
        if isinstance(v, (dict, list)):
            _values_back(v, view[k])
        elif not isinstance(v, torch.Tensor):
            state[k] = view[k]


def load(directory: str | os.PathLike, model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """Load a DCP checkpoint into ``model`` and ``optimizer`` (resharding to this world); returns ``extra``."""
    state = state_for_save(model, optimizer)
    load_state(state, directory)
    set_state_dict(
        state_owner(model), optimizer, model_state_dict=state["model"], optim_state_dict=state["optimizer"],
        options=StateDictOptions(strict=True, flatten_optimizer_state_dict=True),
    )
    return torch.load(Path(directory) / "extra.pt", weights_only=False)
