"""What a streamed block costs: its optimizer state in host memory, stepped on the device
(``BlockPlan.optimizer_streamed``).

Part of the cost model (:mod:`elbowroom.plan.cost`, which adds these terms to its own): the streamed block's device
bytes, the ring its state steps through, the fused step's device traffic and the measured overhead of its chunks. Its
time on the link is the host pipeline's (:mod:`elbowroom.plan.host_pipeline`, 12 B per parameter each way). The
mechanism is :mod:`elbowroom.optim.stream_step`.
"""

from __future__ import annotations

import functools
import math
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from elbowroom.plan.cost import Decisions
    from elbowroom.plan.types import Profile

__all__ = ["ADAM_BYTES_PER_PARAM", "LAUNCH_SECONDS_PER_CHUNK", "RING_BYTES_PER_ELEMENT", "SPLIT_SHARES", "chunks",
           "device_bytes_per_param", "host_part", "launch_seconds", "optimizer_parts",
           "ring_bytes", "split_on_host"]

SPLIT_SHARES = (1 / 3, 1 / 2, 2 / 3)
"""The shares of a split block's parameters the search tries on the host (``Decisions.split_share``): a streamed block
whose largest tensors step on the host and the rest stream, so that the host and the link both work through the
backward, each at the pace of its share. Streamed whole, the early blocks' states wait for their gradients at the
backward's end, and the next forward for them: W1 at 8 GiB on an H200 (13 blocks streamed, 11 on the host), the compute
stream idle 148 ms between steps while the link carried the early blocks' 8 GB each way; the same plan with every
block's fused gate-and-up and down projections on the host and the rest streamed ran at 79.0% of plain against 67.1%
(``ELBOWROOM_BENCH_SPLIT``), and the planner's own split plan (every block at 1/2) at 76.2% and 78.1% in two calls,
0.97-1.00x its predicted step (``BENCHMARKS.md``, twenty-third session)."""


def split_on_host(sizes: tuple[int, ...] | list[int], share: float) -> tuple[bool, ...]:
    """Which of a split block's tensors (``sizes``: their element counts, in ``block.parameters()`` order) step on the
    host: the largest first, each taken where it brings the host's part nearer ``share`` of the block, the others
    streamed. The planner prices and ``apply`` builds the same choice (the block's signature lists the same sizes).
    W1's block at 2/3: the gate-and-up and the attention's input projection (69%)."""
    total = sum(sizes)
    target, got = share * total, 0
    host = [False] * len(sizes)
    for i in sorted(range(len(sizes)), key=lambda i: -sizes[i]):
        if abs(got + sizes[i] - target) < abs(got - target):
            host[i] = True
            got += sizes[i]
    return tuple(host)


@functools.lru_cache(maxsize=4096)
def host_part(signature: str, num_params: int, share: float) -> int:
    """Parameters of a block split at ``share`` that step on the host (:func:`split_on_host` on its signature's
    sizes; ``share`` of ``num_params`` where the signature lists none)."""
    if share <= 0:
        return 0
    sizes = _signature_sizes(signature)
    if not sizes:
        return int(round(share * num_params))
    return sum(n for n, h in zip(sizes, split_on_host(sizes, share)) if h)

ADAM_BYTES_PER_PARAM = 32
"""Fused AdamW on the device per streamed parameter, in its ring: reads master, gradient and two moments, writes
master, moments and the device weight (fp32 states; the weight and the gradient in the offloaded weights' dtype:
32 B with fp32 weights, 28 with bf16)."""

RING_BYTES_PER_ELEMENT = 16
"""Bytes per element of a slot of the streamed states' device ring: fp32 master, two moments and the upcast
gradient (``CPUOffloadConfig.stream_slot_numel``)."""

LAUNCH_SECONDS_PER_CHUNK = 0.4e-3
"""What each streamed tensor chunk (a parameter, or a ``stream_slot_numel`` piece of a bigger one) costs a step beyond
its link and device time, measured on GPT-2-XL at 24 GiB (H100, ``BENCHMARKS.md``): one plan with 13 blocks of 12
tensors streamed, and the same plan with those blocks stepped on the host instead, ran 57-71 ms apart per step
capped, and 74 ms apart with no activation offloaded (so not the activations' link): 0.37-0.47 ms per chunk, on a
backward bound by the host. The cause is not isolated: it is not the step thread's calls into torch, since packing the
small tensors into one slot and one fused call (a sixth of the calls) left it unchanged (call 10). Priced as exposed
on every model: on the 7B shape, whose backward is bound by the GPU, it errs on the slow side (about 35 ms for 5
blocks)."""


def optimizer_parts(profile: Profile, d: Decisions) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """Per block: (its parameters stepped on the host, its parameters streamed). A streamed block split at
    ``d.split_share`` has both (:func:`host_part`). Cached: the search and the host pipeline ask for every placement."""
    key = (id(profile), d.offload_blocks, d.stream_blocks, d.split_share)
    got = _PARTS.get(key)
    if got is not None and got[0] is profile:
        return got[1]
    host, stream = [], []
    for b, o, st in zip(profile.blocks, d.offload_blocks, d.streamed):
        h = b.num_params if o else host_part(b.signature, b.num_params, d.split_share) if st else 0
        host.append(h)
        stream.append(b.num_params - h if st else 0)
    if len(_PARTS) > _PARTS_CACHE_SIZE:
        _PARTS.clear()
    _PARTS[key] = (profile, (tuple(host), tuple(stream)))  # the profile is held, so its id is not reused while cached
    return _PARTS[key][1]


_PARTS: dict[tuple[Any, ...], tuple[Profile, tuple[tuple[int, ...], tuple[int, ...]]]] = {}
_PARTS_CACHE_SIZE = 1 << 15  # (as the cost model's host-step cache: one search pass of placements)


def device_bytes_per_param(offloaded_dtype: str) -> int:
    """Device bytes per streamed parameter the whole step: its weight in the offloaded weights' dtype. Its gradient,
    as many bytes again, lives from its block's backward to that block's forward in the next step
    (:func:`~elbowroom.plan.cost.streamed_gradient_bytes`, counted phase by phase in :mod:`~elbowroom.plan.phases`).

    The count's history (``BENCHMARKS.md``, twelfth to twenty-fourth sessions): weight, gradient and gradient again in
    every phase (6 B in bf16) kept W1 at 8 GiB from streaming at all, while the allocated peaks of all 19 recorded
    streamed rows stood at or under their plans priced with the weight alone. The weight alone then ran the 7B shape at
    48 GiB out of memory: its 9 streamed blocks sit after 11 device-resident ones that keep everything, whose forward
    and backward run while every streamed gradient is held. Counting a gradient twice where its job on the link
    outlasted the backward covered that case but priced W1's split plan at 8.56 GiB against the 7.59 it reserved:
    there every block streams, and each phase holds few activations beside the gradients it holds. Counted phase by
    phase, that plan is priced at 7.98 GiB and the 7B one at 50.56."""
    return 4 if offloaded_dtype == "float32" else 2


def ring_bytes(profile: Profile, d: Decisions) -> int:
    """The device ring the streamed states step through, 0 when no block streams: ``stream_slots`` slots of
    ``min(stream_slot_numel, largest streamed parameter)`` elements of master, two moments and the upcast gradient
    (:data:`RING_BYTES_PER_ELEMENT`). The profile knows the blocks' parameter counts, not their tensors': the largest
    streamed block's count (rounded up to 64) bounds its largest tensor."""
    largest = max((b.num_params - host_part(b.signature, b.num_params, d.split_share)
                   for b, st in zip(profile.blocks, d.stream_blocks) if st), default=0)
    if not largest:
        return 0
    cfg = d.optimizer_config
    numel = min(int(cfg.stream_slot_numel), -(-largest // 64) * 64)
    return int(cfg.stream_slots) * numel * RING_BYTES_PER_ELEMENT


def chunks(profile: Profile, d: Decisions) -> int:
    """The streamed tensor chunks: each parameter's elements over ``stream_slot_numel``, rounded up, the parameters'
    shapes read from the block signatures (the whole block as one parameter where a signature names none)."""
    if not d.streams:
        return 0
    slot = max(1, int(d.optimizer_config.stream_slot_numel))
    return sum(_block_chunks(b.signature, b.num_params, slot, d.split_share)
               for b, st in zip(profile.blocks, d.stream_blocks) if st)


@functools.lru_cache(maxsize=4096)
def _block_chunks(signature: str, num_params: int, slot: int, share: float = 0.0) -> int:
    """One block's streamed chunks (the search asks for every placement it weighs: parsed once per signature); split at
    ``share``, those of the tensors that stream."""
    sizes = _signature_sizes(signature)
    if not sizes:
        return -(-int(round((1.0 - share) * num_params)) // slot)
    host = split_on_host(sizes, share) if share > 0 else (False,) * len(sizes)
    return sum(-(-n // slot) for n, h in zip(sizes, host) if not h)


def launch_seconds(profile: Profile, d: Decisions) -> float:
    """What the streamed chunks cost the step beyond their link and device time (:data:`LAUNCH_SECONDS_PER_CHUNK`
    each)."""
    return LAUNCH_SECONDS_PER_CHUNK * chunks(profile, d)


def _signature_sizes(signature: str) -> list[int]:
    """Parameter sizes from a block signature such as ``GPT2Block(1600,4800x1600,...)`` (empty if it lists none)."""
    inside = signature[signature.find("(") + 1 : signature.rfind(")")] if "(" in signature else ""
    sizes = []
    for shape in filter(None, inside.split(",")):
        try:
            sizes.append(math.prod(int(x) for x in shape.strip().split("x")))
        except ValueError:
            return []
    return sizes
