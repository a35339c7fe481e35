"""The fallback ladder: who answers when the asked policy cannot.

In this order, each saying so in ``RecResult.degraded`` with ``served_by``
naming what answered:

- the asked policy's own list;
- the verifier down, slow or hung (or its :class:`~.breaker.Breaker` open):
  the drafter's list (``drafter``), unless the drafter is known down too; a
  policy that holds the drafter's list already (``fused``, whose verifier call
  failed or ran out of time) answers with it at once;
- the drafter down (policies that need it): ``beam``, else ``nezha``, with the
  time kept back for the drafter given to the verifier
  (:meth:`~specrec.deadline.Deadline.drop_reserve`);
- a part of the verifier's bundle missing (a call it refused as
  UNIMPLEMENTED, code ``"UNIMPLEMENTED"``): ``beam``, else the drafter. That is
  no failure of the verifier: the breaker is left as it is;
- both down, or nothing came back in time: the catalogue's first items
  (fill, the last resort).

A request with less time left than one call's grace answers with the fill at
once, and a fallback is not started with less. The breaker learns from every verdict on the verifier; a budget too
small is no verdict (:meth:`~.breaker.Breaker.settle`). The drafter's own time
in a fallback teaches the cost model what the next requests keep back for it.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from ..costs import CostModel, Resource
from .base import make_policy
from .batch import fill_to_k
from .breaker import Breaker, Cooldown
from .engine import Engine
from .errors import BudgetExceeded, DependencyDown, Unsupported
from .metrics import RequestStats
from .requests import RecRequest, RecResult


def catalogue_only(eng: Engine, req: RecRequest, why: str) -> RecResult:
    """The last resort: the catalogue's first K items, flagged."""
    items, scores, sources = fill_to_k(req.k, eng.itemset, [], [], [], exclude=req.excluded())
    res = RecResult(np.asarray(items, np.int64), np.asarray(scores), sources, RequestStats(exit_reason="degraded"),
                    served_by="fill")
    res.degraded = f"catalogue fill: {why}"
    return res


class Ladder:
    """Runs a request's policy and walks down the ladder when a dependency fails.

    ``grace_s``: the least time a dependency call needs to come back; ``on_down``: told of every
    dependency failure of an asked policy (the gateway logs it)."""

    def __init__(self, breaker: Breaker, drafter: Cooldown, costs: CostModel, grace_s: float = 0.0,
                 on_down: Callable[[DependencyDown], None] | None = None):
        self.breaker, self.drafter, self.costs, self.grace_s = breaker, drafter, costs, grace_s
        self.on_down = on_down or (lambda e: None)

    def _no_time(self, eng: Engine, req: RecRequest) -> bool:
        """Less time left than one call needs to come back: no call is worth starting."""
        return req.deadline is not None and req.deadline.left(eng.clock()) < self.grace_s

    def answer(self, name: str, params: dict, eng: Engine, req: RecRequest) -> RecResult:
        """``name`` (already admitted) answers, or the best fallback still available does."""
        if self._no_time(eng, req):
            return catalogue_only(eng, req, "no time left for any call")  # no call could come back in time
        if name != "drafter" and not self.breaker.allow():
            return self.fallback(eng, req, "verifier", "verifier breaker open (recent failures)")
        try:
            res = make_policy(name, eng, **params).run([req])[0]
            self.breaker.result(True)
            return res
        except DependencyDown as e:
            self.on_down(e)
            if e.which == "verifier" and e.code == "UNIMPLEMENTED":  # a part its bundle lacks, not a failure
                self.breaker.settle()
                return self.fallback(eng, req, "verifier part", str(e))
            if e.which == "verifier":
                self.breaker.result(False)
                if e.partial is not None:  # the drafter's list, already in hand (fused): no call to make
                    res = e.partial
                    res.degraded = f"verifier unavailable: the drafter's list, unranked by the model ({e})"
                    return res
            else:
                self.breaker.settle()
                if e.unreachable:
                    self.drafter.failed()
            return self.fallback(eng, req, e.which, str(e))
        except Unsupported:  # the policy cannot run on these parts (found out during the call): no verdict
            self.breaker.settle()
            raise
        except BudgetExceeded as e:
            # a budget too small is not a fault of the service: the breaker is left as it is
            self.breaker.settle()
            if e.which == "drafter":  # the budget is spent: no time for a verifier answer either
                return catalogue_only(eng, req, f"drafter did not answer in time ({e})")
            if e.partial is not None:  # the drafter's list, already in hand (fused)
                res = e.partial
                res.served_by = "drafter"
                res.degraded = f"verifier did not answer in time: the drafter's list, unranked by the model ({e})"
                return res
            return self.fallback(eng, req, "verifier", f"verifier did not answer in time ({e})")

    def fallback(self, eng: Engine, req: RecRequest, down: str, why: str) -> RecResult:
        """The best answer still available without ``down``; catalogue fill when none."""
        order = {"verifier": ["drafter"], "verifier part": ["beam", "drafter"]}.get(down, ["beam", "nezha"])
        reasons = [why]
        for name in order:
            if self._no_time(eng, req):
                reasons.append("no time left for a fallback")  # nothing could come back in time
                break
            if down == "drafter" and self.breaker.is_open():
                break
            if name == "drafter" and self.drafter.is_down():
                reasons.append("drafter down (recent failure)")
                break
            try:
                if name != "drafter" and req.deadline is not None:
                    req.deadline.drop_reserve()  # the time kept back for the drafter's answer is the verifier's now
                t0 = eng.clock()
                res = make_policy(name, eng).run([req])[0]
                if name == "drafter":  # the drafter's own time: what the next requests keep back for it
                    self.costs.observe_resource(Resource.DRAFTER, eng.clock() - t0)
                res.degraded = f"{down} unavailable: {name} answered ({why})"
                return res
            except (DependencyDown, BudgetExceeded) as e:
                if isinstance(e, DependencyDown) and e.which == "drafter" and e.unreachable:
                    self.drafter.failed()
                reasons.append(str(e))
        return catalogue_only(eng, req, "; ".join(reasons))
