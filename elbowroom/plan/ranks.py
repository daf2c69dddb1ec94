"""Per-rank planning: what one rank of a split or sharded model holds and costs (tensor and pipeline parallel;
FSDP2's shards at the end, :func:`per_rank_profile`).

The model is profiled once, whole, on one micro-batch (:func:`elbowroom.plan.profiler.profile`); each rank's
profile is derived from it, so that ``--budget B`` is every rank's budget and each pipeline rank gets a plan of
its own (its own blocks, its own micro-batches in flight):

- **Tensor parallel** (:func:`tensor_parallel_profile`), degree ``t``, from the plan of
  :mod:`elbowroom.distributed.tensor_parallel` (Megatron's split with sequence parallel, both architectures):

  ==========================================  =========================================================
  what                                        one rank holds
  ==========================================  =========================================================
  block parameters                            the rank's real shards (:func:`tp_local_numel`): colwise
                                              weights and biases ``/ t``, rowwise weights ``/ t``, their
                                              biases and the norms whole
  block input, norm outputs, residual         ``/ t`` (sequence parallel: ``seq / t`` positions)
  q/k/v, attention, MLP inner outputs         ``/ t`` (the rank's heads and MLP columns)
  the two gathered inputs of the colwise      whole: ``+ 2 In (1 - 1/t)`` per block, counted with the
  groups (q/k/v's, the MLP's)                 pointwise bytes (selective and full recompute redo the
                                              gather, so they do not keep them)
  head saved bytes and logits transient       ``/ t`` with ``loss_parallel`` (logits sharded), whole
                                              without (under pipeline parallel)
  times and FLOPs                             ``/ t``, plus an *estimate* of the collectives: an
                                              all-gather and a reduce-scatter of ``In (t-1)/t`` bytes
                                              around attention and around the MLP, forward and backward,
                                              over :data:`TP_LINK_BYTES_PER_S`; full recompute repeats
                                              forward's, selective its two all-gathers
  ==========================================  =========================================================

- **Pipeline parallel** (:func:`stage_profile`): the rank's blocks, split by the pipeline's own
  :func:`~elbowroom.distributed.pipeline.stage_blocks`; the embeddings' parameters on the first stage, the final
  norm, head and loss (parameters, saved bytes, logits, times) on the last; a stage that hands its output on holds
  that output for its backward. The profile's micro-batch is the pipeline's (rows per step / micro-batches),
  and the kept activations are held for :func:`inflight_microbatches` micro-batches
  (``Profile.inflight_microbatches``, counted by the cost model; the one-block working set is counted once).

The CPU-offloaded optimizer and bf16 weights do not run split (they step plain tensors, not DTensor shards or a
stage's subset), and activation offload is left out as well: the offload engine's regions assume that one
micro-batch's backward follows its own forward (a pipeline runs several forwards first) and plain saved tensors.
So the plan decides recompute per block: keep, selective or full.
"""

from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from elbowroom.plan.plan import Plan
from elbowroom.plan.types import BlockProfile, Profile

__all__ = ["TP_LINK_BYTES_PER_S", "RankPlans", "host_share", "inflight_microbatches", "layout_label",
           "rank_profiles", "stage_profile", "tensor_parallel_profile"]

TP_LINK_BYTES_PER_S = 100e9
"""An estimate of one direction of the link tensor parallel's collectives use (NVLink-class, between GPUs of one
host, after protocol overhead); over PCIe or between hosts they are slower. Only the predicted time reads it."""


def inflight_microbatches(schedule: str, pp: int, pp_rank: int, microbatches: int) -> int:
    """Micro-batches whose activations pipeline rank ``pp_rank`` holds at once.

    GPipe runs every forward before any backward: ``m``. 1F1B lets rank ``r`` of ``p`` run ``p - r`` forwards
    before its first backward and one forward per backward after: ``min(p - r, m)``. The interleaved schedules
    (interleaved 1F1B, zero bubble) run several stages per rank with warm-ups that depend on torch's version;
    ``m`` is a safe bound (no stage can hold more micro-batches than a step has).
    """
    if schedule == "1f1b":
        return min(pp - pp_rank, microbatches)
    return microbatches


def tensor_parallel_profile(profile: Profile, tp: int, *, block_params: Sequence[int], outside_params: int,
                            loss_parallel: bool, link_bytes_per_s: float = TP_LINK_BYTES_PER_S) -> Profile:
    """One tensor-parallel rank's share of ``profile`` (the factors of the module docstring).

    Args:
        profile: the whole model's profile.
        tp: the degree.
        block_params: each block's parameters on one rank (``tp_local_numel``).
        outside_params: the parameters outside the blocks on one rank.
        loss_parallel: the logits stay sharded over the vocabulary (no pipeline).
        link_bytes_per_s: the collectives' rate (an estimate).
    """
    if tp == 1:
        return profile
    f = 1.0 / tp
    per_param = profile.head.param_bytes / profile.head.num_params if profile.head.num_params else 4

    def block(b: BlockProfile, n: int) -> BlockProfile:
        gathered = int(2 * b.input_bytes * (1 - f))  # the colwise groups' whole inputs
        comm = 4 * b.input_bytes * (1 - f) / link_bytes_per_s  # estimate: 2 all-gathers + 2 reduce-scatters
        saved = {k: int(math.ceil(v * f)) for k, v in b.saved_bytes.items()}
        saved["pointwise"] = saved.get("pointwise", 0) + gathered
        return dataclasses.replace(
            b, num_params=n, param_bytes=int(n * b.param_bytes / b.num_params) if b.num_params else 0,
            saved_bytes=saved, selective_saved_bytes=int(math.ceil(b.selective_saved_bytes * f)),
            input_bytes=int(math.ceil(b.input_bytes * f)),
            largest_saved_bytes=max(int(math.ceil(b.largest_saved_bytes * f)), b.input_bytes),
            forward_s=b.forward_s * f + comm, backward_s=b.backward_s * f + comm,
            recompute_s=b.recompute_s * f + comm, selective_recompute_s=b.selective_recompute_s * f + comm / 2,
            flops=b.flops * f, saved_sizes=(), kept_sizes=(),  # sharded tensors: the bytes are scaled as a share
        )

    h = profile.head
    logits = f if loss_parallel else 1.0
    head = dataclasses.replace(
        h, num_params=outside_params, param_bytes=int(outside_params * per_param),
        saved_bytes=int(math.ceil(h.saved_bytes * logits)),
        logits_transient_bytes=int(math.ceil(h.logits_transient_bytes * logits)),
        forward_s=h.forward_s * f, backward_s=h.backward_s * f, flops=h.flops * f,
    )
    return dataclasses.replace(profile, blocks=tuple(block(b, n) for b, n in zip(profile.blocks, block_params)),
                               head=head)


def stage_profile(profile: Profile, blocks: Sequence[int], *, first: bool, last: bool, embedding_params: int,
                  head_params: int, inflight: int, outputs: int = 0) -> Profile:
    """One pipeline rank's share of ``profile`` (already a tensor-parallel rank's, if any).

    Args:
        profile: the model's profile on the pipeline's micro-batch.
        blocks: indices of the rank's blocks, in the order it runs them.
        first, last: the rank holds the first stage (embeddings) or the last (final norm, head and loss).
        embedding_params, head_params: parameters of the embeddings and of the final norm and head (one rank's).
        inflight: micro-batches held at once (:func:`inflight_microbatches`).
        outputs: stages of the rank that hand their output to another stage (each holds it for its backward).
    """
    h = profile.head
    per_param = h.param_bytes / h.num_params if h.num_params else 4
    n = (embedding_params if first else 0) + (head_params if last else 0)
    out_bytes = outputs * (profile.blocks[blocks[-1]].input_bytes if blocks else 0)  # a block's output: its input's
    head = dataclasses.replace(
        h, num_params=n, param_bytes=int(n * per_param),
        saved_bytes=(h.saved_bytes if last else 0) + out_bytes,
        logits_transient_bytes=h.logits_transient_bytes if last else 0,
        fused_transient_bytes=h.fused_transient_bytes if last else 0,
        # the embedding lookup's time is left out (a gather); the head's is the last stage's
        forward_s=h.forward_s if last else 0.0, backward_s=h.backward_s if last else 0.0,
        flops=h.flops if last else 0.0,
    )
    own = tuple(dataclasses.replace(profile.blocks[i], index=j) for j, i in enumerate(blocks))
    return dataclasses.replace(profile, blocks=own, head=head, inflight_microbatches=inflight)


def layout_label(parallel: Any, pp_rank: int, micro_batch: int, seq_len: int) -> str:
    """The layout a rank's plan is made for, as :attr:`Plan.layout` records it (equal labels: the same plan)."""
    p = parallel
    pipe = (f" ({p.pp_schedule}, {p.pp_num_microbatches} micro-batches), pipeline rank {pp_rank}"
            if p.pp > 1 else "")
    return f"tp {p.tp} x pp {p.pp}{pipe}; micro-batch {micro_batch} x {seq_len} tokens"


def rank_profiles(profile: Profile, model: Any, parallel: Any) -> list[Profile]:
    """Every pipeline rank's profile (one when ``pp`` is 1), from the whole model's ``profile`` taken on the
    pipeline's micro-batch; ``model`` is the whole ``DecoderLM`` (before splitting), read for its parameters."""
    from elbowroom.distributed.pipeline import stage_blocks, stage_ids
    from elbowroom.distributed.tensor_parallel import tp_local_numel

    blocks, emb, head = tp_local_numel(model, parallel.tp)
    loss_parallel = parallel.tp > 1 and parallel.tp_loss_parallel and parallel.pp == 1
    tp_prof = tensor_parallel_profile(profile, parallel.tp, block_params=blocks, outside_params=emb + head,
                                      loss_parallel=loss_parallel)
    if parallel.pp == 1:
        return [tp_prof]
    n_stages, n = parallel.pp_num_stages, len(profile.blocks)
    out = []
    for r in range(parallel.pp):
        ids = stage_ids(parallel, r)
        own = [i for s in ids for i in stage_blocks(parallel, n, s)]
        k = inflight_microbatches(parallel.pp_schedule, parallel.pp, r, parallel.pp_num_microbatches)
        out.append(stage_profile(tp_prof, own, first=0 in ids, last=n_stages - 1 in ids, embedding_params=emb,
                                 head_params=head, inflight=k, outputs=sum(s != n_stages - 1 for s in ids)))
    return out


@dataclass(frozen=True)
class RankPlans:
    """The plans of a model-parallel run: one per pipeline rank (one in all without a pipeline), each made for
    that rank's blocks and layout (:attr:`Plan.layout`). Tensor- and data-parallel ranks of one pipeline rank
    follow the same plan. Saved as TOML (``[[ranks]]`` tables, each a plan)."""

    plans: tuple[Plan, ...]

    @property
    def budget_bytes(self) -> int:
        return self.plans[0].budget_bytes

    # what the trainer reads of a plan: tensor and pipeline parallel keep fp32 weights and the plain loss
    weight_dtype = "float32"
    fused_loss = False

    def table(self) -> str:
        return "\n\n".join(f"pipeline rank {r}:\n{p.table()}" if len(self.plans) > 1 else p.table()
                           for r, p in enumerate(self.plans))

    def to_dict(self) -> dict[str, Any]:
        return {"ranks": [p.to_dict() for p in self.plans]}

    def to_json(self, indent: int | None = 2) -> str:
        """The report's copy (``OUT/plan.json``): pipeline rank 0's plan, the rank whose peak the run logs (every
        rank's plan is in the TOML; ``json.dumps(to_dict())`` holds them all and loads back too)."""
        return self.plans[0].to_json(indent)

    def to_toml(self) -> str:
        """Each plan's own TOML under ``[[ranks]]``: its tables become ``[ranks.x]``, its rows ``[[ranks.x]]``."""
        out = ["# elbowroom plans of a model-parallel run: one [[ranks]] per pipeline rank"]
        for p in self.plans:
            for line in p.to_toml().splitlines():
                if line.startswith("#"):
                    out.append("\n[[ranks]]")
                elif line.startswith("[["):
                    out.append("[[ranks." + line[2:])
                elif line.startswith("["):
                    out.append("[ranks." + line[1:])
                else:
                    out.append(line)
        return "\n".join(out) + "\n"

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> RankPlans:
        if not isinstance(data, dict) or set(data) != {"ranks"} or not isinstance(data["ranks"], list) \
                or not data["ranks"]:
            raise ValueError("not the plans of a model-parallel run (one [[ranks]] table per pipeline rank); a "
                             "model-parallel run writes them to OUT/plan.toml")
        return cls(tuple(Plan.from_dict(d) for d in data["ranks"]))

    @classmethod
    def load(cls, path: str | Path) -> RankPlans:
        import tomllib

        path = Path(path)
        text = path.read_text()
        try:
            return cls.from_dict(json.loads(text) if path.suffix == ".json" else tomllib.loads(text))
        except (ValueError, TypeError) as e:
            raise type(e)(f"{path}: {e}") from None


# ---------------------------------------------------------------- FSDP2: one rank of the shards
REDUCE_BYTES = 4
"""Bytes per element of FSDP2's gradient reduction (``reduce_dtype`` float32, as the trainer wraps it)."""


def fsdp_held_bytes(profile: Any, shard_factor: int, accumulation: int = 1, prefetch: int = 0) -> dict[str, int]:
    """What one rank of FSDP2 holds beyond its shards and its activations, by cause.

    - ``gathered blocks``: the unsharded parameters of the block in flight and of the next one, prefetched, in the
      compute dtype (FSDP2's ``MixedPrecisionPolicy.param_dtype``: the run's autocast dtype), in forward and again
      in backward: twice the largest block; with ``prefetch`` units gathered ahead (``parallel.fsdp_prefetch``),
      the block in flight and those.
    - ``unsharded gradients``: in backward, one block's gradient in the reduce dtype before its reduce-scatter; under
      accumulation (gradient sync off for all but the last micro-batch) every parameter's unsharded gradient in the
      reduce dtype, from the first micro-batch's backward to the last one's.
    - ``gathered root`` and ``root gradients``: the parameters outside the blocks (embeddings, final norm, head) in
      the compute dtype, and their unsharded gradients (an upper bound).

    All are held, for the planner, from the first forward to the last backward (each is an upper bound of the moment
    it names; the optimizer step holds less, and the peak is never there), except the root's where its parts are
    units of their own that hold no block (:func:`per_rank_profile`'s ``root_apart``).

    Args:
        profile: the whole model's profile (``elbowroom.plan.Profile``), before :func:`per_rank_profile`.
        shard_factor: ranks each parameter is sharded over (FSDP2 pads each to a multiple of it).
        accumulation: micro-batches per optimizer step.
        prefetch: the units each block unit all-gathers ahead (0: FSDP2's default, one ahead in backward).
    """
    item = 4 if profile.compute_dtype == "float32" else 2

    def whole(n: int) -> int:  # FSDP2 pads a parameter to a multiple of the shard factor
        return -(-n // shard_factor) * shard_factor

    block = max((whole(b.num_params) for b in profile.blocks), default=0)
    root = whole(profile.head.num_params)
    grads = REDUCE_BYTES * block
    if accumulation > 1:
        grads = REDUCE_BYTES * (root + sum(whole(b.num_params) for b in profile.blocks))
    return {"gathered blocks": (1 + max(1, prefetch)) * item * block, "unsharded gradients": grads,
            "gathered root": item * root,
            "root gradients": item * root}


ROOT_TERMS = ("gathered root", "root gradients")
"""The terms of :func:`fsdp_held_bytes` that the root's own units hold only around the head."""


def as_fsdp_computes(model: Any, sample: Any, whole: Any, amp_dtype: Any, compiled: bool = False) -> Any:
    """The whole model's profile with the bytes it saves under FSDP2, which all-gathers its shards in the autocast
    dtype (``MixedPrecisionPolicy(param_dtype=...)``, :func:`elbowroom.train.distributed_run._fsdp_param_dtype`):
    its blocks then compute as a bf16 model's do, the residual stream and the norms in bf16, where the profile of
    fp32 weights under autocast keeps them in fp32 (W1 on 4 H200s: each kept block input 64 MiB in the memory
    snapshot, 128 in the profile). The bytes come from a bf16 copy profiled as the bf16 layout's are
    (:func:`elbowroom.plan.fit.profile_bf16_copy`: measured on the device, else traced); the times stay the
    profile's, less the casts of the rank's shard (``Profile.gathered_in_compute_dtype``: FSDP2 casts on its all-gather
    stream). Unchanged when the run computes in fp32 or the weights are already in the compute dtype. ``compiled``:
    the copy runs its blocks compiled, as ``whole`` was profiled (``profile(compiled=True)``)."""
    import torch

    from elbowroom.plan.fit import profile_bf16_copy
    from elbowroom.plan.profiler import profile
    from elbowroom.plan.search import with_bytes_of

    if amp_dtype not in (torch.bfloat16, torch.float16) or whole.param_dtype != "float32":
        return whole
    return with_bytes_of(whole, profile_bf16_copy(model, sample, whole, profile, None, reentrant=False,
                                                  compiled=compiled))


def with_host_memory(profile: Any, host_bytes: int | None) -> Any:
    """``profile`` planned for a process that may use ``host_bytes`` of host memory (``fit(host_memory=...)``,
    ``--host-budget``, ``elbowroom plan --host-memory``); None: unchanged."""
    if host_bytes is None:
        return profile
    return dataclasses.replace(profile, machine=dataclasses.replace(profile.machine, host_memory_bytes=int(host_bytes)))


def host_share(machine: Any, ranks_per_host: int, link: tuple[float, float, float] | None = None) -> Any:
    """One rank's share of the host that ``ranks_per_host`` data-parallel ranks share: its memory, and its host
    optimizer rate. The host AdamW step is bound by the host's memory bandwidth, and every rank steps at the same
    time (2 H200s under DDP: 0.31 B parameters in 0.20 s, 1.55 G params/s per rank, where the plan had priced the
    single process's rate and predicted a 374 ms step that took 516). The link too may be shared: ``link``, the
    rates every rank sees while all copy at once (``elbowroom.plan.machine.measure_shared_link``), replaces the
    single process's where lower (4 H200s: 21 GB/s each way with both ways busy, against 49 for one GPU alone).

    Args:
        machine: the ``MachineProfile`` measured by one process (or the device table's).
        ranks_per_host: ranks on this host that plan and step alike (1: the machine unchanged).
        link: to the device, from it, each way at once (bytes/s) with every rank copying; None: each GPU's own.
    """
    if ranks_per_host < 1:
        raise ValueError(f"ranks_per_host must be >= 1, got {ranks_per_host}")
    if ranks_per_host == 1:
        return machine
    if link is not None:
        if len(link) != 3 or any(not r > 0 for r in link):
            raise ValueError(f"link must be three positive rates (bytes/s), got {link!r}")
        machine = dataclasses.replace(machine, h2d_bandwidth=min(machine.h2d_bandwidth, link[0]),
                                      d2h_bandwidth=min(machine.d2h_bandwidth, link[1]),
                                      duplex_bandwidth=min(machine.duplex_bandwidth, link[2]))
    return dataclasses.replace(machine, host_memory_bytes=machine.host_memory_bytes // ranks_per_host,
                               host_adam_params_per_s=machine.host_adam_params_per_s / ranks_per_host)


def per_rank_profile(profile: Any, shard_factor: int, *, accumulation: int = 1, ranks_per_host: int = 1,
                     link: tuple[float, float, float] | None = None, root_apart: float = 0.0,
                     prefetch: int = 0) -> Any:
    """The profile one rank plans under FSDP2 (or HSDP) sharding over ``shard_factor`` ranks.

    Each rank holds ``1 / shard_factor`` of every parameter (fp32), of its gradient (the reduce-scatter's fp32
    output) and of its optimizer state (on the device, or on the host where the plan puts it), so the blocks' and
    the head's parameter counts and bytes are divided (rounded up: FSDP2 pads the last shard). On top it holds
    :func:`fsdp_held_bytes` (``Profile.rank_transient_bytes``), less the root's share in units of its own, which
    those hold around the head alone (``root_apart``, ``Profile.rank_head_transient_bytes``): a unit gathers at its
    own forward and frees after its own backward, so an embedding or a head in a unit of its own is not gathered
    while the blocks run (W1 on 4 H200s, the memory snapshot at a plan's peak in backward: one block's
    reduce-scatter buffer and two blocks' gathers, 0.38 GiB, and none of the root's 0.49). A unit that holds blocks
    too gathers for all of them (the root itself, for a weight tied across its children). The activations are those
    of the rank's own micro-batch, which the profile measured. The host's memory and its optimizer rate are shared
    by the ``ranks_per_host`` ranks on it (:func:`host_share`).
    The step time is the profiled one: FSDP2's all-gathers and reduce-scatters are not counted in it.

    Args:
        profile: an ``elbowroom.plan.Profile`` of the whole model on one rank's micro-batch.
        shard_factor: ranks each parameter is sharded over (``parallel.dp_shard``).
        accumulation: micro-batches per optimizer step (``train.gradient_accumulation_steps``).
        ranks_per_host: ranks sharing the host's memory and cores.
        link: the link's rates with every rank of the host copying (:func:`host_share`); None: each GPU's own.
        root_apart: the share of the parameters outside the blocks in FSDP2 units of their own that hold no block
            (the trainer's wrap: ``elbowroom.distributed.data_parallel.root_apart_share``); 0 counts them all
            gathered all step.
        prefetch: the units each block unit all-gathers ahead (``parallel.fsdp_prefetch``; see
            :func:`fsdp_held_bytes`).

    Returns:
        The per-rank profile (a new frozen object; ``extra["shard_factor"]`` records the factor, which the plan
        keeps in ``plan.profile.shard_factor``).
    """
    if shard_factor < 1 or ranks_per_host < 1:
        raise ValueError(f"shard_factor and ranks_per_host must be >= 1, got {shard_factor} and {ranks_per_host}")

    def shard(n: int) -> int:
        return -(-n // shard_factor)

    if not 0.0 <= root_apart <= 1.0:
        raise ValueError(f"root_apart is a share of the parameters outside the blocks, in [0, 1]; got {root_apart}")
    held = fsdp_held_bytes(profile, shard_factor, accumulation, prefetch)
    around_head = int(root_apart * sum(v for k, v in held.items() if k in ROOT_TERMS))
    blocks = tuple(dataclasses.replace(b, num_params=shard(b.num_params), param_bytes=shard(b.param_bytes))
                   for b in profile.blocks)
    head = dataclasses.replace(profile.head, num_params=shard(profile.head.num_params),
                               param_bytes=shard(profile.head.param_bytes))
    machine = host_share(profile.machine, ranks_per_host, link)
    return dataclasses.replace(profile, blocks=blocks, head=head, machine=machine,
                               rank_transient_bytes=profile.rank_transient_bytes + sum(held.values()) - around_head,
                               rank_head_transient_bytes=profile.rank_head_transient_bytes + around_head,
                               gathered_in_compute_dtype=profile.compute_dtype in ("bfloat16", "float16"),
                               extra={**profile.extra, "shard_factor": shard_factor, "fsdp_held_bytes": held})
