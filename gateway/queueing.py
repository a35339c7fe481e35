"""The gateway's queue model: requests admitted and not finished, per resource.

``auto`` (at admission) adds the expected wait of the service a policy uses
to its cost (:meth:`QueueModel.wait`: the requests ahead of this one at that
service, at its running cost per request from the
:class:`~specrec.costs.CostModel`). The verifier's calls end
:meth:`QueueModel.reserve` before the deadline, so the drafter can still
answer when the verifier does not.
"""

from __future__ import annotations

import threading

from specrec.costs import CostModel, Resource, resource_of
from specrec.policies.breaker import Cooldown


class QueueModel:
    def __init__(self, costs: CostModel, reserve_s: float, drafter: Cooldown):
        self.costs, self.reserve_s, self.drafter = costs, reserve_s, drafter
        self.pending = {r: 0 for r in Resource}
        self._lock = threading.Lock()

    def take(self, resource: Resource) -> None:
        """A request admitted to ``resource`` (on arrival, before it runs)."""
        with self._lock:
            self.pending[resource] += 1

    def done(self, resource: Resource) -> None:
        with self._lock:
            self.pending[resource] -= 1

    def wait(self, policy: str = "") -> float:
        """Expected wait (s) before a new request's first call is served: the requests admitted
        ahead of it that use the same service (the drafter for ``drafter``, else the verifier),
        at that service's running mean cost per request."""
        resource = resource_of(policy)
        with self._lock:
            ahead = max(0, self.pending[resource] - 1)
        return ahead * self.costs.resource(resource)

    def reserve(self, left_s: float) -> float:
        """Time kept back from the verifier's calls for the drafter's answer: ``reserve_s``, or twice the
        drafter's running cost (fallback calls included: they are the ones made under pressure) when that
        is more, at most 80% of what is left; none while the drafter is down (its :class:`Cooldown`): the
        verifier gets it all."""
        if self.drafter.is_down():
            return 0.0
        want = max(self.reserve_s, 2.0 * self.costs.resource(Resource.DRAFTER))
        return min(want, 0.8 * max(left_s, 0.0))
