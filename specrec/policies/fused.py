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

from dataclasses import dataclass, replace

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


@dataclass
class FusedRound:
    """One request's round between the phases of :class:`FusedPolicy` (:meth:`~FusedPolicy.begin`'s answer): the
    request, its stats, the items it must not get back, what the item drafter is asked, and whether the GR's pass
    no longer fits after the draft."""

    req: RecRequest
    stats: RequestStats
    exclude: frozenset[int]
    draft: DraftRequest
    late: bool


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

    # -- the phases of one request (the in-process batch below and the gateway's event loop run the same) --------
    def begin(self, req: RecRequest, st: RequestStats, exclude: frozenset[int] = frozenset()) -> FusedRound | RecResult:
        """Before drafting: the catalogue's fill (flagged) when not even a draft fits the budget, else what to ask
        the item drafter (and whether a GR pass fits after it)."""
        if not self.costs.fits(req.deadline, CostStage.DRAFT):
            st.exit_reason = "budget"
            return self._result(req.k, [], [], [], st, exclude=exclude)
        fusion = self.fusion()
        assert fusion is not None  # missing() said so before a caller got here
        st.rounds = 1
        n = self.config.candidates or fusion.candidates(req.k)
        return FusedRound(req, st, exclude, DraftRequest(req.history, n, None, req.excluded(), req.deadline),
                          late=not self.costs.fits(req.deadline, CostStage.ROUND))

    def drafted(self, rnd: FusedRound, draft: Draft) -> RecResult | None:
        """The draft in hand: the item drafter's own list (flagged) when no GR pass fits; else None, and a caller
        that cuts the request at its deadline holds that list to answer with."""
        if rnd.late:
            return self._drafter_list(rnd, draft, "no time for the GR's pass", "budget")
        if rnd.req.deadline is not None:
            st_then = rnd.stats.copy()
            rnd.req.deadline.hold(lambda: self._drafter_list(replace(rnd, stats=st_then.copy()), draft,
                                                             "the GR's pass still running at the deadline", "budget"))
        return None

    def ranked(self, rnd: FusedRound, draft: Draft, token_logp: np.ndarray) -> RecResult:
        """The fused list: the candidates ranked by both models (``token_logp`` [n, L]: the GR's pass over their
        SIDs), the item drafter's unseen places kept."""
        fusion = self.fusion()
        assert fusion is not None
        k = rnd.req.k
        items, scores = fusion.rank(draft.items, token_logp, draft.scores, self.engine.itemset.is_unseen(draft.items),
                                    k, self._reserved(k))
        rnd.stats.exit_reason = "fused"
        return self._result(k, items, scores, ["draft"] * len(items), rnd.stats, exclude=rnd.exclude)

    def unranked(self, rnd: FusedRound, draft: Draft, e: BudgetExceeded | DependencyDown) -> RecResult:
        """The GR's pass failed or ran late: the item drafter's list in hand is the answer (flagged, the failure in
        its ``fault`` for the ladder's verdict on the verifier)."""
        ran_late = isinstance(e, BudgetExceeded)
        res = self._drafter_list(rnd, draft, f"the GR's pass failed ({e})", "budget" if ran_late else "degraded")
        res.fault = e
        return res

    def _run(self, batch: LiveBatch) -> None:
        eng = self.engine
        assert eng.drafter is not None  # missing() said so before run() called this
        rounds: dict[int, FusedRound] = {}
        for j, _, req, st in batch.rows():
            began = self.begin(req, st, batch.exclude)
            if isinstance(began, RecResult):  # not even a draft fits: flagged fill
                batch.finish(j, began)
            else:
                rounds[j] = began
        batch.drop([j for j in range(len(batch.active)) if j not in rounds])
        if not batch.active:
            return
        t0 = eng.clock()
        todo = list(rounds.values())
        if self.config.encode_early and not all(r.late for r in todo):
            eng.verifier.prepare(batch.open_session)  # a remote verifier encodes while the item drafter drafts
        with Stage(eng.clock, batch.active_stats, "draft") as t:
            drafts = eng.drafter.draft([r.draft for r in todo])
        self.costs.observe(CostStage.DRAFT, t.seconds)
        answered = []
        for j, (rnd, d) in enumerate(zip(todo, drafts)):
            res = self.drafted(rnd, d)
            if res is not None:  # no time for the GR's pass: the item drafter's own list, said so
                batch.finish(j, res)
                answered.append(j)
        batch.drop(answered)
        todo = [r for j, r in enumerate(todo) if j not in answered]
        drafts = [d for j, d in enumerate(drafts) if j not in answered]
        if not batch.active:
            return
        try:
            token_logp = self._score(batch, drafts)
        except (BudgetExceeded, DependencyDown) as e:  # the drafts in hand are the item drafter's list: the answer
            if len(drafts) != 1 or (isinstance(e, DependencyDown) and e.which != "verifier"):
                raise
            batch.finish(0, self.unranked(todo[0], drafts[0], e))
            batch.drop([0])
            return
        for j, (rnd, d) in enumerate(zip(todo, drafts)):
            batch.finish(j, self.ranked(rnd, d, token_logp[j]))
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

    def _drafter_list(self, rnd: FusedRound, d: Draft, why: str, exit_reason: str) -> RecResult:
        """The item drafter's own list of ``d`` (:meth:`~specrec.drafters.base.Draft.top`: what the ``drafter``
        policy answers), flagged; ``exit_reason`` budget (no time for the GR's pass) or degraded (it failed)."""
        k, st = rnd.req.k, rnd.stats
        own = d.top(k, self._reserved(k), self.engine.itemset.is_unseen(d.items))
        st.exit_reason = exit_reason
        res = self._result(k, own.items, own.scores, ["draft"] * len(own.items), st, exclude=rnd.exclude)
        res.served_by, res.degraded = "drafter", f"{exit_reason}: {why}, the item drafter's list"
        self.engine.metrics.record("drafter", st)
        return res
