"""A Recommend request, validated: the typed hand-off from the servicer to admission and the policy loop.

:func:`validate` checks every field (INVALID_ARGUMENT naming the field), pins
one catalogue version, resolves the history to item rows and fixes the
request's one :class:`~specrec.deadline.Deadline` (:func:`.budget.request_deadline`). :class:`Admitted` is what
admission (:meth:`gateway.service.GatewayService.admit`) hands the worker thread.
"""

from __future__ import annotations

import json
import threading
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from pydantic import ValidationError

from specrec.costs import Resource, resource_of
from specrec.deadline import Deadline
from specrec.policies import POLICIES, RecRequest
from specrec_rpc.catalogue import Snapshot
from specrec_rpc.errors import InvalidArgument, require
from specrec_rpc.rowindex import rows_of

from .budget import request_deadline
from .calls import Hops
from .settings import GatewaySettings


@dataclass
class ValidRequest:
    policy: str  # the policy asked for (or the default)
    params: dict[str, Any]  # its parameters: the settings' defaults, then the request's
    rows: np.ndarray  # [H] item rows of the history in ``snap``, oldest first (non-empty)
    k: int  # list length, at most the catalogue's size
    budget_ms: float
    snap: Snapshot  # the one catalogue version the request is answered from
    deadline: Deadline  # the budget, or the caller's deadline when that comes first; its watch cancels the request
    ignored: list[str] = field(default_factory=list)  # history ids not in ``snap`` (reported, not used)
    rid: str = ""  # request id (logs, traces, downstream metadata)
    exclude_history: bool = False  # never answer an item of the history (inside the trie constraint)

    def rec_request(self, deadline: Deadline | None = None) -> RecRequest:
        """The core library's request, with the request's deadline (or ``deadline``, one made from it: the same
        watch)."""
        return RecRequest(self.rows, self.k, deadline if deadline is not None else self.deadline,
                          exclude_history=self.exclude_history)


@dataclass
class Admitted:
    """A request admitted to run: the policy chosen for it and the resource it was counted at."""

    request: ValidRequest
    policy: str  # what runs (``auto`` has already chosen)
    params: dict[str, Any]  # the request's parameters when it runs the policy asked, else none
    state: str = "queued"  # -> "running" (a worker took it) or "abandoned" (its caller left while it queued)
    cut_margin: float = 0.0  # seconds before the deadline the gateway's cut fires (how late its event loop runs)
    hops: Hops = field(default_factory=Hops)  # its downstream calls' times (the caller's, and each callee's own)
    done_at: float = 0.0  # when its worker finished (time.monotonic()): the loop's lateness is measured from here
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False, compare=False)

    def begin(self) -> bool:
        """A worker takes it: False when it was abandoned while it queued (then nothing runs)."""
        with self._lock:
            if self.state != "queued":
                return False
            self.state = "running"
            return True

    def abandon(self) -> bool:
        """Its caller left (cancelled, deadline): True when no worker had taken it, so that it never will
        and whoever counted it busy must count it done now."""
        with self._lock:
            if self.state != "queued":
                return False
            self.state = "abandoned"
            return True

    @property
    def resource(self) -> Resource:
        return resource_of(self.policy)


def validate(r, s: GatewaySettings, snap: Snapshot, t0: float, caller_deadline: float | None = None,
             prefix: str = "", rid: str = "") -> ValidRequest:
    """The request ``r`` (RecommendRequest) checked against ``s`` and resolved in ``snap``; ``t0``: when it
    arrived (time.monotonic()); ``prefix``: before every field name (a RecommendBatch item's place)."""
    f = lambda name: f"{prefix}{name}"  # noqa: E731
    _check_sizes(r, s, f)
    policy = r.policy or s.default_policy
    if policy not in POLICIES:
        raise InvalidArgument(f("policy"), f"unknown policy {policy!r} (known: {', '.join(sorted(POLICIES))})")
    params = _params(r, s, policy, f)
    rows, ignored = _rows(r, snap, f)
    budget = r.budget_ms or s.default_budget_ms
    left = len(snap.itemset) - (len(np.unique(rows)) if r.exclude_history else 0)  # items that can come back
    return ValidRequest(policy, params, rows, min(r.k, left), budget, snap,
                        request_deadline(s, budget, t0, caller_deadline), ignored, rid,
                        exclude_history=r.exclude_history)


def _check_sizes(r, s: GatewaySettings, f) -> None:
    require(len(r.history) > 0, f("history"), "empty: send at least one item id")
    require(len(r.history) <= s.max_history_items, f("history"), f"at most {s.max_history_items} item ids")
    require(all(len(i) <= s.max_id_length for i in r.history), f("history"),
            f"item ids are at most {s.max_id_length} characters")
    require(len(r.user_id) <= s.max_id_length, f("user_id"), f"at most {s.max_id_length} characters")
    require(1 <= r.k <= s.max_k, f("k"), f"must be 1..{s.max_k}, got {r.k}")
    require(r.budget_ms >= 0, f("budget_ms"), f"must not be negative, got {r.budget_ms}")
    require(r.budget_ms <= s.max_budget_ms, f("budget_ms"), f"at most {s.max_budget_ms}")


def _params(r, s: GatewaySettings, policy: str, f) -> dict[str, Any]:
    """The settings' defaults for ``policy``, then the request's (JSON values, else strings), checked by
    the policy's config."""
    require(len(r.params) <= s.max_params, f("params"), f"at most {s.max_params} parameters")
    params = dict(s.policy_defaults.get(policy, {}))
    for key, raw in r.params.items():
        require(len(key) <= 64 and len(raw) <= 1024, f(f"params[{key[:64]}]"), "name or value too long")
        try:
            params[key] = json.loads(raw)
        except json.JSONDecodeError:
            params[key] = raw
    key = (policy, repr(sorted(params.items())))
    if key not in _CHECKED:  # the policy's config checks each distinct set of parameters once
        try:
            POLICIES[policy].Config(**params)
        except ValidationError as e:
            err = e.errors()[0]
            loc = ".".join(str(x) for x in err["loc"]) or "?"
            raise InvalidArgument(f("params." + loc), err["msg"]) from None
        if len(_CHECKED) > 1024:  # requests with ever new parameters: start again
            _CHECKED.clear()
        _CHECKED.add(key)
    return params


#: (policy, its parameters) that its config accepted
_CHECKED: set[tuple[str, str]] = set()


def _rows(r, snap: Snapshot, f) -> tuple[np.ndarray, list[str]]:
    """The history's active item rows in ``snap``, and the ids it ignores (unknown or inactive)."""
    active = snap.itemset.active
    assert active is not None  # LocalItemSet fills it in
    known = list(zip(r.history, rows_of(snap.index, r.history)))
    ignored = [i for i, x in known if x is None or not active[x]]
    rows = np.asarray([x for _, x in known if x is not None and active[x]], dtype=np.int64)
    require(
        len(rows) > 0, f("history"), f"none of the {len(r.history)} item ids is in catalogue version {snap.version}"
    )
    return rows, ignored
