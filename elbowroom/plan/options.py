"""The per-block options of a plan and what each costs: the bytes a block keeps, offloads and rematerialises, and the
seconds it adds (recompute, and what compute cannot hide of its copies), as arrays over blocks and options.

The equations are those of :mod:`elbowroom.plan.cost` ("Memory", per block, and ``c_i`` under "Time"); the cost
model adds the global terms and sums these. Nothing here touches a device.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from elbowroom.plan.types import BlockProfile, Profile

__all__ = ["GAP_LEVELS", "OPTIONS", "PREFETCH_LEAD_BLOCKS", "SHARED_LINK_SHARE", "BlockTables", "Option",
           "block_tables", "hiding_seconds", "offload_gaps", "option_bytes"]

SHARED_LINK_SHARE = 0.5
"""The share of a link direction's duplex rate that activation copies get while streamed optimizer states use the
same direction (two copies at once, each about half)."""


GAP_LEVELS = 6
"""How many blocks after a block's copies the cost model counts as hiding them, at most: the next block that
offloads makes the compute stream wait for them at its end (one region in flight), so the kept and recomputed blocks
between give them their compute (:func:`hiding_seconds`). The search carries the gap as a state of its programme
(six states); a gap beyond it is priced as this many blocks, on the safe side. W1's whole block (1.0 GiB, 19 ms at
54 GB/s) needs about six of its 3.5 ms forwards."""
PREFETCH_LEAD_BLOCKS = 3
"""How many blocks before its backward an offloaded block's tensors start back, at most: the activation engine's
default (``elbowroom.activations._wrap.PREFETCH_LEAD_BLOCKS``; a test checks the two agree). The blocks between
that offload nothing lend the copy their backward; the copy holds its bytes on the device from then on."""

DEFAULT_MIN_OFFLOAD_BYTES = 1 << 20
"""The offload engine's default smallest tensor it moves (``elbowroom.activations.offload``, whose import this
module avoids: the planner's import stays free of the engine; a test checks the two agree)."""


@dataclass(frozen=True)
class Option:
    """What one block does with its activations (the fields of :class:`~elbowroom.activations.BlockPolicy`)."""

    checkpoint: str = "none"
    offload_ratio: float = 0.0
    offload_input: bool = False

    @property
    def label(self) -> str:
        if self.checkpoint == "none":
            return "keep" if not self.offload_ratio else f"keep, offload {self.offload_ratio:g}"
        name = {"full": "recompute", "selective": "selective"}[self.checkpoint]
        if self.offload_input and self.checkpoint == "full":
            return name + ", offload input"
        if self.offload_input:
            return name + ", offload all"
        return name if not self.offload_ratio else f"{name}, offload {self.offload_ratio:g}"


OPTIONS: tuple[Option, ...] = (
    Option(),
    *(Option("none", r) for r in (0.25, 0.5, 0.75, 1.0)),
    Option("selective"),
    *(Option("selective", r) for r in (0.25, 0.5, 0.75)),
    Option("selective", 1.0, True),
    Option("full"),
    Option("full", 0.0, True),
)
"""The per-block choices the search considers, in order of preference on a tie (simplest first)."""


# ---------------------------------------------------------------------------------------------- per block
def ratio_bytes(sizes: tuple[int, ...], ratio: float, total: float) -> float:
    """Bytes the offload engine moves at ``ratio`` (:mod:`elbowroom.activations.ratio`): of the tensors of at
    least ``DEFAULT_MIN_OFFLOAD_BYTES``, the largest first until ``ratio`` of their bytes is reached, so one more
    whole tensor than the share may go (GPT-2-XL at 0.25: two of its 0.1 GiB MLP tensors, 42% of the block's
    bytes, which priced as 25% measured 1.44x its prediction). ``total x ratio`` when no sizes were recorded."""
    if not sizes:
        return ratio * total
    eligible = sorted((n for n in sizes if n >= DEFAULT_MIN_OFFLOAD_BYTES), reverse=True)
    target, acc = ratio * sum(eligible), 0
    for n in eligible:
        if acc >= target:
            break
        acc += n
    return float(acc)


def option_bytes(b: BlockProfile) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Kept, offloaded and extra (``S - k``) bytes of each of :data:`OPTIONS` for one block, unscaled (float64)."""
    S = float(b.total_saved_bytes)
    sel = float(min(b.selective_saved_bytes, b.total_saved_bytes))
    inp = float(min(b.input_bytes, sel))
    kept, off = [], []
    for o in OPTIONS:
        if o.checkpoint == "none":
            k_off = min(S, ratio_bytes(b.saved_sizes, o.offload_ratio, S))
            kept.append(S - k_off)
            off.append(k_off)
        elif o.checkpoint == "selective":
            k_off = sel if o.offload_input else min(sel - inp, ratio_bytes(b.kept_sizes, o.offload_ratio, sel - inp))
            kept.append(sel - k_off)
            off.append(k_off)
        else:
            kept.append(0.0 if o.offload_input else inp)
            off.append(inp if o.offload_input else 0.0)
    k, f = np.array(kept), np.array(off)
    return k, f, S - k


def hiding_seconds(profile: Profile) -> tuple[np.ndarray, np.ndarray]:
    """``(hide_f, hide_b)``, each ``(n, GAP_LEVELS)``: the compute that hides block ``i``'s copies out and back when
    the next block that offloads anything is ``i + g`` (``[i, g - 1]``), unscaled by the micro-batch.

    Out: the forward of blocks ``i+1 .. i+g`` (the engine makes the compute stream wait for a region's copies at the
    end of the next region that offloads; index ``n`` is the head's forward, the last block's copies leave under it).
    Back: the backward of blocks ``i+h .. i+1``, ``h = min(g, PREFETCH_LEAD_BLOCKS)`` (block ``i+h`` starts them back
    when its backward starts: :class:`elbowroom.activations._wrap.PrefetchChain`); the last block's under the
    head's. Gaps past :data:`GAP_LEVELS` count as that many blocks (the safe side)."""
    blocks = profile.blocks
    n = len(blocks)
    fwd = np.array([b.forward_s for b in blocks] + [profile.head.forward_s], dtype=np.float64)
    bwd = np.array([b.backward_s for b in blocks] + [0.0], dtype=np.float64)
    cf = np.concatenate(([0.0], np.cumsum(fwd)))  # cf[j] = sum of fwd[:j]
    cb = np.concatenate(([0.0], np.cumsum(bwd)))
    i = np.arange(n)[:, None]
    gaps = np.arange(1, GAP_LEVELS + 1)[None, :]
    end = np.minimum(i + gaps, n)  # last hiding index, inclusive
    hide_f = cf[end + 1] - cf[i + 1]
    end_b = np.minimum(i + np.minimum(gaps, PREFETCH_LEAD_BLOCKS), n)
    hide_b = cb[end_b + 1] - cb[i + 1]
    hide_b[n - 1, :] = profile.head.backward_s
    return hide_f, hide_b


def exposed_seconds(off: np.ndarray, hide_f: np.ndarray, hide_b: np.ndarray, bw_fwd: float, bw_bwd: float
                    ) -> np.ndarray:
    """What compute cannot hide of copies of ``off`` bytes (``(n, options)``) for every gap: ``(n, options, G)``."""
    if bw_fwd <= 0 or bw_bwd <= 0:
        return np.broadcast_to(np.where(off > 0, math.inf, 0.0)[:, :, None], (*off.shape, GAP_LEVELS)).copy()
    o = off[:, :, None]
    return (np.maximum(0.0, o / bw_fwd - hide_f[:, None, :]) + np.maximum(0.0, o / bw_bwd - hide_b[:, None, :]))


def offload_gaps(offloads: np.ndarray) -> np.ndarray:
    """Per block, the gap index (``g - 1``, at most ``GAP_LEVELS - 1``) to the next block that offloads, or to the
    head past the last block, for the blocks' offloading flags ``offloads`` (the exposure tables' third axis)."""
    n = len(offloads)
    out = np.empty(n, dtype=np.int64)
    nxt = n
    for i in range(n - 1, -1, -1):
        out[i] = min(nxt - i, GAP_LEVELS) - 1
        if offloads[i]:
            nxt = i
    return out


@dataclass(frozen=True)
class BlockTables:
    """Per-block, per-option arrays (shape ``(n, len(OPTIONS))``, the exposures ``(n, len(OPTIONS), GAP_LEVELS)``:
    by the gap to the next block that offloads), unscaled by the micro-batch."""

    kept: np.ndarray
    offloaded: np.ndarray
    extra: np.ndarray
    recompute: np.ndarray
    exposed_oneway: np.ndarray
    exposed_duplex: np.ndarray
    exposed_shared: np.ndarray
    """At :data:`SHARED_LINK_SHARE` of the duplex rate, and hidden by nothing: the streamed optimizer states hold the
    copies' direction, and what the copies take of the link they take from them."""

    @property
    def offloads(self) -> np.ndarray:
        """``(n, options)``: the option moves bytes over the link (it makes a region the engine waits at)."""
        return self.offloaded > 0

    def cost(self, w: float, shared: float = 0.0) -> np.ndarray:
        """Seconds per micro-batch of each option and gap, ``(n, options, GAP_LEVELS)`` (unscaled): recompute plus
        the copies' exposed time with a share ``w`` of micro-batches beside the optimizer's copies, of which
        ``shared`` (0 or ``w``) beside streamed ones. One expression, used by the search and by :func:`predict`."""
        # (terms of share 0 are left out: 0 * inf would be nan where a machine without a link makes copies
        # infinitely slow)
        out = self.recompute[:, :, None]
        for share, exposed in ((1.0 - w, self.exposed_oneway), (w - shared, self.exposed_duplex),
                               (shared, self.exposed_shared)):
            if share == 1.0:
                out = out + exposed
            elif share != 0.0:
                out = out + share * exposed
        return np.broadcast_to(out, self.exposed_oneway.shape)

    def chosen(self, idx: np.ndarray, w: float, shared: float = 0.0) -> np.ndarray:
        """Seconds per micro-batch of each block under options ``idx`` (unscaled), at the gaps they leave."""
        rows = np.arange(len(idx))
        gaps = offload_gaps(self.offloads[rows, idx])
        return self.cost(w, shared)[rows, idx, gaps]


_TABLES: dict[int, tuple[Profile, BlockTables]] = {}


def block_tables(profile: Profile) -> BlockTables:
    """The arrays of :class:`BlockTables` for a profile (cached per profile object: profiles are frozen)."""
    got = _TABLES.get(id(profile))
    if got is not None and got[0] is profile:
        return got[1]
    if len(_TABLES) > 16:
        _TABLES.clear()
    tables = _block_tables(profile)
    _TABLES[id(profile)] = (profile, tables)  # the profile is held, so its id is not reused while cached
    return tables


def _block_tables(profile: Profile) -> BlockTables:
    m = profile.machine
    n = len(profile.blocks)
    kept, off, extra, rec = ([] for _ in range(4))
    for b in profile.blocks:
        k, f, e = option_bytes(b)
        kept.append(k)
        off.append(f)
        extra.append(e)
        rec.append([b.recompute_s if o.checkpoint == "full" else b.selective_recompute_s
                    if o.checkpoint == "selective" else 0.0 for o in OPTIONS])
    shape = (n, len(OPTIONS))
    kept_a, off_a, extra_a, rec_a = (np.array(x, dtype=np.float64).reshape(shape) for x in (kept, off, extra, rec))
    hide_f, hide_b = hiding_seconds(profile)
    shared = SHARED_LINK_SHARE * m.duplex_bandwidth
    x1 = exposed_seconds(off_a, hide_f, hide_b, m.d2h_bandwidth, m.h2d_bandwidth)
    x2 = exposed_seconds(off_a, hide_f, hide_b, m.duplex_bandwidth, m.duplex_bandwidth)
    # beside streamed states nothing hides a copy: the link is their critical path, so every byte an activation
    # moves there delays them by its own time (the 7B shape's plan that offloaded 0.25 of ten kept blocks, priced as
    # hidden behind the blocks after them, ran 7% slower than the one that offloaded nothing)
    none = np.zeros_like(hide_f)
    x3 = exposed_seconds(off_a, none, none, shared, shared)
    return BlockTables(kept_a, off_a, extra_a, rec_a, x1, x2, x3)
