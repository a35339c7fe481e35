"""The fallback ladder: who answers when the asked policy cannot.

In this order, each saying so in ``RecResult.degraded`` with ``served_by``
naming what answered:

- the asked policy's own list;
- the verifier down, slow or hung (or its :class:`~.breaker.Breaker` open):
  the drafter's list (``drafter``), unless the drafter is known down too; a
  policy that holds the drafter's list already (``fused``, whose verifier call
  failed or ran out of time) answers with it at once (its result's ``fault``
  says why; the verdict on the verifier is the same as for a raised failure);
- the drafter down (policies that need it): ``beam``, else ``nezha``, with the
  time kept back for the drafter given to the verifier
  (:meth:`~specrec.deadline.Deadline.whole`);
- a part of the verifier's bundle missing (a call it refused as
  UNIMPLEMENTED, code ``"UNIMPLEMENTED"``): ``beam``, else the drafter. That is
  no failure of the verifier: the breaker is left as it is;
- both down, or nothing came back in time: the catalogue's first items
  (fill, the last resort).

A request with less time left than one call's grace answers with the fill at
once, and a fallback is not started with less, nor once the caller cancelled it
(it answered at the deadline). The breaker learns from every verdict on the verifier; a budget too
small is no verdict (:meth:`~.breaker.Breaker.settle`). The drafter's own time
in a fallback teaches the cost model what the next requests keep back for it.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import replace

import numpy as np

from ..costs import CostModel, Resource
from .base import POLICIES, Policy, make_policy
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
        self._policies: dict[tuple, tuple[Engine, Policy]] = {}  # built once per engine, name and parameters
        self._lock = threading.Lock()

    def policy(self, eng: Engine, name: str, params: dict | None = None) -> Policy:
        """The policy object for ``name`` with ``params`` on ``eng``, built once and kept (a policy holds no
        request's state: that is its :class:`~.batch.LiveBatch`'s), except one that is not
        :attr:`~.base.Policy.reusable`."""
        if name not in POLICIES or not POLICIES[name].reusable:
            return make_policy(name, eng, **(params or {}))
        key = (id(eng), name, repr(sorted((params or {}).items())))
        with self._lock:
            held = self._policies.get(key)
        if held is not None and held[0] is eng:
            return held[1]
        policy = make_policy(name, eng, **(params or {}))
        with self._lock:
            if len(self._policies) > 1024:  # requests with ever new parameters, or many engines: start again
                self._policies.clear()
            self._policies[key] = (eng, policy)
        return policy

    def no_time(self, eng: Engine, req: RecRequest) -> bool:
        """Less time left than one call needs to come back: no call is worth starting."""
        return req.deadline is not None and (req.deadline.cancelled or req.deadline.left(eng.clock()) < self.grace_s)

    def answer(self, name: str, params: dict, eng: Engine, req: RecRequest) -> RecResult:
        """``name`` (already admitted) answers, or the best fallback still available does."""
        if self.no_time(eng, req):
            return catalogue_only(eng, req, "no time left for any call")  # no call could come back in time
        if name != "drafter" and not self.breaker.allow():
            return self.fallback(eng, req, "verifier", "verifier breaker open (recent failures)")
        try:
            res = self.policy(eng, name, params).run([req])[0]
        except (DependencyDown, BudgetExceeded) as e:
            return self.failed(eng, req, e)
        except Unsupported:  # the policy cannot run on these parts (found out during the call): no verdict
            self.breaker.settle()
            raise
        return self.verdict(eng, req, res)

    def failed(self, eng: Engine, req: RecRequest, e: DependencyDown | BudgetExceeded) -> RecResult:
        """The answer when the policy raised ``e`` (a dependency down, or out of time), the verdict on the
        verifier given."""
        if isinstance(e, DependencyDown):
            self.on_down(e)
            if e.which == "verifier" and e.code == "UNIMPLEMENTED":  # a part its bundle lacks, not a failure
                self.breaker.settle()
                return self.fallback(eng, req, "verifier part", str(e))
            if e.which == "verifier":
                self.breaker.result(False)
            else:
                self.breaker.settle()
                if e.unreachable:
                    self.drafter.failed()
            return self.fallback(eng, req, e.which, str(e))
        # a budget too small is not a fault of the service: the breaker is left as it is
        self.breaker.settle()
        if e.which == "drafter":  # the budget is spent: no time for a verifier answer either
            return catalogue_only(eng, req, f"drafter did not answer in time ({e})")
        return self.fallback(eng, req, "verifier", f"verifier did not answer in time ({e})")

    def verdict(self, eng: Engine, req: RecRequest, res: RecResult) -> RecResult:
        """The policy answered ``res``: the verdict on the verifier (a list it answered around the verifier's
        failure, ``res.fault``, counts as that failure)."""
        return self._held(eng, req, res) if res.fault is not None else self._verdict(res)

    def _verdict(self, res: RecResult) -> RecResult:
        self.breaker.result(True)
        return res

    def _held(self, eng: Engine, req: RecRequest, res: RecResult) -> RecResult:
        """A list the policy answered around its dependency's failure (``fused``: the item drafter's list in hand,
        its verifier pass failed or ran late): the verdict on the verifier as if the failure had been raised, and
        the answer said so; a part the bundle lacks (UNIMPLEMENTED) is no failure, and its fallback answers."""
        e = res.fault
        if isinstance(e, BudgetExceeded):  # a budget too small: the breaker is left as it is
            self.breaker.settle()
            res.served_by = "drafter"
            res.degraded = f"verifier did not answer in time: the drafter's list, unranked by the model ({e})"
            return res
        assert isinstance(e, DependencyDown)
        self.on_down(e)
        if e.code == "UNIMPLEMENTED":
            self.breaker.settle()
            return self.fallback(eng, req, "verifier part", str(e))
        self.breaker.result(False)
        res.degraded = f"verifier unavailable: the drafter's list, unranked by the model ({e})"
        return res

    def fallback(self, eng: Engine, req: RecRequest, down: str, why: str) -> RecResult:
        """The best answer still available without ``down``; catalogue fill when none."""
        order = {"verifier": ["drafter"], "verifier part": ["beam", "drafter"]}.get(down, ["beam", "nezha"])
        reasons = [why]
        for name in order:
            if self.no_time(eng, req):
                reasons.append("no time left for a fallback")  # nothing could come back in time
                break
            if down == "drafter" and self.breaker.is_open():
                break
            if name == "drafter" and self.drafter.is_down():
                reasons.append("drafter down (recent failure)")
                break
            try:
                # the time kept back for the drafter's answer is the verifier's now
                run = req if name == "drafter" or req.deadline is None else replace(req, deadline=req.deadline.whole())
                t0 = eng.clock()
                res = self.policy(eng, name).run([run])[0]
                if name == "drafter":  # the drafter's own time: what the next requests keep back for it
                    self.costs.observe_resource(Resource.DRAFTER, eng.clock() - t0)
                res.degraded = f"{down} unavailable: {name} answered ({why})"
                return res
            except (DependencyDown, BudgetExceeded) as e:
                if isinstance(e, DependencyDown) and e.which == "drafter" and e.unreachable:
                    self.drafter.failed()
                reasons.append(str(e))
        return catalogue_only(eng, req, "; ".join(reasons))
