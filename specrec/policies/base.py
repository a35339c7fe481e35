"""What every policy shares: requests and results, the engine a policy talks
to, the budget hook, and the fill-up that guarantees K unique valid items.

A policy is a named strategy with one config object (a pydantic model whose
field descriptions are its documentation). ``Policy.run`` takes a batch of
requests and returns one result per request, in order.
"""

from __future__ import annotations

import time
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Callable, ClassVar, Sequence

import numpy as np
import torch
from pydantic import BaseModel, ConfigDict

from ..decoding.beam import Beams
from ..drafters.base import Drafter
from ..itemset import LocalItemSet
from ..verifier import Verifier
from .metrics import RequestStats, SpecMetrics


class PolicyConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")


@dataclass
class RecRequest:
    history: np.ndarray  # item indices, oldest first (non-empty)
    k: int = 10
    deadline: float | None = None  # absolute time on the engine's clock (seconds), None = no budget


@dataclass
class RecResult:
    items: np.ndarray  # [k] item indices, best first
    scores: np.ndarray  # [k] float; the policy's scale (see each policy)
    sources: list[str]  # per item: draft / beam / head / sample / fill
    stats: RequestStats = field(default_factory=RequestStats)
    degraded: str = ""  # set by a server answering without a dependency (why)


@dataclass
class Engine:
    """Everything a policy may call. In-process or gRPC-backed alike."""

    verifier: Verifier
    itemset: LocalItemSet
    max_history: int
    drafter: Drafter | None = None
    clock: Callable[[], float] = time.perf_counter
    metrics: SpecMetrics = field(default_factory=SpecMetrics)

    def history_sids(self, histories: Sequence[np.ndarray]) -> torch.Tensor:
        """Item-index histories -> [R, H, L] codes, left-padded with -1 rows."""
        h, L = self.max_history, len(self.itemset.level_sizes)
        out = torch.full((len(histories), h, L), -1, dtype=torch.int64)
        for i, items in enumerate(histories):
            items = np.asarray(items, dtype=np.int64)[-h:]
            if len(items):
                out[i, h - len(items) :] = self.itemset.sids_t[torch.from_numpy(items)]
        return out


class Budget:
    """The budget hook: before each round a policy asks whether the next round
    fits before the request's deadline, using a running estimate of round cost."""

    def __init__(self, clock: Callable[[], float], alpha: float = 0.3):
        self.clock = clock
        self.alpha = alpha
        self.estimate: dict[str, float] = {}

    def fits(self, deadline: float | None, kind: str) -> bool:
        if deadline is None:
            return True
        return self.clock() + self.estimate.get(kind, 0.0) <= deadline

    def observe(self, kind: str, seconds: float) -> None:
        old = self.estimate.get(kind)
        self.estimate[kind] = seconds if old is None else (1 - self.alpha) * old + self.alpha * seconds


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

    def top(self, k: int) -> tuple[list[int], list[float], list[str]]:
        items = sorted(self.score, key=lambda i: (-self.score[i], i))[:k]
        return items, [self.score[i] for i in items], [self.source[i] for i in items]


def fill_to_k(
    k: int, itemset: LocalItemSet, items: list[int], scores: list[float], sources: list[str],
    prefixes: Beams | None = None, request: int = 0,
) -> tuple[list[int], list[float], list[str]]:
    """Complete a list to K unique valid items (whenever the catalogue has K):
    first items under the request's alive beam prefixes (best prefix first,
    scored by the prefix's mean log-probability), then any other items."""
    taken = set(items)
    items, scores, sources = list(items), list(scores), list(sources)
    if len(items) < k and prefixes is not None and prefixes.level > 0:
        alive = prefixes.alive()[request]
        order = torch.argsort(prefixes.scores[request], descending=True, stable=True)
        for b in order.tolist():
            if not alive[b]:
                continue
            pfx = prefixes.codes[request, b].numpy()
            pscore = float(prefixes.scores[request, b]) / prefixes.level
            for it in itemset.items_with_prefix(pfx).tolist():
                if it not in taken:
                    taken.add(it)
                    items.append(it); scores.append(pscore); sources.append("fill")
                    if len(items) >= k:
                        return items, scores, sources
    if len(items) < k:
        for it in itemset.order[0].tolist():
            if it not in taken:
                taken.add(it)
                items.append(it); scores.append(float("-inf")); sources.append("fill")
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


class Policy(ABC):
    name: ClassVar[str]
    Config: ClassVar[type[PolicyConfig]]

    def __init__(self, engine: Engine, config: PolicyConfig | None = None, **params):
        self.engine = engine
        if config is not None and params:
            raise ValueError("pass a config object or keyword parameters, not both")
        self.config = config if config is not None else self.Config(**params)
        self.budget = Budget(engine.clock)

    @abstractmethod
    def run(self, requests: Sequence[RecRequest]) -> list[RecResult]:
        ...

    def _finish(self, results: list[RecResult]) -> list[RecResult]:
        for res in results:
            self.engine.metrics.record(self.name, res.stats)
        return results

    def _result(self, k: int, items, scores, sources, stats: RequestStats, prefixes: Beams | None = None, request: int = 0) -> RecResult:
        items, scores, sources = fill_to_k(k, self.engine.itemset, list(items)[:k], list(scores)[:k], list(sources)[:k], prefixes, request)
        return RecResult(np.asarray(items[:k], dtype=np.int64), np.asarray(scores[:k], dtype=np.float64), sources[:k], stats)


POLICIES: dict[str, type[Policy]] = {}


def register(cls: type[Policy]) -> type[Policy]:
    POLICIES[cls.name] = cls
    return cls


def make_policy(name: str, engine: Engine, **params) -> Policy:
    if name not in POLICIES:
        raise ValueError(f"unknown policy {name!r} (known: {', '.join(sorted(POLICIES))})")
    return POLICIES[name](engine, **params)
