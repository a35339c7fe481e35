"""``fused`` and ``drafter`` on the event loop: the request path at its floor.

The policies ``auto`` serves most (the best list, and the cheapest model answer it falls back to) run here as
plain coroutines over the gateway's long-lived parts, with asyncio stubs: no worker thread, no blocking stub,
no hand-off between threads; a request is its two round trips (one for ``drafter``) and the core library's
phases between them (:class:`specrec.policies.fused.FusedPolicy`'s ``begin``, ``drafted``, ``ranked`` and
``unranked``; :meth:`specrec.policies.drafter.DrafterPolicy.answer`), the same code the in-process batch runs, so
the lists are the same. Between services the catalogue's rows travel, not ids or SIDs: the drafter gets the
history's rows and answers rows (:func:`.drafter_client.draft_message`), and the verifier's ``rank`` search gets
the history's and the candidates' rows, whose SIDs it reads from its own copy of the catalogue version named.

Everything around the phases is the worker path's own, called the same way: the ladder's checks and verdicts
(:class:`specrec.policies.fallback.Ladder`: no time left, the breaker, a failure's fallback), the policy's
learning (:meth:`~specrec.policies.base.Policy.learn`) and labels, the request's deadline cut (a timer at the
cut's time: the answer the policy holds, else the catalogue's fill, :meth:`.service.GatewayService.cut`). What
would block the loop (a fallback that runs another policy with blocking calls: the breaker open, the drafter
down) runs in the worker pool, as every policy did before: those paths are rare.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

import grpc
import numpy as np

from specrec.costs import CostStage
from specrec.data.histories import left_pad
from specrec.deadline import Deadline
from specrec.drafters.base import Draft, DraftRequest
from specrec.policies import RecRequest, RecResult
from specrec.policies.batch import charge
from specrec.policies.drafter import DrafterPolicy
from specrec.policies.errors import BudgetExceeded, DependencyDown
from specrec.policies.fallback import catalogue_only
from specrec.policies.fused import FusedPolicy, FusedRound
from specrec.policies.metrics import RequestStats
from specrec_rpc import tracing
from specrec_rpc.catalogue import Snapshot
from specrec_rpc.replicas import NoReplica
from specrec_rpc.tensors import from_msg, to_msg
from specrec_rpc.v1 import verifier_pb2

from .calls import Hops, SessionLost, raise_for, timeout_for
from .drafter_client import DraftTries, draft_message, drafts_of
from .request import Admitted

if TYPE_CHECKING:
    from concurrent.futures import ThreadPoolExecutor

    from specrec.policies import Engine
    from specrec.policies.breaker import Breaker
    from specrec.policies.fallback import Ladder
    from specrec_rpc.replicas import Replicas

    from .budget import Budget
    from .drafter_client import DrafterInfo
    from .parts import VerifierParts
    from .settings import GatewaySettings


class Gateway(Protocol):
    """What the fast path needs of the gateway (:class:`gateway.service.GatewayService`, which builds it): the
    parts the worker path uses too."""

    s: GatewaySettings
    ladder: Ladder
    breaker: Breaker
    pool: ThreadPoolExecutor
    budget: Budget
    drafters: Replicas
    verifiers: Replicas
    drafter_info: DrafterInfo
    verifier_parts: VerifierParts

    def engine(self, snap: Snapshot) -> Engine: ...


#: the policies served here (the others run on the worker pool, :meth:`.service.GatewayService.run_policy`)
SERVED = ("fused", "drafter")


class FastPath:
    """The event loop's policies of one gateway (``svc``: its parts, shared with the worker path)."""

    def __init__(self, svc: Gateway):
        self.svc = svc

    async def run(self, run: Admitted, hops: Hops) -> RecResult:
        """An admitted ``fused`` or ``drafter`` request, answered by it or by the ladder's fallback; its calls'
        times go to ``hops``."""
        svc, valid = self.svc, run.request
        eng = svc.engine(valid.snap)
        deadline = svc.budget.for_run(valid.deadline, run.policy, run.cut_margin, time.monotonic())
        req = valid.rec_request(deadline)
        ladder = svc.ladder
        if ladder.no_time(eng, req):  # no call could come back in time
            return catalogue_only(eng, req, "no time left for any call")
        if run.policy == "fused" and not svc.breaker.allow():  # the drafter's list, as the ladder would answer
            return await self._blocking(ladder.fallback, eng, req, "verifier", "verifier breaker open (recent "
                                        "failures)")
        policy = ladder.policy(eng, run.policy, run.params)
        calls = _Calls(valid.snap, tracing.metadata(valid.rid), hops)
        t0 = eng.clock()
        try:
            if isinstance(policy, FusedPolicy):
                res = await self._fused(policy, eng, req, calls)
            else:
                assert isinstance(policy, DrafterPolicy)
                st = RequestStats()
                res = policy.answer(req, st, await self._draft(eng, policy.asks(req), st, calls), req.excluded())
        except (DependencyDown, BudgetExceeded) as e:
            policy.learn([None], [req], eng.clock() - t0, down=isinstance(e, DependencyDown))
            return await self._blocking(ladder.failed, eng, req, e)
        policy.learn([res], [req], eng.clock() - t0, down=False)
        policy.label(res)
        if isinstance(res.fault, DependencyDown) and res.fault.code == grpc.StatusCode.UNIMPLEMENTED.name:
            return await self._blocking(ladder.verdict, eng, req, res)  # its fallback runs another policy
        return ladder.verdict(eng, req, res)

    def ran_late(self, run: Admitted, seconds: float) -> None:
        """``run`` was cut at its deadline after ``seconds`` (its calls cancelled): its policy learns that it cost
        that much at least, as a worker's request that ran late teaches the time it took (otherwise ``auto``
        would admit it again and again for the cut to answer)."""
        valid = run.request
        policy = self.svc.ladder.policy(self.svc.engine(valid.snap), run.policy, run.params)
        policy.learn([None], [valid.rec_request()], seconds, down=False)

    async def _fused(self, policy: FusedPolicy, eng: Engine, req: RecRequest, calls: _Calls) -> RecResult:
        """The phases of :class:`FusedPolicy` around its two calls."""
        st = RequestStats()
        charge([st], encoder=True)  # the history is encoded once, in the scoring pass's call
        began = policy.begin(req, st, req.excluded())
        if isinstance(began, RecResult):  # not even a draft fits: flagged fill
            return began
        t0 = eng.clock()
        # with encode_early the verifier encodes the history while the item drafter drafts (a call more)
        session = self._encode(eng, req, calls) if policy.config.encode_early and not began.late else None
        try:
            draft = await self._draft(eng, began.draft, st, calls)
        except BaseException:
            self._drop(session)
            raise
        policy.costs.observe(CostStage.DRAFT, eng.clock() - t0)
        res = policy.drafted(began, draft)
        if res is not None:  # no time for the GR's pass: the item drafter's own list
            self._drop(session)
            return res
        t1 = eng.clock()
        try:
            token_logp = await self._rank(eng, began, draft, calls, session)
        except (BudgetExceeded, DependencyDown) as e:
            if isinstance(e, DependencyDown) and e.which != "verifier":
                raise
            return policy.unranked(began, draft, e)
        t2 = eng.clock()
        st.stage_ms["verify"] += (t2 - t1) * 1000.0
        charge([st])
        policy.costs.observe(CostStage.VERIFY, t2 - t1)
        res = policy.ranked(began, draft, token_logp)
        policy.costs.observe(CostStage.ROUND, eng.clock() - t0)
        return res

    async def _draft(self, eng: Engine, ask: DraftRequest, st: RequestStats, calls: _Calls) -> Draft:
        """One ``Draft`` call (round-robin over the drafter's replicas, once more on another when one fails), as
        :class:`.drafter_client.RemoteDrafter` makes it."""
        svc = self.svc
        msg = draft_message([ask], calls.snap, svc.s.drafter_mode)
        tries = DraftTries(svc.drafters, svc.drafter_info)
        t0 = eng.clock()
        for attempt in (0, 1):
            replica = tries.next()
            try:
                with replica:
                    resp = await calls.call("drafter", svc.drafters.aio_stub(replica).Draft, msg, ask.deadline, "Draft")
                break
            except DependencyDown as e:
                tries.failed(replica, e)
                if attempt:
                    raise
        st.stage_ms["draft"] += (eng.clock() - t0) * 1000.0
        return drafts_of(resp, calls.snap)[0]

    def _encode(self, eng: Engine, req: RecRequest, calls: _Calls) -> _Session | None:
        """The history's encode started now, on the replica the scoring call will go to (None: no replica)."""
        try:
            replica = self.svc.verifiers.pick(set())
        except NoReplica:
            return None
        msg = verifier_pb2.EncodeRequest(history_rows=_history(eng, req), version=calls.snap.version)
        return _Session(replica, calls.start("verifier", self.svc.verifiers.aio_stub(replica).Encode, msg,
                                             req.deadline, "Encode"))

    async def _rank(self, eng: Engine, rnd: FusedRound, draft: Draft, calls: _Calls,
                    session: _Session | None = None) -> np.ndarray:
        """The GR's scoring pass over the draft's items (the registry's ``rank``, with the history encoded in the
        same call, or by ``session``'s encode started earlier): their token log-probabilities [n, L]. On one
        replica, picked as a session's would be; when it fails, once more on another, from the history (as
        :class:`.remote.RemoteVerifier` does, a replica found unreachable left out of rotation)."""
        svc, req = self.svc, rnd.req
        n = len(draft.items)
        # a catalogue this small that nothing was drafted: any valid item, read by nobody
        rows = draft.items if n else eng.itemset.order[0][:1]
        candidates = {"sids": to_msg(rows.astype(np.int32)[None])}
        history = verifier_pb2.SessionRef(history_rows=_history(eng, req), version=calls.snap.version)
        tried: set[str] = set()
        for attempt in (0, 1):
            ref, replica = history, None
            if session is not None and attempt == 0:
                replica = session.replica
                try:
                    ref = verifier_pb2.SessionRef(session=(await session.encoding).session, end=True)
                except DependencyDown:  # encoded nowhere: the scoring call encodes it, wherever it goes
                    replica = None
            try:
                replica = replica or svc.verifiers.pick(tried)
            except NoReplica as e:
                raise DependencyDown("verifier", str(e)) from None
            msg = verifier_pb2.SearchRequest(ref=ref, search="rank", row_tensors=candidates)
            try:
                with replica:
                    resp = await calls.call("verifier", svc.verifiers.aio_stub(replica).Search, msg, req.deadline,
                                            "Search")
                break
            except SessionLost:  # the early encode's session is gone (evicted, restarted): from the history
                if attempt:
                    raise DependencyDown("verifier", "session lost twice") from None
                continue
            except DependencyDown as e:
                if e.code == grpc.StatusCode.UNIMPLEMENTED.name:
                    raise  # a part this replica's bundle lacks: not a failure, and no other replica is asked
                if e.unreachable:
                    svc.verifier_parts.forget(replica.address)
                    svc.verifiers.eject(replica, str(e))
                tried.add(replica.address)
                if attempt:
                    raise
        return np.array(from_msg(resp.tensors["token_logp"], "token_logp", dtype="float32", ndim=3)[0, :n])

    def _drop(self, session: _Session | None) -> None:
        """An early encode whose session will not be scored: cancelled, or its session released (not waited
        for; sessions also expire on their own)."""
        if session is None:
            return
        if not session.encoding.done():
            session.encoding.cancel()
        elif not session.encoding.cancelled() and session.encoding.exception() is None:
            release = verifier_pb2.ReleaseRequest(session=session.encoding.result().session)
            self.svc.verifiers.aio_stub(session.replica).Release(release, timeout=0.5)  # a call starts as made

    async def _blocking(self, fn, *args) -> RecResult:
        """``fn(*args)`` on the worker pool: a ladder's step that may run a policy with blocking calls."""
        return await asyncio.get_running_loop().run_in_executor(self.svc.pool, fn, *args)


def _history(eng: Engine, req: RecRequest):
    """The request's history as the verifier takes it: its rows, the model's window, left-padded with -1."""
    return to_msg(left_pad([req.history], eng.max_history).astype(np.int32))


@dataclass
class _Session:
    """An encode started early (``encode_early``): the replica it runs on and its call."""

    replica: Any
    encoding: asyncio.Task


@dataclass
class _Calls:
    """What a request's calls from the loop share: its catalogue version, the metadata they forward (its request
    id) and where their hops are recorded."""

    snap: Snapshot
    metadata: tuple
    hops: Hops

    async def call(self, which: str, fn, request, deadline: Deadline | None, method: str):
        """One call, as :func:`.calls.call` makes one from a worker thread: its timeout from the request's deadline
        (the verifier's at ``verifier_at``), none started once the request is cancelled, failures as core errors,
        its hop recorded."""
        if deadline is not None and deadline.cancelled:
            raise BudgetExceeded(which, "cancelled: the request was answered at its deadline")
        until = None if deadline is None else deadline.verifier_at if which == "verifier" else deadline.at
        t0 = time.perf_counter()
        call = fn(request, timeout=timeout_for(until), metadata=self.metadata)
        try:
            resp = await call
        except grpc.aio.AioRpcError as e:
            raise_for(which, e)
        self.hops.add(method, time.perf_counter() - t0, await call.trailing_metadata())
        return resp

    def start(self, which: str, fn, request, deadline: Deadline | None, method: str) -> asyncio.Task:
        """:meth:`call`, started now: its answer awaited later."""
        return asyncio.ensure_future(self.call(which, fn, request, deadline, method))
