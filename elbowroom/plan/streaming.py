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

__all__ = ["ADAM_BYTES_PER_PARAM", "LAUNCH_SECONDS_PER_CHUNK", "RING_BYTES_PER_ELEMENT", "chunks",
           "device_bytes_per_param", "launch_seconds", "ring_bytes"]

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
    """Device bytes per streamed parameter: its weight and gradient in the offloaded weights' dtype (it steps where its
    gradient is, also with ``offload_gradients``), the gradient held to the end of the step, and its bytes once more.

    Held to the end: with clipping its step waits for the global norm, with accumulation it adds up over the
    micro-batches, and stepped in the backward it is read by the link's stream at 12 B per parameter of state, which
    runs past the backward (the 7B shape: 14.5 GB each way for 6 streamed blocks against a 0.2 s backward). Priced as
    freed in the backward, plans at 72 and 76 GiB ran out of memory. Once more: it is freed only when the next forward
    reaches its block (after the stream wait on its step), so its memory comes back to the allocator late, and under a
    cap the allocator then retries, synchronizing with the states still queued on the link (the 7B shape at 76 GiB:
    3.9-4.2 GiB reserved beyond the allocated against 1.9-2.5 without streaming, and a step of 0.64-0.85 s where its
    others took 0.45, 320 ms of it in one retry; H100, ``BENCHMARKS.md``)."""
    item = 4 if offloaded_dtype == "float32" else 2
    return item + 2 * item


def ring_bytes(profile: Profile, d: Decisions) -> int:
    """The device ring the streamed states step through, 0 when no block streams: ``stream_slots`` slots of
    ``min(stream_slot_numel, largest streamed parameter)`` elements of master, two moments and the upcast gradient
    (:data:`RING_BYTES_PER_ELEMENT`). The profile knows the blocks' parameter counts, not their tensors': the largest
    streamed block's count (rounded up to 64) bounds its largest tensor."""
    largest = max((b.num_params for b, st in zip(profile.blocks, d.stream_blocks) if st), default=0)
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
    return sum(_block_chunks(b.signature, b.num_params, slot) for b, st in zip(profile.blocks, d.stream_blocks) if st)


@functools.lru_cache(maxsize=4096)
def _block_chunks(signature: str, num_params: int, slot: int) -> int:
    """One block's streamed chunks (the search asks for every placement it weighs: parsed once per signature)."""
    return sum(-(-n // slot) for n in (_signature_sizes(signature) or [num_params]))


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
