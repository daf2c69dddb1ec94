"""What the planner knows about a model and a machine: the result types of profiling.

Data flows one way: model + sample batch -> :class:`Profile` -> cost model and search -> ``Plan`` -> apply.
A profile is plain data (dataclasses of ints, floats and strings) so that it can be cached, printed,
saved as JSON and compared between its two sources:

- ``measured``: on the device itself, saved-tensor hooks for bytes and CUDA events (or the host clock on
  a CPU) for times, over one or two warm-up steps;
- ``analytic``: no device needed, bytes from a trace of the model on the meta device, FLOPs from
  ``FlopCounterMode``, speeds from a device table (``elbowroom.plan.devices``).

Both give the same bytes for the same model; only the times differ in origin. Sizes are bytes, times are
seconds, rates are per second. A block profile describes one micro-batch (``Profile.micro_batch`` samples
of ``Profile.seq_len`` tokens) in the precision the profile was taken in (``Profile.compute_dtype``).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Literal

SavedKind = Literal["matmul", "attention", "pointwise", "input"]
"""What produced a tensor saved for backward: a matmul output (kept by selective recompute), an attention
output (kept by selective recompute), a norm / activation / other pointwise output (recomputed by
selective), or the block's input (saved by every policy, the only thing a fully recomputed block saves)."""


@dataclass(frozen=True)
class BlockProfile:
    """One repeated block (a transformer layer) for one micro-batch."""

    index: int
    """Position in forward order."""
    signature: str
    """Class name and parameter shapes: blocks with equal signatures behave alike and may share a decision."""
    num_params: int
    """Parameters of the block (counted once)."""
    param_bytes: int
    """Bytes of the block's parameters in their profiled dtype."""
    saved_bytes: dict[str, int]
    """Bytes saved for backward when the block is kept whole, by :data:`SavedKind` (views of one storage
    counted once; parameters and their casts not counted)."""
    selective_saved_bytes: int
    """Bytes saved under selective recompute (the matmul and attention outputs it keeps, plus the input)."""
    input_bytes: int
    """Bytes of the block's input activation (what a fully recomputed block saves)."""
    largest_saved_bytes: int
    """The largest single saved tensor (it bounds the offload prefetch window from below)."""
    forward_s: float
    """Forward time of the block."""
    backward_s: float
    """Backward time of the block (without recompute)."""
    recompute_s: float
    """Extra time of a fully recomputed block over a kept one, forward and backward together (about one forward:
    the recompute in backward, and what the checkpoint itself costs in the forward)."""
    selective_recompute_s: float
    """The same for selective recompute (its pointwise ops in backward, and its per-op bookkeeping on the host in
    forward and backward, which on small blocks bounds the step)."""
    flops: float
    """Forward + backward FLOPs of the block (FlopCounterMode), without recompute."""
    saved_sizes: tuple[int, ...] = ()
    """Each saved activation's bytes (one per storage, in the order saved) when the block is kept whole: the
    offload engine's ratio picks whole tensors, largest first, so the bytes it moves follow from these."""
    kept_sizes: tuple[int, ...] = ()
    """The same for the outputs selective recompute keeps (its cache, the input not included). Both empty in a
    profile made before they were recorded: a ratio then moves that share of the bytes."""

    @property
    def total_saved_bytes(self) -> int:
        return sum(self.saved_bytes.values())


@dataclass(frozen=True)
class HeadProfile:
    """Everything outside the blocks: embeddings, final norm, output head and loss, for one micro-batch."""

    num_params: int
    """Parameters outside the blocks (embeddings, final norm, head; tied weights counted once)."""
    param_bytes: int
    """Their bytes in the profiled dtype."""
    saved_bytes: int
    """Bytes saved for backward outside the blocks with the plain head and loss (logits included)."""
    logits_transient_bytes: int
    """Peak extra bytes of the plain head and loss (logits in compute dtype, their fp32 upcast and gradient)."""
    fused_transient_bytes: int
    """Peak extra bytes of the chunked head and loss (``linear_cross_entropy``): one chunk's logits."""
    forward_s: float
    """Forward time outside the blocks (plain head and loss)."""
    backward_s: float
    """Backward time outside the blocks."""
    flops: float
    """Forward + backward FLOPs outside the blocks."""
    fused_chunk_tokens: int = 0
    """Tokens per chunk of ``linear_cross_entropy`` (its ``chunk_tokens``): ``fused_transient_bytes`` is
    ``min(tokens, fused_chunk_tokens)`` tokens' logits, so another micro-batch's transient grows with its tokens only
    up to one chunk. 0 when not known (older profiles): the transient then scales with the tokens."""
    after_params: int = 0
    """Of ``num_params``, those registered after the last block's (an untied output head, a final norm): their
    gradients are final as the backward starts and their weights are needed only after the last block. The rest
    (embeddings, and a weight tied to one) are final last and needed first. 0 when not known (older profiles)."""

    @property
    def before_params(self) -> int:
        """The rest of ``num_params``: the embeddings (and a weight tied to one), all of them when ``after_params``
        is not known."""
        return self.num_params - min(self.after_params, self.num_params)


@dataclass(frozen=True)
class MachineProfile:
    """The device and its link to the host: measured once per machine and cached, or from the device table."""

    name: str
    """Device name (``torch.cuda.get_device_name`` or the table's key, e.g. ``h100-80gb``; ``cpu``)."""
    device_memory_bytes: int
    """Memory the device has in all."""
    matmul_flops: float
    """Achievable dense matmul rate in the compute dtype (FLOP/s), not the data-sheet peak."""
    memory_bandwidth: float
    """Device memory bandwidth (bytes/s), for memory-bound work such as the device optimizer step."""
    h2d_bandwidth: float
    """Pinned host-to-device copy rate alone (bytes/s); 0 where there is no separate host (CPU)."""
    d2h_bandwidth: float
    """Pinned device-to-host copy rate alone (bytes/s)."""
    duplex_bandwidth: float
    """Each direction's rate while both run at once (bytes/s)."""
    host_adam_params_per_s: float
    """Host fused AdamW rate in parameters per second (fp32 masters and state)."""
    host_memory_bytes: int
    """Host memory available for pinned buffers and host optimizer state."""
    pinned_alloc_s_per_gib: float = 0.5
    """Cost of allocating pinned host memory (paid once, in the first step)."""
    source: Literal["measured", "table"] = "table"
    """Where the numbers came from."""


@dataclass(frozen=True)
class Profile:
    """A model on a machine, for one micro-batch: what each block saves and costs, and the model states."""

    source: Literal["measured", "analytic"]
    """How the bytes and times were obtained."""
    machine: MachineProfile
    """The device and link the times refer to."""
    micro_batch: int
    """Samples per micro-batch profiled."""
    seq_len: int
    """Tokens per sample."""
    compute_dtype: str
    """Precision of the profiled forward: "bfloat16" (autocast or bf16 weights), "float16" or "float32"."""
    param_dtype: str
    """Dtype of the model's parameters as given (usually "float32")."""
    blocks: tuple[BlockProfile, ...]
    """The repeated blocks, in forward order."""
    head: HeadProfile
    """Everything else."""
    block_path: str = ""
    """Where the blocks were found in the model (e.g. ``blocks``, ``model.layers``, ``transformer.h``)."""
    allocator_overhead_bytes: int = 0
    """Measured reserved minus allocated at the peak (fragmentation) with the allocator's defaults, over plain and
    selective steps from an empty cache; 0 when unknown."""
    allocator_overhead_expandable_bytes: int = 0
    """The same with ``expandable_segments:True``, 0 when unknown."""
    inflight_microbatches: int = 1
    """Micro-batches whose kept activations (and head or stage output) one pipeline stage holds at once (GPipe:
    all, 1F1B: the stages to the end; 1 without a pipeline): counted that many times, one block's working set once."""
    rank_transient_bytes: int = 0
    """Bytes one rank holds through the step beyond what the blocks and the model states count: under FSDP2 the
    all-gathered parameters and the unsharded gradients before their reduce-scatter
    (``elbowroom.plan.ranks.per_rank_profile``); 0 for a model that is not sharded."""
    rank_head_transient_bytes: int = 0
    """Bytes one rank holds around the head only (the forward's end): under FSDP2 with the parameters outside the
    blocks in units of their own, their gathered parameters and unsharded gradients; 0 otherwise."""
    gathered_in_compute_dtype: bool = False
    """The weights reach the blocks in the compute dtype whatever their stored dtype: FSDP2 all-gathers its shards in
    the autocast dtype (``MixedPrecisionPolicy(param_dtype=...)``), so fp32 shards cost autocast no casts and no
    weight cache (``elbowroom.plan.ranks.per_rank_profile`` sets it when the profile computes below fp32)."""
    extra: dict[str, Any] = field(default_factory=dict)
    """Free-form details (the trace's kernel split, versions) that are shown, never planned on."""

    @property
    def num_params(self) -> int:
        return sum(b.num_params for b in self.blocks) + self.head.num_params

    @property
    def tokens(self) -> int:
        """Tokens of one micro-batch."""
        return self.micro_batch * self.seq_len

    def to_dict(self) -> dict[str, Any]:
        """A JSON-friendly dict (see :func:`profile_from_dict`)."""
        return dataclasses.asdict(self)


def profile_from_dict(d: dict[str, Any]) -> Profile:
    """The inverse of :meth:`Profile.to_dict`."""
    d = dict(d)
    d["machine"] = MachineProfile(**d["machine"])
    d["blocks"] = tuple(
        BlockProfile(**{**b, "saved_sizes": tuple(b.get("saved_sizes", ())),
                        "kept_sizes": tuple(b.get("kept_sizes", ()))})
        for b in d["blocks"]
    )
    d["head"] = HeadProfile(**d["head"])
    return Profile(**d)
