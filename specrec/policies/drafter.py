"""``drafter``: the drafter's own list, no verifier at all.

The cheapest model answer: what ``auto`` serves when nothing better fits the
budget, and what the gateway answers with while the verifier is down or slow.
Scores are the drafter's (inner products), not log-probabilities.
"""

from __future__ import annotations

from ..drafters.base import Draft, DraftRequest
from .base import Policy, PolicyConfig, register
from .batch import LiveBatch, Stage
from .metrics import RequestStats
from .requests import RecRequest, RecResult


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
            drafts = eng.drafter.draft([self.asks(r) for r in batch.requests])
        for j, _, req, st in batch.rows():
            batch.finish(j, self.answer(req, st, drafts[j], batch.exclude))

    @staticmethod
    def asks(req: RecRequest) -> DraftRequest:
        """What the item drafter is asked for ``req``."""
        return DraftRequest(req.history, req.k, exclude=req.excluded(), deadline=req.deadline)

    def answer(self, req: RecRequest, st: RequestStats, d: Draft, exclude: frozenset[int] = frozenset()) -> RecResult:
        """The drafter's list of ``d`` (the gateway's event loop answers with the same)."""
        st.rounds = 1
        st.exit_reason = "complete"
        return self._result(req.k, d.items.tolist(), d.scores.tolist(), ["draft"] * len(d.items), st, exclude=exclude)
