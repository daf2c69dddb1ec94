"""The cost model: a :class:`~elbowroom.plan.types.Profile` and a set of decisions -> peak bytes and step seconds.

Everything here is arithmetic on the profile; nothing touches a device. The per-block part (the options, their bytes
and seconds as arrays over blocks) is :mod:`elbowroom.plan.options`; this module adds the global terms and predicts.
The search (:mod:`elbowroom.plan.search`) and the printed plan use the same functions, so that a plan's predictions
are exactly the numbers the search minimised. Sizes are bytes, times seconds. ``s = micro_batch /
profile.micro_batch`` scales every activation byte and every block and head time linearly (the request of the
design); per-micro-batch costs that do not grow with the batch (autocast's weight casts) are kept apart from that
scaling.

Decisions
---------
Per block one :class:`Option`: keep (``none``), keep and offload a share ``r`` of the saved bytes, selective
recompute (with a share ``r`` of its kept matmul/attention outputs offloaded, or everything incl. its input),
full recompute, full recompute with its input offloaded. Globally (:class:`Decisions`): which blocks' parameters
step on the host (``offload_blocks``) and which keep their state on the host but step on the device, streamed
through a device ring (``stream_blocks``), whether the parameters outside the blocks step on the host
(``offload_other``), the
weight layout (:data:`LAYOUTS`), micro-batch and accumulation, the fused head + loss, the allocator setting, and
whether the training loop clips gradients (it decides when the host step may start).

Memory (peak over forward and backward)
---------------------------------------
Model states, per parameter on the device (``P_res`` resident, ``P_off`` offloaded)::

    fp32 weights under autocast:            16 B resident (4 weight + 4 grad + 8 AdamW moments), 8 B offloaded
    fp32 resident, bf16 offloaded copies:   16 B resident,                                       4 B offloaded
                                            (8 B for the embedding tables, kept in fp32: the residual stream)
    bf16 weights, fp32 masters:             16 B resident (2 + 2 + 4 master + 8),                4 B offloaded

plus, when anything is offloaded, ``num_staging_slots * bucket_bytes`` of device staging (the optimizer's config)
and, when its bf16 weights cast to and from fp32 on the device, the two copy streams' cast buffers
(``CAST_STREAMS * cast_chunk_bytes``), and with bf16 weights the fp32 chunk the device masters step through
(``device_chunk_numel * 4``). A streamed parameter (``P_str``) is counted at its weight in the offloaded weights'
dtype (4 B, or 2 with bf16 device weights), with or without ``offload_gradients`` (its gradient never leaves: it
steps where it is), its state 12 B on the host and no host gradient; its gradient (``Gs_i`` of block ``i``, as many
bytes again) is counted in the phases that hold it, below (:func:`streamed_gradient_bytes`;
:func:`~elbowroom.plan.streaming.device_bytes_per_param` tells the count's history). When any block streams the
device holds the ring it steps through, ``stream_slots * min(stream_slot_numel, largest streamed block's
parameters) * 16`` (:func:`~elbowroom.plan.streaming.ring_bytes`).

Gradients of resident parameters (``g`` = 4 B fp32, 2 B bf16 per parameter; ``G_i`` of block ``i``, ``G_h`` of the
parameters outside the blocks) are part of those 16 B, but with one micro-batch per step (and the loop's
``zero_grad(set_to_none=True)``, torch's default) they do not exist before the backward: the forward phases leave
them out, and backward block ``i`` counts ``G_h + sum_{j>=i} G_j`` (the head's gradients come first, a block's
own at its backward). The optimizer step then holds all of them (a phase of its own). Under accumulation they live
through every later forward and are counted whole. The gradients of offloaded parameters stay in their 8 / 4 B:
they leave through the staging slots as they become final, but the model does not time that.

Activations, per block ``i`` (bytes of the profile x ``s``): ``S`` every saved byte, ``Sel`` the selective set,
``In`` the input; the option keeps ``k_i`` on the device and offloads ``o_i``::

    keep:          k = S                         o = 0
    keep + r:      k = S - o                     o = ratio(r)     (whole tensors, largest first, until r of them)
    selective:     k = Sel                       o = 0
    selective + r: k = Sel - o                   o = ratio(r)     (of the kept outputs; the input stays)
    selective + 1: k = 0                         o = Sel          (outputs and input offloaded)
    full:          k = In                        o = 0
    full + input:  k = 0                         o = In

In backward each block's whole saved set is back on the device (recomputed, or fetched), ``S``; its extra over
what it kept is ``e_i = S_i - k_i``. Phases (``M`` model states and staging; computed in
:mod:`elbowroom.plan.phases`)::

    forward, block i:   M' + sum_{j<i} k_j + S_i + L_i + f_i                       (L: largest saved tensor, a
                                                                                     temporary; f_i in flight)
    forward's end:      M' + sum_j k_j + o_last + H + C                           (H: head saved + logits, or the
                                                                                     fused chunk; C: autocast cache)
    backward, block i:  M' + G_h + sum_{j>=i} G_j + sum_{j<i} k_j + S_i + b_i + 2 In_i + L_i + G
                                                                                    (W: prefetch window; 2 In + L:
                                                                                     gradients of the residual stream
                                                                                     and of the largest intermediate;
                                                                                     G: the bf16 weight gradients of
                                                                                     the largest block before they
                                                                                     accumulate into fp32 .grad)

    optimizer step:     M

Streamed gradients (one micro-batch per step): the optimizer holds block ``i``'s from its backward to its forward
pre-hook in the next step, however soon its job on the link ends, so backward block ``i`` adds
``sum_{j>=i} Gs_j``, forward block ``i`` adds ``sum_{j>i} Gs_j``, the forward's end none, the optimizer step all;
under accumulation they are in ``M`` whole.

(``M`` includes ``Profile.rank_transient_bytes``: under FSDP2 a rank's all-gathered parameters and unsharded
gradients, held from the first forward to the last backward; 0 for a model that is not sharded. ``H`` includes
``Profile.rank_head_transient_bytes``: the root's parts gathered around the head where they are units of their own.)
(``f_i``: ``o_p`` of the nearest block ``p < i`` that offloads while its copies have not left by the end of block
``i - 1`` at the plan's slowest copy rate; ``o_last`` the last such block's unless its copies left under the forward
after it; ``b_i = min(o_p, W)`` when ``i - p <= PREFETCH_LEAD_BLOCKS``, on its way back, else 0:
:func:`elbowroom.plan.phases._held`.)
(``M'``: ``M`` less the resident gradients when they come and go with the backward, as above; else ``M``. A pipeline
stage adds to all but the last ``(Profile.inflight_microbatches - 1) (sum_j k_j + head saved)``: other micro-batches.)
The peak is the largest of these plus the allocator margin: ``Profile.allocator_overhead_bytes`` when measured,
else :data:`ALLOCATOR_MARGIN` (a fraction of the budget). ``C`` is autocast's weight cache, which holds a bf16
copy of every fp32 block weight to the forward's end only when no block has a policy (an all-default plan
installs no wrapper; any policy turns the cache off inside every block). ``H``: plain head
``saved + logits_transient (+ 2 B per head parameter for its autocast cast)``; fused head
``dh + dW + fused_transient = 2 In_last + 4 B x head parameters + fused_transient`` (``linear_cross_entropy``
keeps only the gradients of its input and weight; the HeadProfile lumps embeddings with the head, so ``dW`` is
bounded by all of them; ``fused_transient``, one chunk's logits, grows with the tokens only up to one chunk).

The search needs a bound that is a sum over blocks plus terms fixed by a few global choices; with the options
limited to those of extra at most ``E`` (``e_i <= E``, hence ``o_i <= E``), every phase above is at most::

    M' + sum_j k_j + max(H + C + O, E + min(O, W) + 2 In_max + L_max + G + (M - M'), E + L_max + O)

where ``O`` is the largest ``o`` among the allowed options. The search enumerates ``E`` over the options' extras
and solves an exact knapsack on ``sum_j k_j`` below the budget less that bound; the printed peak is the exact
maximum of the phases, never above the bound.

Time (one optimizer step of ``A`` micro-batches)
------------------------------------------------
::

    T_step  = A T_mb + T_dev + T_host
    T_mb    = s (sum_i (F_i + B_i) + F_h + B_h - X_0) + X + s sum_i c_i
    c_i     = R_i + (1 - w) x_i(one-way rates) + w x_i(duplex rate)
    x_i     = max(0, o_i / bw_fwd - sum_{j=i+1..i+g_i} F_j) + max(0, o_i / bw_bwd - sum_{j=i+1..i+h_i} B_j)
    g_i     = min(q_i - i, GAP_LEVELS),  h_i = min(g_i, PREFETCH_LEAD_BLOCKS)

``F``, ``B``: forward and backward of a block, ``F_h``, ``B_h`` of the head (plain and fused alike: measured on
the H100 within -1.1..+1.4% of each other, ``BENCHMARKS.md``); ``R_i``: ``recompute_s`` (full) or
``selective_recompute_s`` (selective). ``x_i``: what compute cannot hide of block ``i``'s copies. ``q_i`` is the
next block after ``i`` whose option offloads anything (``n``, the head, when none does). The engine makes the compute
stream wait for block ``i``'s copies out at the end of block ``q_i`` (one offloading region in flight), so they leave
under the forward of every block up to it; they come back under the backward of the ``h_i`` blocks before ``i``'s,
the first of which starts them back (``elbowroom.activations._wrap.PrefetchChain``); for the last block the head's
forward and backward (index ``n`` means the head). The search carries ``g`` as a state of its programme
(:mod:`elbowroom.plan.search`), so the sum stays exact. ``w = 1/A`` when parameters are offloaded (the optimizer's
gradients and weights share the link in one micro-batch of the step: both directions busy, ``duplex_bandwidth``),
else 0 (one direction at a time: ``d2h_bandwidth`` in forward, ``h2d_bandwidth`` in backward). The activation copies
are counted per block, so that the total is a sum: the search's programme is then exact, and a plan's printed time
is what the search minimised.

``X``: autocast's weight casts per micro-batch (not scaled by ``s``): ``P_32 * CAST_BYTES_PER_PARAM /
memory_bandwidth``, ``P_32`` the parameters held in fp32 on the device and run under autocast (all of them with
fp32 weights, the resident ones with bf16 offloaded copies, none with bf16 weights). ``X_0`` is the same for the
profile's own layout (all parameters when it ran fp32 weights under autocast), which the profiled times include.

``T_dev``: the device optimizer step, memory-bound: ``(P_res * b + P_str * 32) / memory_bandwidth`` with ``b`` =
:data:`DEVICE_ADAM_BYTES_PER_PARAM` (fp32) or :data:`DEVICE_MASTER_ADAM_BYTES_PER_PARAM` (bf16 weights, fp32
device masters stepped chunk by chunk), 32 B (:data:`elbowroom.plan.streaming.ADAM_BYTES_PER_PARAM`) per streamed
parameter: its fused step runs on a side stream, but it takes the device's memory bandwidth all the same; plus the
streamed chunks' measured overhead (:func:`~elbowroom.plan.streaming.launch_seconds`).

``T_host``: what the device cannot hide of the host AdamW step. Jobs ``j`` (an offloaded block, or the parameters
outside the blocks) each copy ``4 P_j`` gradient bytes out, step for ``h_j = P_j / host_adam_params_per_s`` (with
clipping 36 / 28 of that: the gradient's scaling pass, :func:`~elbowroom.plan.host_pipeline.host_rate`) and
copy ``4 P_j`` weight bytes back (fp32 gradients and masters travel either way: the casts of bf16 device weights
run on the device), over the duplex link. Copies, steps and uploads each run one job after another::

    d_j = max(d_{j-1}, t_j) + 4 P_j / bw      (gradients on the host; t_j: when job j may start)
    h_j = max(h_{j-1}, d_j) + P_j / rate      (host step done)
    u_j = max(u_{j-1}, h_j) + 4 P_j / bw      (weights back on the device)
    T_host = max(0, max_j (u_j - need_j))     (the next forward stalls by the largest lateness)

``need_j = T_0 + T_dev + s sum_{i<j} F_i``: block ``j`` is needed when the next forward reaches it. Without
clipping (the optimizer learns ``step_in_backward``), jobs start as their gradients become final in the last
micro-batch's backward: ``t_j = s (B_h + sum_{i>=j} B_i)``, late blocks first, and ``T_0 = s (B_h + sum_i B_i)``,
the backward's end. With clipping (or a GradScaler), every gradient must exist first: the jobs start at the
backward's end in forward order (``t_j = 0``, ``T_0 = 0``). Recompute is not counted as time that hides the host
step (it is a per-block choice; leaving it out keeps the cost a sum and errs on the slow side). The parameters
outside the blocks are two jobs: those registered before the blocks, or tied to one that is (embeddings: gradient
final last, weights needed first), and those after them (``HeadProfile.after_params``: an untied output head and
the final norm, final as the backward starts and needed after the last block).
The host step's pace varies between runs (1.6x between two identical runs of one call), and a plan whose step
rests on it hiding with little slack loses most when it runs slow: ``T_host`` is the mean of the lateness at the
measured rate and at :data:`HOST_STEP_SPREAD` of it (a plan with slack to spare pays nothing; one that offloads
optimizer state only to shorten the device step by a few milliseconds no longer wins by doing so).
Streamed blocks are jobs of the link alone (:mod:`elbowroom.plan.host_pipeline`): ready when a host job would be,
each holds both directions for ``12 P_j / bw`` (master and moments up into the device's ring, stepped there, and
back), and its weights are ready when its states are up; the gradients' copies share the device-to-host direction
with them, one after another in the order the jobs are ready, and the host's weights come back in the time they
leave free on the other. As streamed states take both directions, the activation copies of the micro-batch that
shares the link with the optimizer (``w`` above) get :data:`~elbowroom.plan.options.SHARED_LINK_SHARE` of the duplex
rate instead of all of it when any block streams, for the share of the window the streamed states hold the link, and
nothing hides them there: what they take of the link they take from the streamed states.
With ``offload_gradients`` the pipeline is the same: the gradients travel in fp32 either way (4 B each way per
parameter), into a pinned host gradient instead of a staging slot, and the device frees each one once its copy is
enqueued (2 B per bf16 parameter, 4 per fp32 one, no longer held from the backward to the step). Their host copies
are fp32 (:func:`_offloaded_gradient_bytes`): a bf16 host gradient ran the host step at about half the fp32
kernel's pace (the upcast on the host), which is what made them look costly in earlier measurements.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from elbowroom.plan import phases, streaming
from elbowroom.plan.host_pipeline import (
    OPTIMIZER_LINK_BYTES_PER_PARAM,
    host_exposed_seconds,
    host_lateness,
    outside_on_host,
    stream_link_seconds,
)
from elbowroom.plan.options import OPTIONS, Option, block_tables
from elbowroom.plan.streaming import optimizer_parts
from elbowroom.plan.types import Profile

__all__ = [
    "ALLOCATOR_MARGIN",
    "CAST_BYTES_PER_PARAM",
    "DEVICE_ADAM_BYTES_PER_PARAM",
    "DEVICE_MASTER_ADAM_BYTES_PER_PARAM",
    "LAYOUTS",
    "OPTIONS",
    "Decisions",
    "Option",
    "Prediction",
    "predict",
]

GiB = 1 << 30

CAST_BYTES_PER_PARAM = 18
"""Device memory traffic of autocast per fp32 weight and micro-batch: the bf16 cast in forward (read 4, write 2),
the same again in backward (blocks under a policy recast instead of keeping the cast), and the weight gradient's
cast to fp32 (read 2, write 4). On the 7B shape the fp32 half under autocast measured 51 ms per micro-batch over
3.4 B parameters (~51 B/param at the H100's 3.35 TB/s, ``BENCHMARKS.md``), which also holds fp32 norm outputs and
gradient accumulation; 18 counts only what the weights themselves move."""

HOST_STEP_SPREAD = 0.75
"""The host optimizer's rate at the slow end of what training runs showed, as a share of the measured one: between
0.73x and 1.19x of it on the lent H100's host, and 1.6x apart between two identical runs of one call (W1 and
GPT-2-XL plans, ``BENCHMARKS.md``, 2026-11-24, fifth session). ``T_host`` is the mean of the pipeline at the measured
rate and at this share of it."""

CAST_STREAMS = 2
"""The offloaded optimizer's copy streams that cast on the device (gradients down, weights up): a buffer of
``CPUOffloadConfig.cast_chunk_bytes`` each (``Streams.copy_cast``)."""

DEVICE_ADAM_BYTES_PER_PARAM = 28
"""Fused AdamW on the device per fp32 parameter: reads weight, gradient and two moments (16 B), writes weight and
moments (12 B)."""

DEVICE_MASTER_ADAM_BYTES_PER_PARAM = 40
"""The same for bf16 weights with fp32 device masters, stepped chunk by chunk: the bf16 gradient upcast into fp32
scratch (read 2, write 4), the fused step on the master (28), the master cast into the bf16 weight (read 4,
write 2)."""

HOST_BYTES_PER_PARAM = 12
"""Host memory per offloaded parameter: fp32 master (4) and AdamW's two moments (8)."""

ALLOCATOR_MARGIN = {"default": 0.08, "expandable_segments": 0.03}
"""Reserved beyond allocated, as a fraction of the budget, when the profile did not measure it. The caching
allocator rounds large blocks to 2 MiB and cannot reuse a freed segment for a bigger tensor; plans that mix kept,
recomputed and offloaded blocks free and allocate many sizes. ``expandable_segments:True`` maps more memory into
one segment instead, which leaves little of it unusable. (Values argued. A measured profile measures both
settings on a plain step instead: on the H100, W1's plain step held 3.4 GiB beyond its 52.2 GiB allocated with the
default allocator, and planned W1 steps 1.6-2.4 GiB; GPT-2-XL's about 4.2 GiB, plain or planned, ``BENCHMARKS.md``.)"""

PINNED_ACTIVATION_SHARE = 1.0
"""Host bytes the activation pool needs per offloaded byte of one micro-batch (the pool holds a whole micro-batch
of offloaded activations; slots are reused across micro-batches)."""

LAYOUTS: dict[str, tuple[str, str]] = {
    "fp32": ("float32", "float32"),
    "fp32-offload-bf16": ("float32", "bfloat16"),
    "bf16": ("bfloat16", "bfloat16"),
}
"""Weight layouts by name: (device weight dtype of resident parameters, device dtype of offloaded parameters).
fp32 weights run under autocast; ``fp32-offload-bf16`` keeps the offloaded weights in bf16 on the device
(``param_dtype=torch.bfloat16``) with fp32 masters on the host; ``bf16`` is the whole model in bf16 with fp32
masters in the optimizer on both sides (no autocast)."""


@dataclass(frozen=True)
class Decisions:
    """Everything a plan decides, in the form the cost model reads."""

    options: tuple[Option, ...]
    """One per block."""
    offload_blocks: tuple[bool, ...]
    """Per block: its parameters' optimizer state and step on the host."""
    offload_other: bool = False
    """The parameters outside the blocks (embeddings, final norm, head) on the host."""
    offload_head: bool = False
    """Of those, the ones after the blocks alone (an untied output head, a final norm:
    ``HeadProfile.after_params``) on the host, the embeddings on the device: with clipping the embeddings' host step
    would stand before the next forward's first kernel, the head's runs beside the blocks' forward. Implied by
    ``offload_other``."""
    stream_blocks: tuple[bool, ...] = ()
    """Per block: its parameters' optimizer state lives on the host but steps on the device, streamed through a small
    device ring (``CPUOffloadOptimizer(stream_params=...)``); empty: no block. A block streams or steps on the host
    (``offload_blocks``), never both."""
    split_share: float = 0.0
    """Of each streamed block, the share of its parameters that steps on the host instead (its largest tensors,
    :func:`~elbowroom.plan.streaming.split_on_host`): the block's optimizer split between the host and the link, so
    that both work through the backward. 0: streamed blocks stream whole."""
    layout: str = "fp32"
    """A key of :data:`LAYOUTS`."""
    micro_batch: int = 1
    accumulation: int = 1
    fused_loss: bool = False
    expandable_segments: bool | None = None
    """The caching allocator's ``expandable_segments`` as the plan sets it; None: as the process runs (on CPU, or
    where the plan may not set it), priced as the defaults."""
    grad_clipping: bool = True
    """The loop clips gradients (or uses a GradScaler): the host step starts after the whole backward."""
    offload_gradients: bool = False  # offloaded parameters' gradients leave the device in the backward
    persistent_gradients: bool = False
    """Every gradient exists for the whole step, the forward too: DDP's buckets (its ``.grad`` are views of them)."""
    offload_config: Any = None
    """The CPU-offloaded optimizer's engine settings (``CPUOffloadConfig``; None: its defaults), whose staging
    slots the plan prices."""

    def __post_init__(self) -> None:
        if self.stream_blocks and len(self.stream_blocks) != len(self.offload_blocks):
            raise ValueError(f"stream_blocks has {len(self.stream_blocks)} entries, offload_blocks "
                             f"{len(self.offload_blocks)}: one per block (or none)")
        both = [i for i, (o, st) in enumerate(zip(self.offload_blocks, self.stream_blocks)) if o and st]
        if both:
            raise ValueError(f"block {both[0]} both steps on the host and streams: a block's optimizer is on the "
                             "device, on the host (offload_blocks) or streamed (stream_blocks)")
        if not 0.0 <= self.split_share < 1.0:
            raise ValueError(f"split_share is a share of a streamed block's parameters in [0, 1), got "
                             f"{self.split_share}")

    @property
    def streamed(self) -> tuple[bool, ...]:
        """Per block: streamed (``stream_blocks``, all False when it is empty)."""
        return self.stream_blocks or (False,) * len(self.offload_blocks)

    @property
    def streams(self) -> bool:
        """Some block streams its optimizer state."""
        return any(self.stream_blocks)

    @property
    def offloads_params(self) -> bool:
        """Some optimizer state lives on the host (stepped there or streamed)."""
        return self.offload_other or self.offload_head or any(self.offload_blocks) or self.streams

    @property
    def optimizer_config(self) -> Any:
        """The ``CPUOffloadConfig`` the optimizer is built with: ``offload_config``, or its defaults."""
        return self.offload_config if self.offload_config is not None else _default_offload_config()


@functools.lru_cache(maxsize=1)
def _default_offload_config() -> Any:
    """``CPUOffloadConfig()``, made once (it is frozen; the search reads it thousands of times)."""
    from elbowroom.optim.config import CPUOffloadConfig

    return CPUOffloadConfig()


@dataclass(frozen=True)
class BlockCost:
    """What the cost model predicts for one block and one micro-batch."""

    kept_bytes: int
    offloaded_bytes: int
    recomputed_bytes: int
    """Bytes rematerialised by recompute in backward (the saved set less what was kept)."""
    seconds: float
    """Forward + backward + recompute + exposed copies of one micro-batch."""


@dataclass(frozen=True)
class Prediction:
    """The cost model's answer for one set of decisions."""

    peak_bytes: int
    """Peak device memory incl. the allocator margin."""
    peak_phase: str
    """Where the peak falls (``forward block i``, ``forward end``, ``backward block i``)."""
    step_seconds: float
    memory: dict[str, int] = field(default_factory=dict)
    """Breakdown of the peak by component."""
    time: dict[str, float] = field(default_factory=dict)
    """Breakdown of the step time by component."""
    blocks: tuple[BlockCost, ...] = ()
    host_bytes: int = 0
    """Host memory the plan needs (optimizer state and the pinned activation pool)."""


# ---------------------------------------------------------------------------------------------- globals
def _optimizer_config(d: Decisions) -> tuple[int, int, int]:
    """(bucket_bytes, num_staging_slots, device_chunk_numel) of the CPU-offloaded optimizer's config (the one
    :func:`~elbowroom.plan.apply.apply` builds it with)."""
    cfg = d.optimizer_config
    return int(cfg.bucket_bytes), int(cfg.num_staging_slots), int(cfg.device_chunk_numel)


def autocast_profiled(profile: Profile) -> bool:
    """Whether the profile ran fp32 weights under a lower-precision autocast (its times include the casts)."""
    return profile.param_dtype == "float32" and profile.compute_dtype in ("bfloat16", "float16")


def layouts_for(profile: Profile, precision: str) -> tuple[list[str], list[str]]:
    """The weight layouts a search may use, and notes on what was left out and why."""
    if precision == "fp32":
        return ["fp32"], []
    if profile.compute_dtype not in ("bfloat16", "float16"):
        return ["fp32"], [
            f"bf16 weights need a profile taken in bf16 (autocast or bf16 weights); this one computed in "
            f"{profile.compute_dtype}: fp32 weights only"
        ]
    return list(LAYOUTS), []


@dataclass(frozen=True)
class Globals:
    """The terms of memory and time that do not depend on the per-block options."""

    states: int
    """Model states (weights, gradients, optimizer state on the device), optimizer buffers, rank_transient_bytes."""
    transient_grads: int
    """The resident gradients that exist only from the backward on (``M - M'``; 0 under accumulation)."""
    head_grads: int
    """``G_h`` when the gradients are transient (else 0): the resident gradients outside the blocks."""
    streamed_grads: int
    """The streamed blocks' gradients when the gradients are transient (else 0: in ``states``), each held from its
    block's backward to its forward in the next step (:func:`streamed_gradient_bytes`)."""
    head: int
    """Head and loss at the forward's end (saved + transient), scaled; under FSDP2 with the root's parts in units of
    their own, plus their gathered parameters and gradients (``Profile.rank_head_transient_bytes``)."""
    cache: int
    """Autocast's weight cache when no block has a policy."""
    backward_work: int
    """2 In_max + L_max (scaled) + G: working memory of one block's backward."""
    largest: int
    """L_max, scaled."""
    compute_s: float
    """s (sum F + B + head - X_0) + X: one micro-batch without recompute or copies."""
    cast_s: float
    device_step_s: float
    host_step_s: float
    """The whole host step (for the breakdown)."""
    host_exposed_s: float
    host_bytes: int
    """Host memory of the optimizer state."""


@dataclass(frozen=True)
class _Sums:
    """Per-profile sums the search reads thousands of times."""

    num_params: int
    block_params: tuple[int, ...]
    base_s: float
    largest: int
    in_max: int
    params_max: int
    saved: np.ndarray
    largest_each: np.ndarray
    input_each: np.ndarray


_SUMS: dict[int, tuple[Profile, _Sums]] = {}


def _sums(profile: Profile) -> _Sums:
    got = _SUMS.get(id(profile))
    if got is not None and got[0] is profile:
        return got[1]
    blocks, head = profile.blocks, profile.head
    sums = _Sums(
        num_params=profile.num_params,
        block_params=tuple(b.num_params for b in blocks),
        base_s=sum(b.forward_s + b.backward_s for b in blocks) + head.forward_s + head.backward_s,
        largest=max((b.largest_saved_bytes for b in blocks), default=0),
        in_max=max((b.input_bytes for b in blocks), default=0),
        params_max=max((b.num_params for b in blocks), default=0),
        saved=np.array([b.total_saved_bytes for b in blocks], dtype=np.float64),
        largest_each=np.array([b.largest_saved_bytes for b in blocks], dtype=np.float64),
        input_each=np.array([b.input_bytes for b in blocks], dtype=np.float64),
    )
    if len(_SUMS) > 16:
        _SUMS.clear()
    _SUMS[id(profile)] = (profile, sums)  # the profile is held, so its id is not reused while cached
    return sums


def _param_split(profile: Profile, d: Decisions) -> tuple[int, int, int]:
    """Parameters (stepped on the device, stepped on the host, streamed)."""
    sums = _sums(profile)
    host, stream = optimizer_parts(profile, d)
    p_off = sum(host) + sum(outside_on_host(profile, d))
    p_str = sum(stream)
    return sums.num_params - p_off - p_str, p_off, p_str


def fp32_offloaded_params(profile: Profile, d: Decisions) -> int:
    """Offloaded parameters that keep fp32 device copies in the ``fp32-offload-bf16`` layout: those before the
    blocks (the embedding tables, :func:`~elbowroom.plan.apply.build_optimizer`), whose output is the residual
    stream that autocast keeps in fp32, as the profile measured it; else 0."""
    weight, off_dtype = LAYOUTS[d.layout]
    if not d.offload_other or weight != "float32" or off_dtype != "bfloat16":
        return 0
    return profile.head.before_params


def state_bytes(profile: Profile, d: Decisions) -> int:
    """Model states on the device and the optimizer's device buffers (see the module docstring)."""
    p_res, p_off, p_str = _param_split(profile, d)
    weight, off_dtype = LAYOUTS[d.layout]
    halve = 2 if d.offload_gradients else 1
    off_per = (8 if off_dtype == "float32" else 4) // halve  # weight (+ gradient)
    total = 16 * p_res + off_per * p_off + (8 // halve - off_per) * fp32_offloaded_params(profile, d)
    total += streaming.device_bytes_per_param(off_dtype) * p_str + streaming.ring_bytes(profile, d)
    if not transient_gradients(d):  # streamed gradients held the whole step (else their phases hold them)
        total += sum(streamed_gradient_bytes(profile, d))
    bucket, slots, chunk = _optimizer_config(d)
    if p_off:
        # each staging slot holds one bucket of gradients (at most bucket_bytes; the whole offloaded set when smaller)
        total += slots * min(bucket, (off_per // 2) * p_off)
        if off_dtype == "bfloat16" and d.optimizer_config.cast_on_device:
            total += CAST_STREAMS * int(d.optimizer_config.cast_chunk_bytes)  # the copy streams' cast buffers
    if weight == "bfloat16" and p_res:
        total += 4 * min(chunk, p_res)
    return total


def transient_gradients(d: Decisions) -> bool:
    """Whether gradients exist only from the backward on: not under accumulation (they live through every later
    micro-batch's forward), nor in DDP's buckets (from their construction on)."""
    return d.accumulation == 1 and not d.persistent_gradients


def streamed_gradient_bytes(profile: Profile, d: Decisions) -> tuple[int, ...]:
    """Each block's streamed gradients, in the offloaded weights' dtype. The optimizer holds them from the backward
    until the block's forward pre-hook in the next step (``Handover.release_grads``: the compute stream must wait for
    the link's reads first), however soon its job on the link ends; :mod:`~elbowroom.plan.phases` counts them in the
    phases they live through."""
    per = 4 if LAYOUTS[d.layout][1] == "float32" else 2
    return tuple(per * p for p in optimizer_parts(profile, d)[1])


def gradient_bytes(profile: Profile, d: Decisions) -> tuple[int, tuple[int, ...]]:
    """(``G_h``, ``G_i`` per block): gradient bytes of the device-resident parameters, outside and in the blocks (a
    streamed block's are not counted: :func:`~elbowroom.plan.streaming.device_bytes_per_param`)."""
    per = 2 if LAYOUTS[d.layout][0] == "bfloat16" else 4
    blocks = tuple(0 if o or st else per * n
                   for n, o, st in zip(_sums(profile).block_params, d.offload_blocks, d.streamed))
    head = per * (profile.head.num_params - sum(outside_on_host(profile, d)))
    return head, blocks


def globals_for(profile: Profile, d: Decisions) -> Globals:
    """The global terms for decisions ``d`` (its per-block options are not read)."""
    m = profile.machine
    s = d.micro_batch / profile.micro_batch
    blocks, head = profile.blocks, profile.head
    weight, off_dtype = LAYOUTS[d.layout]
    p_res, p_off, p_str = _param_split(profile, d)
    autocast = profile.compute_dtype in ("bfloat16", "float16")
    # autocast casts fp32 device weights every micro-batch, unless they arrive cast (FSDP2's all-gathers)
    casts = autocast and not profile.gathered_in_compute_dtype
    # parameters in fp32 on the device that autocast casts every micro-batch
    if not casts or weight == "bfloat16":
        p32 = 0
    elif off_dtype == "bfloat16":
        p32 = p_res
    else:
        p32 = _sums(profile).num_params
    bwm = m.memory_bandwidth if m.memory_bandwidth > 0 else math.inf
    cast_s = p32 * CAST_BYTES_PER_PARAM / bwm
    sums = _sums(profile)
    cast0 = sums.num_params * CAST_BYTES_PER_PARAM / bwm if autocast_profiled(profile) else 0.0
    base = sums.base_s
    compute_s = s * max(0.0, base - cast0) + cast_s
    per = DEVICE_MASTER_ADAM_BYTES_PER_PARAM if weight == "bfloat16" else DEVICE_ADAM_BYTES_PER_PARAM
    device_step_s = (p_res * per + p_str * streaming.ADAM_BYTES_PER_PARAM) / bwm + streaming.launch_seconds(profile, d)
    host_step_s, host_exposed_s = _host_step(profile, d, device_step_s)

    in_last = blocks[-1].input_bytes if blocks else 0
    head_params_cast = 2 * head.num_params if (casts and weight == "float32") else 0
    if d.fused_loss:
        head_b = s * 2 * in_last + fused_transient_bytes(profile, s) + 4 * head.num_params
    else:
        head_b = s * (head.saved_bytes + head.logits_transient_bytes) + head_params_cast
    block_params_32 = 0 if (not casts or weight == "bfloat16") else sum(
        n for n, o, st in zip(sums.block_params, d.offload_blocks, d.streamed)
        if not ((o or st) and off_dtype == "bfloat16")
    )
    cache = 2 * block_params_32
    largest, in_max = sums.largest, sums.in_max
    grad_t = 2 * sums.params_max if (autocast and weight == "float32") else 0
    g_head, g_blocks = gradient_bytes(profile, d)
    transient = transient_gradients(d)
    og_bytes = _offloaded_gradient_bytes(profile, d)
    return Globals(
        states=state_bytes(profile, d) + profile.rank_transient_bytes,
        transient_grads=g_head + sum(g_blocks) if transient else 0,
        head_grads=g_head if transient else 0,
        streamed_grads=sum(streamed_gradient_bytes(profile, d)) if transient else 0,
        head=int(math.ceil(head_b)) + profile.rank_head_transient_bytes,  # (FSDP2's root units: gathered here)
        cache=cache,
        backward_work=int(math.ceil(s * (2 * in_max + largest))) + grad_t + gradient_backlog_bytes(profile, d),
        largest=int(math.ceil(s * largest)),
        compute_s=compute_s,
        cast_s=cast_s,
        device_step_s=device_step_s,
        host_step_s=host_step_s,
        host_exposed_s=float(host_exposed_s),
        host_bytes=int(HOST_BYTES_PER_PARAM * (p_off + p_str)) + og_bytes,
    )


def fused_transient_bytes(profile: Profile, s: float) -> float:
    """One chunk's logits of ``linear_cross_entropy`` at ``s`` times the profile's micro-batch: they grow with the
    tokens up to one chunk (``HeadProfile.fused_chunk_tokens``) and no further. Scaling the profile's bytes by ``s``
    alone priced a micro-batch smaller than the profile's below one chunk of the tokens it runs, and a larger one
    above it (W1 profiled at 1x2048: 2x4096 at 0.49 GiB, 4x4096 at 0.98 GiB, where one 4096-token chunk is 0.49)."""
    head = profile.head
    chunk, tokens = head.fused_chunk_tokens, profile.tokens
    if chunk <= 0 or tokens <= 0:  # an older profile, without the chunk size
        return s * head.fused_transient_bytes
    return head.fused_transient_bytes * min(s * tokens, chunk) / min(tokens, chunk)


def gradient_backlog_bytes(profile: Profile, d: Decisions) -> int:
    """``offload_gradients``: the most device gradient bytes of host-stepped blocks that wait for their copy at the
    start of a block's backward, else 0. Each is freed only once its copy (4 B per parameter, one after another over
    the link shared with the weights coming back) has run, and a block's backward can outpace that (the 7B shape:
    ~10 ms of backward against ~18 ms of copy per block). Without clipping, streamed blocks' states share that
    direction in the backward, in the order the jobs are ready (:mod:`elbowroom.plan.host_pipeline`). Recompute is
    left out of the backward's time, which errs on the large side."""
    if not d.offload_gradients:
        return 0
    blocks, m = profile.blocks, profile.machine
    bw = m.duplex_bandwidth if m.duplex_bandwidth > 0 else math.inf
    s = d.micro_batch / profile.micro_batch
    weight, off_dtype = LAYOUTS[d.layout]
    per = 2 if "bfloat16" in (weight, off_dtype) else 4  # a host-stepped parameter's device gradient
    t, copied, worst = s * profile.head.backward_s, -math.inf, 0
    waiting: list[tuple[float, int]] = []  # (its copy done, bytes)
    host, stream = optimizer_parts(profile, d)
    if d.grad_clipping:
        stream = (0,) * len(blocks)  # (with clipping: after the backward)
    for j in range(len(blocks) - 1, -1, -1):
        worst = max(worst, sum(b for done, b in waiting if done > t))  # as block j's backward starts
        t += s * blocks[j].backward_s
        if host[j]:
            copied = max(copied, t) + OPTIMIZER_LINK_BYTES_PER_PARAM * host[j] / bw
            waiting.append((copied, per * host[j]))
        if stream[j]:  # its states take the same direction, in the order the jobs are ready
            copied = max(copied, t) + stream_link_seconds(stream[j], bw)
    return max(worst, sum(b for done, b in waiting if done > t))


def _offloaded_gradient_bytes(profile: Profile, d: Decisions) -> int:
    """Bytes of the pinned host copies of the host-stepped parameters' gradients (``offload_gradients``), else 0:
    in the dtype the gradients are staged in, fp32 unless bf16 device weights are cast on the host
    (``CPUOffloadConfig.cast_on_device`` off)."""
    if not d.offload_gradients:
        return 0
    per = 4 if (LAYOUTS[d.layout][1] == "float32" or d.optimizer_config.cast_on_device) else 2
    return int(per * _param_split(profile, d)[1])  # (streamed gradients stay on the device)


def host_terms(profile: Profile, d: Decisions, device_step_s: float, rate_scale: float = 1.0,
               extra_backward_s: Any = None) -> tuple[float, float]:
    """(the whole host step, the part of it the device does not hide) with the host optimizer at ``rate_scale`` times
    the measured rate: the pipeline of the module docstring, with or without ``offload_gradients``.
    ``extra_backward_s``: seconds each block's backward runs besides its own (its recompute, unscaled), which hide
    host work too; the prices leave them out so that the search's cost stays a sum.

    Offloaded gradients were priced as the whole host step exposed until their host copies became fp32: with bf16
    host gradients the host step ran the upcast path (W1, H100, 8 GiB: the forward waited 0.41 s of a 0.47 s host
    step at 2.5-2.9 G params/s, where the fp32 kernel steps 3.8-4.3), and priced as the pipeline the planner took them
    at 16 GiB and lost 9 points of plain's speed to a host step 33% slower."""
    return host_exposed_seconds(profile, d, device_step_s, rate_scale, extra_backward_s)


_HOST: dict[tuple[Any, ...], tuple[Profile, float, float, float]] = {}
_HOST_CACHE_SIZE = 1 << 15
"""Placements :func:`_host_step` keeps. The search weighs every placement for each weight layout in turn (the layouts
are its outer loop), so the cache must hold one layout's pass: a 100-block search weighs some 5,000 placements, and
a cache of 4,096 cleared itself within each pass and priced every placement once per layout."""


def _host_step(profile: Profile, d: Decisions, device_step_s: float) -> tuple[float, float]:
    """(the whole host step, its exposed part): the host step's pace varies between runs (:data:`HOST_STEP_SPREAD`),
    so the exposed part is the mean of the pipeline at the measured rate and at the slow end, and a plan that leans on
    the host step hiding pays for the risk it takes. Cached on what the pipeline reads (its lateness, from which each
    device step takes its own share): the search asks again for every weight layout, head and loss choice of one
    placement."""
    _, whole, late, late_slow = _host_pipeline(profile, d)
    return whole, float(0.5 * (max(0.0, late - device_step_s) + max(0.0, late_slow - device_step_s)))


def _host_pipeline(profile: Profile, d: Decisions) -> tuple[Profile, float, float, float]:
    """(profile, the whole host step, its lateness at the measured rate and at the slow end of its spread), cached
    for :func:`_host_step`."""
    key = (id(profile), d.offload_blocks, d.stream_blocks, d.split_share, d.offload_other, d.offload_head,
           d.micro_batch, d.grad_clipping, d.offload_gradients, d.optimizer_config.step_order)
    got = _HOST.get(key)
    if got is None or got[0] is not profile:
        whole, late = host_lateness(profile, d)
        got = (profile, whole, late, host_lateness(profile, d, HOST_STEP_SPREAD)[1])
        if len(_HOST) > _HOST_CACHE_SIZE:
            _HOST.clear()
        _HOST[key] = got  # the profile is held, so its id is not reused while cached
    return got


def step_seconds(g: Globals, scale: float, accumulation: int, block_cost_sum: float) -> float:
    """``A (compute + s sum_i c_i) + T_dev + T_host``: the one expression of the step time (search and predict)."""
    return accumulation * (g.compute_s + scale * block_cost_sum) + g.device_step_s + g.host_exposed_s


def measured_margin(profile: Profile, expandable_segments: bool | None) -> int:
    """The allocator overhead the profile measured for this setting (0: not measured)."""
    if expandable_segments:
        return int(profile.allocator_overhead_expandable_bytes)
    return int(profile.allocator_overhead_bytes)


def margin_bytes(profile: Profile, budget_bytes: int, expandable_segments: bool | None) -> int:
    """The allocator's margin: measured when the profile has it (for this setting), else a fraction of the budget."""
    got = measured_margin(profile, expandable_segments)
    if got > 0:
        return got
    frac = ALLOCATOR_MARGIN["expandable_segments" if expandable_segments else "default"]
    return int(frac * budget_bytes)


def duplex_share(d: Decisions) -> float:
    """``w``: the share of micro-batches whose copies share the link with the optimizer's."""
    return 1.0 / d.accumulation if d.offloads_params else 0.0


def stream_share(d: Decisions, profile: Profile | None = None) -> float:
    """The share of micro-batches' copies that share their direction of the link with streamed optimizer states: ``w``
    times the share of the window they stream in that the streamed states hold the link (12 B per streamed parameter
    each way at the duplex rate, against the backward, or with clipping the forward, of one micro-batch), 0 when no
    block streams. Without ``profile``, ``w`` (the whole window held: the safe side)."""
    w = duplex_share(d) if d.streams else 0.0
    if not w or profile is None:
        return w
    bw = profile.machine.duplex_bandwidth
    p_str = sum(optimizer_parts(profile, d)[1])
    s = d.micro_batch / profile.micro_batch
    window = s * sum((b.forward_s if d.grad_clipping else b.backward_s) for b in profile.blocks)
    if bw <= 0 or window <= 0:
        return w
    return w * min(1.0, stream_link_seconds(p_str, bw) / window)


def link_shares(d: Decisions, profile: Profile | None = None) -> tuple[float, float]:
    """(:func:`duplex_share`, :func:`stream_share`): the arguments of
    :meth:`~elbowroom.plan.options.BlockTables.cost`."""
    return duplex_share(d), stream_share(d, profile)


# ---------------------------------------------------------------------------------------------- predict
def predict(
    profile: Profile, d: Decisions, budget_bytes: int, *, prefetch_window_bytes: int | None = None
) -> Prediction:
    """Peak memory and step time of ``d`` on ``profile`` (the equations of the module docstring).

    Args:
        profile: what the model and machine cost.
        d: the decisions, one option per block.
        budget_bytes: the budget (the allocator margin is a fraction of it when the profile did not measure it).
        prefetch_window_bytes: the offload engine's prefetch window (its default when None).

    Returns:
        The prediction, with breakdowns.
    """
    n = len(profile.blocks)
    if len(d.options) != n or len(d.offload_blocks) != n or len(d.streamed) != n:
        raise ValueError(f"decisions for {len(d.options)} blocks, profile has {n}")
    if prefetch_window_bytes is None:
        from elbowroom.activations.offload import DEFAULT_PREFETCH_WINDOW_BYTES

        prefetch_window_bytes = DEFAULT_PREFETCH_WINDOW_BYTES
    s = d.micro_batch / profile.micro_batch
    tab = block_tables(profile)
    idx = np.array([OPTIONS.index(o) for o in d.options], dtype=np.int64)
    rows = np.arange(n)
    g = globals_for(profile, d)
    cost = tab.chosen(idx, *link_shares(d, profile))
    block_sum = 0.0
    for c in cost[::-1]:
        block_sum += float(c)  # last block first, as the search's programme adds them
    step = step_seconds(g, s, d.accumulation, block_sum)

    ph = phases.phases(profile, g, d, idx, prefetch_window_bytes)
    kept, off, saved = ph.kept, ph.off, ph.saved
    margin = margin_bytes(profile, budget_bytes, d.expandable_segments)
    at = int(ph.values.argmax())
    phase, parts = ph.describe(at)
    states = g.states - g.transient_grads
    held = profile.rank_transient_bytes  # FSDP2's gathers, shown apart from the model states they are added to
    memory = {"model states": states - held, **({"FSDP2 gathered parameters and gradients": held} if held else {}),
              **{k: v for k, v in parts.items() if v}, "allocator margin": margin}
    peak = states + int(ph.values[at]) + margin

    rec = tab.recompute[rows, idx]
    x = cost - rec
    base_block = [s * (b.forward_s + b.backward_s) for b in profile.blocks]
    blocks = tuple(
        BlockCost(
            kept_bytes=int(kept[i]),
            offloaded_bytes=int(off[i]),
            recomputed_bytes=max(0, int(saved[i] - kept[i] - off[i])),
            seconds=base_block[i] + s * float(cost[i]),
        )
        for i in range(n)
    )
    launches = streaming.launch_seconds(profile, d)  # (in the device step's term, shown apart)
    time = {
        "compute": d.accumulation * (g.compute_s - g.cast_s),
        "autocast casts": d.accumulation * g.cast_s,
        "recompute": d.accumulation * s * float(rec.sum()),
        "exposed activation copies": d.accumulation * s * float(x.sum()),
        "device optimizer step": g.device_step_s - launches,
        **({"streamed chunks (measured overhead)": launches} if launches else {}),
        "host optimizer step (whole)": g.host_step_s,
        # (the part the device does not hide: of the host's step, and of the streamed states' trips over the link)
        ("host and streamed optimizer steps (exposed)" if d.streams else "host optimizer step (exposed)"):
            g.host_exposed_s,
    }
    pool = int(PINNED_ACTIVATION_SHARE * int(off.sum()))
    return Prediction(
        peak_bytes=int(peak),
        peak_phase=phase,
        step_seconds=step,
        memory=memory,
        time=time,
        blocks=blocks,
        host_bytes=g.host_bytes + pool,
    )

