"""``sample``: sampled, diverse lists with exact speculative sampling.

The NEZHA head drafts whole SIDs (q), the GR model verifies every position in
one pass (p), tokens are accepted with min(1, p/q) and a rejected one is
replaced from the residual max(p - q, 0) (see
:mod:`specrec.decoding.speculative`). Temperature, top-k and the item-set
mask are applied identically to p and q, so every stream is an exact sample
from the GR model's (processed) distribution over valid SIDs.

A list is the distinct items of independent streams in draw order: the same
law as drawing from the GR model repeatedly and skipping repeats (sampling
without replacement). Scores are the target log-probabilities.
"""

from __future__ import annotations

from typing import Sequence

import torch
from pydantic import Field

from ..decoding.speculative import speculative_sample, transform
from .base import Policy, PolicyConfig, RecRequest, RecResult, RequestStats, Stage, charge, register


class SampleConfig(PolicyConfig):
    temperature: float = Field(1.0, gt=0, description="applied to target and draft alike")
    top_k: int = Field(0, ge=0, description="keep the k most likely valid codes per level (0 = all)")
    streams: int | None = Field(None, ge=1, description="samples drawn per request per batch (default: 2K)")
    max_batches: int = Field(4, ge=1, description="batches of streams at most before filling the list")
    seed: int | None = Field(None, description="random seed (None = fresh randomness)")


@register
class SamplePolicy(Policy):
    name = "sample"
    Config = SampleConfig

    def __init__(self, engine, config=None, **params):
        super().__init__(engine, config, **params)
        self.generator = torch.Generator()
        if self.config.seed is None:
            self.generator.seed()
        else:
            self.generator.manual_seed(self.config.seed)

    def _allowed(self, prefix: torch.Tensor, level: int) -> torch.Tensor:
        trie = self.engine.itemset.trie
        nodes = trie.walk(prefix) if level else torch.zeros(prefix.shape[0], dtype=torch.int64)
        return trie.allowed_mask(level, nodes)

    def distributions(self, sess, R: int, M: int, stats=()):
        """The processed target (``p_fn``) and draft (``q_next``) distributions
        for R requests with M streams each, flattened to R*M rows."""
        ver, cfg = self.engine.verifier, self.config
        L = len(self.engine.itemset.level_sizes)

        def q_next(prefix: torch.Tensor) -> torch.Tensor:
            j = prefix.shape[1]
            logq = ver.head_logprobs(sess, prefix.view(R, M, j))[j].reshape(R * M, -1)
            return transform(logq, self._allowed(prefix, j), cfg.temperature, cfg.top_k)

        def p_fn(seq: torch.Tensor) -> list[torch.Tensor]:
            full = ver.score(sess, seq.view(R, M, L), full=True).full
            charge(stats)
            return [transform(full[j].reshape(R * M, -1), self._allowed(seq[:, :j], j), cfg.temperature, cfg.top_k)
                    for j in range(L)]

        return p_fn, q_next

    def run(self, requests: Sequence[RecRequest]) -> list[RecResult]:
        eng, ver, cfg = self.engine, self.engine.verifier, self.config
        L = len(eng.itemset.level_sizes)
        R = len(requests)
        M = cfg.streams or 2 * max(r.k for r in requests)
        stats = [RequestStats() for _ in requests]
        with Stage(eng.clock, stats, "encode"):
            sess = ver.encode(eng.history_sids([r.history for r in requests]))
        charge(stats, encoder=True)

        p_fn, q_next = self.distributions(sess, R, M, stats)

        lists: list[dict[int, float]] = [dict() for _ in requests]
        for _ in range(cfg.max_batches):
            with Stage(eng.clock, stats, "sample"):
                seq, logp, sst = speculative_sample(p_fn, q_next, R * M, L, self.generator)
            items = eng.itemset.lookup(seq.numpy()).reshape(R, M)
            logp = logp.view(R, M).numpy()
            for i in range(R):
                st = stats[i]
                st.rounds += sst.rounds
                for it, lp in zip(items[i].tolist(), logp[i].tolist()):
                    if it >= 0 and it not in lists[i]:
                        lists[i][it] = lp
            # token counters are per batch of all requests; attribute evenly
            for st in stats:
                st.draft_tokens += sst.draft_tokens // R
                st.accepted_tokens += sst.accepted_tokens // R
                st.drafted_by_position = [a + b // R for a, b in zip(st.drafted_by_position or [0] * L, sst.drafted_by_position)]
                st.accepted_by_position = [a + b // R for a, b in zip(st.accepted_by_position or [0] * L, sst.accepted_by_position)]
            if all(len(lists[i]) >= r.k for i, r in enumerate(requests)):
                break
        results = []
        for i, r in enumerate(requests):
            its = list(lists[i])[: r.k]
            stats[i].drafted = stats[i].draft_tokens
            stats[i].accepted = stats[i].accepted_tokens
            stats[i].exit_reason = "complete" if len(its) >= r.k else "max_batches"
            results.append(self._result(r.k, its, [lists[i][x] for x in its], ["sample"] * len(its), stats[i]))
        ver.release(sess)
        return self._finish(results)
