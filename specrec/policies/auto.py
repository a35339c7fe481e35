"""``auto``: per request, the most accurate policy whose tail cost fits the budget.

The gateway's default. Candidates are tried from the most accurate down
(``tiers``; by default ordered by quality measured on validation users):
``specgr`` where it ranks by both models (the item drafter's SASRec list
re-ranked with the GR model's scores, :mod:`specrec.fusion`: above SASRec and
above beam on validation; ranked by the GR alone it is beam's quality at more
cost, and is no tier); then, where the drafter's fusion says its own list beat
the GR model's on validation (SASRec on Amazon Beauty: R@10 0.101 against
0.100, on test 0.081 against 0.065), ``drafter``; then ``beam`` and ``strict``
(the same list: the cheaper of the two by estimate is tried), then ``nezha``
(the draft head's list), then ``drafter`` where it was not placed above.
Only policies that can run on
the engine are candidates (:meth:`~.base.Policy.missing`: a verifier whose
bundle has no SID drafter offers no ``nezha``). A candidate is admitted when
its tail completion fits:

    now + tail cost + the queue wait's tail <= deadline - reserve

The tail cost is the high quantile (p99 by default) of the policy's request
times at the request's list length K over a recent window (across every K
while that K has none; learned online from its own requests, in the engine's
:class:`~specrec.costs.CostModel`; a request that failed counts with the time
it took): admitted on a mean, a tier whose mean fits answers late whenever it
runs slow, and the budget is a promise on every request. The queue wait is the
engine's live tail estimate for the service the policy uses
(``Engine.load(policy)``; 0 in-process). The reserve (``Engine.reserve``) is
the time the gateway keeps back from a verifier policy's calls for its
fallback, the drafter's own tail answer: the verifier's calls end there, so a
tier that does not end before it would not end at all. The ``drafter`` tier
keeps nothing back (its fallback, the catalogue's fill, takes no time); nor
does any tier in-process, or while the drafter is down. A request that nothing
fits, not even the drafter, is refused (:class:`Overloaded`): the gateway
answers RESOURCE_EXHAUSTED at once, while there is still time to say so,
instead of computing an answer that would arrive late.

Estimates of a tier that was not chosen for a while go stale (they were
learned under load, or while the verifier was paused), so a better tier that
was skipped for ``probe_s`` seconds is tried once anyway when its estimate
misses the time left by less than 2x; its estimates are then replaced by that
request's time (requests meanwhile still see the old ones). The last tier is
probed like that however far its estimate is off: otherwise one burst that
taught it a cost above the budget would refuse every request from then on
(nothing would run to teach it otherwise). After a fault the verifier's tiers come back within about
``probe_s``, and while the fault lasts one request in ``probe_s`` pays for the
probe (it falls back to the drafter like any verifier call that misses).
"""

from __future__ import annotations

from pydantic import Field

from ..costs import Resource, resource_of
from .base import LiveBatch, Policy, PolicyConfig, RecRequest, make_policy, register
from .errors import Overloaded, Unsupported
from .specgr import SpecGRPolicy

__all__ = ["AutoConfig", "AutoPolicy", "Overloaded"]


#: auto's tiers where the engine's item drafter does not beat the GR model on validation
MODEL_FIRST = [["specgr"], ["beam", "strict"], ["nezha"], ["drafter"]]
#: ... and where it does (its fusion tells both models' validation recall): its own list above the GR's
ITEM_MODEL_SECOND = [["specgr"], ["drafter"], ["beam", "strict"], ["nezha"]]


class AutoConfig(PolicyConfig):
    tiers: list[list[str]] | None = Field(
        None, description="candidate policies, most accurate first; within a tier, equally accurate policies (the "
        "cheapest by estimate is tried); specgr only where it ranks by both models. Default: by the quality measured "
        "on validation users: specgr (both models), then the item drafter's own list where it beat the GR model's "
        "(the drafter's fusion tells both: SASRec on Amazon Beauty), then beam / strict, nezha (and the drafter, "
        "where it did not)")
    probe_s: float = Field(1.0, gt=0.0, le=3600.0, description="try a better tier skipped for this many seconds once")


@register
class AutoPolicy(Policy):
    name = "auto"
    Config = AutoConfig
    config: AutoConfig
    uses_verifier = False

    def _run(self, batch: LiveBatch) -> None:
        for j, _, req, _ in batch.rows():
            name = self.choose(req)
            batch.finish(j, make_policy(name, self.engine).run([req])[0])

    def _cost(self, name: str, k: int) -> float | None:
        return self.engine.costs.tail(name, k)

    def _kept_back(self, name: str, left: float) -> float:
        """What ``name``'s calls leave, out of ``left``, for its fallback's tail answer: the engine's reserve for
        a verifier policy (the drafter answers when it misses), none for ``drafter`` (its fallback is the fill)."""
        return 0.0 if resource_of(name) is Resource.DRAFTER else self.engine.reserve(left)

    def choose(self, req: RecRequest) -> str:
        eng, cfg, costs = self.engine, self.config, self.engine.costs
        tiers = self.runnable()
        if not tiers:
            raise Unsupported(self.name, "a policy that can run: " + "; ".join(
                f"{n} needs {make_policy(n, eng).missing()}" for tier in self.tiers() for n in tier))
        if req.deadline is None:
            return self._cheapest(tiers[0], req.k)
        now = eng.clock()
        budget = req.deadline.left(now)
        for n, tier in enumerate(tiers):
            name = self._cheapest(tier, req.k)
            cost = self._cost(name, req.k)
            left = budget - eng.load(name) - self._kept_back(name, budget)
            last = costs.last_tried(name, now)
            if cost is None or cost <= left:
                costs.tried(name, now)
                return name
            if now - last >= cfg.probe_s and 0 < left and (cost <= 2 * left or n + 1 == len(tiers)):
                costs.tried(name, now)
                costs.relearn(name)  # its estimates are replaced by this request's time
                return name
        raise Overloaded(
            f"no policy fits the {max(0.0, budget) * 1000:.1f} ms left "
            f"(queue ahead: verifier {eng.load('beam') * 1000:.1f} ms, drafter {eng.load('drafter') * 1000:.1f} ms; "
            f"kept back for the drafter's answer: {self._kept_back('beam', budget) * 1000:.1f} ms)"
        )

    def runnable(self) -> list[list[str]]:
        """The tiers with only the policies that can run on this engine (``Policy.missing``: a bundle without
        a SID drafter offers no ``nezha``, an engine without an item drafter no ``drafter``); empty tiers
        dropped."""
        tiers = [[n for n in tier if self._offers(n)] for tier in self.tiers()]
        return [t for t in tiers if t]

    def tiers(self) -> list[list[str]]:
        """The configured tiers, else the order of quality measured on validation (:data:`ITEM_MODEL_SECOND`
        where the engine's item drafter's fusion says its list beat the GR model's, else :data:`MODEL_FIRST`)."""
        if self.config.tiers is not None:
            return self.config.tiers
        fusion = getattr(self.engine.drafter, "fusion", None) if self.engine.drafter is not None else None
        return ITEM_MODEL_SECOND if fusion is not None and fusion.item_model_leads else MODEL_FIRST

    def _offers(self, name: str) -> bool:
        """Whether ``name`` is a candidate here: it can run, and ``specgr`` only where it ranks by both models."""
        pol = make_policy(name, self.engine)
        if pol.missing() is not None:
            return False
        return not isinstance(pol, SpecGRPolicy) or pol.fusion() is not None

    def _cheapest(self, tier: list[str], k: int) -> str:
        costs = [(self._cost(n, k), n) for n in tier]
        unknown = [n for c, n in costs if c is None]
        if unknown:  # not measured yet: try it
            return unknown[0]
        return min(costs)[1]
