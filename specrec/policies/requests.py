"""A policy's request and its answer."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from ..deadline import Deadline
from .metrics import RequestStats


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
    # the dependency's failure this list answered around (``fused``: its verifier pass failed or ran late, so the
    # item drafter's list in hand is the answer); the fallback ladder's verdict on the dependency reads it
    fault: Exception | None = None
