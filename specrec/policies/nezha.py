"""``nezha``: one GR forward (encoder + a decoder pass over placeholders) and
the NEZHA draft head's beams; no verifier loop at all. Invalid SIDs are
removed by exact set membership before every top-k, so the beams refill with
valid ones and every returned item is in the item set. Scores are the head's
summed log-probabilities."""

from __future__ import annotations

from typing import Sequence

from pydantic import Field

from .base import Policy, PolicyConfig, RecRequest, RecResult, RequestStats, Stage, charge, register


class NezhaPolicyConfig(PolicyConfig):
    width: int | None = Field(None, ge=1, description="head beam width (default: K)")


@register
class NezhaPolicy(Policy):
    name = "nezha"
    Config = NezhaPolicyConfig

    def run(self, requests: Sequence[RecRequest]) -> list[RecResult]:
        eng, ver = self.engine, self.engine.verifier
        width = self.config.width or max(r.k for r in requests)
        stats = [RequestStats() for _ in requests]
        with Stage(eng.clock, stats, "encode"):
            sess = ver.encode(eng.history_sids([r.history for r in requests]))
        charge(stats, encoder=True)
        with Stage(eng.clock, stats, "head"):
            beams = ver.head_beams(sess, eng.itemset.trie, width)
        charge(stats)
        items = beams.items(eng.itemset.trie)
        results = []
        for i, r in enumerate(requests):
            ok = items[i] >= 0
            its = items[i][ok].numpy()
            valid = eng.itemset.contains(eng.itemset.sids_of(its))  # model-free verification
            stats[i].rounds = 1
            stats[i].drafted = int(ok.sum())
            stats[i].accepted = int(valid.sum())
            stats[i].exit_reason = "complete"
            results.append(self._result(r.k, its[valid].tolist(), beams.scores[i][ok].numpy()[valid].tolist(),
                                        ["head"] * int(valid.sum()), stats[i]))
        ver.release(sess)
        return self._finish(results)
