"""The drafter service as the core library's :class:`~specrec.drafters.base.Drafter`."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from specrec.deadline import Deadline
from specrec.drafters.base import Draft, DraftRequest
from specrec.fusion import Fusion
from specrec.policies.errors import DependencyDown
from specrec_rpc.catalogue import Snapshot
from specrec_rpc.v1 import common_pb2, drafter_pb2

from .calls import call


class DrafterReport:
    """What the drafter service says of its drafts, kept across requests (the gateway's one record): the share of
    each draft it reserves for unseen items (``DraftResponse.unseen_share``) and, for a mode whose scores are
    meant to be fused with the GR model's, the fusion (``DraftResponse.fusion``: the SASRec drafter's, chosen on
    validation users), as the last answer said. The gateway's warm-up drafts before it serves, so requests read
    the drafter's own settings."""

    def __init__(self) -> None:
        self.unseen_share = 0.0
        self.fusion: Fusion | None = None

    def read(self, r: drafter_pb2.DraftResponse) -> None:
        self.unseen_share = float(r.unseen_share)
        f = r.fusion if r.HasField("fusion") else None
        self.fusion = None if f is None else Fusion(f.weight, f.norm or "z", f.drafts or 50,  # type: ignore[arg-type]
                                                    f.item_recall or None, f.gr_recall or None)


class RemoteDrafter:
    """:class:`specrec.drafters.base.Drafter` over the drafter service's replicas, round-robin
    (drafting is stateless; a failed replica's call goes to the next one, once). Rows <-> item ids
    via the snapshot. ``unseen_share`` is what the drafter service said of its drafts (:class:`DrafterReport`):
    ``specgr`` keeps that share of its list for unseen items, as in-process from the bundle."""

    name = "remote"

    def __init__(self, replicas, snap: Snapshot, deadline: Deadline | None, mode: str = "", metadata=(),
                 report: DrafterReport | None = None):
        self.replicas, self.snap, self.deadline, self.mode = replicas, snap, deadline, mode
        self.metadata = tuple(metadata)
        self.report = report if report is not None else DrafterReport()

    @property
    def unseen_share(self) -> float:
        return self.report.unseen_share

    @property
    def fusion(self) -> Fusion | None:
        return self.report.fusion

    def draft(self, requests: Sequence[DraftRequest]) -> list[Draft]:
        ids = self.snap.ids
        queries = []
        for q in requests:
            queries.append(drafter_pb2.DraftQuery(
                history=[ids[r] for r in q.history.tolist()], n=q.n,
                prefixes=[common_pb2.Sid(codes=p.tolist()) for p in (q.prefixes if q.prefixes is not None else [])],
                exclude=[ids[r] for r in q.exclude],
            ))
        from specrec_rpc.replicas import NoReplica

        req = drafter_pb2.DraftRequest(queries=queries, version=self.snap.version, mode=self.mode)
        for attempt in (0, 1):
            try:
                replica = self.replicas.next()
            except NoReplica as e:
                raise DependencyDown("drafter", str(e)) from None
            try:
                with replica:
                    r = call("drafter", replica.stub.Draft, req, None if self.deadline is None else self.deadline.at,
                              self.metadata)
                break
            except DependencyDown:
                if attempt:
                    raise
        self.report.read(r)
        out = []
        index, active = self.snap.index, self.snap.itemset.active
        assert active is not None  # LocalItemSet fills it in
        for d in r.drafts:
            rows, scores = [], []
            for i, s in zip(d.item_ids, d.scores):
                row = index.get(i)
                if row is not None and active[row]:  # ids of another catalogue version are skipped
                    rows.append(row)
                    scores.append(s)
            out.append(Draft(np.asarray(rows, dtype=np.int64), np.asarray(scores, dtype=np.float32)))
        return out
