"""``specgr``: draft, verify in one pass, accept, exit early; re-draft guided
by the GR's own beam prefixes (SpecGR, AAAI'26), per request.

A round, in phases:

1. ``_draft_round``: the drafter proposes ``delta`` items per request (never
   one already verified for it; after round 0 only items under *this
   request's* beam prefixes);
2. ``_verify``: one verifier call (``score_step``): one decoder pass over the
   unique prefixes of the drafts *and* of the current beams (a prefix tree),
   and the beam search's next level read from that pass (no second pass, no
   second round trip); the score V is the length-normalised log-likelihood,
   over L-1 levels for items the catalogue flags unseen (the L-1 rule);
3. ``_accept``: items with V > gamma (strictly) are accepted; a request with K
   accepted exits (``accepted``) with the beams it had before the step;
4. the others go on with the stepped beams; a round that drafted nothing
   (``_advance_beams``) takes a plain beam step instead.

Drafting is skipped for a round when it does not pay (``adaptive``, the
seed's alpha > rho condition, per round index): it pays when the estimated
chance of exiting at that round, times the cost of the beam steps an exit
saves, exceeds the cost of drafting and verifying. The chance and the costs
are estimated online (one request in 16 drafts in every round and one never
drafts, to keep the estimates fresh). A request that never drafts is plain beam search, ranked by V.
Round 0 always drafts while places are kept for unseen items (``unseen_share``): its drafts are the only
way such items reach the list.

When the beams are complete (``beams_complete``), or the budget cannot fit
another round (``budget``), the list is filled up to K from rejected
candidates and complete beams on the same V scale, and sorted by V. With
delta = 0 this is beam search (items ordered by V).

Ranking the item drafter's candidates by both models (GR + SASRec) in one pass is a policy of its own,
``fused`` (:mod:`.fused`).
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, field
from typing import Literal

import numpy as np
import torch
from pydantic import Field

from ..costs import CostStage
from ..decoding.beam import Beams
from ..drafters.base import Draft, DraftRequest
from .base import Policy, PolicyConfig, register
from .batch import Candidates, LiveBatch, Stage, charge, length_normalised
from .requests import RecResult

EXPLORE_EVERY = 16


class SpecGRConfig(PolicyConfig):
    delta: int | None = Field(None, ge=0, le=4096, description="items drafted per request per round "
                              "(default: adaptive, about 2K)")
    beta: int | None = Field(None, ge=1, le=1000, description="beam width of guided re-drafting (default: K)")
    gamma: float = Field(-2.0, ge=-100.0, le=0.0,
                         description="accept a draft when its length-normalised log-likelihood V > gamma (-2: "
                         "chosen on validation users with the distilled drafter, see bench/results/HISTORY.md)")
    unseen_rule: bool = Field(True, description="score unseen items over the first L-1 levels")
    max_rounds: int | None = Field(
        None, ge=1, le=16, description="draft rounds at most (default: L, one per beam level)"
    )
    adaptive: bool = Field(True, description="skip drafting in a round where the online estimate says it does not pay")
    unseen_share: float | None = Field(
        None, ge=0.0, le=1.0, description="share of the K places kept for the best-scored unseen candidates "
        "(items with no training interactions) that were drafted and verified: their V over L-1 levels is below "
        "the seen items' (the model never saw their codes), so by V alone none reaches the list (default: the "
        "engine drafter's unseen_share where it has one, i.e. in-process from the bundle's drafters.unseen_share; "
        "else 0)")
    first_drafter: Literal["auto", "distilled", "engine", "both"] = Field(
        "auto", description="who drafts round 0: the distilled drafter on the verifier (its beams of delta SIDs, "
        "drafted and verified in one call: the target's own near-frontier), the engine's drafter (text-aware: it "
        "reaches new items), or both (their union verified in one pass); auto: the distilled drafter where the "
        "verifier has one, else the engine's (chosen on validation users: fastest, best R@10 on items the model "
        "was trained on; ask for both to reach new items in round 0). Later rounds, guided by the beam prefixes, "
        "use the engine's drafter")


@dataclass
class RequestPool:
    """One request's verified candidates (accepted or not), by V."""

    pool: Candidates = field(default_factory=Candidates)
    verified: set[int] = field(default_factory=set)
    accepted: int = 0


@register
class SpecGRPolicy(Policy):
    name = "specgr"
    Config = SpecGRConfig
    config: SpecGRConfig

    def _run(self, batch: LiveBatch) -> None:
        eng, cfg = self.engine, self.config
        L = len(eng.itemset.level_sizes)
        k = max(r.k for r in batch.requests)
        pools = [RequestPool() for _ in batch.requests]
        eng.verifier.beam_start(batch.open_session, batch.trie, cfg.beta or k)
        if not self._distilled_alone():  # a remote verifier encodes while the engine's drafter drafts round 0
            eng.verifier.prepare(batch.open_session)  # (the distilled drafter's round 0 carries the history itself)
        phase = self.online.requests % EXPLORE_EVERY  # 0: always draft (learns exit rates), 1: never (learns step cost)
        explore = {0: True, 1: False}.get(phase)
        for rnd in range(cfg.max_rounds or L):
            self._exit_late(batch, CostStage.ROUND, lambda j: self._final(batch, pools, j, complete=False))
            if not batch.active:
                return
            t0 = eng.clock()
            for st in batch.active_stats:
                st.rounds += 1
            delta = self._delta(rnd, k, explore)
            complete = batch.beams is not None and batch.beams.level >= L  # the search ended in an earlier round
            try:
                stepped = False
                if delta:
                    verified, beams = self._draft_and_verify(batch, pools, delta, rnd, step=not complete)
                    if verified:
                        self._observe_exits(batch, pools, rnd, k, beams)
                        if not batch.active:
                            return
                        stepped = beams is not None
                if complete:
                    break
                if not stepped:
                    self._advance_beams(batch)
            finally:  # what a round costs, learned from every round that ran to its end (the budget hook reads
                # it); a round cut short by a dependency that failed says nothing about the next one's cost
                if sys.exc_info()[0] is None:
                    self.costs.observe(CostStage.ROUND, eng.clock() - t0)
        self._finish_rest(batch, pools)

    def missing(self) -> str | None:
        eng, cfg = self.engine, self.config
        if cfg.first_drafter == "distilled" and not eng.verifier.parts().distilled_drafter:
            return "the distilled SID drafter (first_drafter='distilled'; its bundle has none)"
        if cfg.delta and eng.drafter is None and not self._distilled_first():
            return "an item drafter (delta > 0 and no distilled SID drafter to draft round 0)"
        return None

    def _finish_rest(self, batch: LiveBatch, pools: list[RequestPool]) -> None:
        """The requests still active after the last round: their lists, from complete beams if the search ended."""
        complete = batch.beams is not None and batch.beams.level >= len(self.engine.itemset.level_sizes)
        for st in batch.active_stats:
            st.exit_reason = "beams_complete" if complete else "max_rounds"
        for j in range(len(batch.active)):
            batch.finish(j, self._final(batch, pools, j, complete=complete))

    # -- when drafting pays ------------------------------------------------------------
    def _unseen_share(self) -> float:
        """The share of the K places kept for unseen candidates (config, else the engine drafter's)."""
        share = self.config.unseen_share
        return float(getattr(self.engine.drafter, "unseen_share", 0.0) or 0.0) if share is None else share

    def _delta(self, rnd: int, k: int, explore: bool | None) -> int:
        """Items to draft this round (0: skip drafting)."""
        cfg = self.config
        if cfg.delta is not None:
            return cfg.delta if (rnd == 0 and self._distilled_first()) or self.engine.drafter is not None else 0
        if rnd == 0 and self._distilled_first():
            return 2 * k  # one call drafts and the first verify pass is the beams' own: it always pays
        if self.engine.drafter is None:
            return 0
        delta = 2 * k
        if not cfg.adaptive or explore is True or (rnd == 0 and self._unseen_share() > 0):
            return delta  # (round 0's drafts are the only way unseen items reach the places kept for them)
        if explore is False:
            return 0
        L = len(self.engine.itemset.level_sizes)
        costs = self.costs
        # an expected saving against an expected cost: the stages' window means, as the budget hook reads them
        step = costs.estimate(CostStage.BEAM_STEP)
        draft = costs.estimate(CostStage.DRAFT) + costs.estimate(CostStage.VERIFY)  # the verify call holds the step
        p_exit = self.online.rate(f"specgr.exit@{rnd}", 1.0)  # optimistic until measured
        saved = (L - rnd) * step  # an exit at this round saves the beam steps from here on
        return delta if p_exit * saved > draft or not step else 0

    def _observe_exits(self, batch: LiveBatch, pools: list[RequestPool], rnd: int, k: int,
                       stepped: Beams | None) -> None:
        """Finish requests with K accepted (with the beams before this round's step); learn the exit rate of
        this round; the others go on with ``stepped``, the beams the verify call stepped to (None: none)."""
        done = [j for j, i, req, _ in batch.rows() if pools[i].accepted >= req.k]
        n = len(batch.active)
        for j in done:
            batch.stats[batch.active[j]].exit_reason = "accepted"
            # K accepted: every accepted V > gamma >= every rejected V, so the top K are accepted ones
            batch.finish(j, self._final(batch, pools, j, complete=False))
        if n:
            self.online.observe_rate(f"specgr.exit@{rnd}", len(done) / n)
        if stepped is not None:
            batch.beams = stepped
        batch.drop(done)

    # -- phases ----------------------------------------------------------------------------
    def _distilled_alone(self) -> bool:
        """Round 0 is the distilled drafter's alone (drafted and verified in one verifier call)."""
        return self._distilled_first() and self.config.first_drafter != "both"

    def _distilled_first(self) -> bool:
        """Round 0 drafts with the verifier's distilled drafter (where it has one)."""
        return self.config.first_drafter != "engine" and self.engine.verifier.parts().distilled_drafter

    def _draft_and_verify(self, batch: LiveBatch, pools: list[RequestPool], delta: int, rnd: int = 1,
                          step: bool = True) -> tuple[bool, Beams | None]:
        """Draft, verify and accept: (whether anything was verified, the beams the verify call stepped to,
        with ``step``)."""
        if rnd == 0 and self._distilled_alone():  # drafted and verified in one call
            scored = self._distilled_round(batch, pools, delta, scored=True)
            if scored is not None:
                drafts, values = scored
                self._accept(batch, pools, drafts, values)
                return True, None
        drafts = self._distilled_round(batch, pools, delta) if rnd == 0 and self._distilled_first() else None
        if drafts is None or (self.config.first_drafter == "both" and self.engine.drafter is not None):
            if self.engine.drafter is None:
                return False, None
            more = self._draft_round(batch, pools, delta)
            drafts = more if drafts is None else [_union(a, b) for a, b in zip(drafts, more)]
        if not any(len(d.items) for d in drafts):
            return False, None
        values, beams = self._verify(batch, drafts, step)
        self._accept(batch, pools, drafts, values)
        return True, beams

    def _draft_round(self, batch: LiveBatch, pools: list[RequestPool], delta: int) -> list[Draft]:
        eng = self.engine
        dreqs = []
        for j, i, req, _ in batch.rows():
            prefixes = None
            if batch.beams is not None:
                prefixes = batch.beams.codes[j][batch.beams.alive[j]].numpy()
            dreqs.append(DraftRequest(req.history, delta, prefixes, frozenset(pools[i].verified) | req.excluded(),
                                      req.deadline))
        if eng.drafter is None:
            raise RuntimeError("specgr drafts with the engine's drafter, and this engine has none")
        with Stage(eng.clock, batch.active_stats, "draft") as t:
            drafts = eng.drafter.draft(dreqs)
        self.costs.observe(CostStage.DRAFT, t.seconds)
        return drafts

    def _distilled_round(self, batch: LiveBatch, pools: list[RequestPool], delta: int, scored: bool = False):
        """Round 0 from the distilled drafter: its ``delta`` beams (level 0 exact), valid SIDs only; with
        ``scored``, verified in the same call: (drafts, V per draft). None where the verifier has no distilled
        drafter."""
        eng = self.engine
        with Stage(eng.clock, batch.active_stats, "draft_verify" if scored else "draft") as t:
            beams = eng.verifier.search(batch.open_session, "draft_scored" if scored else "draft", batch.trie,
                                        (delta,))
        if beams is None:  # a remote verifier just learned that it has none
            return None
        self.costs.observe(CostStage.DRAFT, t.seconds)
        charge(batch.active_stats)
        items = beams.items(batch.trie)
        out, values = [], []
        for j in range(len(batch.active)):
            ok = (items[j] >= 0) & beams.alive[j]
            d = Draft(items[j][ok].numpy(), beams.scores[j][ok].numpy())
            out.append(d)
            if scored:
                values.append(self._value(beams.token_logp[j][ok], d.items))
        return (out, values) if scored else out

    def _verify(self, batch: LiveBatch, drafts: list[Draft], step: bool) -> tuple[list[np.ndarray], Beams | None]:
        """One verifier call: one pass over the drafts and the beam frontier -> V per draft, and, with ``step``,
        the beams one level on, read from that pass."""
        eng = self.engine
        m = max(len(d.items) for d in drafts)
        L = len(eng.itemset.level_sizes)
        sids = np.zeros((len(drafts), m, L), dtype=np.int64)
        for j, d in enumerate(drafts):
            if len(d.items):
                sids[j, : len(d.items)] = eng.itemset.sids_of(d.items)
                sids[j, len(d.items) :] = sids[j, 0]
            else:  # a request with no drafts this round repeats any valid item (adds nothing to the pass)
                sids[j] = eng.itemset.sids[eng.itemset.order[0][0]]
        beams = None
        with Stage(eng.clock, batch.active_stats, "verify") as t:
            if step:
                scores, beams = eng.verifier.score_step(batch.open_session, torch.from_numpy(sids))
            else:  # the search is complete: nothing to step
                scores = eng.verifier.score(batch.open_session, torch.from_numpy(sids), with_frontier=True)
        self.costs.observe(CostStage.VERIFY, t.seconds)
        charge(batch.active_stats)
        return [self._value(scores.token_logp[j, : len(d.items)], d.items) for j, d in enumerate(drafts)], beams

    def _value(self, token_logp: torch.Tensor, items: np.ndarray) -> np.ndarray:
        """V of each item from its target token log-probs [n, L]: length-normalised (over L-1 levels for
        unseen items, with the unseen rule)."""
        if self.config.unseen_rule:
            return length_normalised(token_logp, self.engine.itemset.is_unseen(items)).numpy()
        return token_logp.mean(-1).numpy()

    def _accept(
        self, batch: LiveBatch, pools: list[RequestPool], drafts: list[Draft], values: list[np.ndarray]
    ) -> None:
        for j, i, _, st in batch.rows():
            d, v = drafts[j], values[j]
            acc = int((v > self.config.gamma).sum())
            pools[i].pool.add(d.items, v, "draft")
            pools[i].verified.update(d.items.tolist())
            pools[i].accepted += acc
            st.observe_items(len(d.items), acc)

    def _advance_beams(self, batch: LiveBatch) -> None:
        """A round without a verify pass: a beam step that computes its distributions."""
        eng = self.engine
        with Stage(eng.clock, batch.active_stats, "beam") as t:
            batch.beams = eng.verifier.beam_step(batch.open_session)
        self.costs.observe(CostStage.BEAM_STEP, t.seconds)
        charge(batch.active_stats)

    def _final(self, batch: LiveBatch, pools: list[RequestPool], row: int, complete: bool) -> RecResult:
        """The list of the request at ``row``: best V from its pool (with the
        complete beams, when complete), filled under its beam prefixes."""
        eng, trie = self.engine, batch.trie
        i = batch.active[row]
        req, st, pool = batch.requests[i], batch.stats[i], pools[i].pool
        beams = batch.beams
        if complete and beams is not None:
            ok = beams.alive[row]
            complete_items = beams.items(trie)[row][ok].numpy()
            tl = beams.token_logp[row][ok]
            unseen = eng.itemset.is_unseen(complete_items)
            v = length_normalised(tl, unseen) if self.config.unseen_rule else tl.mean(-1)
            pool.add(complete_items, v.numpy(), "beam")
        items, scores, sources = pool.top(req.k, int(round(self._unseen_share() * req.k)), eng.itemset.is_unseen)
        return self._result(req.k, items, scores, sources, st, None if complete else beams, row, exclude=batch.exclude)


def _union(a: Draft, b: Draft) -> Draft:
    """Drafts of two drafters for one request, each item once (``a``'s first)."""
    extra = ~np.isin(b.items, a.items)
    return Draft(np.concatenate([a.items, b.items[extra]]), np.concatenate([a.scores, b.scores[extra]]))
