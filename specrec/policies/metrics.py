"""Speculative-decoding counters, in the style of vLLM's spec-decode metrics.

Counters only ever increase; :meth:`SpecMetrics.snapshot` gives a plain dict
(acceptance rates derived from the counters). Services export the same
numbers to Prometheus.
"""

from __future__ import annotations

import threading
from collections import Counter, defaultdict
from dataclasses import dataclass, field


@dataclass
class RequestStats:
    """What one request cost and how it ended."""

    rounds: int = 0
    drafted: int = 0  # candidate items (or draft tokens, for token-level policies) proposed
    accepted: int = 0
    draft_tokens: int = 0
    accepted_tokens: int = 0
    verifier_calls: int = 0
    encoder_calls: int = 0
    exit_reason: str = ""
    accepted_by_round: list[int] = field(default_factory=list)
    accepted_by_position: list[int] = field(default_factory=list)  # token-level: accepted at SID level j
    drafted_by_position: list[int] = field(default_factory=list)
    stage_ms: dict[str, float] = field(default_factory=lambda: defaultdict(float))

    def as_dict(self) -> dict:
        d = dict(self.__dict__)
        d["stage_ms"] = {k: round(v, 3) for k, v in self.stage_ms.items()}
        return d


class SpecMetrics:
    """Aggregated counters across requests, per policy."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.requests: Counter = Counter()
        self.num_drafts: Counter = Counter()  # draft rounds
        self.num_draft_items: Counter = Counter()
        self.num_accepted_items: Counter = Counter()
        self.num_draft_tokens: Counter = Counter()
        self.num_accepted_tokens: Counter = Counter()
        self.verifier_calls: Counter = Counter()
        self.encoder_calls: Counter = Counter()
        self.exit_reasons: Counter = Counter()  # (policy, reason)
        self.accepted_by_round: dict[str, Counter] = defaultdict(Counter)
        self.accepted_by_position: dict[str, Counter] = defaultdict(Counter)
        self.drafted_by_position: dict[str, Counter] = defaultdict(Counter)

    def record(self, policy: str, st: RequestStats) -> None:
        with self._lock:
            self.requests[policy] += 1
            self.num_drafts[policy] += st.rounds if st.drafted else 0
            self.num_draft_items[policy] += st.drafted
            self.num_accepted_items[policy] += st.accepted
            self.num_draft_tokens[policy] += st.draft_tokens
            self.num_accepted_tokens[policy] += st.accepted_tokens
            self.verifier_calls[policy] += st.verifier_calls
            self.encoder_calls[policy] += st.encoder_calls
            self.exit_reasons[(policy, st.exit_reason)] += 1
            for r, n in enumerate(st.accepted_by_round):
                self.accepted_by_round[policy][r] += n
            for j, n in enumerate(st.accepted_by_position):
                self.accepted_by_position[policy][j] += n
            for j, n in enumerate(st.drafted_by_position):
                self.drafted_by_position[policy][j] += n

    def acceptance_rate(self, policy: str) -> float:
        if self.num_draft_tokens[policy]:
            return self.num_accepted_tokens[policy] / self.num_draft_tokens[policy]
        d = self.num_draft_items[policy]
        return self.num_accepted_items[policy] / d if d else float("nan")

    def snapshot(self) -> dict:
        with self._lock:
            out = {}
            for p in self.requests:
                out[p] = {
                    "requests": self.requests[p],
                    "drafts": self.num_drafts[p],
                    "draft_items": self.num_draft_items[p],
                    "accepted_items": self.num_accepted_items[p],
                    "draft_tokens": self.num_draft_tokens[p],
                    "accepted_tokens": self.num_accepted_tokens[p],
                    "verifier_calls": self.verifier_calls[p],
                    "encoder_calls": self.encoder_calls[p],
                    "acceptance_rate": self.acceptance_rate(p),
                    "exit_reasons": {r: n for (q, r), n in self.exit_reasons.items() if q == p},
                    "accepted_by_round": dict(sorted(self.accepted_by_round[p].items())),
                    "accepted_by_position": dict(sorted(self.accepted_by_position[p].items())),
                    "drafted_by_position": dict(sorted(self.drafted_by_position[p].items())),
                }
            return out
