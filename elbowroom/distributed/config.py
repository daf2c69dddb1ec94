"""How a run is spread over processes: the mesh's sizes and the gradient communication (``--parallel.*``)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

CommHook = Literal["none", "fp16", "bf16", "powersgd", "topk", "int8"]
PipelineSchedule = Literal["gpipe", "1f1b", "interleaved_1f1b", "zero_bubble"]
_MULTI_STAGE_SCHEDULES = ("interleaved_1f1b", "zero_bubble")


@dataclass(frozen=True)
class ParallelConfig:
    """The device mesh (torchtitan's dimension names) and the data-parallel gradient exchange."""

    dp_replicate: int = 1
    """Data-parallel replicas (DDP; across nodes under HSDP). 1 with dp_shard > 1 is FSDP2."""
    dp_shard: int = 1
    """Data-parallel shards (FSDP2 / ZeRO-3 within a replica group). 1 with dp_replicate > 1 is DDP."""
    tp: int = 1
    """Tensor-parallel degree: heads, MLP width and the output head split over this many ranks (torch's
    parallelize_module, sequence parallel for the norms; elbowroom.distributed.tensor_parallel)."""
    pp: int = 1
    """Pipeline-parallel degree: ranks the blocks are split over (torch.distributed.pipelining)."""
    pp_schedule: PipelineSchedule = "1f1b"
    """Pipeline schedule: gpipe, 1f1b, interleaved_1f1b or zero_bubble (the last two run several stages per rank)."""
    pp_microbatches: int = 0
    """Micro-batches per pipeline step (0: one per stage, the fewest a schedule accepts; more shrink the bubble)."""
    pp_stages_per_rank: int = 0
    """Stages per pipeline rank (0: 1 for gpipe and 1f1b, 2 for interleaved_1f1b and zero_bubble)."""
    tp_loss_parallel: bool = True
    """Keep the logits sharded over the vocabulary and compute cross-entropy on the shards (torch's
    loss_parallel); applies without pipeline parallel, whose last stage hands whole logits to the loss."""
    data_parallel: Literal["auto", "ddp", "fsdp", "hsdp"] = "auto"
    """The engine: auto (DDP when dp_shard is 1, FSDP2 when dp_replicate is 1, HSDP when both exceed 1), or
    one named: hsdp shards over dp_shard and replicates over dp_replicate whatever their sizes."""
    comm_hook: CommHook = "none"
    """DDP gradient compression: none, fp16, bf16 (torch's hooks), powersgd (torch's, with error feedback),
    topk or int8 (ours, with error feedback). Needs dp_shard 1 (DDP)."""
    powersgd_rank: int = 4
    """Rank of PowerSGD's low-rank approximation."""
    topk_ratio: float = 0.01
    """Share of each parameter's gradient entries that top-k sends (the rest is carried to the next step)."""
    ddp_bucket_mb: float = 25.0
    """DDP's gradient bucket size in MiB (torch's ``bucket_cap_mb``): larger buckets launch fewer all-reduces, the
    last one, which no backward hides, is larger."""
    ddp_broadcast_buffers: bool = True
    """DDP: broadcast rank 0's buffers before every forward (torch's default), which buffers that training changes
    need (batch norm's running statistics); a decoder's rotary tables are alike on every rank without it. Off, W1
    on 2 H200s ran as fast (92.7-93.3% of 2x one GPU either way)."""
    fsdp_cpu_offload: bool = False
    """FSDP2's own CPUOffloadPolicy (parameters, gradients and the step on the host); elbowroom's optimizer
    offload (optimizer.offload_fraction) is the faster engine for the same job."""
    fsdp_prefetch: int = 0
    """FSDP2: each block unit issues the all-gathers of the next N units in forward (and of the N before it in
    backward) from its own pre-forward, so they do not wait for the host to reach those units (torch's
    set_modules_to_forward_prefetch); 0: FSDP2's default. An offloading optimizer's wait moves ahead with them, and
    a --budget plan counts the units gathered at once."""

    def __post_init__(self) -> None:
        if isinstance(self.fsdp_prefetch, bool) or not isinstance(self.fsdp_prefetch, int) or self.fsdp_prefetch < 0:
            raise ValueError(f"parallel.fsdp_prefetch must be a whole number of units >= 0, got {self.fsdp_prefetch!r}")
        if isinstance(self.ddp_bucket_mb, bool) or not isinstance(self.ddp_bucket_mb, (int, float)) or not (
                self.ddp_bucket_mb > 0):
            raise ValueError(f"parallel.ddp_bucket_mb must be a positive number of MiB, got {self.ddp_bucket_mb!r}")
        for name in ("dp_replicate", "dp_shard", "tp", "pp"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"parallel.{name} must be an integer >= 1, got {value!r}")
        self._check_model_parallel()
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
        if self.fsdp_prefetch and self.mode not in ("fsdp", "hsdp"):
            raise ValueError(f"parallel.fsdp_prefetch sets FSDP2's all-gathers ahead, but this mesh runs {self.mode}; "
                             "shard with --parallel.dp_shard, or drop --parallel.fsdp_prefetch")

    def _check_model_parallel(self) -> None:
        if self.pp_schedule not in ("gpipe", "1f1b", *_MULTI_STAGE_SCHEDULES):
            raise ValueError(f"parallel.pp_schedule must be gpipe, 1f1b, interleaved_1f1b or zero_bubble, "
                             f"got {self.pp_schedule!r}")
        for name in ("pp_microbatches", "pp_stages_per_rank"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise ValueError(f"parallel.{name} must be an integer >= 0 (0: automatic), got {value!r}")
        if self.pp_schedule not in _MULTI_STAGE_SCHEDULES and self.pp_stages_per_rank > 1:
            raise ValueError(
                f"parallel.pp_schedule {self.pp_schedule} runs one stage per rank, but pp_stages_per_rank = "
                f"{self.pp_stages_per_rank}; use interleaved_1f1b or zero_bubble, or set pp_stages_per_rank 1"
            )
        if self.pp > 1 and self.pp_microbatches and self.pp_microbatches < self.pp_num_stages:
            raise ValueError(
                f"parallel.pp_microbatches = {self.pp_microbatches} is fewer than the pipeline's "
                f"{self.pp_num_stages} stages: a stage would wait for a micro-batch that never comes (torch's "
                f"schedules hang or fail); set --parallel.pp_microbatches {self.pp_num_stages} or more"
            )
        if (self.tp > 1 or self.pp > 1) and self.mode == "ddp":
            raise ValueError(
                "DDP does not compose with tensor or pipeline parallel (it needs plain, unsplit parameters); "
                "replicate with --parallel.data_parallel hsdp, or shard with --parallel.dp_shard"
            )

    @property
    def pp_num_stages(self) -> int:
        """Pipeline stages over all pipeline ranks (1 without pipeline parallel)."""
        if self.pp == 1:
            return 1
        per_rank = self.pp_stages_per_rank or (2 if self.pp_schedule in _MULTI_STAGE_SCHEDULES else 1)
        return self.pp * per_rank

    @property
    def pp_num_microbatches(self) -> int:
        """Micro-batches per pipeline step (1 without pipeline parallel)."""
        if self.pp == 1:
            return 1
        return self.pp_microbatches or self.pp_num_stages

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
        if self.dp_size == 1:  # one process, or tensor/pipeline parallel without data parallel
            return "fsdp" if self.fsdp_cpu_offload else "single"
        if self.dp_shard == 1:
            return "ddp"
        return "fsdp" if self.dp_replicate == 1 else "hsdp"
