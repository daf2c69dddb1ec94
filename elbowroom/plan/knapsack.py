"""The per-block programme of the search (:mod:`elbowroom.plan.search`): for one profile, the least summed block seconds
at every memory capacity, and the options that reach it.

A multiple-choice knapsack over the blocks' :data:`~elbowroom.plan.cost.OPTIONS`, memory discretised in units that
depend on the profile only (never on the budget). The programme runs from the last block to the first and carries,
as a state, the gap to the next block that offloads anything: the compute that hides a block's copies depends on it
(:func:`~elbowroom.plan.options.hiding_seconds`, :data:`~elbowroom.plan.options.GAP_LEVELS` states), so the sum it
minimises is exactly the cost model's. One programme serves every capacity at once; a cap ``E`` on any block's
backward extra (a *level*) limits the options, for the search's peak bound.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from elbowroom.plan import options
from elbowroom.plan.options import OPTIONS
from elbowroom.plan.types import Profile

__all__ = ["KEEP", "Knapsack"]

KEEP = 0  # index of Option() in OPTIONS
_MAX_LEVELS = 16
"""Most caps ``E`` on a block's backward extra the outer grid tries (all distinct ones when fewer)."""


class Knapsack:
    """The per-block programme for one profile: units, levels and cached solutions."""

    def __init__(
        self, profile: Profile, tables: options.BlockTables, offload_ok: bool, prefetch_window: int,
        selective_ok: bool = True,
    ) -> None:
        self.profile = profile
        self.t = tables
        n = len(profile.blocks)
        self.n = n
        base = int(min(8192, max(2048, 40 * n)))
        total = float(tables.kept[:, KEEP].sum())
        self.unit0 = max(1.0, total / base)  # bytes per unit at the profile's micro-batch
        # rounding each block up adds at most one unit per block: room for every block kept whole
        self.M = base + n + 1
        self.units = np.ceil(tables.kept / self.unit0 - 1e-9).astype(np.int64)
        self._units = self.units.tolist()  # (the backtrack reads them one by one)
        self.offload_ok = offload_ok
        self.window = prefetch_window
        offloads = np.array([o.offload_ratio > 0 or o.offload_input for o in OPTIONS])[None, :]
        # an option that offloads moves whole tensors of at least the engine's smallest size: where a block has
        # none, it would move nothing and only pay the engine's hooks
        allowed_base = ~offloads | (tables.offloaded > 0) if offload_ok else ~offloads & (tables.offloaded <= 0)
        if not selective_ok:
            allowed_base &= np.array([o.checkpoint != "selective" for o in OPTIONS])[None, :]
        ex = np.unique(np.round(tables.extra[allowed_base], 0))
        ex = ex[ex > 0]
        if len(ex) > _MAX_LEVELS - 1:
            pick = np.unique(np.linspace(0, len(ex) - 1, _MAX_LEVELS - 1).round().astype(int))
            ex = ex[pick]
        self.levels = [0.0, *[float(e) for e in ex]]
        self.allowed = []
        self.level_off = []  # O_E: the largest offload among allowed options (unscaled)
        self.level_pool = []  # the most bytes the allowed options can offload in all (unscaled)
        for e in self.levels:
            a = allowed_base & (tables.extra <= e + 0.5)
            if e == 0.0:
                a = np.zeros_like(a)
                a[:, KEEP] = True
            self.allowed.append(a)
            offs = np.where(a, tables.offloaded, 0.0)
            self.level_off.append(float(offs.max()) if offs.size else 0.0)
            self.level_pool.append(float(offs.max(axis=1).sum()) if offs.size else 0.0)
        self.keep_units = int(self.units[:, KEEP].sum())
        self.min_units = [
            self.keep_units if li == 0 else int(np.where(self.allowed[li], self.units, 1 << 40).min(axis=1).sum())
            for li in range(len(self.levels))
        ]
        self._cache: dict[tuple[int, tuple[float, float]], np.ndarray] = {}
        self._choices: dict[tuple[int, tuple[float, float]], list[np.ndarray]] = {}
        self._picked: dict[tuple[int, tuple[float, float], int], np.ndarray] = {}

    def best(self, level: int, w: tuple[float, float]) -> np.ndarray:
        """Best summed block seconds (unscaled) for every capacity 0..M at cap level ``level``, with the link shared
        with the optimizer as ``w`` (:func:`cost.link_shares`) says."""
        key = (level, w)
        got = self._cache.get(key)
        if got is None:
            got = self._cache[key] = self._solve(level, w, record=False)[0]
        return got

    def _solve(self, level: int, w: tuple[float, float], record: bool) -> tuple[np.ndarray, Any]:
        """The programme, last block first: ``B[g, m]`` is the least summed seconds of the blocks seen so far within
        ``m`` units, where the nearest of them that offloads is ``g + 1`` blocks after the next one to be placed
        (the gap its copies' exposure depends on, :func:`options.hiding_seconds`; ``GAP_LEVELS - 1``: that far or
        none). With ``record``, per block the choice and the state it came from (for :meth:`backtrack`)."""
        M, n, G = self.M, self.n, options.GAP_LEVELS
        c = self.t.cost(*w)  # (n, options, G)
        if level == 0:  # every block kept whole: one configuration
            out = np.full(M + 1, np.inf)
            tot = 0.0
            for i in range(n - 1, -1, -1):
                tot += float(c[i, KEEP, 0])
            if self.keep_units <= M:
                out[self.keep_units:] = tot
            return out, None
        allowed = self.allowed[level]
        offloads = self.t.offloads
        # two kinds of state: A = every block after this one kept whole (one configuration; its gap is to the head),
        # B = at least one block has a policy (a plan with no policy at all installs no wrapper and keeps autocast's
        # weight cache: level 0 prices it)
        a_units, a_cost = 0, 0.0
        B = np.full((G, M + 1), np.inf)
        shift_rows = np.minimum(np.arange(G) + 1, G - 1)  # a block that offloads nothing: the gap grows by one
        choices: list[np.ndarray] = []
        for i in range(n - 1, -1, -1):
            gap_a = min(n - i, G) - 1
            nb = np.full((G, M + 1), np.inf)
            tag = np.zeros((G, M + 1), dtype=np.int16) if record else None
            for o in range(len(OPTIONS)):
                if not allowed[i, o]:
                    continue
                u = int(self.units[i, o])
                if u > M:
                    continue
                co = c[i, o]
                cand = B[:, : M + 1 - u] + co[:, None]  # (G, M + 1 - u): from each gap state
                if not record:
                    if offloads[i, o]:
                        np.minimum(nb[0, u:], cand.min(axis=0), out=nb[0, u:])
                    else:
                        np.minimum(nb[1:, u:], cand[:-1], out=nb[1:, u:])
                        np.minimum(nb[G - 1, u:], cand[G - 1], out=nb[G - 1, u:])
                elif offloads[i, o]:
                    # this block offloads: its copies see the gap it came from; the next block's gap is 1
                    src = cand.argmin(axis=0)
                    val = cand[src, np.arange(M + 1 - u)]
                    _better(nb[0], tag[0] if record else None, u, val, o + _SRC * src)
                else:
                    # offloads nothing: every gap grows by one, the largest stays (the nearest offload as far)
                    for r in range(G - 1, -1, -1):
                        t = shift_rows[r]
                        _better(nb[t], tag[t] if record else None, u, cand[r], o + _SRC * r)
                if o != KEEP and a_units + u <= M:  # the first policy, after blocks all kept
                    t = 0 if offloads[i, o] else shift_rows[gap_a]
                    _better(nb[t], tag[t] if record else None, a_units + u,
                            np.full(M + 1 - a_units - u, a_cost + float(co[gap_a])), o + _SRC * gap_a + _FROM_A)
            B = nb
            if record:
                choices.append(tag)
            a_units += int(self.units[i, KEEP])
            a_cost += float(c[i, KEEP, 0])
        best = B.min(axis=0)
        if not record:
            return best, None
        return best, (choices[::-1], B.argmin(axis=0))

    def picked(self, level: int, w: tuple[float, float], capacity: int) -> np.ndarray:
        """:meth:`backtrack` as an array, cached: the refinement asks for the same few capacities of its fixed grid
        under many outer choices."""
        key = (level, w, capacity)
        got = self._picked.get(key)
        if got is None:
            if len(self._picked) > 4096:
                self._picked.clear()
            got = self._picked[key] = np.asarray(self.backtrack(level, w, capacity), dtype=np.int64)
        return got

    def backtrack(self, level: int, w: tuple[float, float], capacity: int) -> tuple[int, ...]:
        """The option index per block of the best solution within ``capacity`` units."""
        if level == 0:
            return (KEEP,) * self.n
        got = self._choices.get((level, w))
        if got is None:
            if len(self._choices) * self.n * (self.M + 1) * options.GAP_LEVELS * 2 > _CHOICES_BYTES:
                self._choices.clear()
            got = self._choices[(level, w)] = self._solve(level, w, record=True)[1]
        choices, rows = got
        out = [KEEP] * self.n
        m, r = capacity, int(rows[capacity])
        for i in range(self.n):
            tag = choices[i].item(r, m)
            o = tag % _SRC
            out[i] = o
            m -= self._units[i][o]
            r = (tag % _FROM_A) // _SRC
            if tag >= _FROM_A:
                break  # the blocks after are all kept whole
        return tuple(out)


_CHOICES_BYTES = 256 << 20
"""The most memory the recorded choices of the programmes kept for backtracking may take (n x GAP_LEVELS x
(M + 1) int16 each: 0.6 MB at 24 blocks, 5 MB at 100)."""
_SRC = 32
"""A recorded choice: ``option + _SRC x the gap state it came from (+ _FROM_A)``."""
_FROM_A = 1024
"""A recorded choice that is the first policy, after blocks all kept whole."""


def _better(row: np.ndarray, tag: np.ndarray | None, u: int, val: np.ndarray, code: Any) -> None:
    """``row[u:] = min(row[u:], val)``, recording ``code`` where ``val`` is smaller (strictly: on a tie the earlier
    candidate stays, the options' order of preference)."""
    cur = row[u:]
    if tag is None:
        np.minimum(cur, val, out=cur)
        return
    less = val < cur
    cur[less] = val[less]
    tag[u:][less] = code[less] if isinstance(code, np.ndarray) else code
