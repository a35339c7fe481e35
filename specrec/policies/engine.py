"""What a policy may call (:class:`Engine`: verifier, item set, drafter, clock, costs, what its caller tells of
its conditions, :class:`Serving`) and what each policy learns across requests (:class:`Online`).

An engine is long-lived: the gateway builds one per catalogue version and every request of that version runs on
it; what is a request's own (its deadline, its cancellation) comes with the request
(:class:`~specrec.deadline.Deadline`)."""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np
import torch

from ..costs import CostModel
from ..data.histories import history_codes
from ..drafters.base import Drafter
from ..itemset import LocalItemSet
from ..verifier import Verifier
from .draft_sizer import DraftSizer
from .metrics import SpecMetrics


class Serving(Protocol):
    """What the caller that serves the policies tells them of its conditions (the gateway's
    :class:`gateway.budget.Budget`); in-process, :class:`InProcess`: no queue, nothing kept back, nothing down."""

    def wait(self, policy: str) -> float:
        """The tail (s) of the queue wait at the service ``policy`` uses."""
        ...

    def kept_back(self, policy: str, left: float) -> float:
        """Seconds, out of ``left``, that ``policy``'s work must end before the deadline: the time the caller keeps
        for its fallback's answer, and how early its own cut fires. What ``auto`` plans must end before it."""
        ...

    def down(self, dependency: str) -> bool:
        """Whether ``dependency`` ("verifier", "drafter") is down now: ``auto`` skips the tiers that need it."""
        ...


class InProcess:
    """:class:`Serving` in-process: no queue, nothing kept back, nothing down."""

    def wait(self, policy: str) -> float:
        return 0.0

    def kept_back(self, policy: str, left: float) -> float:
        return 0.0

    def down(self, dependency: str) -> bool:
        return False


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
    costs: CostModel = field(default_factory=CostModel)  # what stages and requests cost, per policy and resource
    serving: Serving = field(default_factory=InProcess)  # the caller's queues, what it keeps back, what is down

    def learned(self, policy: str) -> Online:
        """The policy's :class:`Online` state, shared by every policy object of this engine."""
        if policy not in self.online:
            self.online[policy] = Online()
        return self.online[policy]

    def history_sids(self, histories: Sequence[np.ndarray]) -> torch.Tensor:
        """Item-index histories -> [R, H, L] codes, left-padded with -1 rows
        (:func:`~specrec.data.histories.history_codes`)."""
        return torch.from_numpy(history_codes(histories, self.max_history, self.itemset.sids))


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
