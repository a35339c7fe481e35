"""``fused``: the item drafter's best candidates ranked by both models in one GR pass.

Where the engine's item drafter tells a fusion (the bundle's SASRec drafter, with the weight chosen on
validation users by ``specrec tune-fusion``, :mod:`specrec.fusion`), a request is one round:

1. the item drafter proposes its best ``candidates`` items (default :meth:`~specrec.fusion.Fusion.candidates`:
   the chosen count, at least 2K; its unseen share among them) while a remote verifier encodes the history;
2. the GR model scores their SIDs in one pass (the verifier's scoring pass, the registry's ``rank``: each prefix
   node's own level, a precision chosen on validation users where the graphs allow it);
3. the list is the K best by the fused score (:meth:`~specrec.fusion.Fusion.rank`, the one definition
   ``tune-fusion`` chose the weight with), the item drafter's unseen places kept (``unseen_share``).

Ranked by the GR alone the list falls to the GR's own level, by the item model alone it is the item drafter's;
fused, on Amazon Beauty it is better than either (``bench/results/README.md``). It is not lossless: no list of
another policy is its reference.

The budget: a request whose draft does not fit is the catalogue's fill (flagged); one whose GR pass does not
fit after the draft, or whose pass runs out of time or fails, is answered with the item drafter's own list of the
candidates in hand (``served_by`` drafter, flagged, the failure in its ``fault``, returned like any list), which
is what the ``drafter`` policy would answer; such a request teaches what ``fused`` costs only when it ran late.
So nothing is kept back from its verifier call for a fallback's call (:attr:`~.base.Policy.holds_fallback`): its
fallback is in hand.
"""

from __future__ import annotations

import numpy as np
import torch
from pydantic import Field

from ..costs import CostStage
from ..drafters.base import Draft, DraftRequest
from ..fusion import Fusion
from .base import Policy, PolicyConfig, register
from .batch import LiveBatch, Stage, charge
from .errors import BudgetExceeded, DependencyDown
from .metrics import RequestStats
from .requests import RecRequest, RecResult


class FusedConfig(PolicyConfig):
    candidates: int | None = Field(None, ge=1, le=4096, description="the item drafter's candidates ranked per request "
                                   "(default: the fusion's count, chosen on validation users, and at least 2K)")
    unseen_share: float | None = Field(
        None, ge=0.0, le=1.0, description="share of the K places kept for the item drafter's unseen candidates (items "
        "with no training interactions, drafted by text), in its order (default: the item drafter's own share, i.e. "
        "in-process the bundle's drafters.unseen_share, through the gateway what the drafter service describes)")
    encode_early: bool = Field(
        False, description="a remote verifier encodes the history in a call of its own beside the draft, instead of "
        "with the scoring call after it: the encode leaves the critical path on an idle machine, but costs a call "
        "more (measured on 2 cores through the gateway, 200 requests one at a time, twice each way: no lower "
        "latency, and per request about 1.5 ms more CPU in the gateway and 2-4 ms more in the verifier)")


@register
class FusedPolicy(Policy):
    name = "fused"
    Config = FusedConfig
    config: FusedConfig
    uses_drafter = True
    holds_fallback = True  # once drafted, a verifier that fails or runs late is answered from the drafts in hand

    def fusion(self) -> Fusion | None:
        """How the engine's item drafter's scores fuse with the GR's (None: it tells none, or there is none)."""
        return None if self.engine.drafter is None else getattr(self.engine.drafter, "fusion", None)

    def missing(self) -> str | None:
        if self.fusion() is None:
            return ("an item drafter that tells a fusion (the bundle's SASRec drafter, with `specrec tune-fusion` "
                    "run)")
        return None

    def unseen_share(self) -> float:
        """The share of the K places kept for unseen candidates (config, else the item drafter's)."""
        share = self.config.unseen_share
        return float(getattr(self.engine.drafter, "unseen_share", 0.0) or 0.0) if share is None else share

    def _run(self, batch: LiveBatch) -> None:
        eng = self.engine
        fusion = self.fusion()
        assert fusion is not None and eng.drafter is not None  # missing() said so before run() called this
        self._exit_late(batch, CostStage.DRAFT, lambda j: self._result(  # not even a draft fits: flagged fill
            batch.requests[batch.active[j]].k, [], [], [], batch.stats[batch.active[j]], exclude=batch.exclude))
        if not batch.active:
            return
        t0 = eng.clock()
        late = [j for j, _, r, _ in batch.rows() if not self.costs.fits(r.deadline, CostStage.ROUND)]
        for st in batch.active_stats:
            st.rounds = 1
        if self.config.encode_early and len(late) < len(batch.active):
            eng.verifier.prepare(batch.open_session)  # a remote verifier encodes while the item drafter drafts
        reqs = [DraftRequest(req.history, self.config.candidates or fusion.candidates(req.k), None, req.excluded(),
                             req.deadline)
                for _, _, req, _ in batch.rows()]
        with Stage(eng.clock, batch.active_stats, "draft") as t:
            drafts = eng.drafter.draft(reqs)
        self.costs.observe(CostStage.DRAFT, t.seconds)
        if late:  # no time for the GR's pass: the item drafter's own list, said so
            rows = list(batch.rows())
            for j in late:
                _, _, req, st = rows[j]
                batch.finish(j, self._drafter_list(req, drafts[j], st, batch.exclude, "no time for the GR's pass",
                                                   "budget"))
            batch.drop(late)
            drafts = [d for j, d in enumerate(drafts) if j not in late]
            if not batch.active:
                return
        _, _, req0, st0 = next(batch.rows())
        if len(drafts) == 1 and req0.deadline is not None:  # the item drafter's list is in hand: a caller cut
            # at its deadline answers with it
            d0, st_then, excl = drafts[0], st0.copy(), batch.exclude
            req0.deadline.hold(lambda: self._drafter_list(req0, d0, st_then.copy(), excl,
                                                          "the GR's pass still running at the deadline", "budget"))
        try:
            token_logp = self._score(batch, drafts)
        except (BudgetExceeded, DependencyDown) as e:  # the drafts in hand are the item drafter's list: the answer
            if len(drafts) != 1 or (isinstance(e, DependencyDown) and e.which != "verifier"):
                raise
            ran_late = isinstance(e, BudgetExceeded)
            res = self._drafter_list(req0, drafts[0], st0, batch.exclude, f"the GR's pass failed ({e})",
                                     "budget" if ran_late else "degraded")
            res.fault = e  # the fallback ladder's verdict on the verifier reads it
            batch.finish(0, res)
            batch.drop([0])
            return
        for j, _, req, st in list(batch.rows()):
            d = drafts[j]
            items, scores = fusion.rank(d.items, token_logp[j], d.scores, eng.itemset.is_unseen(d.items), req.k,
                                        self._reserved(req.k))
            st.exit_reason = "fused"
            batch.finish(j, self._result(req.k, items, scores, ["draft"] * len(items), st, exclude=batch.exclude))
        batch.drop(list(range(len(batch.active))))
        self.costs.observe(CostStage.ROUND, eng.clock() - t0)

    def _reserved(self, k: int) -> int:
        return int(round(self.unseen_share() * k))

    def _score(self, batch: LiveBatch, drafts: list[Draft]) -> list[np.ndarray]:
        """One verifier call, the scoring pass over every active request's candidates: per request, its candidates'
        token log-probabilities [n, L]."""
        eng = self.engine
        m = max(1, max(len(d.items) for d in drafts))
        L = len(eng.itemset.level_sizes)
        sids = np.zeros((len(drafts), m, L), dtype=np.int64)
        for j, d in enumerate(drafts):
            if len(d.items):
                sids[j, : len(d.items)] = eng.itemset.sids_of(d.items)
                sids[j, len(d.items):] = sids[j, 0]
            else:  # no candidates (a catalogue this small): any valid item, read by nobody
                sids[j] = eng.itemset.sids[eng.itemset.order[0][0]]
        with Stage(eng.clock, batch.active_stats, "verify") as t:
            token = eng.verifier.search(batch.open_session, "rank", None, (), {"sids": torch.from_numpy(sids)})
        self.costs.observe(CostStage.VERIFY, t.seconds)
        charge(batch.active_stats)
        return [token[j, : len(d.items)].numpy() for j, d in enumerate(drafts)]

    def _drafter_list(self, req: RecRequest, d: Draft, st: RequestStats, exclude: frozenset[int], why: str,
                      exit_reason: str) -> RecResult:
        """The item drafter's own list of ``d`` (:meth:`~specrec.drafters.base.Draft.top`: what the ``drafter``
        policy answers), flagged; ``exit_reason`` budget (no time for the GR's pass) or degraded (it failed)."""
        own = d.top(req.k, self._reserved(req.k), self.engine.itemset.is_unseen(d.items))
        st.exit_reason = exit_reason
        res = self._result(req.k, own.items, own.scores, ["draft"] * len(own.items), st, exclude=exclude)
        res.served_by, res.degraded = "drafter", f"{exit_reason}: {why}, the item drafter's list"
        self.engine.metrics.record("drafter", st)
        return res
