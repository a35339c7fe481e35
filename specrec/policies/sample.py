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

import torch
from pydantic import Field

from ..decoding.speculative import speculative_sample, transform
from .base import Policy, PolicyConfig, register
from .batch import LiveBatch, Stage, charge


class SampleConfig(PolicyConfig):
    temperature: float = Field(1.0, gt=0, le=100.0, description="applied to target and draft alike")
    top_k: int = Field(0, ge=0, le=4096, description="keep the k most likely valid codes per level (0 = all)")
    streams: int | None = Field(None, ge=1, le=4096, description="samples drawn per request per batch (default: 2K)")
    max_batches: int = Field(4, ge=1, le=64, description="batches of streams at most before filling the list")
    seed: int | None = Field(None, description="random seed (None = fresh randomness)")


@register
class SamplePolicy(Policy):
    name = "sample"
    Config = SampleConfig
    config: SampleConfig
    reusable = False  # its generator: each request through the gateway draws from the seed's start

    def __init__(self, engine, config=None, **params):
        super().__init__(engine, config, **params)
        self.generator = torch.Generator()
        if self.config.seed is None:
            self.generator.seed()
        else:
            self.generator.manual_seed(self.config.seed)

    @staticmethod
    def _allowed(trie, prefix: torch.Tensor, level: int) -> torch.Tensor:
        nodes = trie.walk(prefix) if level else torch.zeros(prefix.shape[0], dtype=torch.int64)
        return trie.allowed_mask(level, nodes)

    def distributions(self, sess, R: int, M: int, stats=(), trie=None):
        """The processed target (``p_fn``) and draft (``q_next``) distributions
        for R requests with M streams each, flattened to R*M rows."""
        ver, cfg = self.engine.verifier, self.config
        L = len(self.engine.itemset.level_sizes)
        trie = trie if trie is not None else self.engine.itemset.trie

        def q_next(prefix: torch.Tensor) -> torch.Tensor:
            j = prefix.shape[1]
            logq = ver.head_logprobs(sess, prefix.view(R, M, j))[j].reshape(R * M, -1)
            return transform(logq, self._allowed(trie, prefix, j), cfg.temperature, cfg.top_k)

        def p_fn(seq: torch.Tensor) -> list[torch.Tensor]:
            full = ver.score(sess, seq.view(R, M, L), full=True).full
            assert full is not None  # asked for with full=True
            charge(stats)
            return [
                transform(full[j].reshape(R * M, -1), self._allowed(trie, seq[:, :j], j), cfg.temperature, cfg.top_k)
                for j in range(L)
            ]

        return p_fn, q_next

    def _run(self, batch: LiveBatch) -> None:
        eng, cfg = self.engine, self.config
        requests, stats = batch.requests, batch.stats
        L = len(eng.itemset.level_sizes)
        R = len(requests)
        M = cfg.streams or 2 * max(r.k for r in requests)
        p_fn, q_next = self.distributions(batch.open_session, R, M, stats, batch.trie)
        lists: list[dict[int, float]] = [dict() for _ in requests]
        for _ in range(cfg.max_batches):
            with Stage(eng.clock, stats, "sample"):
                seq, logp, sst = speculative_sample(p_fn, q_next, R * M, L, self.generator)
            self._collect(lists, seq, logp, R, M)
            self._observe(stats, sst, R, M)
            if all(len(lists[i]) >= r.k for i, r in enumerate(requests)):
                break
        for j, i, r, st in batch.rows():
            its = list(lists[i])[: r.k]
            st.exit_reason = "complete" if len(its) >= r.k else "max_batches"
            batch.finish(
                j, self._result(r.k, its, [lists[i][x] for x in its], ["sample"] * len(its), st, exclude=batch.exclude)
            )

    def _collect(self, lists: list[dict[int, float]], seq: torch.Tensor, logp: torch.Tensor, R: int, M: int) -> None:
        """Distinct valid items of each request's streams, in draw order (stream rows are request-major)."""
        items = self.engine.itemset.lookup(seq.numpy()).reshape(R, M)
        logp_rows = logp.view(R, M).numpy()
        for i in range(R):
            for it, lp in zip(items[i].tolist(), logp_rows[i].tolist()):
                if it >= 0 and it not in lists[i]:
                    lists[i][it] = lp

    @staticmethod
    def _observe(stats, sst, R: int, M: int) -> None:
        """Per request: its own streams' rounds, drafted and accepted tokens."""
        for i, st in enumerate(stats):
            rows = slice(i * M, (i + 1) * M)
            st.rounds += int(sst.rounds_per_stream[rows].max())
            for j in range(sst.drafted.shape[1]):
                st.observe_tokens(j, int(sst.drafted[rows, j].sum()), int(sst.accepted[rows, j].sum()))
