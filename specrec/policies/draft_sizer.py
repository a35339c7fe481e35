"""How many drafts a request asks for, learned across requests (:class:`DraftSizer`)."""

from __future__ import annotations

import threading

from ..backends.base import DRAFT_FACTORS, draft_count


class DraftSizer:
    """Draft count per list length K, adapted online, on a fixed ladder of
    multiples of K (:data:`LADDER`), so a backend that keeps one graph per
    width sees only a few widths, all warmed up before serving.

    By coverage (:meth:`observe`): x(1 + step) after a request whose drafts
    fell short, x(1 - step/4) after one they served, kept in [min_factor * K,
    max_factor * K]; it settles where about one request in five falls short.

    By cost, once a policy reports what its requests cost (:meth:`observe_cost`,
    ``strict`` on the distilled drafter, whose misses cost more than hits: a
    missed row is finished from the verified levels, L-2 more passes): the
    count whose running mean cost is lowest, with a neighbouring
    count of the ladder tried every ``explore_every``-th request."""

    LADDER = DRAFT_FACTORS

    def __init__(self, start_factor: float = 1.5, min_factor: float = 1.0, max_factor: float = 6.0, step: float = 0.2,
                 explore_every: int = 8, alpha: float = 0.1):
        self.start, self.min, self.max, self.step = start_factor, min_factor, max_factor, step
        self.explore_every, self.alpha = explore_every, alpha
        self._n: dict[int, float] = {}
        self._cost: dict[int, dict[int, float]] = {}  # K -> draft count -> running mean seconds per request
        self._asked: dict[int, int] = {}
        self._lock = threading.Lock()

    def ladder(self, k: int) -> list[int]:
        return sorted({draft_count(m, k) for m in self.LADDER})

    def size(self, k: int) -> int:
        with self._lock:
            costs = self._cost.get(k)
            if costs:
                asked = self._asked[k] = self._asked.get(k, 0) + 1
                best = min(costs, key=lambda n: costs[n])
                if asked % self.explore_every:
                    return best
                ns = self.ladder(k)
                i = ns.index(best) if best in ns else 0
                near = [ns[j] for j in (i - 1, i + 1) if 0 <= j < len(ns)]
                return near[(asked // self.explore_every) % len(near)] if near else best
            n = self._n.setdefault(k, self.start * k)
        return next((c for c in self.ladder(k) if c >= n), self.ladder(k)[-1])

    def observe(self, k: int, short: bool) -> None:
        with self._lock:
            n = self._n.setdefault(k, self.start * k)
            n *= (1 + self.step) if short else (1 - self.step / 4)
            self._n[k] = min(self.max * k, max(self.min * k, n))

    def observe_cost(self, k: int, n: int, seconds: float) -> None:
        """One request drafted ``n`` per level and cost ``seconds`` in all (drafting, verifying, any fallback)."""
        with self._lock:
            costs = self._cost.setdefault(k, {})
            old = costs.get(n)
            costs[n] = seconds if old is None else (1 - self.alpha) * old + self.alpha * seconds
