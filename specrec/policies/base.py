"""What every policy is: :class:`Policy`, its config, and the registry (:func:`register`, :func:`make_policy`).
The parts policies share have files named for them: requests and results (:mod:`.requests`), the engine a
policy talks to (:mod:`.engine`, with its cost model, :mod:`specrec.costs`), the draft count
(:mod:`.draft_sizer`), the live batch and the fill-up that guarantees K unique valid items (:mod:`.batch`).

A policy is a named strategy with one config object (a pydantic model whose
field descriptions are its documentation). ``Policy.run`` takes a batch of
requests and returns one result per request, in order. It is the same for
every policy: stats, encode, ``self._run(batch)`` with the session released in
a ``finally``, then the metrics. A policy implements ``_run`` as short named
phases over a :class:`LiveBatch`.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from functools import cached_property
from typing import ClassVar, final

import numpy as np
from pydantic import BaseModel, ConfigDict

from ..costs import CostStage, PolicyCosts
from ..deadline import Deadline
from ..decoding.beam import Beams
from .batch import LiveBatch, Stage, charge, fill_to_k
from .engine import Engine, Online
from .errors import DependencyDown, Unsupported
from .metrics import RequestStats
from .requests import RecRequest, RecResult


class PolicyConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")


def _earliest(requests: Sequence[RecRequest]) -> Deadline | None:
    """The batch's session's deadline: its requests' earliest (None when none has one)."""
    deadlines = [r.deadline for r in requests if r.deadline is not None]
    return min(deadlines, key=lambda d: d.verifier_at) if deadlines else None


def _handed_on(results: Sequence[RecResult | None], name: str) -> bool:
    """Whether every request was answered at once by another's list because this policy's work did not fit its
    budget (``fused``'s pass: the item drafter's drafts, ``exit_reason`` budget) or its dependency failed (the
    result's ``fault``): its time is not what the policy costs, and counted as such it read as cheap, so ``auto``
    chose the policy again and again for it to hand its requests on (measured through the gateway at 30 ms on a
    slower machine: 99% of ``auto``'s answers budget exits)."""
    return bool(results) and all(
        r is not None and r.served_by not in ("", name) and _not_its_cost(r) for r in results)


def _not_its_cost(r: RecResult) -> bool:
    """Whether another's list answered for the policy without its work having run (exit ``budget``, no fault), or
    because its dependency failed (a DependencyDown fault: the fault's time, not the policy's); a list that
    answered around a verifier call that ran late (a BudgetExceeded fault) counts: the policy ran late."""
    if r.fault is not None:
        return isinstance(r.fault, DependencyDown)
    return r.stats.exit_reason == "budget"


class Policy(ABC):
    name: ClassVar[str]
    Config: ClassVar[type[PolicyConfig]]
    uses_verifier: ClassVar[bool] = True  # False: run() opens no verifier session (drafter-only, auto)
    # True: when its verifier call fails or runs late, the policy answers with a list it holds already (the item
    # drafter's, ``fused``), with no further call: no time is kept back from its verifier calls for a fallback
    holds_fallback: ClassVar[bool] = False
    uses_drafter: ClassVar[bool] = False  # True: its requests call the item drafter (``Engine.drafter``)
    # False: the object carries state from one run to the next (``sample``'s random stream), so a caller that
    # serves each request as if it were the first (the gateway: every request from the seed) builds one per request
    reusable: ClassVar[bool] = True

    def __init__(self, engine: Engine, config: PolicyConfig | None = None, online: Online | None = None, **params):
        self.engine = engine
        if config is not None and params:
            raise ValueError("pass a config object or keyword parameters, not both")
        self.config = config if config is not None else self.Config(**params)
        self.online = online or engine.learned(self.name)

    @cached_property
    def costs(self) -> PolicyCosts:
        """This policy's costs in the engine's cost model (its budget hook; made once: the engine's model and
        clock are the policy's for its life)."""
        return self.engine.costs.for_policy(self.name, self.engine.clock)

    def missing(self) -> str | None:
        """What this policy, with its config, needs that the engine lacks (a part of the verifier's bundle,
        :meth:`Verifier.parts`, or an item drafter), said for a person; None when it can run."""
        return None

    @final
    def run(self, requests: Sequence[RecRequest]) -> list[RecResult]:
        lacking = self.missing()
        if lacking is not None:
            raise Unsupported(self.name, lacking)
        if len(requests) > 1 and any(r.exclude_history for r in requests):
            # each such request has its own valid set (a trie view): served one by one
            return [res for r in requests for res in self.run([r])]
        eng = self.engine
        stats = [RequestStats() for _ in requests]
        batch = LiveBatch(requests, stats, eng.verifier, eng.itemset)
        t0 = eng.clock()
        down = False
        try:
            if self.uses_verifier:
                with Stage(eng.clock, stats, "encode"):
                    batch.session = eng.verifier.encode(eng.history_sids([r.history for r in requests]),
                                                        _earliest(requests))
                charge(stats, encoder=True)
                try:
                    self._run(batch)
                finally:
                    eng.verifier.release(batch.session)
            else:
                self._run(batch)
        except DependencyDown:
            down = True
            raise
        finally:  # a request that ran late still teaches what it cost; one whose dependency was down does not
            self.learn(batch.results, requests, eng.clock() - t0, down)
        results = [res for res in batch.results if res is not None]
        if len(results) < len(batch.results):
            raise RuntimeError(f"{self.name} left {len(batch.results) - len(results)} requests without a result")
        for res in results:
            self.label(res)
        return results

    def learn(self, results: Sequence[RecResult | None], requests: Sequence[RecRequest], seconds: float,
              down: bool) -> None:
        """What a run of ``requests`` taking ``seconds`` teaches (the end of :meth:`run`, and of a caller that runs
        the policy's phases itself, the gateway's event loop): the request count, and its cost at its largest K."""
        self.online.requests += 1
        # a batch is as slow as its longest list: its time counts for its largest K
        k = max((r.k for r in requests), default=0)
        # the time to find a replica gone is the fault's, not the policy's: counted, a few of them (a
        # connect timeout each) would hold its tail above the budget long after the fault (the breaker,
        # the replicas' ejection and ``auto``'s skip of a tier that is down deal with the fault itself)
        if not down and not _handed_on(results, self.name):
            self.costs.observe_request(seconds / max(1, len(requests)), k)

    def label(self, res: RecResult) -> RecResult:
        """A result as :meth:`run` answers it: who served it (recorded in the engine's metrics), and a list of
        fill alone flagged."""
        if not res.served_by:  # a delegating policy's results were recorded by the policy that made them
            res.served_by = self.name
            self.engine.metrics.record(self.name, res.stats)
        if not res.degraded and not res.stats.rounds and res.sources and all(src == "fill" for src in res.sources):
            # no round ran (the first did not fit the budget), so no model scored anything: flagged
            res.degraded = f"catalogue fill: {res.served_by} scored no item (exit {res.stats.exit_reason or '?'})"
        return res

    @abstractmethod
    def _run(self, batch: LiveBatch) -> None:
        """Fill ``batch.results`` for every request (phases of the policy)."""

    def _result(
        self,
        k: int,
        items,
        scores,
        sources,
        stats: RequestStats,
        prefixes: Beams | None = None,
        request: int = 0,
        exclude: frozenset[int] = frozenset(),
    ) -> RecResult:
        n = k + len(exclude)  # excluded items are dropped before the cut
        items, scores, sources = fill_to_k(k, self.engine.itemset, list(items)[:n], list(scores)[:n], list(sources)[:n],
                                           prefixes, request, exclude)
        return RecResult(
            np.asarray(items[:k], dtype=np.int64), np.asarray(scores[:k], dtype=np.float64), sources[:k], stats
        )

    def _exit_late(self, batch: LiveBatch, stage: CostStage, result_fn) -> None:
        """Finish (exit reason ``budget``) the requests whose next ``stage`` would not fit their deadline."""
        late = [j for j, _, r, _ in batch.rows() if not self.costs.fits(r.deadline, stage)]
        for j in late:
            batch.stats[batch.active[j]].exit_reason = "budget"
            batch.finish(j, result_fn(j))
        batch.drop(late)


POLICIES: dict[str, type[Policy]] = {}


def register(cls: type[Policy]) -> type[Policy]:
    POLICIES[cls.name] = cls
    return cls


def make_policy(name: str, engine: Engine, online: Online | None = None, **params) -> Policy:
    if name not in POLICIES:
        raise ValueError(f"unknown policy {name!r} (known: {', '.join(sorted(POLICIES))})")
    return POLICIES[name](engine, online=online, **params)
