"""``strict``: lossless speculative beam search (AtSpeed-S style).

With a distilled drafter (the bundle's ``sid_mlp``; ``drafter`` "auto" or
"distilled") a request is one encode and one verifier call: the drafter's
beams (the target's exact top-K at level 0, then N drafted prefixes per
level up to L-2), one tree pass over all of them, the target's own beam search
read from that pass, and its last level from one small pass over the target's
own beams (:meth:`~specrec.verifier.Verifier.draft_verify`). A request whose
drafts missed a prefix the target kept is finished inside the same verifier
call from the levels the tree verified (levels 0 and 1 are always the
target's own: L-2 more passes over K beams, not a whole search of L).
Without a distilled drafter
it verifies the NEZHA head's or the engine's item drafter's SIDs level by level
(:mod:`.levelwise`): "auto" takes the first of the three the engine has
(:meth:`~specrec.verifier.Verifier.parts`), so a bundle with the GR model alone
still serves ``strict`` from its item drafter.

Either way the output equals ``beam`` exactly: same items, same order, scores
equal up to float rounding, for every history. N adapts per K
(:class:`~.draft_sizer.DraftSizer`) to the cost observed: the count of the ladder
whose requests, misses included, cost least."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from .base import PolicyConfig, register
from .batch import LiveBatch, Stage, charge
from .errors import Unsupported
from .levelwise import LevelwisePolicy


class StrictConfig(PolicyConfig):
    width: int | None = Field(default=None, ge=1, le=1000, description="beam width (default: K)")
    n_drafts: int | None = Field(
        default=None, ge=1, le=4096,
        description="drafted prefixes per level (default: adaptive, see draft_sizer.DraftSizer)")
    drafter: Literal["auto", "distilled", "head", "drafter"] = Field(
        default="auto",
        description="draft with the distilled drafter (one call), the NEZHA head or the engine's item drafter; "
        "auto: the first of these three the verifier's bundle and the engine have",
    )


@register
class StrictPolicy(LevelwisePolicy):
    name = "strict"
    Config = StrictConfig
    # strict's options are levelwise's, and its drafter takes two more values ("auto", "distilled"); levelwise's
    # phases read only the fields both have, and take any other drafter for the head
    config: StrictConfig  # type: ignore[assignment]

    def draft_source(self) -> str | None:
        cfg, eng = self.config, self.engine
        if cfg.drafter != "auto":
            if cfg.drafter == "distilled":
                return "distilled" if eng.verifier.parts().distilled_drafter else None
            return super().draft_source()
        parts = eng.verifier.parts()
        if parts.distilled_drafter:
            return "distilled"
        if parts.draft_head:
            return "head"
        return "drafter" if eng.drafter is not None else None

    def missing(self) -> str | None:
        if self.draft_source() is not None:
            return None
        if self.config.drafter == "distilled":
            return "the distilled SID drafter (its bundle has none: `specrec train-drafters --which distill`)"
        if self.config.drafter == "auto":
            return "a drafter: the distilled SID drafter, the NEZHA draft head or an item drafter"
        return super().missing()

    def _run(self, batch: LiveBatch) -> None:
        if self.draft_source() == "distilled":
            if self._run_distilled(batch):
                return
            # the verifier said it has none after all (it learned so from this call): the target's own search
            # answers from the next source the engine has
            if self.draft_source() is None:
                raise Unsupported(self.name, "a drafter")
        super()._run(batch)

    def _run_distilled(self, batch: LiveBatch) -> bool:
        eng, cfg = self.engine, self.config
        trie = batch.trie
        k = max(r.k for r in batch.requests)
        width = cfg.width or k
        n = cfg.n_drafts or self.online.drafts.size(k)
        sess = batch.session
        assert sess is not None
        t0 = eng.clock()
        with Stage(eng.clock, batch.stats, "draft_verify"):
            drafted = eng.verifier.search(sess, "strict", trie, (width, n))
        if drafted is None:
            return False
        charge(batch.stats)
        beams = drafted.beams  # exact in every row: the verifier finished the rows the drafts missed
        miss = [j for j in range(len(batch)) if not drafted.covered[j]]
        if not cfg.n_drafts:  # what this draft count cost, resumed misses included: the sizer picks the cheapest
            self.online.drafts.observe_cost(k, n, (eng.clock() - t0) / len(batch))
        items = beams.items(trie)
        for j, _, req, st in batch.rows():
            fr = drafted.frontier[j]
            for lvl in range(len(fr)):
                kept, held = int(fr[lvl][0]), int(fr[lvl][1])
                # the first and the last level are the target's own (held by construction), not drafted
                st.observe_frontier(lvl, kept, held, drafted=0 < lvl < len(fr) - 1)
                st.observe_tokens(lvl, width if lvl == 0 else n, held)  # drafted prefixes that became target beams
            st.rounds = 1
            st.fallback_steps = int((fr[:, 1] < fr[:, 0]).sum())  # levels the drafts missed
            st.exit_reason = "complete"
            a = beams.alive[j]
            src = "beam" if j in miss else "draft"
            batch.finish(j, self._result(req.k, items[j][a].tolist(), beams.scores[j][a].tolist(),
                                         [src] * int(a.sum()), st, exclude=batch.exclude))
        return True
