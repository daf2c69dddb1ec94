"""How a run is spread over processes: the mesh's sizes and the gradient communication (``--parallel.*``)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

CommHook = Literal["none", "fp16", "bf16", "powersgd", "topk", "int8"]


@dataclass(frozen=True)
class ParallelConfig:
    """The device mesh (torchtitan's dimension names) and the data-parallel gradient exchange."""

    dp_replicate: int = 1
    """Data-parallel replicas (DDP; across nodes under HSDP). 1 with dp_shard > 1 is FSDP2."""
    dp_shard: int = 1
    """Data-parallel shards (FSDP2 / ZeRO-3 within a replica group). 1 with dp_replicate > 1 is DDP."""
    tp: int = 1
    """Tensor-parallel degree (the model-parallel issue; must be 1 for now)."""
    pp: int = 1
    """Pipeline-parallel stages (the model-parallel issue; must be 1 for now)."""
    data_parallel: Literal["auto", "ddp", "fsdp", "hsdp"] = "auto"
    """The engine: auto (DDP when dp_shard is 1, FSDP2 when dp_replicate is 1, HSDP when both exceed 1), or
    one named: hsdp shards over dp_shard and replicates over dp_replicate whatever their sizes."""
    comm_hook: CommHook = "none"
    """DDP gradient compression: none, fp16, bf16 (torch's hooks), powersgd (torch's, with error feedback),
    topk or int8 (ours, with error feedback). Needs dp_shard 1 (DDP)."""
    powersgd_rank: int = 4
    """Rank of PowerSGD's low-rank approximation."""
    topk_ratio: float = 0.01
    """Share of each gradient bucket's entries that top-k sends (the rest is carried to the next step)."""
    fsdp_cpu_offload: bool = False
    """FSDP2's own CPUOffloadPolicy (parameters, gradients and the step on the host); elbowroom's optimizer
    offload (optimizer.offload_fraction) is the faster engine for the same job."""

    def __post_init__(self) -> None:
        for name in ("dp_replicate", "dp_shard", "tp", "pp"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"parallel.{name} must be an integer >= 1, got {value!r}")
        if self.tp != 1 or self.pp != 1:
            raise ValueError(
                "parallel.tp and parallel.pp (tensor and pipeline parallel) are not available yet; set them to 1"
            )
        if self.data_parallel == "ddp" and self.dp_shard != 1:
            raise ValueError(
                f"parallel.data_parallel ddp replicates whole models, but dp_shard = {self.dp_shard}; "
                "set --parallel.dp_shard 1 (and dp_replicate to the data-parallel size)"
            )
        if self.data_parallel == "fsdp" and self.dp_replicate != 1:
            raise ValueError(
                f"parallel.data_parallel fsdp shards over one dimension, but dp_replicate = {self.dp_replicate}; "
                "use --parallel.data_parallel hsdp for a 2-D mesh"
            )
        if self.comm_hook != "none" and self.mode not in ("ddp", "single"):
            raise ValueError(
                f"parallel.comm_hook {self.comm_hook} compresses DDP's all-reduce, but this mesh runs "
                f"{self.mode}; set --parallel.dp_shard 1 or --parallel.comm_hook none"
            )
        if self.powersgd_rank < 1:
            raise ValueError(f"parallel.powersgd_rank must be >= 1, got {self.powersgd_rank}")
        if not 0.0 < self.topk_ratio <= 1.0:
            raise ValueError(f"parallel.topk_ratio must be in (0, 1], got {self.topk_ratio}")
        if self.fsdp_cpu_offload and self.dp_shard == 1 and self.dp_replicate > 1:
            raise ValueError("parallel.fsdp_cpu_offload needs FSDP2 (dp_shard > 1, or a world size of 1)")

    @property
    def world_size(self) -> int:
        """Processes the mesh needs."""
        return self.dp_replicate * self.dp_shard * self.tp * self.pp

    @property
    def dp_size(self) -> int:
        """Ranks that each see a different slice of the global batch."""
        return self.dp_replicate * self.dp_shard

    @property
    def enabled(self) -> bool:
        return self.world_size > 1

    @property
    def mode(self) -> str:
        """``single``, ``ddp``, ``fsdp`` or ``hsdp``."""
        if self.data_parallel != "auto":
            return self.data_parallel
        if self.world_size == 1:
            return "fsdp" if self.fsdp_cpu_offload else "single"
        if self.dp_shard == 1:
            return "ddp"
        return "fsdp" if self.dp_replicate == 1 else "hsdp"
