"""``beam``: trie-constrained beam search with a KV cache (the baseline).

Scores are summed log-probabilities of the SID (the reference scale that
``strict`` reproduces). With a budget, a request whose next level would not
fit stops early and its list is filled from items under its best prefixes
(exit reason ``budget``).
"""

from __future__ import annotations

from typing import Sequence

import torch
from pydantic import Field

from .base import Policy, PolicyConfig, RecRequest, RecResult, RequestStats, Stage, charge, register


class BeamConfig(PolicyConfig):
    width: int | None = Field(None, ge=1, description="beam width (default: K, the list length)")


@register
class BeamPolicy(Policy):
    name = "beam"
    Config = BeamConfig

    def run(self, requests: Sequence[RecRequest]) -> list[RecResult]:
        eng, ver = self.engine, self.engine.verifier
        trie = eng.itemset.trie
        width = self.config.width or max(r.k for r in requests)
        stats = [RequestStats() for _ in requests]
        results: list[RecResult | None] = [None] * len(requests)
        with Stage(eng.clock, stats, "encode"):
            sess = ver.encode(eng.history_sids([r.history for r in requests]))
        charge(stats, encoder=True)
        ver.beam_start(sess, trie, width)
        active = list(range(len(requests)))
        beams = None
        depth = len(eng.itemset.level_sizes)
        for level in range(depth):
            stop = [j for j, i in enumerate(active) if not self.budget.fits(requests[i].deadline, "step")]
            for j in stop:
                i = active[j]
                stats[i].exit_reason = "budget"
                results[i] = self._result(requests[i].k, [], [], [], stats[i], beams, j)
            if stop:
                keep = [j for j in range(len(active)) if j not in set(stop)]
                if not keep:
                    break
                sess = ver.select(sess, torch.tensor(keep))
                active = [active[j] for j in keep]
            act_stats = [stats[i] for i in active]
            with Stage(eng.clock, act_stats, "beam") as t:
                beams = ver.beam_step(sess)
            self.budget.observe("step", t.seconds)
            charge(act_stats)
            for st in act_stats:
                st.rounds += 1
        if beams is not None and beams.level == depth:
            items = beams.items(trie)
            for j, i in enumerate(active):
                ok = items[j] >= 0
                stats[i].exit_reason = "complete"
                results[i] = self._result(requests[i].k, items[j][ok].tolist(), beams.scores[j][ok].tolist(),
                                          ["beam"] * int(ok.sum()), stats[i])
        ver.release(sess)
        return self._finish(results)
