"""The gateway's budget, in one place: a request's one deadline, what is kept back from it, and when it is cut.

A request's budget (``budget_ms``, else ``default_budget_ms``) becomes one
immutable :class:`~specrec.deadline.Deadline` when it arrives
(:func:`request_deadline`): the budget less ``respond_ms`` (the time to build
and send the answer), or the caller's own gRPC deadline less
``reply_margin_ms`` when that comes first (:func:`caller_deadline`). It carries
the request's :class:`~specrec.deadline.Watch`, which the gateway cancels when
it answers at the deadline: policies stop at their next step, no call is
started after, and one in flight ends at its own timeout (:func:`.calls.call`).

Out of that deadline (:class:`Budget`, which is also what ``auto`` and the
policies see of the gateway, :class:`specrec.policies.engine.Serving`):

- the verifier's calls end early enough that the drafter can still answer when
  the verifier does not: the drafter's reserve (:meth:`.queueing.QueueModel.reserve`,
  at least ``reserve_ms``), or only :data:`HELD_RESERVE_S` for a policy whose
  fallback is in hand (``fused``), none for the drafter's own policy;
- the cut: when the deadline comes and the policy still runs, the gateway answers
  with what it has (the held list, else the catalogue's fill). With ``cut_early``
  the cut fires early by how late the event loop runs (:class:`.looplag.LoopLag`),
  at most :data:`CUT_SHARE` of the time left, and ``auto`` plans to end before it
  (:meth:`Budget.cut_margin`; the estimate is learned here too, :meth:`Budget.observe_lateness`:
  this module is the one place to remove both, should a quiet machine's
  measurements show that with requests cancelled at the cut they are no longer needed);
- every downstream call's gRPC timeout is the time left until its end plus
  :data:`GRACE_S`, so a call started just in time can still answer.

The settings (``respond_ms``, ``reply_margin_ms``, ``reserve_ms``,
``cut_early``) are the knobs; ``docs/degraded-modes.md`` ("Budget") says what
each one does.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from specrec.costs import CostModel, Resource, resource_of
from specrec.deadline import Deadline, Watch
from specrec.policies import POLICIES

from .looplag import LoopLag
from .queueing import QueueModel
from .settings import GatewaySettings

#: extra time granted to one downstream call beyond its end, so that a call that starts just in time can still
#: answer (keeps answers within budget + a few ms); also the least time left for a call to be worth starting
GRACE_S = 0.002

#: what a policy whose fallback is in hand (``fused``: its drafts) keeps back from its verifier call: the time to
#: answer with that fallback once the call has ended at the latest
HELD_RESERVE_S = 0.001

#: the most of the time left that the deadline's early cut keeps back (a loop that runs very late, e.g. services
#: sharing one interpreter, would otherwise leave no tier time to run: every request refused)
CUT_SHARE = 0.2


def request_deadline(s: GatewaySettings, budget_ms: float, t0: float, caller_at: float | None) -> Deadline:
    """The request's one deadline (``time.monotonic()``): the answer built and sent by the budget's end
    (``respond_ms`` before it), or by the caller's deadline (:func:`caller_deadline`) when that comes first; the
    time the request waited before its handler ran is spent already."""
    at = t0 + max(0.0, budget_ms - s.respond_ms) / 1000.0
    if caller_at is not None:
        at = min(at, caller_at)
    return Deadline(at, watch=Watch())


def caller_deadline(s: GatewaySettings, time_remaining: float | None) -> float | None:
    """When the answer must leave for a caller whose gRPC deadline is ``time_remaining`` seconds away
    (``reply_margin_ms`` before it); None when it set none."""
    return None if time_remaining is None else time.monotonic() + time_remaining - s.reply_margin_ms / 1000.0


class Budget:
    """What is kept back from a request's deadline and when it is cut (the module's docstring), and what the
    policies see of the gateway (:class:`specrec.policies.engine.Serving`: the queue's wait, what is kept back,
    which dependency is down)."""

    def __init__(self, s: GatewaySettings, queue: QueueModel, costs: CostModel, down: Callable[[str], bool]):
        self.s, self.queue, self._down = s, queue, down
        self.loop_lag = LoopLag(costs)  # how late the event loop runs: what the early cut keeps back

    # -- the early cut's estimate, learned on the gateway's event loop ---------------------------------
    def observe_lateness(self, seconds: float) -> None:
        """How late the event loop took up an answer its worker finished (what the early cut keeps back)."""
        self.loop_lag.observe(seconds)

    def observe_cut(self, seconds: float) -> None:
        """A cut's time from its timer firing to its answer built (part of what the early cut keeps back)."""
        self.loop_lag.observe_cut(seconds)

    # -- Serving -------------------------------------------------------------------------
    def wait(self, policy: str) -> float:
        return self.queue.wait(policy)

    def kept_back(self, policy: str, left: float) -> float:
        """What ``policy``'s work must end before, out of ``left``: its fallback's reserve and the cut's margin."""
        return self.reserve(policy, left) + self.cut_margin(left)

    def down(self, dependency: str) -> bool:
        return self._down(dependency)

    # -- the parts -----------------------------------------------------------------------
    def reserve(self, policy: str, left: float) -> float:
        """What ``policy``'s verifier calls leave, out of ``left``, for its fallback's tail answer: the drafter's
        reserve for a verifier policy (the drafter answers when it misses), none for ``drafter`` (its fallback is
        the fill), and only the time to build it for a policy whose fallback is in hand (``fused``: its drafts)."""
        if resource_of(policy) is Resource.DRAFTER:
            return 0.0
        return HELD_RESERVE_S if POLICIES[policy].holds_fallback else self.queue.reserve(left)

    def cut_margin(self, left: float) -> float:
        """How early the deadline's cut fires, out of ``left`` seconds: the event loop's lateness and a cut's own
        time (:class:`.looplag.LoopLag`), at most :data:`CUT_SHARE` of ``left``; none without ``cut_early``."""
        if not self.s.cut_early:
            return 0.0
        return min(self.loop_lag.margin(), CUT_SHARE * max(0.0, left))

    def for_run(self, deadline: Deadline, policy: str, cut_margin: float, now: float) -> Deadline:
        """The deadline ``policy`` runs with: its verifier calls (their grace included) end where its fallback's
        reserve starts, before the cut (which fires ``cut_margin`` early)."""
        return deadline.keeping(self.reserve(policy, deadline.left(now)) + GRACE_S + cut_margin)
