"""What a policy may call (:class:`Engine`: verifier, item set, drafter, clock, costs, what the caller keeps
back) and what each policy learns across requests (:class:`Online`)."""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

from ..costs import CostModel
from ..data.histories import history_codes
from ..drafters.base import Drafter
from ..itemset import LocalItemSet
from ..verifier import Verifier
from .draft_sizer import DraftSizer
from .metrics import SpecMetrics
from .requests import RecResult


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
