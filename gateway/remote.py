"""gRPC-backed implementations of the core library's verifier and drafter
interfaces, so the policy loop runs unchanged in the gateway.

Policies are synchronous code; the gateway runs each request's policy in a
worker thread, and these adapters use blocking stubs from there. Every call
carries the request's remaining budget as its gRPC deadline.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Sequence

import grpc
import numpy as np
import torch

from specrec.decoding.beam import Beams
from specrec.decoding.scoring import Scores
from specrec.drafters.base import Draft, DraftRequest
from specrec.verifier import Session
from specrec_rpc.catalogue import Snapshot
from specrec_rpc.tensors import to_msg, to_torch
from specrec_rpc.v1 import common_pb2, drafter_pb2, verifier_pb2

#: extra time granted to one downstream call beyond the request's budget, so a
#: call that starts just in time can still answer (keeps answers within budget + a few ms)
GRACE_S = 0.004


class DependencyDown(RuntimeError):
    def __init__(self, which: str, detail: str):
        super().__init__(f"{which} unavailable: {detail}")
        self.which = which


class BudgetExceeded(RuntimeError):
    pass


def _timeout(deadline: float | None, floor: float = 0.002) -> float | None:
    if deadline is None:
        return None
    return max(floor, deadline - time.monotonic() + GRACE_S)


def _call(which: str, fn, request, deadline):
    try:
        return fn(request, timeout=_timeout(deadline))
    except grpc.RpcError as e:
        code = e.code()
        if code == grpc.StatusCode.DEADLINE_EXCEEDED:
            raise BudgetExceeded(f"{which}: {e.details()}") from None
        if code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED, grpc.StatusCode.UNKNOWN,
                    grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.StatusCode.INTERNAL):
            raise DependencyDown(which, f"{code.name}: {e.details()}") from None
        raise


@dataclass
class RemoteState:
    session: str
    width: int = 0


def _beams(m: verifier_pb2.Beams) -> Beams:
    alive = to_torch(m.alive, "alive")
    nodes = torch.where(alive, torch.zeros_like(alive, dtype=torch.int64), torch.full_like(alive, -1, dtype=torch.int64))
    return Beams(to_torch(m.codes, "codes"), to_torch(m.scores, "scores"), nodes, to_torch(m.token_logp, "token_logp"))


class RemoteVerifier:
    """:class:`specrec.verifier.Verifier` over the verifier service.

    Beams come back with a ``nodes`` tensor of 0 (alive) / -1 (dead): the
    gateway never walks the verifier's trie, it only needs to know which beams
    are alive. ``select`` supports the whole batch only (the gateway runs one
    request per policy call)."""

    def __init__(self, stub, snap: Snapshot, deadline: float | None, level_sizes: list[int]):
        self.stub, self.snap, self.deadline = stub, snap, deadline
        self.level_sizes = list(level_sizes)

    def encode(self, hist_sids: torch.Tensor) -> Session:
        r = _call("verifier", self.stub.Encode,
                  verifier_pb2.EncodeRequest(history_sids=to_msg(hist_sids), version=self.snap.version), self.deadline)
        sess = Session(n=r.n, state=RemoteState(r.session))
        sess.calls["encode"] += 1
        return sess

    def select(self, sess: Session, idx: torch.Tensor) -> Session:
        if len(idx) != sess.n:
            raise NotImplementedError("the remote verifier keeps whole sessions")
        return sess

    def score(self, sess: Session, sids: torch.Tensor, full: bool = False) -> Scores:
        sess.calls["score"] += 1
        r = _call("verifier", self.stub.Score,
                  verifier_pb2.ScoreRequest(session=sess.state.session, sids=to_msg(sids), full=full), self.deadline)
        return Scores(to_torch(r.token_logp, "token_logp"), [to_torch(f, "full") for f in r.full] if full else None)

    def next_logprobs(self, sess: Session, prefixes: torch.Tensor) -> torch.Tensor:
        sess.calls["expand"] += 1
        r = _call("verifier", self.stub.Expand,
                  verifier_pb2.ExpandRequest(session=sess.state.session, prefixes=to_msg(prefixes)), self.deadline)
        return to_torch(r.logp, "logp")

    def beam_start(self, sess: Session, trie, width: int) -> None:
        sess.state.width = width

    def beam_step(self, sess: Session) -> Beams:
        sess.calls["step"] += 1
        r = _call("verifier", self.stub.BeamStep,
                  verifier_pb2.BeamStepRequest(session=sess.state.session, width=sess.state.width), self.deadline)
        return _beams(r)

    def beam_search(self, sess: Session, trie, width: int) -> Beams:
        self.beam_start(sess, trie, width)
        beams = None
        for _ in self.level_sizes:
            beams = self.beam_step(sess)
        return beams

    def head_logprobs(self, sess: Session, prefixes: torch.Tensor) -> list[torch.Tensor]:
        r = _call("verifier", self.stub.HeadLogprobs,
                  verifier_pb2.HeadLogprobsRequest(session=sess.state.session, prefixes=to_msg(prefixes)), self.deadline)
        return [to_torch(x, "logp") for x in r.logp]

    def head_beams(self, sess: Session, trie, width: int) -> Beams:
        sess.calls["head"] += 1
        r = _call("verifier", self.stub.HeadDrafts,
                  verifier_pb2.HeadDraftsRequest(session=sess.state.session, width=width), self.deadline)
        return _beams(r)

    def release(self, sess: Session) -> None:
        if sess.state is None:
            return
        try:
            self.stub.Release(verifier_pb2.ReleaseRequest(session=sess.state.session), timeout=0.05)
        except grpc.RpcError:
            pass  # the session expires on its own
        sess.state = None


class RemoteDrafter:
    """:class:`specrec.drafters.base.Drafter` over the drafter service (rows <-> item ids via the snapshot)."""

    name = "remote"

    def __init__(self, stub, snap: Snapshot, deadline: float | None, mode: str = ""):
        self.stub, self.snap, self.deadline, self.mode = stub, snap, deadline, mode

    def draft(self, requests: Sequence[DraftRequest]) -> list[Draft]:
        ids = self.snap.ids
        queries = []
        for q in requests:
            queries.append(drafter_pb2.DraftQuery(
                history=[ids[r] for r in q.history.tolist()], n=q.n,
                prefixes=[common_pb2.Sid(codes=p.tolist()) for p in (q.prefixes if q.prefixes is not None else [])],
                exclude=[ids[r] for r in q.exclude],
            ))
        r = _call("drafter", self.stub.Draft,
                  drafter_pb2.DraftRequest(queries=queries, version=self.snap.version, mode=self.mode), self.deadline)
        out = []
        index, active = self.snap.index, self.snap.itemset.active
        for d in r.drafts:
            rows, scores = [], []
            for i, s in zip(d.item_ids, d.scores):
                row = index.get(i)
                if row is not None and active[row]:  # ids of another catalogue version are skipped
                    rows.append(row)
                    scores.append(s)
            out.append(Draft(np.asarray(rows, dtype=np.int64), np.asarray(scores, dtype=np.float32)))
        return out
