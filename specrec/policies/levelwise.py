"""Level-by-level verification of drafted SIDs (shared by ``strict`` and ``relaxed``).

Phases:

1. ``_draft``: N SIDs per request, from the NEZHA head (its constrained beams)
   or from the engine's drafter;
2. ``_verify``: one decoder pass over the drafts' unique prefixes (a prefix
   tree, :mod:`specrec.decoding.tree`); the session remembers every node's
   next-level distribution;
3. ``_search``: the target's own beam search, level by level, which reads the
   distributions of beams whose prefix was drafted and computes only the
   others (one pass per level with misses: a *fallback*);
4. ``_accept``: the list, and what was accepted (items: drafted SIDs in the
   list; tokens: drafted prefixes on the list's paths, by position).

How the next beams are chosen is the policy's :class:`~specrec.verifier.SelectRule`:
``strict`` takes the exact top-K (so its output equals ``beam``); ``relaxed``
prefers drafted codes the target finds good enough.

The draft count adapts (:class:`~.draft_sizer.DraftSizer`): it grows after a
fallback and shrinks slowly while drafts cover every level, per list length
K, so it settles where about one request in five needs a fallback.
"""

from __future__ import annotations

from typing import ClassVar, Literal

import numpy as np
import torch
from pydantic import Field

from ..decoding.tree import prefix_keys
from ..drafters.base import DraftRequest
from ..verifier import SelectRule
from .base import Policy, PolicyConfig
from .batch import LiveBatch, Stage, charge


class LevelwiseConfig(PolicyConfig):
    width: int | None = Field(None, ge=1, le=1000, description="beam width (default: K)")
    n_drafts: int | None = Field(None, ge=1, le=4096,
                                 description="drafted SIDs per request (default: adaptive, see draft_sizer.DraftSizer)")
    drafter: Literal["head", "drafter"] = Field("head", description="draft with the NEZHA head or the engine's drafter")


class LevelwisePolicy(Policy):
    Config: ClassVar[type[PolicyConfig]] = LevelwiseConfig  # relaxed and strict bring their own
    config: LevelwiseConfig

    def rule(self) -> SelectRule:
        return SelectRule()

    def draft_source(self) -> str | None:
        """Who drafts: "head" (the NEZHA head on the verifier) or "drafter" (the engine's item drafter);
        None when the engine lacks it."""
        cfg, eng = self.config, self.engine
        if cfg.drafter == "drafter":
            return "drafter" if eng.drafter is not None else None
        return "head" if eng.verifier.parts().draft_head else None

    def missing(self) -> str | None:
        if self.draft_source() is not None:
            return None
        return "an item drafter" if self.config.drafter == "drafter" else "the NEZHA draft head (its bundle has none)"

    def _run(self, batch: LiveBatch) -> None:
        k = max(r.k for r in batch.requests)
        width = self.config.width or k
        n = self.config.n_drafts or self.online.drafts.size(k)
        codes, ok = self._draft(batch, n)
        self._verify(batch, codes, ok)
        self._search(batch, width)
        self._accept(batch, codes, ok)

    def _draft(self, batch: LiveBatch, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Draft SIDs [R, N, L] and a validity mask [R, N]."""
        eng = self.engine
        if self.draft_source() == "head":
            with Stage(eng.clock, batch.stats, "draft"):
                b = eng.verifier.search(batch.open_session, "head", batch.trie, (n,))
            charge(batch.stats)
            return b.codes, b.alive
        assert eng.drafter is not None  # draft_source() is "drafter"
        with Stage(eng.clock, batch.stats, "draft"):
            drafts = eng.drafter.draft([DraftRequest(r.history, n, exclude=r.excluded(), deadline=r.deadline)
                                        for r in batch.requests])
        L = len(eng.itemset.level_sizes)
        m = max(1, max(len(d.items) for d in drafts))
        codes = torch.zeros(len(drafts), m, L, dtype=torch.int64)
        ok = torch.zeros(len(drafts), m, dtype=torch.bool)
        for i, d in enumerate(drafts):
            if len(d.items):
                codes[i, : len(d.items)] = torch.from_numpy(eng.itemset.sids_of(d.items))
                ok[i, : len(d.items)] = True
        return codes, ok

    def _verify(self, batch: LiveBatch, codes: torch.Tensor, ok: torch.Tensor) -> None:
        """One pass over the drafts' unique prefixes (remembered by the session)."""
        eng = self.engine
        sids = codes.clone()
        first_valid = torch.from_numpy(eng.itemset.sids[eng.itemset.order[0][:1]]).view(-1)
        for j in range(len(sids)):  # rows without a draft repeat one (a duplicate adds no node)
            good = torch.nonzero(ok[j]).view(-1)
            sids[j][~ok[j]] = sids[j, good[0]].clone() if len(good) else first_valid
        with Stage(eng.clock, batch.stats, "verify"):
            eng.verifier.score(batch.open_session, sids)
        charge(batch.stats)

    def _search(self, batch: LiveBatch, width: int) -> None:
        """The target's beam search over the verified distributions (fallback passes where they miss)."""
        eng, sess = self.engine, batch.open_session
        before = len(sess.coverage)
        with Stage(eng.clock, batch.stats, "beam"):
            batch.beams = eng.verifier.search(sess, "beam", batch.trie, (width,), rule=self.rule())
        steps = sess.coverage[before:]
        for j, _, req, st in batch.rows():
            st.rounds = len(steps)
            st.fallback_steps = sum(int(s.computed[j] > 0) for s in steps)
            st.verifier_calls += 1 + st.fallback_steps  # the search call, and one pass per fallback
            self.online.drafts.observe(req.k, st.fallback_steps > 0)

    def _accept(self, batch: LiveBatch, codes: torch.Tensor, ok: torch.Tensor) -> None:
        eng = self.engine
        beams = batch.beams
        assert beams is not None  # set by _search
        trie = batch.trie
        items = beams.items(trie)
        sizes = eng.itemset.level_sizes
        for j, _, req, st in batch.rows():
            a = beams.alive[j]
            drafted = codes[j][ok[j]].numpy()
            final = beams.codes[j][a].numpy()
            for lvl in range(len(sizes)):  # drafted prefixes of length lvl+1 on the list's paths
                dk = np.unique(prefix_keys(drafted[:, : lvl + 1], sizes))
                fk = np.unique(prefix_keys(final[:, : lvl + 1], sizes))
                st.observe_tokens(lvl, len(dk), int(np.isin(dk, fk).sum()))
            st.observe_items(len(np.unique(prefix_keys(drafted, sizes))),
                             int(np.isin(prefix_keys(final, sizes), prefix_keys(drafted, sizes)).sum()))
            st.exit_reason = "complete"
            sources = [
                "draft" if s else "beam" for s in np.isin(prefix_keys(final, sizes), prefix_keys(drafted, sizes))
            ]
            batch.finish(
                j,
                self._result(
                    req.k, items[j][a].tolist(), beams.scores[j][a].tolist(), sources, st, exclude=batch.exclude
                ),
            )
