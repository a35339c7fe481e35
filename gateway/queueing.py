"""The gateway's queue model: requests admitted and not finished, per resource.

``auto`` (at admission) adds the expected wait of the service a policy uses
to its cost (:meth:`QueueModel.wait`): the requests ahead of this one at that
service, times the service's measured time between completions while it is
busy (Little's law: the wait is the queue over the throughput). Under load
many requests run at once (worker threads, the verifier's batches), so each
one's own wall time grows while completions come as fast as ever: the time
per request of the :class:`~specrec.costs.CostModel` would count each of them
as if they ran one after another, overestimate the wait by the concurrency
and shed requests the stack would have answered in time. Until a service has
completed requests, the cost model's time per request stands in.

The verifier's calls end :meth:`QueueModel.reserve` before the deadline, so
the drafter can still answer when the verifier does not.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

from specrec.costs import CostModel, Resource, resource_of
from specrec.policies.breaker import Cooldown


class QueueModel:
    def __init__(self, costs: CostModel, reserve_s: float, drafter: Cooldown, alpha: float = 0.1,
                 clock: Callable[[], float] = time.monotonic):
        self.costs, self.reserve_s, self.drafter = costs, reserve_s, drafter
        self.alpha, self.clock = alpha, clock
        self.pending = {r: 0 for r in Resource}
        self._mark = {r: 0.0 for r in Resource}  # the last completion, or when the resource last became busy
        self._interval: dict[Resource, float] = {}  # running mean busy time between completions
        self._lock = threading.Lock()

    def take(self, resource: Resource) -> None:
        """A request admitted to ``resource`` (on arrival, before it runs)."""
        with self._lock:
            if self.pending[resource] == 0:
                self._mark[resource] = self.clock()
            self.pending[resource] += 1

    def done(self, resource: Resource, served: bool = True) -> None:
        """A request finished at ``resource``; ``served`` False: it left before it ran (it completed nothing,
        and the busy time goes on counting towards the next completion)."""
        with self._lock:
            if not served:
                self.pending[resource] -= 1
                return
            now = self.clock()
            gap = now - self._mark[resource]  # busy all along: it had a request since the mark
            self._mark[resource] = now
            self.pending[resource] -= 1
            old = self._interval.get(resource)
            self._interval[resource] = gap if old is None else (1 - self.alpha) * old + self.alpha * gap

    def per_request(self, resource: Resource) -> float:
        """Seconds of the resource's busy time per completed request (the cost model's time per request
        until it has completed any)."""
        with self._lock:
            got = self._interval.get(resource)
        return self.costs.resource(resource) if got is None else got

    def wait(self, policy: str = "") -> float:
        """Expected wait (s) before a new request's first call is served: the requests admitted
        ahead of it that use the same service (the drafter for ``drafter``, else the verifier),
        at that service's busy time per completed request."""
        resource = resource_of(policy)
        with self._lock:
            ahead = max(0, self.pending[resource] - 1)
        return ahead * self.per_request(resource) if ahead else 0.0

    def reserve(self, left_s: float) -> float:
        """Time kept back from the verifier's calls for the drafter's answer: ``reserve_s``, or twice the
        drafter's running cost (fallback calls included: they are the ones made under pressure) when that
        is more, at most 80% of what is left; none while the drafter is down (its :class:`Cooldown`): the
        verifier gets it all."""
        if self.drafter.is_down():
            return 0.0
        want = max(self.reserve_s, 2.0 * self.costs.resource(Resource.DRAFTER))
        return min(want, 0.8 * max(left_s, 0.0))
