"""``drafter``: the drafter's own list, no verifier at all.

The cheapest model answer: what ``auto`` serves when nothing better fits the
budget, and what the gateway answers with while the verifier is down or slow.
Scores are the drafter's (inner products), not log-probabilities.
"""

from __future__ import annotations

from ..drafters.base import DraftRequest
from .base import Policy, PolicyConfig, register
from .batch import LiveBatch, Stage


class DrafterConfig(PolicyConfig):
    pass


@register
class DrafterPolicy(Policy):
    name = "drafter"
    Config = DrafterConfig
    uses_verifier = False
    uses_drafter = True

    def missing(self) -> str | None:
        return "an item drafter" if self.engine.drafter is None else None

    def _run(self, batch: LiveBatch) -> None:
        eng = self.engine
        assert eng.drafter is not None  # missing() said so before run() called this
        with Stage(eng.clock, batch.stats, "draft"):
            drafts = eng.drafter.draft([DraftRequest(r.history, r.k, exclude=r.excluded(),
                                                     deadline=r.deadline) for r in batch.requests])
        for j, _, req, st in batch.rows():
            d = drafts[j]
            st.rounds = 1
            st.exit_reason = "complete"
            batch.finish(
                j,
                self._result(
                    req.k, d.items.tolist(), d.scores.tolist(), ["draft"] * len(d.items), st, exclude=batch.exclude
                ),
            )
