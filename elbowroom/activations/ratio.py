"""Offload ratios (haiscale's CPUOffload semantics): measure a tag's saved tensors once, then pick the largest.

The first entry of a tag offloads every eligible tensor and records their sizes; later entries offload
the largest tensors until ``ratio`` of those bytes, and measure again if the region's tensors change.
"""

from __future__ import annotations

import logging

logger = logging.getLogger(__name__)


class _RatioState:
    """Per (tag, kind): sizes measured at the tag's first entry and the indices chosen to offload."""

    def __init__(self, ratio: float) -> None:
        self.ratio = ratio
        self.measured: list[int] | None = None
        self.chosen: frozenset[int] | None = None

    def choose(self, sizes: list[int]) -> None:
        self.measured = list(sizes)
        total = sum(sizes)
        target = self.ratio * total
        picked, acc = [], 0
        for i in sorted(range(len(sizes)), key=lambda i: (-sizes[i], i)):
            if acc >= target:
                break
            picked.append(i)
            acc += sizes[i]
        self.chosen = frozenset(picked)
        logger.debug("offload ratio %.3f: %d of %d tensors, %d of %d bytes", self.ratio, len(picked), len(sizes),
                     acc, total)


class _Entry:
    """One region's pass through a ratio state."""

    __slots__ = ("state", "sizes")

    def __init__(self, state: _RatioState) -> None:
        self.state = state
        self.sizes: list[int] = []

    def decide(self, nbytes: int) -> bool:
        i = len(self.sizes)
        self.sizes.append(nbytes)
        st = self.state
        if st.ratio >= 1.0:
            return True
        if st.ratio <= 0.0:
            return False
        if st.chosen is None:
            return True  # the measuring entry offloads everything, so the pool is sized for any plan
        return i in st.chosen

    def finish(self) -> None:
        st = self.state
        if 0.0 < st.ratio < 1.0:
            if st.chosen is None:
                if self.sizes:
                    st.choose(self.sizes)
            elif self.sizes != st.measured:
                logger.debug("offload region changed its saved tensors; measuring again")
                st.chosen = None
