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

Completions do not come evenly (arrivals are bursty, the services share the
cores), so the wait of ``n`` requests ahead is not ``n`` mean intervals for
certain: like a policy's cost, it carries ``spread`` running mean absolute
deviations of the interval, scaled by sqrt(n) (the spread of a sum of n
roughly independent intervals). Without that term a request admitted to a
queue that ran slower than its mean answered late (most late answers at 3x
capacity on a slow 2-core machine were the drafter's, admitted on the mean).

The verifier's calls end :meth:`QueueModel.reserve` before the deadline, so
the drafter can still answer when the verifier does not; the reserve holds the
drafter's queue as well, since a fallback waits behind the requests already
there.
"""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Callable

from specrec.costs import CostModel, Resource, resource_of
from specrec.policies.breaker import Cooldown


class QueueModel:
    def __init__(self, costs: CostModel, reserve_s: float, drafter: Cooldown, alpha: float = 0.1,
                 clock: Callable[[], float] = time.monotonic, spread: float = 2.0):
        self.costs, self.reserve_s, self.drafter = costs, reserve_s, drafter
        self.alpha, self.clock, self.spread = alpha, clock, spread
        self.pending = {r: 0 for r in Resource}
        self._mark = {r: 0.0 for r in Resource}  # the last completion, or when the resource last became busy
        self._interval: dict[Resource, float] = {}  # running mean busy time between completions
        self._dev: dict[Resource, float] = {}  # its running mean absolute deviation
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
            if old is None:
                self._interval[resource], self._dev[resource] = gap, 0.0
            else:
                a = self.alpha
                self._interval[resource] = (1 - a) * old + a * gap
                self._dev[resource] = (1 - a) * self._dev[resource] + a * abs(gap - old)

    def per_request(self, resource: Resource) -> float:
        """Seconds of the resource's busy time per completed request (the cost model's time per request
        until it has completed any)."""
        with self._lock:
            got = self._interval.get(resource)
        return self.costs.resource(resource) if got is None else got

    def _behind(self, resource: Resource, n: int) -> float:
        """Seconds until ``n`` requests at ``resource`` complete: n busy times per completion, plus ``spread``
        deviations of it times sqrt(n)."""
        if n <= 0:
            return 0.0
        with self._lock:
            dev = self._dev.get(resource, 0.0)
        return n * self.per_request(resource) + self.spread * math.sqrt(n) * dev

    def wait(self, policy: str = "") -> float:
        """Expected wait (s) before a new request's first call is served: the requests admitted
        ahead of it that use the same service (the drafter for ``drafter``, else the verifier),
        at that service's busy time per completed request, plus ``spread`` deviations of that time
        times sqrt(ahead)."""
        resource = resource_of(policy)
        with self._lock:
            ahead = self.pending[resource] - 1
        return self._behind(resource, ahead)

    def reserve(self, left_s: float) -> float:
        """Time kept back from the verifier's calls for the drafter's answer: ``reserve_s``, or twice the
        drafter's running cost (fallback calls included: they are the ones made under pressure) when that
        is more, plus the wait behind the requests queued at the drafter now; at most 80% of what is left;
        none while the drafter is down (its :class:`Cooldown`): the verifier gets it all."""
        if self.drafter.is_down():
            return 0.0
        with self._lock:
            queued = self.pending[Resource.DRAFTER]
        want = max(self.reserve_s, 2.0 * self.costs.resource(Resource.DRAFTER)) + self._behind(Resource.DRAFTER, queued)
        return min(want, 0.8 * max(left_s, 0.0))
