"""FSDP2 on one GPU as a peer mode for ``bench.py``: torch's own answer to "the model does not fit".

    python benchmarks/bench.py --workload w1 --modes plain,fsdp2_cpu_offload,fsdp2_cpu_offload+ckpt

- ``fsdp2_cpu_offload``: ``fully_shard`` on each block and on the root at world size 1, with
  ``CPUOffloadPolicy(pin_memory=True)`` (parameters, gradients and the optimizer step on the host: torch's
  AdamW runs on the CPU over the sharded fp32 parameters) and ``MixedPrecisionPolicy(param_dtype=bf16,
  reduce_dtype=fp32)``. Measured elsewhere on W1: 42% of plain at 34.8 GiB, 39% at 7.8 GiB with checkpoint.
- ``fsdp2_cpu_offload+ckpt``: the same with torch's per-block non-reentrant checkpoint.
- ``fsdp2``: ``fully_shard`` without offload (the wrapper's own cost at world size 1).
- ``fsdp2+ours_selective`` / ``fsdp2+ours_ckpt``: FSDP2 at world size 1 with our activation policy on every
  block (selective, or full recompute), beside ``ours_selective`` / ``ours_ckpt`` on the bare model.
- ``fsdp2_ours_offload+ours_ckpt_inputs``: FSDP2 with our ``CPUOffloadOptimizer`` stepping every shard on the host
  (``offload_fraction=1.0``, bf16 device copies) and full recompute with the block inputs offloaded: our offload
  under FSDP2, against ``fsdp2_cpu_offload+ckpt`` (torch's ``CPUOffloadPolicy``); ``fsdp2_ours_offload_bf16+...``
  keeps bf16 device copies of the weights (``param_dtype``), fp32 masters on the host.

The process group is made here when none exists (one rank; NCCL on CUDA, gloo elsewhere). The fused loss
(``+fl``) does not apply: it reads the head's weight outside the head's forward, where FSDP2 keeps it sharded.
"""

from __future__ import annotations

import os
import socket
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import Setup  # noqa: E402


def _one_rank_group() -> None:
    import torch.distributed as dist

    if dist.is_initialized():
        return
    with socket.socket() as s:  # a free port for the one-rank rendezvous
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(port))
    dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo", rank=0, world_size=1)


def _fsdp2(model: torch.nn.Module, args: Any, *, offload: bool, ckpt: bool) -> Setup:
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard

    _one_rank_group()
    if ckpt:
        import bench

        bench.setup_torch_ckpt(model, args)  # each block's forward under torch's checkpoint; FSDP2's hooks stay outside
    kw: dict[str, Any] = {"mp_policy": MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)}
    if offload:
        kw["offload_policy"] = CPUOffloadPolicy(pin_memory=True)
    for blk in model.blocks:
        fully_shard(blk, **kw)
    fully_shard(model, **kw)
    # with the offload policy the sharded parameters live on the host: torch's AdamW steps them there
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=None if offload else True)
    return Setup(opt, notes={"fsdp2": {"cpu_offload": offload, "checkpoint": ckpt, "world_size": 1}})


def _fsdp2_ours(model: torch.nn.Module, args: Any, *, policy: dict[str, Any], offload_optimizer: bool,
                bf16: bool = False, offload_gradients: bool = False) -> Setup:
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    from elbowroom.activations import apply_activation_policy

    _one_rank_group()
    apply_activation_policy(model, **policy)  # our wrappers inside each block; FSDP2's hooks outside
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for blk in model.blocks:
        fully_shard(blk, mp_policy=mp)
    fully_shard(model, mp_policy=mp)
    if offload_optimizer:
        from elbowroom.optim import CPUOffloadOptimizer

        kw: dict[str, Any] = {"param_dtype": torch.bfloat16} if bf16 else {}
        if offload_gradients:
            kw["offload_gradients"] = True  # each gradient leaves the device once copied
        opt: Any = CPUOffloadOptimizer(model.parameters(), torch.optim.AdamW, lr=1e-4, offload_fraction=1.0, **kw)
    else:
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
    stats = (lambda: {"host_GiB": round(opt.stats()["host_bytes"] / 2**30, 2)}) if offload_optimizer else None
    return Setup(opt, stats=stats, notes={"fsdp2": {"ours": policy, "optimizer_offload": offload_optimizer,
                                                    "world_size": 1}})


MODES: dict[str, Callable[..., Setup]] = {
    "fsdp2+ours_selective": lambda m, a: _fsdp2_ours(m, a, policy={"checkpoint": "selective"},
                                                     offload_optimizer=False),
    "fsdp2+ours_ckpt": lambda m, a: _fsdp2_ours(m, a, policy={"checkpoint": "full"}, offload_optimizer=False),
    "fsdp2_ours_offload+ours_ckpt_inputs": lambda m, a: _fsdp2_ours(
        m, a, policy={"checkpoint": "full", "offload_checkpoint_inputs": True}, offload_optimizer=True),
    "fsdp2_ours_offload_og+ours_ckpt_inputs": lambda m, a: _fsdp2_ours(
        m, a, policy={"checkpoint": "full", "offload_checkpoint_inputs": True}, offload_optimizer=True,
        offload_gradients=True),
    "fsdp2_ours_offload_bf16+ours_ckpt_inputs": lambda m, a: _fsdp2_ours(
        m, a, policy={"checkpoint": "full", "offload_checkpoint_inputs": True}, offload_optimizer=True, bf16=True),
    "fsdp2": lambda m, a: _fsdp2(m, a, offload=False, ckpt=False),
    "fsdp2_cpu_offload": lambda m, a: _fsdp2(m, a, offload=True, ckpt=False),
    "fsdp2_cpu_offload+ckpt": lambda m, a: _fsdp2(m, a, offload=True, ckpt=True),
}
