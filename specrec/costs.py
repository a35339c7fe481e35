"""What things cost: one model, learned online from the requests that ran.

Every reader and writer of a cost goes through one :class:`CostModel`:

- **stage costs per policy** (:class:`CostStage`): a policy times its stages
  (a ``specgr`` round, a drafting call, a verify pass, a beam step, a whole
  beam search) and its budget hook asks, before the next one, whether it
  still fits the request's deadline (:meth:`PolicyCosts.fits`). Running mean,
  the first observation taken as it is.
- **request cost per policy**: running mean and mean absolute deviation of a
  whole request; ``auto`` picks by ``mean + spread * deviation``
  (:meth:`CostModel.expected`). ``auto`` also records here when it last chose
  each policy (its probe timer), and marks a policy whose next request's time
  replaces its stale estimate (:meth:`CostModel.relearn`).
- **request cost per resource** (:class:`Resource`, the service a policy
  uses): the gateway's queue wait (requests ahead x cost per request) and the
  time it keeps back for the drafter's answer.

A policy object lives for one request; the model lives as long as the engine
(or the gateway) and is shared by the worker threads, so every method holds
one lock.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass
from enum import Enum

from .deadline import Deadline


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


@dataclass
class _Spread:
    mean: float
    dev: float


class CostModel:
    """Costs by (policy, stage), by policy (whole requests) and by resource; thread-safe.

    ``stage_alpha``, ``request_alpha`` and ``resource_alpha`` are the running means' weights of a new
    observation."""

    def __init__(self, stage_alpha: float = 0.3, request_alpha: float = 0.1, resource_alpha: float = 0.1,
                 resource_start: dict[Resource, float] | None = None):
        self.stage_alpha, self.request_alpha, self.resource_alpha = stage_alpha, request_alpha, resource_alpha
        self._stages: dict[tuple[str, CostStage], float] = {}
        self._requests: dict[str, _Spread] = {}
        self._relearn: set[str] = set()
        self._tried: dict[str, float] = {}
        self._resources: dict[Resource, float] = dict(resource_start or RESOURCE_START)
        self._lock = threading.Lock()

    # -- stages ------------------------------------------------------------------------------
    def stage(self, policy: str, stage: CostStage) -> float | None:
        """The running mean cost (s) of ``policy``'s ``stage``; None before any was measured."""
        with self._lock:
            return self._stages.get((policy, stage))

    def observe_stage(self, policy: str, stage: CostStage, seconds: float) -> None:
        with self._lock:
            old = self._stages.get((policy, stage))
            a = self.stage_alpha
            self._stages[policy, stage] = seconds if old is None else (1 - a) * old + a * seconds

    # -- whole requests, per policy ----------------------------------------------------------------
    def observe_request(self, policy: str, seconds: float) -> None:
        """One request's time (a failed one too): running mean and mean absolute deviation. After
        :meth:`relearn` the observation replaces the estimate instead of nudging it."""
        with self._lock:
            old = self._requests.get(policy)
            if old is None or policy in self._relearn:
                self._relearn.discard(policy)
                self._requests[policy] = _Spread(seconds, 0.5 * seconds)
                return
            a = self.request_alpha
            old.dev = (1 - a) * old.dev + a * abs(seconds - old.mean)
            old.mean = (1 - a) * old.mean + a * seconds

    def expected(self, policy: str, spread: float = 2.0) -> float | None:
        """A high estimate of a ``policy`` request's time (mean + ``spread`` deviations); None before any."""
        with self._lock:
            s = self._requests.get(policy)
            return None if s is None else s.mean + spread * s.dev

    def relearn(self, policy: str) -> None:
        """``policy``'s next request time replaces its estimate (a probe of a stale tier)."""
        with self._lock:
            self._relearn.add(policy)

    def last_tried(self, policy: str, now: float) -> float:
        """When ``auto`` last chose ``policy`` (``now`` the first time it asks)."""
        with self._lock:
            return self._tried.setdefault(policy, now)

    def tried(self, policy: str, now: float) -> None:
        with self._lock:
            self._tried[policy] = now

    # -- resources -----------------------------------------------------------------------------
    def resource(self, resource: Resource) -> float:
        """The running mean time (s) of a request answered by ``resource``."""
        with self._lock:
            return self._resources[resource]

    def observe_resource(self, resource: Resource, seconds: float) -> None:
        with self._lock:
            a = self.resource_alpha
            self._resources[resource] = (1 - a) * self._resources[resource] + a * seconds

    def for_policy(self, policy: str, clock: Callable[[], float]) -> PolicyCosts:
        return PolicyCosts(self, policy, clock)


class PolicyCosts:
    """One policy's view of the :class:`CostModel`: its budget hook."""

    def __init__(self, model: CostModel, policy: str, clock: Callable[[], float]):
        self.model, self.policy, self.clock = model, policy, clock

    def fits(self, deadline: Deadline | None, stage: CostStage) -> bool:
        """Whether one more ``stage`` ends by ``deadline`` (an unmeasured stage costs 0)."""
        if deadline is None:
            return True
        return self.clock() + self.estimate(stage) <= deadline.at

    def estimate(self, stage: CostStage) -> float:
        """The stage's running mean cost (s); 0 before any was measured."""
        cost = self.model.stage(self.policy, stage)
        return 0.0 if cost is None else cost

    def measured(self, stage: CostStage) -> bool:
        return self.model.stage(self.policy, stage) is not None

    def observe(self, stage: CostStage, seconds: float) -> None:
        self.model.observe_stage(self.policy, stage, seconds)

    def observe_request(self, seconds: float) -> None:
        self.model.observe_request(self.policy, seconds)

    def expected(self, spread: float = 2.0) -> float | None:
        return self.model.expected(self.policy, spread)
