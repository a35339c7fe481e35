"""``auto``: per request, the most accurate policy whose tail cost fits the budget.

The gateway's default. Candidates are tried from the most accurate down
(``tiers``). By default the list ``specrec tune-fusion`` decided on
(:attr:`specrec.fusion.Fusion.default`: ``fused`` only where validation users
showed it beating the item drafter's own list by more than chance, a paired
bootstrap interval above 0; else ``drafter``) comes first, the others ordered
by the validation recall@10 of the list each one serves, as ``specrec
tune-fusion`` measured it on the bundle's
validation users (:attr:`specrec.fusion.Fusion.valid`): ``fused`` (the item
drafter's candidates ranked by both models), ``drafter`` (the item drafter's
own list), ``beam`` with ``strict`` (the GR's own beam search: the same list,
the cheaper of the two by estimate is tried) and ``nezha`` (the draft head's
list). On Amazon Beauty: fused 0.113 > SASRec's list 0.101 > beam's. A list
with no figure (an engine without an item drafter that tells a fusion, an
older bundle) goes after the measured ones, in :data:`UNMEASURED_ORDER`.
Only policies that can run on
the engine are candidates (:meth:`~.base.Policy.missing`: a verifier whose
bundle has no SID drafter offers no ``nezha``). A candidate is admitted when
its tail completion fits:

    now + tail cost + the queue wait's tail <= deadline - kept back

The tail cost is the high quantile (p99 by default) of the policy's request
times at the request's list length K over a recent window (across every K
while that K has none; learned online from its own requests, in the engine's
:class:`~specrec.costs.CostModel`, and through the gateway measured before the
first request, in its warm-up, on the real callees; a request that ran late
counts with the time it took, one whose dependency was down does not):
admitted on a mean, a tier whose mean fits answers late whenever it runs
slow, and the budget is a promise on every request. The queue wait is the
engine's live tail estimate for the service the policy uses
(``Engine.serving.wait(policy)``; 0 in-process). What is kept back
(``Engine.serving.kept_back``, the gateway's :class:`gateway.budget.Budget`) is
the time the gateway keeps back from a verifier policy's calls for its
fallback, the drafter's own tail answer (only the time to build it for a
policy whose fallback is in hand, ``fused``), plus how early the gateway's cut
fires on a busy machine: the verifier's calls end there, so a tier that does
not end before it would not end at all. The ``drafter`` tier keeps nothing back
for a fallback (its fallback, the catalogue's fill, takes no time); nor does
any tier in-process, or while the drafter is down. A request that nothing
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

A tier whose dependency is down (``Engine.serving.down``: at the gateway, the
verifier's breaker refusing calls, or the drafter failed a moment ago) is
skipped, not admitted to fall back: with the verifier down ``auto`` serves the
drafter's list as its own choice, and with the drafter down, beam's. The
breaker's half-open probe is a normal request of the best tier again.
"""

from __future__ import annotations

from pydantic import Field

from .base import POLICIES, Policy, PolicyConfig, make_policy, register
from .batch import LiveBatch
from .errors import Overloaded, Unsupported
from .requests import RecRequest

__all__ = ["AutoConfig", "AutoPolicy", "Overloaded", "ordered_tiers"]


#: the tiers ``auto`` orders, named by the policy whose list its figure measures
TIERS = {"fused": ["fused"], "drafter": ["drafter"], "beam": ["beam", "strict"], "nezha": ["nezha"]}
#: the order of the lists with no validation figure: the GR's own search, its draft head's, the item drafter's
UNMEASURED_ORDER = ["fused", "beam", "nezha", "drafter"]


def ordered_tiers(valid: dict[str, float], default: str | None = None) -> list[list[str]]:
    """The tiers, most accurate first: the ``default`` list first where one was decided (``tune-fusion``'s
    ``fusion.default``: ``fused`` only where validation showed it beating the item drafter's own list by more
    than chance, else ``drafter``), then the lists with a validation figure by it (recall@10, higher first), then
    the others in :data:`UNMEASURED_ORDER`."""
    measured = sorted((n for n in TIERS if n in valid), key=lambda n: -valid[n])
    order = measured + [n for n in UNMEASURED_ORDER if n not in valid]
    if default in TIERS:
        order = [default] + [n for n in order if n != default]
    return [TIERS[n] for n in order]


class AutoConfig(PolicyConfig):
    tiers: list[list[str]] | None = Field(
        None, description="candidate policies, most accurate first; within a tier, equally accurate policies (the "
        "cheapest by estimate is tried). Default: by the validation recall@10 of the list each serves (the item "
        "drafter's fusion tells them, `specrec tune-fusion`): fused, drafter, beam / strict, nezha in that figure's "
        "order; lists with no figure after the measured ones")
    probe_s: float = Field(1.0, gt=0.0, le=3600.0, description="try a better tier skipped for this many seconds once")


@register
class AutoPolicy(Policy):
    name = "auto"
    Config = AutoConfig
    config: AutoConfig
    uses_verifier = False

    def __init__(self, *args, **kw) -> None:
        super().__init__(*args, **kw)
        self._runnable: dict[tuple, list[list[str]]] = {}  # runnable() by what the engine offers

    def _run(self, batch: LiveBatch) -> None:
        for j, _, req, _ in batch.rows():
            name = self.choose(req)
            batch.finish(j, make_policy(name, self.engine).run([req])[0])

    def _cost(self, name: str, k: int) -> float | None:
        return self.engine.costs.tail(name, k)

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
        serving = eng.serving
        tiers = self._up(tiers)
        for n, tier in enumerate(tiers):
            name = self._cheapest(tier, req.k)
            cost = self._cost(name, req.k)
            left = budget - serving.wait(name) - serving.kept_back(name, budget)
            last = costs.last_tried(name, now)
            if cost is None or cost <= left:
                costs.tried(name, now)
                return name
            if now - last >= cfg.probe_s and 0 < left and (cost <= 2 * left or n + 1 == len(tiers)):
                costs.tried(name, now)
                costs.relearn(name)  # its estimates, its stages' too, are replaced by this request's
                return name
        ahead, kept = serving.wait, serving.kept_back('beam', budget)
        raise Overloaded(
            f"no policy fits the {max(0.0, budget) * 1000:.1f} ms left "
            f"(queue ahead: verifier {ahead('beam') * 1000:.1f} ms, drafter {ahead('drafter') * 1000:.1f} ms; "
            f"kept back for the drafter's answer: {kept * 1000:.1f} ms)"
        )

    def _up(self, tiers: list[list[str]]) -> list[list[str]]:
        """The tiers without the policies whose dependency is down (``Engine.serving.down``: the verifier's breaker
        refuses, the drafter failed a moment ago): a tier that would only fall back is skipped, and the next one
        is the choice, not a degraded answer. All of them when every tier needs something down (their fallbacks
        answer as they can)."""
        eng = self.engine
        down = {d for d in ("verifier", "drafter") if eng.serving.down(d)}
        if not down:
            return tiers
        up = [[n for n in tier if not ((POLICIES[n].uses_verifier and "verifier" in down)
                                      or (POLICIES[n].uses_drafter and "drafter" in down))] for tier in tiers]
        return [t for t in up if t] or tiers

    def runnable(self) -> list[list[str]]:
        """The tiers with only the policies that can run on this engine (``Policy.missing``: a bundle without
        a SID drafter offers no ``nezha``, an engine without an item drafter no ``drafter``, one whose item drafter
        tells no fusion no ``fused``); empty tiers dropped. Kept while what the engine offers stays the same
        (admission asks it for every request)."""
        key = self._offer_key()
        cached = self._runnable.get(key)
        if cached is None:
            tiers = [[n for n in tier if make_policy(n, self.engine).missing() is None] for tier in self.tiers()]
            cached = self._runnable[key] = [t for t in tiers if t]
        return cached

    def _offer_key(self) -> tuple:
        """What :meth:`runnable` depends on: the verifier's parts, the item drafter and its fusion's figures."""
        drafter = self.engine.drafter
        fusion = None if drafter is None else getattr(drafter, "fusion", None)
        return (self.engine.verifier.parts(), drafter is None, fusion,
                None if fusion is None else tuple(sorted(fusion.valid.items())),
                None if fusion is None else fusion.default, str(self.config.tiers))

    def tiers(self) -> list[list[str]]:
        """The configured tiers, else by the validation figures of the lists they serve (:func:`ordered_tiers`)."""
        if self.config.tiers is not None:
            return self.config.tiers
        drafter = self.engine.drafter
        fusion = None if drafter is None else getattr(drafter, "fusion", None)
        return ordered_tiers(dict(fusion.valid) if fusion is not None else {},
                             None if fusion is None else fusion.default)

    def _cheapest(self, tier: list[str], k: int) -> str:
        costs = [(self._cost(n, k), n) for n in tier]
        unknown = [n for c, n in costs if c is None]
        if unknown:  # not measured yet: try it
            return unknown[0]
        return min(costs)[1]
