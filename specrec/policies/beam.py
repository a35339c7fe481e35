"""``beam``: trie-constrained beam search with a KV cache (the baseline).

Scores are summed log-probabilities of the SID (the reference scale that
``strict`` reproduces). When the whole search fits the budget it is one
verifier call (one RPC through the gateway); otherwise it goes level by level,
and a request whose next level would not fit stops early and its list is
filled from items under its best prefixes (exit reason ``budget``).
"""

from __future__ import annotations

from pydantic import Field

from ..costs import CostStage
from .base import Policy, PolicyConfig, register
from .batch import LiveBatch, Stage, charge


class BeamConfig(PolicyConfig):
    width: int | None = Field(None, ge=1, le=1000, description="beam width (default: K, the list length)")


@register
class BeamPolicy(Policy):
    name = "beam"
    Config = BeamConfig
    config: BeamConfig

    def _run(self, batch: LiveBatch) -> None:
        width = self.config.width or max(r.k for r in batch.requests)
        if all(self.costs.fits(r.deadline, CostStage.SEARCH) for r in batch.requests):
            self._search(batch, width)
        else:
            self._stepwise(batch, width)
        self._complete(batch)

    def _search(self, batch: LiveBatch, width: int) -> None:
        """The whole search in one verifier call."""
        eng = self.engine
        with Stage(eng.clock, batch.stats, "beam") as t:
            batch.beams = eng.verifier.search(batch.open_session, "beam", batch.trie, (width,))
        self.costs.observe(CostStage.SEARCH, t.seconds)
        charge(batch.stats)
        for st in batch.stats:
            st.rounds = len(eng.itemset.level_sizes)

    def _stepwise(self, batch: LiveBatch, width: int) -> None:
        """One level at a time, exiting requests whose next level would not fit."""
        eng = self.engine
        eng.verifier.beam_start(batch.open_session, batch.trie, width)
        for _ in eng.itemset.level_sizes:
            self._exit_late(
                batch,
                CostStage.STEP,
                lambda j: self._result(
                    batch.requests[batch.active[j]].k,
                    [],
                    [],
                    [],
                    batch.stats[batch.active[j]],
                    batch.beams,
                    j,
                    exclude=batch.exclude,
                ),
            )
            if not batch.active:
                return
            with Stage(eng.clock, batch.active_stats, "beam") as t:
                batch.beams = eng.verifier.beam_step(batch.open_session)
            self.costs.observe(CostStage.STEP, t.seconds)
            self.costs.observe(CostStage.SEARCH, t.seconds * len(eng.itemset.level_sizes))
            charge(batch.active_stats)
            for st in batch.active_stats:
                st.rounds += 1

    def _complete(self, batch: LiveBatch) -> None:
        trie = batch.trie
        if not batch.active:
            return
        beams = batch.beams
        assert beams is not None  # set by _search or _stepwise for the rows still active
        items, scores = beams.items(trie).numpy(), beams.scores.numpy()
        for j, _, req, st in batch.rows():
            ok = items[j] >= 0
            st.exit_reason = "complete"
            batch.finish(j, self._result(req.k, items[j][ok].tolist(), scores[j][ok].tolist(),
                                         ["beam"] * int(ok.sum()), st, exclude=batch.exclude))
