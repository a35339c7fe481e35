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


@dataclass
class DraftRequest:
    history: np.ndarray  # item indices, oldest first
    n: int
    prefixes: np.ndarray | None = None  # [P, l] SID prefixes (all the same length l), or None
    exclude: frozenset[int] = field(default_factory=frozenset)


@dataclass
class Draft:
    items: np.ndarray  # [n'] item indices, best first (n' <= n)
    scores: np.ndarray  # [n'] drafter scores


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
