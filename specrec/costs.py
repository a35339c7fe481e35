"""What things cost: one model, learned online from the requests that ran.

Every cost is a **tail**, not a mean: the ``quantile`` (0.99 by default) of
the last ``window`` (200) observations (:class:`TailEstimate`). The budget is
a promise on every request, so a decision taken on a mean is wrong for the
slow part of them: a tier whose mean fits the time left but whose p99 does
not answers late one time in a few, and those late answers are exactly what
a latency SLO pages on. A window, not the whole history, so the estimate
follows the machine: a machine that slows down (a noisy neighbour, a
throttled core) moves the tail within a few observations, and the estimate
forgets the old machine once the window has turned over.

Every reader and writer of a cost goes through one :class:`CostModel`:

- **stage costs per policy** (:class:`CostStage`): a policy times its stages
  (a ``specgr`` round, a drafting call, a verify pass, a beam step, a whole
  beam search) and its budget hook asks, before the next one, whether it
  still fits the request's deadline (:meth:`PolicyCosts.fits`, on the stage's
  mean over the window: a stage that does not fit is not run, so a tail
  inflated by one slow call would never be observed down again). ``specgr``'s
  choice whether drafting pays reads the same mean (:meth:`PolicyCosts.estimate`).
- **request cost per (policy, K)**: the tail of a whole request's time, by
  the list length K (a K = 50 beam costs several K = 10 ones); a K not
  measured yet reads the policy's tail across every K. ``auto`` admits a
  tier by it (:meth:`CostModel.tail`). ``auto`` also records here when it
  last chose each policy (its probe timer), and marks a policy whose next
  request's time replaces its stale estimates (:meth:`CostModel.relearn`).
- **request cost per resource** (:class:`Resource`, the service a policy
  uses): its tail stands in for the gateway's queue model until the service
  has completed requests, and is the drafter's own tail that the gateway
  keeps back for its answer (:mod:`gateway.queueing`).

A policy object lives for one request; the model lives as long as the engine
(or the gateway) and is shared by the worker threads, so every method holds
one lock (a :class:`TailEstimate` has none of its own).
"""

from __future__ import annotations

import math
import statistics
import threading
from collections.abc import Callable
from enum import Enum

from .deadline import Deadline


class TailEstimate:
    """The ``q``-quantile of the last ``window`` observations: a streaming tail that follows change.

    A ring buffer of the last ``window`` values; :meth:`tail` sorts them on demand (cached until the
    next observation) and interpolates linearly between order statistics (numpy's default quantile,
    ``np.quantile(values, q)``). :attr:`count` is every observation since the last :meth:`reset`.

    **Few samples.** A sample of n values holds its q-quantile only once it has about ``1 / (1 - q)``
    of them (a p99 needs 100 to see one value in a hundred): below :attr:`min_samples` =
    ``min(window, round(1 / (1 - q)))`` observations, :meth:`tail` is the q-quantile of a normal
    distribution fitted robustly to the observations since the first: their median plus 2.33 (at a p99)
    times 1.4826 median absolute deviations, which one slow call among a few does not move. Not the
    largest value seen (nor a mean and deviation, which one outlier inflates as much): ``auto`` tries a
    lower tier's policy only now and then, so its estimate stays a short sample for long, and one slow
    call among a few held the tier out (through the gateway at 30 ms on a slow machine, ``auto``
    answered 92% of requests one at a time from the item drafter with the maximum).
    The first is left out once there is a second: a first
    call pays what no other does (a channel connecting, a graph loaded or exported on first use:
    seconds, in the integration tests' stack), and kept it held a whole beam search as not fitting any
    budget for the next 99 requests. A window shorter than ``1 / (1 - q)`` (q = 0.999 with 200) never
    resolves its quantile: its tail is then always that normal estimate.

    **Following a machine.** The window holds the last ``window`` observations only. When every cost
    doubles (a step to values above all the old ones), the tail is one of the new values once
    ``ceil((1 - q) * (window - 1)) + 1`` of them are in (a p99 of 200: three; the window's two largest
    values alone do not move it), and nothing of the old machine is left after ``window``. A machine
    that speeds up is followed more slowly (its old slow values leave the top only as the window turns
    over): an estimate that errs, errs on the side of time.

    Not thread-safe: its owner (:class:`CostModel`, the gateway's queue model) holds a lock."""

    def __init__(self, q: float = 0.99, window: int = 200):
        if not 0.0 < q < 1.0:
            raise ValueError(f"quantile {q} is not in (0, 1)")
        if window < 1:
            raise ValueError(f"window {window} holds no observation")
        self.q, self.window = q, window
        self.min_samples = min(window, max(1, round(1.0 / (1.0 - q))))
        self._z = statistics.NormalDist().inv_cdf(q)  # the few-samples estimate's deviations (2.33 at a p99)
        self._ring: list[float] = []
        self._next = 0  # where the next observation goes once the ring is full
        self.count = 0
        self._cache: tuple[float, float] | None = None  # (tail, mean) of the ring as it is

    def observe(self, x: float) -> None:
        if len(self._ring) < self.window:
            self._ring.append(float(x))
        else:
            self._ring[self._next] = float(x)
            self._next = (self._next + 1) % self.window
        self.count += 1
        self._cache = None

    def reset(self) -> None:
        """Forget every observation (the next one starts a new estimate)."""
        self._ring.clear()
        self._next = self.count = 0
        self._cache = None

    def _read(self) -> tuple[float, float] | None:
        if not self._ring:
            return None
        if self._cache is None:
            vals = sorted(self._ring)
            n = len(vals)
            if self.count < self.min_samples:  # since the first (still ring[0]: count < window)
                xs = self._ring[1:] if n > 1 else self._ring
                med = statistics.median(xs)
                tail = med + self._z * 1.4826 * statistics.median(abs(x - med) for x in xs)
            else:
                pos = (n - 1) * self.q
                lo = math.floor(pos)
                hi = min(lo + 1, n - 1)
                tail = vals[lo] + (pos - lo) * (vals[hi] - vals[lo])
            self._cache = (tail, math.fsum(vals) / n)
        return self._cache

    def tail(self) -> float | None:
        """The ``q``-quantile of the window (before :attr:`min_samples`, a normal one fitted robustly to the
        observations since the first); None when empty."""
        got = self._read()
        return None if got is None else got[0]

    def mean(self) -> float | None:
        """The window's mean; None when empty."""
        got = self._read()
        return None if got is None else got[1]


class CostStage(str, Enum):
    """A stage whose cost a policy learns and its budget hook reads."""

    ROUND = "round"  # specgr: one round (draft, verify, beam step), from rounds that ran to their end
    DRAFT = "draft"  # one drafting call (the engine's drafter or the distilled one)
    VERIFY = "verify"  # one verify call: a pass over the drafts and the beam frontier, and the beam step read from it
    BEAM_STEP = "beam_step"  # one beam step that computes its distributions (a round without a verify pass)
    SEARCH = "search"  # beam: a whole beam search in one call
    STEP = "step"  # beam: one level of a level-by-level search


class Resource(str, Enum):
    """The service a policy's requests wait for."""

    VERIFIER = "verifier"
    DRAFTER = "drafter"


def resource_of(policy: str) -> Resource:
    """``drafter`` uses the drafter alone; every other policy queues at the verifier."""
    return Resource.DRAFTER if policy == "drafter" else Resource.VERIFIER


#: a resource's cost per request before any was measured (seconds)
RESOURCE_START = {Resource.VERIFIER: 0.004, Resource.DRAFTER: 0.002}

#: the tail's quantile and window by default (the gateway's ``cost_quantile`` and ``cost_window``)
QUANTILE, WINDOW = 0.99, 200


class CostModel:
    """Costs by (policy, stage), by (policy, K) (whole requests) and by resource, each a
    :class:`TailEstimate` of ``quantile`` over the last ``window`` observations; thread-safe."""

    def __init__(self, quantile: float = QUANTILE, window: int = WINDOW,
                 resource_start: dict[Resource, float] | None = None):
        self.quantile, self.window = quantile, window
        self.estimator()  # a bad quantile or window fails here, not at the first observation
        self._stages: dict[tuple[str, CostStage], TailEstimate] = {}
        self._requests: dict[tuple[str, int | None], TailEstimate] = {}  # (policy, K); K None: every K
        self._relearn: set[str] = set()
        self._tried: dict[str, float] = {}
        self._resource_start = dict(resource_start or RESOURCE_START)
        self._resources = {r: self.estimator() for r in Resource}
        self._lock = threading.Lock()

    def estimator(self) -> TailEstimate:
        """A new, empty tail of this model's quantile and window (the gateway's queue model keeps its own)."""
        return TailEstimate(self.quantile, self.window)

    # -- stages ------------------------------------------------------------------------------
    def stage(self, policy: str, stage: CostStage) -> float | None:
        """The tail cost (s) of ``policy``'s ``stage``; None before any was measured."""
        with self._lock:
            got = self._stages.get((policy, stage))
            return None if got is None else got.tail()

    def stage_mean(self, policy: str, stage: CostStage) -> float | None:
        """The mean cost (s) of ``policy``'s ``stage`` over the same window; None before any was measured."""
        with self._lock:
            got = self._stages.get((policy, stage))
            return None if got is None else got.mean()

    def observe_stage(self, policy: str, stage: CostStage, seconds: float) -> None:
        with self._lock:
            got = self._stages.get((policy, stage))
            if got is None:
                got = self._stages[policy, stage] = self.estimator()
            got.observe(seconds)

    # -- whole requests, per policy and K ------------------------------------------------------------
    def observe_request(self, policy: str, seconds: float, k: int) -> None:
        """One request's time (a failed one too) at list length ``k``, counted for ``k`` and across every K.
        After :meth:`relearn` the observation replaces the policy's estimates (every K's) instead of joining
        them."""
        with self._lock:
            if policy in self._relearn:
                self._relearn.discard(policy)
                for key in [key for key in self._requests if key[0] == policy]:
                    del self._requests[key]
            for key in ((policy, k), (policy, None)):
                got = self._requests.get(key)
                if got is None:
                    got = self._requests[key] = self.estimator()
                got.observe(seconds)

    def tail(self, policy: str, k: int | None = None) -> float | None:
        """The tail (s) of a ``policy`` request's time at list length ``k``; the policy's tail across every K
        while that K has none (or for ``k`` None); None before any request of the policy."""
        with self._lock:
            got = self._requests.get((policy, k))
            if got is None:
                got = self._requests.get((policy, None))
            return None if got is None else got.tail()

    def relearn(self, policy: str) -> None:
        """``policy``'s next request time replaces its estimates (a probe of a stale tier), and its stages are
        measured afresh: their estimates are dropped now, so the probe runs every stage (an unmeasured stage
        costs nothing to :meth:`PolicyCosts.fits`; the deadline's cut still bounds it). Otherwise a stage whose
        stale mean did not fit was skipped by every probe and never measured again: ``fused`` warmed up slow
        (its round's mean from ten warm-up requests) answered its item drafter's list for 300 requests in a
        row through the gateway at 30 ms (``bench.catalogue_scale``'s stack at 1M items: GR-ranked 0.00)."""
        with self._lock:
            self._relearn.add(policy)
            for key in [key for key in self._stages if key[0] == policy]:
                del self._stages[key]

    def last_tried(self, policy: str, now: float) -> float:
        """When ``auto`` last chose ``policy`` (``now`` the first time it asks)."""
        with self._lock:
            return self._tried.setdefault(policy, now)

    def tried(self, policy: str, now: float) -> None:
        with self._lock:
            self._tried[policy] = now

    # -- resources -----------------------------------------------------------------------------
    def resource(self, resource: Resource) -> float:
        """The tail time (s) of a request answered by ``resource`` (``resource_start`` before any)."""
        with self._lock:
            got = self._resources[resource].tail()
            return self._resource_start[resource] if got is None else got

    def resource_mean(self, resource: Resource) -> float:
        """The mean time (s) of a request answered by ``resource`` over the window (``resource_start`` before any)."""
        with self._lock:
            got = self._resources[resource].mean()
            return self._resource_start[resource] if got is None else got

    def observe_resource(self, resource: Resource, seconds: float) -> None:
        with self._lock:
            self._resources[resource].observe(seconds)

    def reset(self) -> None:
        """Forget everything learned: every stage, request and resource estimate, the probe timers. The gateway
        calls it after its cold warm-up requests (channels connecting, first calls), whose times are no policy's
        cost, before the ones it measures."""
        with self._lock:
            self._stages.clear()
            self._requests.clear()
            self._relearn.clear()
            self._tried.clear()
            for got in self._resources.values():
                got.reset()

    def for_policy(self, policy: str, clock: Callable[[], float]) -> PolicyCosts:
        return PolicyCosts(self, policy, clock)


class PolicyCosts:
    """One policy's view of the :class:`CostModel`: its budget hook."""

    def __init__(self, model: CostModel, policy: str, clock: Callable[[], float]):
        self.model, self.policy, self.clock = model, policy, clock

    def fits(self, deadline: Deadline | None, stage: CostStage) -> bool:
        """Whether one more ``stage`` ends by ``deadline`` at its mean cost over the window (an unmeasured
        stage costs 0). A mean, not the tail: a stage that does not fit is not run, so it is not observed
        again, and a tail (one slow call among the first hundred) kept it from running for good. Measured
        through the gateway at 30 ms (``bench.serving``): with the tail here and in the drafter's reserve,
        ``strict`` answered from the model in 34% of requests and ``specgr`` in 51% (100% with means), and
        beam's whole search went level by level (p50 14.5 -> 20.3 ms). The tiers ``auto`` admits, and the
        queue wait, are tails (:meth:`CostModel.tail`); the hard deadline cuts what still runs late."""
        if deadline is None:
            return True
        if deadline.cancelled:  # the caller answered already: no further stage runs for it
            return False
        return self.clock() + self.estimate(stage) <= deadline.at

    def estimate(self, stage: CostStage) -> float:
        """The stage's mean cost (s) over the window (the budget hook's, and choices on expected costs); 0 before
        any was measured."""
        cost = self.model.stage_mean(self.policy, stage)
        return 0.0 if cost is None else cost

    def measured(self, stage: CostStage) -> bool:
        return self.model.stage(self.policy, stage) is not None

    def observe(self, stage: CostStage, seconds: float) -> None:
        self.model.observe_stage(self.policy, stage, seconds)

    def observe_request(self, seconds: float, k: int) -> None:
        self.model.observe_request(self.policy, seconds, k)
