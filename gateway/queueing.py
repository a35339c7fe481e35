"""The gateway's queue model: requests admitted and not finished, per resource.

``auto`` (at admission) adds the tail of the wait at the service a policy
uses to its tail cost (:meth:`QueueModel.wait`): the requests ahead of this
one at that service, times the service's measured time between completions
while it is busy (Little's law: the wait is the queue over the throughput).
Under load many requests run at once (worker threads, the verifier's
batches), so each one's own wall time grows while completions come as fast
as ever: the time per request of the :class:`~specrec.costs.CostModel` would
count each of them as if they ran one after another, overestimate the wait by
the concurrency and shed requests the stack would have answered in time.
Until a service has completed requests, the cost model's tail time per
request stands in.

Completions do not come evenly (arrivals are bursty, the services share the
cores, a machine slows down), so the wait is a tail too, not a mean: the time
between completions is a :class:`~specrec.costs.TailEstimate` (the cost
model's quantile, p99 by default, over its window of the last completions),
and the wait of ``n`` requests ahead is

    n * mean + sqrt(n) * (tail - mean)

of that interval. One request ahead waits the interval's tail itself. ``n``
of them wait a sum of ``n`` intervals, whose mean is ``n`` means and whose
spread grows as sqrt(n) (the spread of a sum of n roughly independent
intervals), so the sum's excess over its mean at the same quantile is
sqrt(n) times one interval's (exact for normal intervals, the central limit
theorem's scaling otherwise). ``n`` times the tail would assume every one of
them slow at once, double count the queue at load and shed requests that
would have been answered; the mean alone admitted requests to a queue that
then ran slow, and they answered late. Intervals that are slow together (a
stalled machine) are what the window is for: it follows the stall within a
few completions.

The verifier's calls end :meth:`QueueModel.reserve` before the deadline, so
the drafter can still answer when the verifier does not: the drafter's own
tail answer (its request time's tail in the cost model, at least
``reserve_s``) plus the tail of the wait behind the requests already queued
there, since a fallback waits behind them.
"""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Callable

from specrec.costs import CostModel, Resource, resource_of
from specrec.policies.breaker import Cooldown


class QueueModel:
    def __init__(self, costs: CostModel, reserve_s: float, drafter: Cooldown,
                 clock: Callable[[], float] = time.monotonic):
        self.costs, self.reserve_s, self.drafter, self.clock = costs, reserve_s, drafter, clock
        self.pending = {r: 0 for r in Resource}
        self._mark = {r: 0.0 for r in Resource}  # the last completion, or when the resource last became busy
        self._gaps = {r: costs.estimator() for r in Resource}  # busy time between completions: mean and tail
        self._lock = threading.Lock()

    def reset(self) -> None:
        """Forget the busy times learned so far (the requests admitted now still count)."""
        with self._lock:
            for got in self._gaps.values():
                got.reset()

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
            self.pending[resource] -= 1
            if not served:
                return
            now = self.clock()
            self._gaps[resource].observe(now - self._mark[resource])  # busy all along: it had a request since
            self._mark[resource] = now

    def _behind(self, resource: Resource, n: int) -> float:
        """The tail (s) of the time until ``n`` requests at ``resource`` complete: ``n`` mean intervals plus
        sqrt(n) times one interval's excess of its tail over its mean (the module's docstring); n times the
        cost model's tail per request before the resource completed any."""
        if n <= 0:
            return 0.0
        with self._lock:
            gaps = self._gaps[resource]
            tail, mean = gaps.tail(), gaps.mean()
        if tail is None or mean is None:
            return n * self.costs.resource(resource)
        return n * mean + math.sqrt(n) * (tail - mean)

    def wait(self, policy: str = "") -> float:
        """The tail (s) of the wait before a new request's first call is served: the requests admitted ahead
        of it that use the same service (the drafter for ``drafter``, else the verifier), at that service's
        busy time per completed request (:meth:`_behind`)."""
        resource = resource_of(policy)
        with self._lock:
            ahead = self.pending[resource] - 1
        return self._behind(resource, ahead)

    def reserve(self, left_s: float) -> float:
        """Time kept back from the verifier's calls for the drafter's answer: ``reserve_s``, or twice the
        drafter's mean request time over the window (fallback calls included: they are the ones made under
        pressure) when that is more, plus the tail of the wait behind the requests queued at the drafter now;
        at most 80% of what is left; none while the drafter is down (its :class:`Cooldown`): the verifier gets
        it all. Not the drafter's own tail: kept back from every verifier call, it took the verifier's time in
        most requests (measured: ``PolicyCosts.fits``)."""
        if self.drafter.is_down():
            return 0.0
        with self._lock:
            queued = self.pending[Resource.DRAFTER]
        want = (max(self.reserve_s, 2.0 * self.costs.resource_mean(Resource.DRAFTER))
                + self._behind(Resource.DRAFTER, queued))
        return min(want, 0.8 * max(left_s, 0.0))
