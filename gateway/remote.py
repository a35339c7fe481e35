"""gRPC-backed implementations of the core library's verifier and drafter
interfaces, so the policy loop runs unchanged in the gateway.

Policies are synchronous code; the gateway runs each request's policy in a
worker thread, and these adapters use blocking stubs from there. Every call
carries the request's remaining budget as its gRPC deadline.

Round trips are few: ``encode`` sends nothing; the history travels with the
first verifier call (which creates the session), every whole search is one
``Search`` (the registry's name, widths and tensors: nothing here names a
search), and a ``specgr`` round is one ``Score`` that also takes the
beam step (``score_step``). A policy that drafts before it verifies
(``specgr``) calls :meth:`RemoteVerifier.prepare`, which starts the encode in
the background so that it runs while the drafter works. A session the verifier lost (restart,
eviction) is re-created once from the history, wherever the call does not
depend on the session's beam state; otherwise the request degrades. A lost
session is known by the status's ``google.rpc.ErrorInfo`` reason
(``SESSION_LOST``), never by the message text.

Both adapters live as long as the catalogue version they serve (the gateway
builds them once per version) and serve every request of it. A request's one
:class:`~specrec.deadline.Deadline` comes with its session (``encode``) and its
draft requests: the drafter's calls end at its ``at``, the verifier's at its
``verifier_at`` (the reserve kept back for the drafter's answer before it), and
once it is cancelled no call starts (:func:`.calls.call`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import grpc
import numpy as np
import torch

from specrec.deadline import Deadline
from specrec.decoding.beam import Beams
from specrec.decoding.scoring import Scores
from specrec.decoding.searches import SEARCHES
from specrec.policies.errors import BudgetExceeded, DependencyDown
from specrec.verifier import Parts, SelectRule, Session, StepCoverage
from specrec_rpc.catalogue import Snapshot
from specrec_rpc.tensors import to_msg, to_torch
from specrec_rpc.v1 import verifier_pb2

from .calls import GRACE_S, SessionLost, current_metadata
from .calls import call as _call
from .calls import raise_for as _raise_for
from .calls import timeout_for as _timeout
from .drafter_client import RemoteDrafter
from .parts import VerifierParts

__all__ = ["GRACE_S", "BudgetExceeded", "DependencyDown", "RemoteDrafter", "RemoteVerifier", "SessionLost"]


@dataclass
class RemoteState:
    history: torch.Tensor  # [R, H, L]: sent with the first call, and again if the session is lost
    deadline: Deadline | None = None  # the request's: every call of the session ends at its verifier_at
    replica: Any = None  # the verifier replica every call of the request goes to (its sessions live there)
    session: str = ""  # the verifier's id, once it has the session
    encoding: Any = None  # an Encode started early by prepare() (a grpc future)
    width: int = 0
    rule: SelectRule | None = None
    trie: Any = None  # the trie beam_start was given (a request's view of it carries the SIDs it excludes)
    tried: set = field(default_factory=set)  # replicas that failed this request


def _coverage(m, sess: Session) -> None:
    """The beam steps a call took (``m``: its Beams or SearchReply), recorded on the request's session."""
    if m.covered.shape:
        cov, comp = to_torch(m.covered, "covered"), to_torch(m.computed, "computed")
        sess.coverage.extend(StepCoverage(a.tolist(), b.tolist()) for a, b in zip(cov, comp))


def _beams(m: verifier_pb2.Beams, sess: Session) -> Beams:
    _coverage(m, sess)
    return Beams(to_torch(m.codes, "codes"), to_torch(m.scores, "scores"), to_torch(m.token_logp, "token_logp"),
                 to_torch(m.alive, "alive").bool())


def _excluding(ref: verifier_pb2.SessionRef, trie) -> verifier_pb2.SessionRef:
    """``ref`` with the SIDs a request's view of the trie excludes (its history, when it asks)."""
    sids = getattr(trie, "excluded_sids", None)
    if sids is not None and len(sids):
        ref.exclude_sids.CopyFrom(to_msg(torch.from_numpy(np.ascontiguousarray(sids, dtype=np.int64))))
    return ref


def _rule(rule: SelectRule | None) -> verifier_pb2.SelectRule | None:
    if rule is None or rule.kind == "exact":
        return None
    return verifier_pb2.SelectRule(kind=rule.kind, threshold=rule.threshold, top_k=rule.top_k)


class RemoteVerifier:
    """:class:`specrec.verifier.Verifier` over the verifier service's replicas
    (:class:`specrec_rpc.replicas.Replicas`): a request's calls all go to the
    replica picked at ``encode`` (least outstanding of two); when it fails,
    another one takes over from the history. ``select`` supports the whole
    batch only (the gateway runs one request per policy call)."""

    def __init__(self, replicas, offers: VerifierParts, snap: Snapshot, level_sizes: list[int]):
        self.replicas, self.snap = replicas, snap
        self.offers = offers  # what the replicas' bundles have (the gateway's one record, shared by every request)
        self.level_sizes = list(level_sizes)

    # -- sessions --------------------------------------------------------------------
    def encode(self, hist_sids: torch.Tensor, deadline: Deadline | None = None) -> Session:
        sess = Session(n=hist_sids.shape[0], state=RemoteState(hist_sids, deadline))
        self._use(sess.state, self._pick(set()))
        return sess

    def _pick(self, exclude: set):
        from specrec_rpc.replicas import NoReplica

        try:
            return self.replicas.pick(exclude)
        except NoReplica as e:
            raise DependencyDown("verifier", str(e)) from None

    @staticmethod
    def _use(st: RemoteState, replica) -> None:
        if st.replica is not None:
            st.replica.__exit__(None, None, None)
        st.replica = replica.__enter__()

    def prepare(self, sess: Session) -> None:
        """Start encoding now, in the background (the next call waits for it)."""
        st: RemoteState = sess.state
        if not st.session and st.encoding is None:
            req = verifier_pb2.EncodeRequest(history_sids=to_msg(st.history), version=self.snap.version)
            until = None if st.deadline is None else st.deadline.verifier_at
            st.encoding = st.replica.stub.Encode.future(req, timeout=_timeout(until), metadata=current_metadata())
            if st.deadline is not None and st.deadline.watch is not None:
                st.deadline.watch.on_cancel(st.encoding.cancel)

    def select(self, sess: Session, idx: torch.Tensor) -> Session:
        if len(idx) != sess.n:
            raise NotImplementedError("the remote verifier keeps whole sessions")
        return sess

    def release(self, sess: Session) -> None:
        st: RemoteState | None = sess.state
        if st is None:
            return
        if st.encoding is not None and not st.session:
            st.encoding.cancel()
        if st.session:
            # fire and forget: the answer is not waited for (the session expires on its own anyway)
            st.replica.stub.Release.future(verifier_pb2.ReleaseRequest(session=st.session), timeout=0.5)
        if st.replica is not None:
            st.replica.__exit__(None, None, None)
        sess.state = None

    def _ref(self, st: RemoteState, keep: bool = True, fresh: bool = False) -> verifier_pb2.SessionRef:
        """The call's session: the one the verifier holds for the request (``keep`` False: it ends with this
        call), else the history, encoded in the call's batch (and kept for later calls with ``keep``)."""
        if st.encoding is not None and not fresh:
            try:
                st.session = st.encoding.result().session
            except grpc.FutureCancelledError:  # the request was cancelled at its deadline
                st.encoding = None
                raise BudgetExceeded("verifier", "cancelled: the request was answered at its deadline") from None
            except grpc.RpcError as e:
                st.encoding = None
                _raise_for("verifier", e)
            st.encoding = None
        if st.session and not fresh:
            return verifier_pb2.SessionRef(session=st.session, end=not keep)
        return verifier_pb2.SessionRef(history_sids=to_msg(st.history), version=self.snap.version, keep=keep)

    def _session_call(self, sess: Session, method: str, make, keep: bool = True, stateful: bool = False):
        """Call ``method`` with ``make(ref)`` on the request's replica. A lost session is re-created
        from the history once; a replica that fails is replaced by another one, once (unless the call
        needs the lost session's beam state: then the request degrades). ``keep`` False: the request's last
        call, after which the verifier holds nothing for it (no Release)."""
        st: RemoteState = sess.state
        for attempt in (0, 1):
            fresh = attempt > 0
            try:
                resp = self._invoke(st, method, make(self._ref(st, keep, fresh)))
            except SessionLost as e:
                if fresh or stateful:
                    raise DependencyDown("verifier", f"session lost: {e}") from None
                st.session = ""
                continue
            except DependencyDown as e:
                if e.code == grpc.StatusCode.UNIMPLEMENTED.name:
                    raise  # a part this replica's bundle lacks: not a failure, and no other replica is asked
                if e.unreachable:
                    self.offers.forget(st.replica.address)  # it may come back with another bundle: ask it again
                    self.replicas.eject(st.replica, str(e))  # out of rotation until its health check answers
                st.tried.add(st.replica.address)
                if fresh or (stateful and st.session):
                    raise
                self._use(st, self._pick(st.tried))  # fail over: another replica, from the history
                st.session, st.encoding = "", None
                continue
            if not keep:
                st.session = ""  # ended with this call (or never kept): nothing to release
            elif resp.session:
                st.session = resp.session
            return resp

    def _invoke(self, st: RemoteState, method: str, request):
        """One call of ``method`` on the request's replica."""
        return _call("verifier", getattr(st.replica.stub, method), request, st.deadline, method)

    # -- verification ---------------------------------------------------------------------
    def score(self, sess: Session, sids: torch.Tensor, full: bool = False, with_frontier: bool = False) -> Scores:
        r = self._session_call(sess, "Score", lambda ref: verifier_pb2.ScoreRequest(
            ref=ref, sids=to_msg(sids), full=full, with_frontier=with_frontier), stateful=with_frontier)
        return Scores(to_torch(r.token_logp, "token_logp"), [to_torch(f, "full") for f in r.full] if full else None)

    def score_step(self, sess: Session, sids: torch.Tensor) -> tuple[Scores, Beams]:
        """One ``Score`` that also takes the beam step from its pass (starting the search on the verifier
        with ``beam_start``'s width, rule and trie view when it has none yet)."""
        st: RemoteState = sess.state
        step = verifier_pb2.BeamOptions(width=st.width, rule=_rule(st.rule))
        r = self._session_call(sess, "Score", lambda ref: verifier_pb2.ScoreRequest(
            ref=_excluding(ref, st.trie), sids=to_msg(sids), with_frontier=True, step=step), stateful=bool(st.session))
        return Scores(to_torch(r.token_logp, "token_logp")), _beams(r.beams, sess)

    def next_logprobs(self, sess: Session, prefixes: torch.Tensor) -> torch.Tensor:
        r = self._session_call(
            sess, "Expand", lambda ref: verifier_pb2.ExpandRequest(ref=ref, prefixes=to_msg(prefixes))
        )
        return to_torch(r.logp[0], "logp")

    # -- beam search --------------------------------------------------------------------------
    def beam_start(self, sess: Session, trie, width: int, rule: SelectRule | None = None) -> None:
        sess.state.width, sess.state.rule, sess.state.trie = width, rule, trie

    def beam_step(self, sess: Session) -> Beams:
        st: RemoteState = sess.state
        r = self._session_call(sess, "BeamStep", lambda ref: verifier_pb2.BeamStepRequest(
            ref=_excluding(ref, st.trie), width=st.width, rule=_rule(st.rule)), stateful=bool(st.session))
        return _beams(r, sess)

    # -- NEZHA draft head ------------------------------------------------------------------------
    def head_logprobs(self, sess: Session, prefixes: torch.Tensor) -> list[torch.Tensor]:
        r = self._part_call(sess, "draft_head", "Expand", lambda ref: verifier_pb2.ExpandRequest(
            ref=ref, prefixes=to_msg(prefixes), head=True))
        return [to_torch(x, "logp") for x in r.logp]

    # -- parts of the bundle ------------------------------------------------------------------------
    def parts(self) -> Parts:
        """What every verifier replica's bundle offers (:class:`.parts.VerifierParts`: as each one said)."""
        return self.offers.current()

    def _part_call(self, sess: Session, part: str, method: str, make):
        """A call only a bundle with ``part`` answers; UNIMPLEMENTED marks the replica as lacking it (and is
        raised as DependencyDown with that code: the ladder falls back without counting a failure)."""
        try:
            return self._session_call(sess, method, make)
        except DependencyDown as e:
            if e.code == grpc.StatusCode.UNIMPLEMENTED.name:
                self.offers.lacks(sess.state.replica.address, part)
            raise

    # -- whole searches -------------------------------------------------------------------------------------
    def search(self, sess: Session, name: str, trie, widths: tuple[int, ...],
               args: dict[str, torch.Tensor] | None = None, rule: SelectRule | None = None) -> Any:
        """One ``Search`` (the registry's :data:`SEARCHES` says what goes in and what comes back). A search of
        the distilled drafter answers None where the replicas lack it (the policies plan a fallback); one of
        the NEZHA head raises DependencyDown (UNIMPLEMENTED: the ladder falls back). A search whose value is
        the answer (``final``) ends the session with it."""
        s = SEARCHES[name]
        if s.uses_sid_drafter and not self.parts().distilled_drafter:
            return None
        tensors = {k: to_msg(v) for k, v in (args or {}).items()}

        def make(ref: verifier_pb2.SessionRef) -> verifier_pb2.SearchRequest:
            req = verifier_pb2.SearchRequest(ref=_excluding(ref, trie) if s.tables else ref, search=name,
                                             widths=dict(zip(s.widths, widths)), tensors=tensors)
            wire_rule = _rule(rule)
            if wire_rule is not None:
                req.rule.CopyFrom(wire_rule)
            return req

        part = "distilled_drafter" if s.uses_sid_drafter else "draft_head" if s.uses_head else None
        try:
            r = self._session_call(sess, "Search", make, keep=not s.final)
        except DependencyDown as e:
            if part is None or e.code != grpc.StatusCode.UNIMPLEMENTED.name:
                raise
            self.offers.lacks(sess.state.replica.address, part)
            if s.uses_sid_drafter:
                return None
            raise
        _coverage(r, sess)
        return s.result({k: to_torch(v, k) for k, v in r.tensors.items()})
