"""A policy's working parts for one batch of requests: the live batch (:class:`LiveBatch`), timed stages and
calls charged to requests, scored candidates, and the fill-up that guarantees K unique valid items."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from ..decoding.beam import Beams
from ..ids.trie import SidTrie
from ..itemset import LocalItemSet
from ..verifier import Session, Verifier
from .metrics import RequestStats
from .requests import RecRequest, RecResult


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
            # at most as many as could be taken already plus the ones missing (a short prefix of a catalogue of
            # millions holds tens of thousands of items: a whole .tolist() per fill is milliseconds)
            for it in itemset.items_with_prefix(pfx)[:len(taken) + k].tolist():
                if it not in taken:
                    taken.add(it)
                    items.append(it)
                    scores.append(pscore)
                    sources.append("fill")
                    if len(items) >= k:
                        return items, scores, sources
    if len(items) < k:
        for it in itemset.order[0][:len(taken) + k].tolist():  # (the whole order at 10M items: 0.5 s)
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
