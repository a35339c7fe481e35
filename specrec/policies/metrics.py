"""Speculative-decoding counters, in the style of vLLM's ``SpecDecodingStats``.

Two kinds of acceptance, never mixed:

- **items**: whole candidate items a drafter proposed (``specgr``, the head's
  SIDs in ``strict``/``relaxed``, ``nezha``) and how many the target accepted
  (``specgr``: V > gamma; ``strict``/``relaxed``: the drafted SID is in the final
  list; ``nezha``: a valid SID, since verification is set membership);
- **tokens**: drafted SID codes by position (level) and how many the target
  accepted at that position (``sample``: the rejection-sampling test;
  ``strict``/``relaxed``: a drafted prefix that became one of the target's
  beams at that level).

A request records through :meth:`RequestStats.observe_items` and
:meth:`RequestStats.observe_tokens`; :class:`SpecMetrics` aggregates counters
only (they never decrease). Acceptance rates are derived where they are read:
in PromQL, ``rate(specrec_spec_accepted_items_total[5m]) /
rate(specrec_spec_draft_items_total[5m])``, and the same for tokens.
"""

from __future__ import annotations

import threading
from collections import Counter, defaultdict
from dataclasses import dataclass, field


@dataclass
class RequestStats:
    """What one request cost and how it ended."""

    rounds: int = 0
    draft_items: int = 0
    accepted_items: int = 0
    draft_tokens_by_position: list[int] = field(default_factory=list)
    accepted_tokens_by_position: list[int] = field(default_factory=list)
    accepted_items_by_round: list[int] = field(default_factory=list)
    verifier_calls: int = 0
    encoder_calls: int = 0
    fallback_steps: int = 0  # levelwise: beam steps that computed beams the drafts did not cover
    frontier_kept_by_level: list[int] = field(default_factory=list)  # strict: prefixes the target kept per level
    frontier_held_by_level: list[int] = field(default_factory=list)  # ... and how many of them were drafted
    frontier_drafted_levels: set[int] = field(default_factory=set)  # levels the drafts chose (not the target's own)
    exit_reason: str = ""
    stage_ms: dict[str, float] = field(default_factory=lambda: defaultdict(float))

    def observe_items(self, drafted: int, accepted: int) -> None:
        """Candidate items proposed and accepted (one call per draft round)."""
        self.draft_items += int(drafted)
        self.accepted_items += int(accepted)
        self.accepted_items_by_round.append(int(accepted))

    def observe_tokens(self, position: int, drafted: int, accepted: int) -> None:
        """Drafted SID codes at one position (level) and how many were accepted."""
        while len(self.draft_tokens_by_position) <= position:
            self.draft_tokens_by_position.append(0)
            self.accepted_tokens_by_position.append(0)
        self.draft_tokens_by_position[position] += int(drafted)
        self.accepted_tokens_by_position[position] += int(accepted)

    def observe_frontier(self, level: int, kept: int, held: int, drafted: bool = True) -> None:
        """The target kept ``kept`` prefixes after ``level``; the drafts held ``held`` of them. ``drafted``:
        the drafter chose that level's prefixes (False where they are the target's own, held by construction)."""
        if drafted:
            self.frontier_drafted_levels.add(level)
        while len(self.frontier_kept_by_level) <= level:
            self.frontier_kept_by_level.append(0)
            self.frontier_held_by_level.append(0)
        self.frontier_kept_by_level[level] += int(kept)
        self.frontier_held_by_level[level] += int(held)

    def copy(self) -> RequestStats:
        """A copy sharing no container with this one (``copy.deepcopy``'s result at a tenth of its cost: ``fused``
        copies its stats on every request)."""
        out = object.__new__(RequestStats)
        for name, value in self.__dict__.items():
            if isinstance(value, defaultdict):
                value = defaultdict(value.default_factory, value)
            elif isinstance(value, (list, set)):
                value = type(value)(value)
            out.__dict__[name] = value
        return out

    @property
    def draft_tokens(self) -> int:
        return sum(self.draft_tokens_by_position)

    @property
    def accepted_tokens(self) -> int:
        return sum(self.accepted_tokens_by_position)

    def as_dict(self) -> dict:
        d = dict(self.__dict__)
        d["stage_ms"] = {k: round(v, 3) for k, v in self.stage_ms.items()}
        d["draft_tokens"], d["accepted_tokens"] = self.draft_tokens, self.accepted_tokens
        return d


class SpecMetrics:
    """Aggregated counters across requests, per policy."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._clear()

    def _clear(self) -> None:
        self.requests: Counter = Counter()
        self.draft_rounds: Counter = Counter()
        self.draft_items: Counter = Counter()
        self.accepted_items: Counter = Counter()
        self.draft_tokens: dict[str, Counter] = defaultdict(Counter)  # policy -> position -> n
        self.accepted_tokens: dict[str, Counter] = defaultdict(Counter)
        self.accepted_items_by_round: dict[str, Counter] = defaultdict(Counter)
        self.verifier_calls: Counter = Counter()
        self.encoder_calls: Counter = Counter()
        self.fallback_steps: Counter = Counter()
        self.no_fallback_requests: Counter = Counter()
        self.exit_reasons: Counter = Counter()  # (policy, reason)
        self.frontier_kept: dict[str, Counter] = defaultdict(Counter)  # policy -> level -> n
        self.frontier_held: dict[str, Counter] = defaultdict(Counter)
        self.frontier_drafted: dict[str, set] = defaultdict(set)  # policy -> levels its drafts chose
        self.whole_frontier: Counter = Counter()  # requests whose drafts held every drafted level's kept prefixes
        self.frontier_requests: Counter = Counter()

    def reset(self) -> None:
        """Forget every count (e.g. after warm-up requests that no figure should include)."""
        with self._lock:
            self._clear()

    def record(self, policy: str, st: RequestStats) -> None:
        with self._lock:
            self.requests[policy] += 1
            self.draft_rounds[policy] += len(st.accepted_items_by_round)
            self.draft_items[policy] += st.draft_items
            self.accepted_items[policy] += st.accepted_items
            for j, n in enumerate(st.draft_tokens_by_position):
                self.draft_tokens[policy][j] += n
            for j, n in enumerate(st.accepted_tokens_by_position):
                self.accepted_tokens[policy][j] += n
            for r, n in enumerate(st.accepted_items_by_round):
                self.accepted_items_by_round[policy][r] += n
            self.verifier_calls[policy] += st.verifier_calls
            self.encoder_calls[policy] += st.encoder_calls
            self.fallback_steps[policy] += st.fallback_steps
            self.no_fallback_requests[policy] += int(st.fallback_steps == 0)
            self.exit_reasons[(policy, st.exit_reason)] += 1
            for j, n in enumerate(st.frontier_kept_by_level):
                self.frontier_kept[policy][j] += n
            for j, n in enumerate(st.frontier_held_by_level):
                self.frontier_held[policy][j] += n
            if st.frontier_kept_by_level:
                self.frontier_drafted[policy] |= st.frontier_drafted_levels
                self.frontier_requests[policy] += 1
                self.whole_frontier[policy] += int(all(st.frontier_held_by_level[j] >= st.frontier_kept_by_level[j]
                                                       for j in st.frontier_drafted_levels))

    def snapshot(self) -> dict:
        """Plain counters per policy, plus the rates derived from them (for tables)."""
        with self._lock:
            out = {}
            for p in self.requests:
                dt, at = sum(self.draft_tokens[p].values()), sum(self.accepted_tokens[p].values())
                di, ai = self.draft_items[p], self.accepted_items[p]
                out[p] = {
                    "requests": self.requests[p],
                    "draft_rounds": self.draft_rounds[p],
                    "draft_items": di,
                    "accepted_items": ai,
                    "draft_tokens": dt,
                    "accepted_tokens": at,
                    "item_acceptance": ai / di if di else float("nan"),
                    "token_acceptance": at / dt if dt else float("nan"),
                    "draft_tokens_by_position": dict(sorted(self.draft_tokens[p].items())),
                    "accepted_tokens_by_position": dict(sorted(self.accepted_tokens[p].items())),
                    "accepted_items_by_round": dict(sorted(self.accepted_items_by_round[p].items())),
                    "verifier_calls": self.verifier_calls[p],
                    "encoder_calls": self.encoder_calls[p],
                    "fallback_steps": self.fallback_steps[p],
                    "no_fallback_share": self.no_fallback_requests[p] / self.requests[p],
                    "exit_reasons": {r: n for (q, r), n in self.exit_reasons.items() if q == p},
                }
                kept = self.frontier_kept[p]
                if kept:  # held / kept per level; the levels the drafts chose apart (the others are 1 by design)
                    per = {j: self.frontier_held[p][j] / n for j, n in sorted(kept.items()) if n}
                    drafted = {j: v for j, v in per.items() if j in self.frontier_drafted[p]}
                    out[p]["frontier_coverage_by_level"] = per
                    out[p]["drafted_level_coverage_by_level"] = drafted
                    out[p]["drafted_level_coverage"] = (sum(drafted.values()) / len(drafted) if drafted
                                                        else float("nan"))
                    out[p]["whole_frontier_share"] = self.whole_frontier[p] / self.frontier_requests[p]
            return out
