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
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from elbowroom.plan.cost import Decisions
    from elbowroom.plan.types import Profile

__all__ = ["ADAM_BYTES_PER_PARAM", "LAUNCH_SECONDS_PER_CHUNK", "RING_BYTES_PER_ELEMENT", "SPLIT_SHARES", "chunks",
           "device_bytes_per_param", "host_part", "launch_seconds", "ring_bytes", "split_on_host"]

SPLIT_SHARES = (1 / 3, 1 / 2, 2 / 3)
"""The shares of a split block's parameters the search tries on the host (``Decisions.split_share``): a streamed block
whose largest tensors step on the host and the rest stream, so that the host and the link both work through the
backward, each at the pace of its share. Streamed whole, the early blocks' states wait for their gradients at the
backward's end, and the next forward for them: W1 at 8 GiB on an H200 (13 blocks streamed, 11 on the host), the compute
stream idle 148 ms between steps while the link carried the early blocks' 8 GB each way; the same plan with every
block's fused gate-and-up and down projections on the host and the rest streamed ran at 79.0% of plain against 67.1%
(``ELBOWROOM_BENCH_SPLIT``, ``BENCHMARKS.md``)."""


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


def device_bytes_per_param(offloaded_dtype: str) -> int:
    """Device bytes per streamed parameter: its weight in the offloaded weights' dtype. Its gradient is not counted.

    It used to be, twice (weight + gradient + gradient again: 6 B in bf16), when streamed plans of W2 and of the 7B
    shape reserved 2-7 GiB beyond what they allocated (H100, the twelfth to fourteenth sessions); the count was the
    allocator's gap priced as gradients, and it kept W1 at 8 GiB from streaming at all. Measured since, that gap is
    gone and the gradient was never the allocation at the peak:

    - the allocated peaks of all 19 recorded streamed rows (W1, W2, the 7B shape; ``benchmarks/streamed_count_trial.py
      --check-rows``) are at or under their plans priced with the weight alone (the 7B shape at 48 GiB: 37.4-38.9
      GiB allocated against 38.7-40.9);
    - on an H200 (twenty-third session) plans made with the weight alone reserved within 1% of their predictions and
      inside their budgets: W2 at 12 GiB 11.96 GiB (11.98 predicted), W2 at 16 GiB 15.77 (15.68), W1 at 8 GiB 7.61
      (7.93), its allocated peak 6.07 GiB against 6.23.

    At the backward's peak a streamed block's gradient exists only from its own backward until its step, and the
    blocks that stream are the early ones (their backward comes last) or split with the host (their link keeps pace
    with the backward): what the phases' backward working set already holds. The 7B shape's tight streamed plans are
    the ones not measured again with this count."""
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
