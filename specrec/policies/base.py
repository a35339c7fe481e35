"""What every policy shares: requests and results, the engine a policy talks
to (with its cost model, :mod:`specrec.costs`), the live batch, and the fill-up that guarantees K unique
valid items.

A policy is a named strategy with one config object (a pydantic model whose
field descriptions are its documentation). ``Policy.run`` takes a batch of
requests and returns one result per request, in order. It is the same for
every policy: stats, encode, ``self._run(batch)`` with the session released in
a ``finally``, then the metrics. A policy implements ``_run`` as short named
phases over a :class:`LiveBatch`.
"""

from __future__ import annotations

import threading
import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import ClassVar, final

import numpy as np
import torch
from pydantic import BaseModel, ConfigDict

from ..backends.base import DRAFT_FACTORS, draft_count
from ..costs import CostModel, CostStage, PolicyCosts
from ..deadline import Deadline
from ..decoding.beam import Beams
from ..drafters.base import Drafter
from ..ids.trie import SidTrie
from ..itemset import LocalItemSet
from ..verifier import Session, Verifier
from .errors import DependencyDown, Unsupported
from .metrics import RequestStats, SpecMetrics


class PolicyConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")


@dataclass
class RecRequest:
    history: np.ndarray  # item indices, oldest first (non-empty)
    k: int = 10
    # on the engine's clock; a number is taken as Deadline(at=number); None = no budget
    deadline: Deadline | None = None
    exclude_history: bool = False  # never recommend an item of ``history`` (masked inside the trie constraint)

    def __post_init__(self) -> None:
        if isinstance(self.deadline, (int, float)):
            self.deadline = Deadline(float(self.deadline))

    def excluded(self) -> frozenset[int]:
        """The items this request must not get back."""
        return frozenset(np.asarray(self.history).tolist()) if self.exclude_history else frozenset()


@dataclass
class RecResult:
    items: np.ndarray  # [k] item indices, best first
    scores: np.ndarray  # [k] float; the policy's scale (see each policy)
    sources: list[str]  # per item: draft / beam / head / sample / fill
    stats: RequestStats = field(default_factory=RequestStats)
    degraded: str = ""  # why the answer is not the asked policy's own (a dependency down, catalogue fill), when so
    served_by: str = ""  # the policy that made the list (``auto`` picks one)


@dataclass
class Engine:
    """Everything a policy may call. In-process or gRPC-backed alike."""

    verifier: Verifier
    itemset: LocalItemSet
    max_history: int
    drafter: Drafter | None = None
    clock: Callable[[], float] = time.perf_counter
    metrics: SpecMetrics = field(default_factory=SpecMetrics)
    online: dict = field(default_factory=dict)  # policy name -> Online: what each policy learned, across requests
    load: Callable[[str], float] = lambda policy: 0.0  # the queue wait's tail (s) at the service a policy uses
    # seconds a verifier policy's calls keep back, out of ``left`` seconds, for its fallback's (the drafter's) own
    # tail answer: the gateway's reserve; 0 in-process, where nothing is kept back
    reserve: Callable[[float], float] = lambda left: 0.0
    # what a policy whose fallback is in hand (``Policy.holds_fallback``) keeps back instead: time to build that
    # answer after its verifier call ended (the gateway: a millisecond); 0 in-process
    reserve_held: float = 0.0
    # a policy whose fallback is in hand gives here how to build that answer, so that a caller whose deadline comes
    # while the policy still waits on its verifier call answers with it (the gateway's cut), not with fill
    hold: Callable[[Callable[[], RecResult]], None] = lambda answer: None
    costs: CostModel = field(default_factory=CostModel)  # what stages and requests cost, per policy and resource
    # whether a dependency ("verifier", "drafter") is down now (the gateway: its breaker refuses, or the drafter
    # failed a moment ago): ``auto`` skips the tiers that need it; never in-process
    down: Callable[[str], bool] = lambda dependency: False
    # how early before the deadline the caller's own cut fires, out of ``left`` seconds (the gateway: how late its
    # event loop runs); what ``auto`` plans must end before it. 0 in-process
    cut_margin: Callable[[float], float] = lambda left: 0.0

    def learned(self, policy: str) -> Online:
        """The policy's :class:`Online` state, shared by every policy object of this engine."""
        if policy not in self.online:
            self.online[policy] = Online()
        return self.online[policy]

    def history_sids(self, histories: Sequence[np.ndarray]) -> torch.Tensor:
        """Item-index histories -> [R, H, L] codes, left-padded with -1 rows."""
        h, L = self.max_history, len(self.itemset.level_sizes)
        out = np.full((len(histories), h, L), -1, dtype=np.int64)
        sids = self.itemset.sids
        for i, items in enumerate(histories):
            items = np.asarray(items, dtype=np.int64)[-h:]
            if len(items):
                out[i, h - len(items) :] = sids[items]
        return torch.from_numpy(out)


class DraftSizer:
    """Draft count per list length K, adapted online, on a fixed ladder of
    multiples of K (:data:`LADDER`), so a backend that keeps one graph per
    width sees only a few widths, all warmed up before serving.

    By coverage (:meth:`observe`): x(1 + step) after a request whose drafts
    fell short, x(1 - step/4) after one they served, kept in [min_factor * K,
    max_factor * K]; it settles where about one request in five falls short.

    By cost, once a policy reports what its requests cost (:meth:`observe_cost`,
    ``strict`` on the distilled drafter, whose misses cost more than hits: a
    missed row is finished from the verified levels, L-2 more passes): the
    count whose running mean cost is lowest, with a neighbouring
    count of the ladder tried every ``explore_every``-th request."""

    LADDER = DRAFT_FACTORS

    def __init__(self, start_factor: float = 1.5, min_factor: float = 1.0, max_factor: float = 6.0, step: float = 0.2,
                 explore_every: int = 8, alpha: float = 0.1):
        self.start, self.min, self.max, self.step = start_factor, min_factor, max_factor, step
        self.explore_every, self.alpha = explore_every, alpha
        self._n: dict[int, float] = {}
        self._cost: dict[int, dict[int, float]] = {}  # K -> draft count -> running mean seconds per request
        self._asked: dict[int, int] = {}
        self._lock = threading.Lock()

    def ladder(self, k: int) -> list[int]:
        return sorted({draft_count(m, k) for m in self.LADDER})

    def size(self, k: int) -> int:
        with self._lock:
            costs = self._cost.get(k)
            if costs:
                asked = self._asked[k] = self._asked.get(k, 0) + 1
                best = min(costs, key=lambda n: costs[n])
                if asked % self.explore_every:
                    return best
                ns = self.ladder(k)
                i = ns.index(best) if best in ns else 0
                near = [ns[j] for j in (i - 1, i + 1) if 0 <= j < len(ns)]
                return near[(asked // self.explore_every) % len(near)] if near else best
            n = self._n.setdefault(k, self.start * k)
        return next((c for c in self.ladder(k) if c >= n), self.ladder(k)[-1])

    def observe(self, k: int, short: bool) -> None:
        with self._lock:
            n = self._n.setdefault(k, self.start * k)
            n *= (1 + self.step) if short else (1 - self.step / 4)
            self._n[k] = min(self.max * k, max(self.min * k, n))

    def observe_cost(self, k: int, n: int, seconds: float) -> None:
        """One request drafted ``n`` per level and cost ``seconds`` in all (drafting, verifying, any fallback)."""
        with self._lock:
            costs = self._cost.setdefault(k, {})
            old = costs.get(n)
            costs[n] = seconds if old is None else (1 - self.alpha) * old + self.alpha * seconds


@dataclass
class Online:
    """What a policy learns across requests besides costs (those are the engine's
    :class:`~specrec.costs.CostModel`): the adaptive draft count and acceptance
    estimates. The gateway keeps one per policy and hands it to the policy
    object of each request."""

    drafts: DraftSizer = field(default_factory=DraftSizer)
    rates: dict[str, float] = field(default_factory=dict)  # running estimates by name (e.g. exit rate per round)
    requests: int = 0

    def rate(self, name: str, default: float) -> float:
        return self.rates.get(name, default)

    def observe_rate(self, name: str, value: float, alpha: float = 0.05) -> None:
        old = self.rates.get(name)
        self.rates[name] = value if old is None else (1 - alpha) * old + alpha * value


def charge(stats: Sequence[RequestStats], encoder: bool = False) -> None:
    """Count one verifier call (batched) against every request taking part."""
    for st in stats:
        st.verifier_calls += 1
        st.encoder_calls += int(encoder)


class Stage:
    """Context manager adding elapsed ms to ``stats.stage_ms[name]`` for each stats."""

    def __init__(self, clock, stats: Sequence[RequestStats], name: str):
        self.clock, self.stats, self.name = clock, stats, name

    def __enter__(self):
        self.t0 = self.clock()
        return self

    def __exit__(self, *exc):
        self.seconds = self.clock() - self.t0
        for st in self.stats:
            st.stage_ms[self.name] += self.seconds * 1000.0
        return False


class Candidates:
    """Scored candidate items of one request; an item keeps its best score."""

    def __init__(self) -> None:
        self.score: dict[int, float] = {}
        self.source: dict[int, str] = {}

    def add(self, items, scores, source: str) -> None:
        for it, s in zip(np.asarray(items).tolist(), np.asarray(scores, dtype=np.float64).tolist()):
            if it < 0 or not np.isfinite(s):
                continue
            if it not in self.score or s > self.score[it]:
                self.score[it] = s
                self.source[it] = source

    def __len__(self) -> int:
        return len(self.score)

    def __contains__(self, item: int) -> bool:
        return item in self.score

    def top(self, k: int, reserved: int = 0, eligible=None) -> tuple[list[int], list[float], list[str]]:
        """The best ``k`` by score; with ``reserved``, at least that many of them (where there are) from the
        items ``eligible`` (a vectorised predicate over item ids) accepts, the best of those, in score order."""
        ranked = sorted(self.score, key=lambda i: (-self.score[i], i))
        items = ranked[:k]
        if reserved and eligible is not None and ranked:
            ok = np.asarray(eligible(np.asarray(ranked, dtype=np.int64)), dtype=bool).tolist()
            special = [it for it, e in zip(ranked, ok) if e][:min(reserved, k)]
            if special:
                rest = [it for it, e in zip(ranked, ok) if not e][:k - len(special)]
                chosen = set(special) | set(rest)
                items = [it for it in ranked if it in chosen]
        return items, [self.score[i] for i in items], [self.source[i] for i in items]


def fill_to_k(
    k: int, itemset: LocalItemSet, items: list[int], scores: list[float], sources: list[str],
    prefixes: Beams | None = None, request: int = 0, exclude: frozenset[int] = frozenset(),
) -> tuple[list[int], list[float], list[str]]:
    """Complete a list to K unique valid items (whenever the catalogue has K):
    first items under the request's alive beam prefixes (best prefix first,
    scored by the prefix's mean log-probability), then any other items.
    Items in ``exclude`` (the request's history, when it asks) are dropped
    from the list and never filled in."""
    if exclude:
        keep = [j for j, it in enumerate(items) if it not in exclude]
        items, scores, sources = [items[j] for j in keep], [scores[j] for j in keep], [sources[j] for j in keep]
    taken = set(items) | exclude
    items, scores, sources = list(items), list(scores), list(sources)
    if len(items) < k and prefixes is not None and prefixes.level > 0:
        alive = prefixes.alive[request]
        order = torch.argsort(prefixes.scores[request], descending=True, stable=True)
        for b in order.tolist():
            if not alive[b]:
                continue
            pfx = prefixes.codes[request, b].numpy()
            pscore = float(prefixes.scores[request, b]) / prefixes.level
            for it in itemset.items_with_prefix(pfx).tolist():
                if it not in taken:
                    taken.add(it)
                    items.append(it)
                    scores.append(pscore)
                    sources.append("fill")
                    if len(items) >= k:
                        return items, scores, sources
    if len(items) < k:
        for it in itemset.order[0].tolist():
            if it not in taken:
                taken.add(it)
                items.append(it)
                scores.append(float("-inf"))
                sources.append("fill")
                if len(items) >= k:
                    break
    return items, scores, sources


def length_normalised(token_logp: torch.Tensor, unseen: torch.Tensor | np.ndarray) -> torch.Tensor:
    """SpecGR's verification score: mean token log-probability over all L
    levels for seen items, over the first L-1 for unseen items (their
    collision digit is uninformative to a model that never saw them)."""
    L = token_logp.shape[-1]
    unseen = torch.as_tensor(np.asarray(unseen), dtype=torch.bool)
    full = token_logp.mean(-1)
    head = token_logp[..., : L - 1].mean(-1)
    return torch.where(unseen, head, full)


class LiveBatch:
    """The requests of one :meth:`Policy.run` that are still being worked on.

    Row ``j`` of the verifier session (and of :attr:`beams`) is request
    ``active[j]``. :meth:`finish` records a request's result; :meth:`drop`
    takes finished rows out of the session and the beams in one place."""

    def __init__(self, requests: Sequence[RecRequest], stats: list[RequestStats], verifier: Verifier,
                 itemset: LocalItemSet):
        self.requests = requests
        self.stats = stats
        self.verifier = verifier
        self.session: Session | None = None
        self.beams: Beams | None = None  # beams of the active rows, when the policy keeps some
        self.active: list[int] = list(range(len(requests)))
        self.results: list[RecResult | None] = [None] * len(requests)
        # the valid items of this batch: the catalogue's trie, or, for one request that excludes its history,
        # a view of it without those items (Policy.run never batches such a request with others)
        self.trie: SidTrie = itemset.trie
        self.exclude: frozenset[int] = frozenset()
        if len(requests) == 1 and requests[0].exclude_history:
            self.exclude = requests[0].excluded()
            ids = np.fromiter(self.exclude, dtype=np.int64)
            ids = ids[(ids >= 0) & (ids < len(itemset.sids))]
            self.trie = itemset.trie.excluding(itemset.sids[ids])

    def __len__(self) -> int:
        return len(self.active)

    @property
    def open_session(self) -> Session:
        """The verifier session :meth:`Policy.run` opened for a policy that uses the verifier."""
        if self.session is None:
            raise RuntimeError("no verifier session is open (the policy has uses_verifier = False)")
        return self.session

    def rows(self):
        """(row, request index, request, stats) of every active request."""
        for j, i in enumerate(self.active):
            yield j, i, self.requests[i], self.stats[i]

    @property
    def active_stats(self) -> list[RequestStats]:
        return [self.stats[i] for i in self.active]

    def finish(self, row: int, result: RecResult) -> None:
        self.results[self.active[row]] = result

    def drop(self, rows: Sequence[int]) -> None:
        """Remove finished rows (session rows and beams follow)."""
        gone = set(rows)
        if not gone:
            return
        keep = [j for j in range(len(self.active)) if j not in gone]
        if keep:
            idx = torch.tensor(keep)
            self.session = self.verifier.select(self.open_session, idx)
            if self.beams is not None:
                self.beams = self.beams.select(idx)
        self.active = [self.active[j] for j in keep]


def _handed_on(results: Sequence[RecResult | None], name: str) -> bool:
    """Whether every request was answered at once by another's list because this policy's work did not fit its
    budget (``fused``'s pass: the item drafter's drafts, ``exit_reason`` budget): its time is not what the
    policy costs, and counted as such it read as cheap, so ``auto`` chose the policy again and again for it to
    hand its requests on (measured through the gateway at 30 ms on a slower machine: 99% of ``auto``'s answers
    budget exits)."""
    return bool(results) and all(
        r is not None and r.stats.exit_reason == "budget" and r.served_by not in ("", name) for r in results)


class Policy(ABC):
    name: ClassVar[str]
    Config: ClassVar[type[PolicyConfig]]
    uses_verifier: ClassVar[bool] = True  # False: run() opens no verifier session (drafter-only, auto)
    # True: when its verifier call fails or runs late, the policy answers with a list it holds already (the item
    # drafter's, ``fused``), with no further call: no time is kept back from its verifier calls for a fallback
    holds_fallback: ClassVar[bool] = False
    uses_drafter: ClassVar[bool] = False  # True: its requests call the item drafter (``Engine.drafter``)

    def __init__(self, engine: Engine, config: PolicyConfig | None = None, online: Online | None = None, **params):
        self.engine = engine
        if config is not None and params:
            raise ValueError("pass a config object or keyword parameters, not both")
        self.config = config if config is not None else self.Config(**params)
        self.online = online or engine.learned(self.name)

    @property
    def costs(self) -> PolicyCosts:
        """This policy's costs in the engine's cost model (its budget hook)."""
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
                    batch.session = eng.verifier.encode(eng.history_sids([r.history for r in requests]))
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
            self.online.requests += 1
            # a batch is as slow as its longest list: its time counts for its largest K
            k = max((r.k for r in requests), default=0)
            # the time to find a replica gone is the fault's, not the policy's: counted, a few of them (a
            # connect timeout each) would hold its tail above the budget long after the fault (the breaker,
            # the replicas' ejection and ``auto``'s skip of a tier that is down deal with the fault itself)
            if not down and not _handed_on(batch.results, self.name):
                self.costs.observe_request((eng.clock() - t0) / max(1, len(requests)), k)
        results = [res for res in batch.results if res is not None]
        if len(results) < len(batch.results):
            raise RuntimeError(f"{self.name} left {len(batch.results) - len(results)} requests without a result")
        for res in results:
            if not res.served_by:  # a delegating policy's results were recorded by the policy that made them
                res.served_by = self.name
                eng.metrics.record(self.name, res.stats)
            if not res.degraded and not res.stats.rounds and res.sources and all(src == "fill" for src in res.sources):
                # no round ran (the first did not fit the budget), so no model scored anything: flagged
                res.degraded = f"catalogue fill: {res.served_by} scored no item (exit {res.stats.exit_reason or '?'})"
        return results

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
