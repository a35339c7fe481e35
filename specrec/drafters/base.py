"""The drafter interface: propose candidate items cheaply.

A drafter answers one :class:`DraftRequest` per request (batched as a list):
``n`` candidates for a history, optionally restricted to items whose SID
starts with one of ``prefixes`` (guided re-drafting), never proposing an item
in ``exclude`` (already verified). Scores are the drafter's own, higher is
better; they order candidates but are not on the verifier's scale.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np

from ..deadline import Deadline


@dataclass
class DraftRequest:
    history: np.ndarray  # item indices, oldest first
    n: int
    prefixes: np.ndarray | None = None  # [P, l] SID prefixes (all the same length l), or None
    exclude: frozenset[int] = field(default_factory=frozenset)
    deadline: Deadline | None = None  # the request's (a remote drafter's call ends at its ``at``); None: no budget


@dataclass
class Draft:
    items: np.ndarray  # [n'] item indices, best first (n' <= n)
    scores: np.ndarray  # [n'] drafter scores

    def top(self, k: int, reserved: int = 0, unseen: np.ndarray | None = None) -> Draft:
        """The drafter's own list of ``k`` out of a longer draft, as a draft of ``n = k`` would have answered it:
        its order, with ``reserved`` of the places for its unseen items (``unseen`` [n'] bool, drafted by text
        below the others) where it holds some. The one meaning of "the drafter's list" wherever a policy holds
        more drafts than it answers with."""
        from ..fusion import top_reserved

        pick = top_reserved(-np.arange(len(self.items), dtype=np.float64), k, reserved, unseen)
        return Draft(self.items[pick], self.scores[pick])


class Drafter(Protocol):
    name: str

    def draft(self, requests: Sequence[DraftRequest]) -> list[Draft]: ...


def topn_excluding(scores: np.ndarray, candidates: np.ndarray, n: int, exclude: frozenset[int]) -> Draft:
    """Best ``n`` of ``candidates`` by ``scores``, skipping excluded items."""
    if exclude and len(candidates):
        keep = ~np.isin(candidates, np.fromiter(exclude, dtype=np.int64, count=len(exclude)))
        candidates, scores = candidates[keep], scores[keep]
    if len(candidates) > n:
        part = np.argpartition(-scores, n - 1)[:n]
        candidates, scores = candidates[part], scores[part]
    order = np.argsort(-scores, kind="stable")
    return Draft(candidates[order].astype(np.int64), scores[order].astype(np.float32))
