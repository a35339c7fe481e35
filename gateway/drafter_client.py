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
from specrec.fusion import DEFAULTS, FEATURES, Combiner, Fusion
from specrec.policies.errors import DependencyDown
from specrec_rpc.catalogue import Snapshot
from specrec_rpc.rowindex import rows_of
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
                                                   _combiner(f))
            with self._lock:
                self.unseen_share, self.fusion = float(d.unseen_share), fusion
            self.log.info("drafter described", replica=replica.address, mode=d.mode, unseen_share=self.unseen_share,
                          fusion=None if fusion is None else {**fusion.as_dict(), "valid": dict(fusion.valid)})
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
        from specrec_rpc.replicas import NoReplica

        ids = self.snap.ids
        queries = [drafter_pb2.DraftQuery(
            history=[ids[r] for r in q.history.tolist()], n=q.n,
            prefixes=[common_pb2.Sid(codes=p.tolist()) for p in q.prefixes] if q.prefixes is not None else None,
            exclude=[ids[r] for r in q.exclude]) for q in requests]
        req = drafter_pb2.DraftRequest(queries=queries, version=self.snap.version, mode=self.mode)
        deadline = _earliest(requests)
        tried: set[str] = set()
        for attempt in (0, 1):
            try:
                replica = self.replicas.next(tried)  # a retry goes to another replica where there is one
            except NoReplica as e:
                if not tried:
                    raise DependencyDown("drafter", str(e)) from None
                replica = self.replicas.next()  # the only one: once more
            try:
                with replica:
                    r = call("drafter", replica.stub.Draft, req, deadline, "Draft")
                break
            except DependencyDown as e:
                if e.unreachable:
                    self.info.forget()
                    self.replicas.eject(replica, str(e))
                tried.add(replica.address)
                if attempt:
                    raise
        index, active = self.snap.index, self.snap.itemset.active
        assert active is not None  # LocalItemSet fills it in
        out = []
        for d in r.drafts:
            rows = rows_of(index, d.item_ids, -1)
            keep = [j for j, row in enumerate(rows) if row >= 0 and active[row]]  # another version's ids skipped
            if len(keep) == len(rows):
                out.append(Draft(np.asarray(rows, dtype=np.int64), np.asarray(d.scores, dtype=np.float32)))
            else:
                scores = list(d.scores)
                out.append(Draft(np.asarray([rows[j] for j in keep], dtype=np.int64),
                                 np.asarray([scores[j] for j in keep], dtype=np.float32)))
        return out
