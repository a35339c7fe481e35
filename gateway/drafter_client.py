"""The drafter service as the core library's :class:`~specrec.drafters.base.Drafter`, and what it says of its
drafts (:class:`DrafterInfo`, asked once)."""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Sequence

import grpc
import numpy as np
import structlog

from specrec.deadline import Deadline
from specrec.drafters.base import Draft, DraftRequest
from specrec.fusion import DEFAULT_LISTS, DEFAULTS, FEATURES, Combiner, Fusion
from specrec.policies.errors import DependencyDown
from specrec_rpc.catalogue import Snapshot
from specrec_rpc.tensors import from_msg, to_msg
from specrec_rpc.v1 import common_pb2, drafter_pb2

from .calls import call


class DrafterInfo:
    """What the drafter service says of its drafts in the gateway's mode (``Describe``: the gateway's one record,
    read at start, and again after the drafter was unreachable): the share of each draft it reserves for unseen
    items and, for a mode whose scores are meant to be fused with the GR model's, the fusion (the SASRec
    drafter's, chosen on validation users, with the validation recall of every list a policy serves). Until a
    replica has answered, the drafter reserves nothing and tells no fusion."""

    def __init__(self, replicas, mode: str = "", timeout_s: float = 2.0, retry_s: float = 5.0):
        self.replicas, self.mode, self.timeout_s, self.retry_s = replicas, mode, timeout_s, retry_s
        self.unseen_share = 0.0
        self.fusion: Fusion | None = None
        self._asked = -math.inf
        self._lock = threading.Lock()
        self.log = structlog.get_logger("drafter-info")

    def describe(self) -> bool:
        """Ask the replicas (blocking: the gateway's start) until one answers: True when one did."""
        with self._lock:
            self._asked = time.monotonic()
        for replica in list(self.replicas.replicas.values()):
            try:
                d = replica.stub.Describe(drafter_pb2.DescribeDrafterRequest(mode=self.mode), timeout=self.timeout_s)
            except grpc.RpcError as e:
                self.log.info("describe failed", replica=replica.address, code=e.code().name)
                continue
            f = d.fusion if d.HasField("fusion") else None
            fusion = None if f is None else Fusion(f.weight, f.norm or DEFAULTS["norm"],  # type: ignore[arg-type]
                                                   f.drafts or DEFAULTS["drafts"], dict(f.valid_recall),
                                                   _combiner(f), _default_list(f.default_list))
            with self._lock:
                self.unseen_share, self.fusion = float(d.unseen_share), fusion
            self.log.info("drafter described", replica=replica.address, mode=d.mode, unseen_share=self.unseen_share,
                          fusion=None if fusion is None else {**fusion.as_dict(), "valid": dict(fusion.valid),
                                                              "default": fusion.default})
            return True
        return False

    def forget(self) -> None:
        """The drafter was unreachable: ask again in the background (at most every ``retry_s``), since it may
        have come back with another bundle; what it said stays meanwhile."""
        with self._lock:
            now = time.monotonic()
            if now - self._asked < self.retry_s:
                return
            self._asked = now
        threading.Thread(target=self.describe, name="describe drafter", daemon=True).start()


def _earliest(requests: Sequence[DraftRequest]) -> Deadline | None:
    """The draft call's deadline: its requests' earliest (None when none has one)."""
    deadlines = [q.deadline for q in requests if q.deadline is not None]
    return min(deadlines, key=lambda d: d.at) if deadlines else None


def _default_list(name: str) -> str | None:
    """The list a drafter said ``auto`` serves by default (None: it said none, or one this gateway does not know,
    which it then orders by the validation figures alone, and says so)."""
    if not name:
        return None
    if name not in DEFAULT_LISTS:
        structlog.get_logger("drafter-info").warning("default list not known: auto orders by validation figures",
                                                     default_list=name)
        return None
    return name


def _combiner(f) -> Combiner | None:
    """The learned combiner a drafter described (None: it described none, or one reading features this gateway
    does not compute, which it then ranks by the weight, and says so)."""
    if not f.HasField("combiner"):
        return None
    c = f.combiner
    try:
        return Combiner.from_flat(c.inputs, c.hidden, list(c.weights), c.features or FEATURES)
    except ValueError as e:
        structlog.get_logger("drafter-info").warning("combiner not used: fused ranks by the weight", reason=str(e))
        return None


class RemoteDrafter:
    """:class:`specrec.drafters.base.Drafter` over the drafter service's replicas, round-robin
    (drafting is stateless; a failed replica's call goes to the next one, once). Rows <-> item ids
    via the snapshot. ``unseen_share`` and ``fusion`` are what the drafter service described
    (:class:`DrafterInfo`)."""

    name = "remote"

    def __init__(self, replicas, snap: Snapshot, mode: str = "", info: DrafterInfo | None = None):
        self.replicas, self.snap, self.mode = replicas, snap, mode
        self.info = info if info is not None else DrafterInfo(replicas, mode)

    @property
    def unseen_share(self) -> float:
        return self.info.unseen_share

    @property
    def fusion(self) -> Fusion | None:
        return self.info.fusion

    def draft(self, requests: Sequence[DraftRequest]) -> list[Draft]:
        req = draft_message(requests, self.snap, self.mode)
        deadline = _earliest(requests)
        tries = DraftTries(self.replicas, self.info)
        for attempt in (0, 1):
            replica = tries.next()
            try:
                with replica:
                    r = call("drafter", replica.stub.Draft, req, deadline, "Draft")
                break
            except DependencyDown as e:
                tries.failed(replica, e)
                if attempt:
                    raise
        return drafts_of(r, self.snap)


class DraftTries:
    """Where one ``Draft`` call's two tries go (the blocking client's and the gateway's event loop's alike):
    round-robin over the drafter's replicas, the second try on another where there is one (the only one again
    where there is not); a replica found unreachable is left out of rotation and the drafter's description
    forgotten."""

    def __init__(self, replicas, info: DrafterInfo):
        self.replicas, self.info = replicas, info
        self.tried: set[str] = set()

    def next(self):
        from specrec_rpc.replicas import NoReplica

        try:
            return self.replicas.next(self.tried)
        except NoReplica as e:
            if not self.tried:
                raise DependencyDown("drafter", str(e)) from None
            return self.replicas.next()  # the only one: once more

    def failed(self, replica, e: DependencyDown) -> None:
        if e.unreachable:
            self.info.forget()
            self.replicas.eject(replica, str(e))
        self.tried.add(replica.address)


def draft_message(requests: Sequence[DraftRequest], snap: Snapshot, mode: str) -> drafter_pb2.DraftRequest:
    """The ``Draft`` call for ``requests`` (their items are rows of ``snap``): histories and exclusions as rows
    (int32), so the drafter reads them as they are and answers rows too."""
    queries = [drafter_pb2.DraftQuery(
        history_rows=to_msg(np.asarray(q.history, dtype=np.int32)), n=q.n,
        prefixes=[common_pb2.Sid(codes=p) for p in q.prefixes.tolist()] if q.prefixes is not None else None,
        exclude_rows=to_msg(np.fromiter(q.exclude, dtype=np.int32, count=len(q.exclude))) if q.exclude else None)
        for q in requests]
    return drafter_pb2.DraftRequest(queries=queries, version=snap.version, mode=mode)


def drafts_of(resp: drafter_pb2.DraftResponse, snap: Snapshot) -> list[Draft]:
    """The drafts of a ``Draft`` answer by rows, less the rows ``snap`` does not hold active (a drafter a version
    ahead or behind: an item added since, or removed)."""
    active = snap.itemset.active
    assert active is not None  # LocalItemSet fills it in
    out = []
    for d in resp.drafts:
        rows = from_msg(d.rows, "rows", dtype="int32", ndim=1).astype(np.int64)
        scores = np.array(from_msg(d.row_scores, "row_scores", dtype="float32", ndim=1))
        keep = rows < len(active)
        keep[keep] = active[rows[keep]]
        out.append(Draft(rows, scores) if keep.all() else Draft(rows[keep], scores[keep]))
    return out
