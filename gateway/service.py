"""The gateway: Recommend over gRPC.

The request path reads validate -> admit -> serve -> respond
(:mod:`.servicer`). Validation (:mod:`.request`) pins one catalogue version
and fixes the request's one :class:`~specrec.deadline.Deadline`. Admission is
``auto``'s, decided when a request arrives (on the event loop, seeing every
request admitted before it): the most accurate policy whose tail cost plus
the tail of the queue ahead of it (at the service it uses, :mod:`.queueing`)
fits the remaining budget less the reserve for its fallback's tail answer; a
request that nothing fits, not even the drafter's list, is refused at once
with RESOURCE_EXHAUSTED. Every cost is a high quantile (``cost_quantile``)
over a window of recent observations (``cost_window``), not a mean.

The chosen policy (the core library's loop) runs in a worker thread on the
gateway's long-lived engine (one per catalogue version, built once: gRPC-backed
verifier and drafter adapters, :mod:`.remote`; the policy objects are kept
too), with the request's one deadline as every downstream call's deadline.
What is kept back from it and when it is cut is :mod:`.budget`'s (the
verifier's calls end early enough for the drafter to answer; at the deadline
the gateway answers with what it has and cancels the request, so nothing runs
on for it). When a dependency fails, the core's
fallback ladder (:mod:`specrec.policies.fallback`) answers instead and says so
in ``stats.degraded`` / ``degraded_reason``; after ``breaker_failures``
verifier failures in a row the breaker (:mod:`specrec.policies.breaker`) stops
asking the verifier for ``breaker_open_s``. What everything costs is one
:class:`~specrec.costs.CostModel`, shared by the policies, ``auto``, the
queue model and the reserve.
"""

from __future__ import annotations

import asyncio
import contextvars
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import grpc
import numpy as np
from prometheus_client.core import REGISTRY

from specrec.costs import CostModel
from specrec.deadline import Deadline, Watch
from specrec.policies import Engine, RecResult, SpecMetrics, make_policy
from specrec.policies.auto import AutoPolicy
from specrec.policies.breaker import Breaker, Cooldown
from specrec.policies.errors import DependencyDown, Unsupported
from specrec.policies.fallback import Ladder, catalogue_only
from specrec_rpc import tracing
from specrec_rpc.catalogue import CatalogueWatcher, Snapshot
from specrec_rpc.errors import register
from specrec_rpc.replicas import Replicas, wait_serving
from specrec_rpc.server import Service, make_channel
from specrec_rpc.v1 import drafter_pb2_grpc, recommender_pb2_grpc, verifier_pb2_grpc

from .budget import GRACE_S, Budget
from .calls import request_calls
from .drafter_client import DrafterInfo
from .fastpath import SERVED as FAST_POLICIES
from .fastpath import FastPath
from .metrics import BUDGET_CUTS, BUDGET_MISSES, DEFAULT_BUDGET, DEPENDENCY_UP, HOP_OVERHEAD, RECS, STAGE, SpecCollector
from .parts import VerifierParts
from .queueing import QueueModel
from .remote import RemoteDrafter, RemoteVerifier
from .request import Admitted, ValidRequest
from .requestlog import RequestLog
from .servicer import Servicer
from .settings import GatewaySettings

__all__ = ["GatewayService", "GatewaySettings"]

# a policy the verifiers' bundles cannot serve (no SID drafter for nezha, say), asked for by name
register(Unsupported, grpc.StatusCode.FAILED_PRECONDITION)

WARMUP_POLICIES = ("fused", "beam", "strict", "nezha", "drafter", "specgr")  # every policy auto may pick


class GatewayService(Service):
    name = "gateway"
    grpc_services = ("specrec.v1.Recommender",)

    def __init__(self, settings: GatewaySettings):
        super().__init__(settings)
        self.s = settings
        self.metrics = SpecMetrics()
        self.pool = ThreadPoolExecutor(max_workers=settings.workers, thread_name_prefix="policy")
        self._collector = SpecCollector(self.metrics)
        self.online: dict = {}  # what every policy learned, across requests (a policy object lives for one request)
        # what stages, requests and services cost (their tails): policies, auto, queue and reserve
        self.costs = CostModel(settings.cost_quantile, settings.cost_window)
        self.breaker = Breaker(settings.breaker_failures, settings.breaker_open_s)
        self.drafter = Cooldown(settings.breaker_open_s)  # the drafter counts as down for a while after it failed
        self.queue = QueueModel(self.costs, settings.reserve_ms / 1000.0, self.drafter)
        self.ladder = Ladder(self.breaker, self.drafter, self.costs, GRACE_S, on_down=self._log_down)
        self.requests_log = RequestLog(self.log, settings.log_sample_rate)
        self.budget = Budget(settings, self.queue, self.costs, self._down)  # what is kept back, when it is cut
        self._engines: dict[str, Engine] = {}  # catalogue version -> its engine (the last few versions)
        self._engines_lock = threading.Lock()

        self._missing: dict[tuple, str | None] = {}  # (policy, params, parts, fusion) -> what it lacks
        self.fast = FastPath(self) if settings.fast_path else None  # fused and drafter on the event loop
        DEFAULT_BUDGET.set(settings.default_budget_ms / 1000.0)

    async def start(self) -> None:
        s = self.s
        self.itemset_channel = make_channel(s.itemset_addr, s, aio=True)
        self.catalogue = CatalogueWatcher(self.itemset_channel, min_reload_s=s.catalogue_min_reload_s)
        await self.catalogue.start()
        # per replica, a blocking channel (policies in worker threads) and an asyncio one (the event loop's)
        aio_channel = lambda address: make_channel(address, s, aio=True)  # noqa: E731
        self.verifiers = Replicas(s.verifier_addr, verifier_pb2_grpc.VerifierStub, self.client_channel,
                                  make_aio_channel=aio_channel)
        self.drafters = Replicas(s.drafter_addr, drafter_pb2_grpc.DrafterStub, self.client_channel,
                                 make_aio_channel=aio_channel)
        await asyncio.to_thread(self._wait_for_backends)
        # policies plan with what the bundles have: the verifiers' parts, the drafter's unseen share and fusion
        self.verifier_parts = VerifierParts(self.verifiers)
        await asyncio.to_thread(self.verifier_parts.describe_all)
        self.drafter_info = DrafterInfo(self.drafters, s.drafter_mode)
        await asyncio.to_thread(self.drafter_info.describe)
        # admission's planner, built once: auto chooses with the costs, queues and parts every request shares
        assert self.catalogue.current is not None  # start() waited for the first version
        self.auto = AutoPolicy(self.engine(self.catalogue.current))
        try:
            REGISTRY.register(self._collector)
        except ValueError:
            pass  # already registered in this process
        DEPENDENCY_UP.labels("verifier").set_function(lambda: 0.0 if self.breaker.is_open() else 1.0)
        DEPENDENCY_UP.labels("drafter").set_function(lambda: 0.0 if self.drafter.is_down() else 1.0)
        DEPENDENCY_UP.labels("itemset").set_function(
            lambda: 1.0 if time.monotonic() - self.catalogue.last_ok < 5.0 else 0.0)
        await self._warmup()

    def _wait_for_backends(self) -> None:
        """Until every verifier and drafter replica is SERVING (``backends_wait_s`` at most): the gateway starts
        beside them, and plans and warms up only once they answer."""
        t0 = time.monotonic()
        for name, replicas in (("verifier", self.verifiers), ("drafter", self.drafters)):
            serving = wait_serving(replicas, max(0.0, self.s.backends_wait_s - (time.monotonic() - t0)))
            known, waited = sorted(replicas.replicas), round(time.monotonic() - t0, 2)
            if serving == known and known:
                self.log.info("backends serving", service=name, replicas=known, waited_s=waited)
            else:
                self.log.warning("starting without every backend serving", service=name, serving=serving,
                                 replicas=known, waited_s=waited)

    async def _warmup(self) -> None:
        """What ``auto`` knows of costs when the first request comes, measured here, before the health check says
        SERVING: every policy it may pick runs on the real path (admission, a worker thread, the real verifier and
        drafter over gRPC), on histories as long as the model's window and at each K of ``warmup_k``.

        1. Once each, cold: channels connect, each callee's first call at these shapes, the code's first run. Those
           times are no policy's cost (up to seconds), so every estimate they taught is then forgotten
           (:meth:`CostModel.reset`, the queue's busy times too).
        2. ``warmup_requests`` rounds of every policy, measured: the tails auto admits its first requests by.

        Without (2), auto knew only the cold requests: the tail of two or three of them held the fused list above a
        30 ms budget on a fresh stack, and the first answers were SASRec's own. Not fatal: a policy that fails is
        left out of the rounds after, and auto learns its cost from live requests."""
        snap = self.catalogue.current
        assert snap is not None and snap.itemset.active is not None  # start() waited for the first version
        rows = np.nonzero(snap.itemset.active)[0]
        rng = np.random.default_rng(0)
        policies = []
        for policy in WARMUP_POLICIES:
            lacking = self._lacking(policy, {})
            if lacking is None:
                policies.append(policy)
            else:
                self.log.info("warm-up skipped: the policy cannot run here", policy=policy, needs=lacking)
        t0 = time.monotonic()
        await self._warm_round(snap, policies, rows, rng)
        self.costs.reset()
        self.queue.reset()
        t1 = time.monotonic()
        for _ in range(self.s.warmup_requests):
            await self._warm_round(snap, policies, rows, rng)
        k = self.s.warmup_k[0]
        tails = {p: round(1000.0 * t, 2) for p in policies if (t := self.costs.tail(p, k)) is not None}
        self.log.info("warm-up measured", cold_s=round(t1 - t0, 2), measured_s=round(time.monotonic() - t1, 2),
                      requests=self.s.warmup_requests, k=k, tail_ms=tails)

    async def _warm_round(self, snap: Snapshot, policies: list[str], rows: np.ndarray,
                          rng: np.random.Generator) -> None:
        """One request of every policy in ``policies`` at every K of ``warmup_k``; a policy that fails is logged
        and taken out of ``policies``."""
        size = min(len(rows), self.s.max_history)
        for policy in list(policies):
            for k in self.s.warmup_k:
                hist = rng.choice(rows, size=size, replace=False)
                valid = ValidRequest(policy, {}, hist, k, 1000.0, snap, Deadline(time.monotonic() + 1.0, watch=Watch()))
                try:
                    res = await self.serve(self.admit(valid))
                except Exception as e:  # noqa: BLE001 -- logged, not fatal: auto learns it from live requests
                    self.log.warning("warm-up failed", policy=policy, k=k, error=str(e))
                    policies.remove(policy)
                    break
                if res.degraded or res.served_by != policy:
                    self.log.warning("warm-up answer degraded", policy=policy, k=k, served_by=res.served_by,
                                     degraded=res.degraded)

    def client_channel(self, address: str) -> grpc.Channel:
        return make_channel(address, self.s)

    async def stop(self) -> None:
        await self.catalogue.stop()
        await self.itemset_channel.close()
        await self.verifiers.close_aio()
        await self.drafters.close_aio()
        self.pool.shutdown(wait=True)
        self.verifiers.close()
        self.drafters.close()
        try:
            REGISTRY.unregister(self._collector)
        except KeyError:
            pass

    def add_to_server(self, server: grpc.aio.Server) -> None:
        recommender_pb2_grpc.add_RecommenderServicer_to_server(Servicer(self), server)

    # -- admission and the policy loop ------------------------------------------------------
    def engine(self, snap: Snapshot) -> Engine:
        """The core library's engine for catalogue version ``snap`` (built once per version, the last few kept),
        over the gRPC adapters; a request's own deadline comes with the request, and what auto plans with (the
        queue, what is kept back, what is down) is the gateway's :class:`.budget.Budget`."""
        with self._engines_lock:
            eng = self._engines.get(snap.version)
            if eng is not None and eng.itemset is snap.itemset:
                return eng
        eng = Engine(
            verifier=RemoteVerifier(self.verifiers, self.verifier_parts, snap, snap.level_sizes),
            itemset=snap.itemset, max_history=self.s.max_history,
            drafter=RemoteDrafter(self.drafters, snap, self.s.drafter_mode, self.drafter_info),
            clock=time.monotonic, metrics=self.metrics, online=self.online, costs=self.costs, serving=self.budget)
        with self._engines_lock:
            if len(self._engines) >= 4:  # older versions' engines go (a request holding one keeps it alive)
                self._engines.pop(next(iter(self._engines)))
            self._engines[snap.version] = eng  # two threads building one at once: either is right
        return eng

    def admit(self, valid: ValidRequest) -> Admitted:
        """On arrival (event loop): the policy to run (``auto`` picks one now, seeing every request
        admitted before it) and its resource counted as busy; Overloaded when nothing fits. Nothing is built per
        request here: ``auto``'s planner and what each policy lacks are kept across requests."""
        name = valid.policy
        if name == "auto":
            name = self.auto.choose(valid.rec_request())
        else:
            lacking = self._lacking(name, valid.params)
            if lacking is not None:
                raise Unsupported(name, lacking)
        run = Admitted(valid, name, valid.params if name == valid.policy else {})
        self.queue.take(run.resource)
        return run

    def _lacking(self, name: str, params: dict) -> str | None:
        """What policy ``name`` with ``params`` needs that the backends lack (``Policy.missing``), kept while what
        they offer stays the same."""
        key = (name, repr(sorted(params.items())), self.verifier_parts.current(), self.drafter_info.fusion)
        if key not in self._missing:
            if len(self._missing) > 1024:  # requests with ever new parameters: start again
                self._missing.clear()
            self._missing[key] = make_policy(name, self.auto.engine, **params).missing()
        return self._missing[key]

    async def serve(self, run: Admitted, ctx: contextvars.Context | None = None) -> RecResult:
        """Run an admitted request on a worker thread (in ``ctx``, so the trace span and log bindings follow),
        and answer by its deadline whatever it asked: a policy (or its fallback) still running then is cut
        (:meth:`_cut`) and cancelled, the cut set earlier by how late the event loop runs its timers
        (:meth:`.budget.Budget.cut_margin`), so that it fires by the deadline on a busy machine. A request whose
        caller leaves while it still queues for a worker never runs, and its count at its resource is returned at
        once: a queue of abandoned requests must not read as load forever; one whose caller leaves while it runs
        is cancelled.

        One future is all the hand-off: the worker settles it (``call_soon_threadsafe``), or the deadline's timer
        does first with :data:`_CUT`, and the request's task wakes once (``wait_for(shield(run_in_executor()))``
        took three turns of the loop: from the worker's end to the loop taking up its answer, p50 0.17 ms before,
        0.13 after, 400 fused requests each on two cores)."""
        if self.fast is not None and run.policy in FAST_POLICIES:
            return await self._serve_on_loop(run)
        loop = asyncio.get_running_loop()
        deadline = run.request.deadline
        run.cut_margin = self.budget.cut_margin(deadline.left(time.monotonic()))  # on the loop that learns it
        answer: asyncio.Future = loop.create_future()
        self.pool.submit(self._work, run, ctx, loop, answer)
        timer = loop.call_at(loop.time() + max(0.0, deadline.left(time.monotonic()) - run.cut_margin),
                             _settle, answer, _CUT, None)
        try:
            res = await answer
        except asyncio.CancelledError:
            if run.abandon():
                self.queue.done(run.resource, served=False)
            _cancel(deadline)
            raise
        finally:
            timer.cancel()
        if res is not _CUT:
            self.budget.observe_lateness(time.monotonic() - run.done_at)  # what the early cut learns
            return res
        t_cut = time.monotonic()
        res = self._cut(run)
        self.budget.observe_cut(time.monotonic() - t_cut)
        return res

    async def _serve_on_loop(self, run: Admitted) -> RecResult:
        """An admitted ``fused`` or ``drafter`` request on the event loop (:mod:`.fastpath`), cut at the same time
        as a worker's (:meth:`serve`): the timer cancels it there, and the answer it holds (``fused``: the item
        drafter's list), else the catalogue's fill, is the answer."""
        assert self.fast is not None
        loop = asyncio.get_running_loop()
        deadline = run.request.deadline
        t0 = time.monotonic()
        left = deadline.left(t0)
        run.cut_margin = self.budget.cut_margin(left)
        run.begin()  # nothing queues for a worker here: it runs now
        try:
            async with asyncio.timeout_at(loop.time() + max(0.0, left - run.cut_margin)):
                res = await self.fast.run(run, run.hops)
        except TimeoutError:
            t_cut = time.monotonic()
            self.fast.ran_late(run, t_cut - t0)
            res = self._cut(run)
            self.budget.observe_cut(time.monotonic() - t_cut)
            return res
        except asyncio.CancelledError:  # its caller left: nothing more runs for it
            _cancel(deadline)
            raise
        finally:
            self.queue.done(run.resource)
        self._account(run, res, t0)
        return res

    def _work(self, run: Admitted, ctx: contextvars.Context | None, loop: asyncio.AbstractEventLoop,
              answer: asyncio.Future) -> None:
        """In a worker thread: :meth:`run_policy` (in ``ctx``), its answer or its error handed to the loop."""
        try:
            res, err = (self.run_policy(run) if ctx is None else ctx.run(self.run_policy, run)), None
        except BaseException as e:  # noqa: BLE001 -- the request's task raises it (or, cut, drops it)
            res, err = None, e
        try:
            loop.call_soon_threadsafe(_settle, answer, res, err)
        except RuntimeError:  # the loop closed (the gateway stopped): nobody waits for the answer
            pass

    def _cut(self, run: Admitted) -> RecResult:
        """The deadline came and nothing answered (the verifier or the drafter late, the worker pool busy): the
        answer its policy holds (``fused``: the item drafter's list), else the catalogue's fill, now,
        ``exit_reason = budget``, flagged degraded; the run, if it started, is cancelled (its policy stops at its
        next step and starts no call; one in flight ends at its timeout) and its answer dropped."""
        if run.abandon():  # still queued for a worker: it never runs
            self.queue.done(run.resource, served=False)
            why = "no worker took it before the deadline"
        else:
            why = f"{run.policy} still running at the deadline"
        valid = run.request
        _cancel(valid.deadline)  # (its outcome, when it comes, is dropped: the answer's future is settled)
        res = None
        held = None if valid.deadline.watch is None else valid.deadline.watch.held
        if held is not None:  # the policy holds a fallback (fused: the item drafter's list): that, not fill
            try:
                res = held()
            except Exception as e:  # noqa: BLE001 -- built beside the running thread: fill is still an answer
                self.log.warning("held answer failed", error=str(e))
        if res is None:
            res = catalogue_only(self.engine(valid.snap), valid.rec_request(), f"budget: {why}")
        res.stats.exit_reason = "budget"
        BUDGET_CUTS.labels(valid.policy, run.policy).inc()
        return res

    def run_policy(self, run: Admitted) -> RecResult:
        """In a worker thread: the admitted policy answers, or a fallback does."""
        if not run.begin():  # its caller left while it queued (serve returned its count)
            raise RuntimeError("abandoned before it ran")
        t0 = time.monotonic()
        valid = run.request
        try:
            # the verifier's calls end (their grace included) where the reserve for the fallback's answer starts,
            # before the gateway's cut (which fires ``cut_margin`` early on a busy machine)
            deadline = self.budget.for_run(valid.deadline, run.policy, run.cut_margin, t0)
            with request_calls(tracing.metadata(valid.rid), run.hops):
                res = self.ladder.answer(run.policy, run.params, self.engine(valid.snap), valid.rec_request(deadline))
        finally:
            self.queue.done(run.resource)
        self._account(run, res, t0)
        run.done_at = time.monotonic()  # from here to the event loop taking it up: how late the loop runs
        return res

    def _account(self, run: Admitted, res: RecResult, t0: float) -> None:
        """What a request that ran to its end (``t0``: when it started) teaches before its answer leaves: its
        total time and its callees' own in its stages, and the service it used its time (``auto`` admits by
        it). Its metrics wait until the answer has left (:meth:`record`)."""
        total = time.monotonic() - t0
        res.stats.stage_ms["total"] = total * 1000.0
        for method, ms in run.hops.server_ms.items():  # the callees' own time, beside the stages that called them
            res.stats.stage_ms[f"server.{method}"] = ms
        if res.served_by == run.policy and not res.degraded:
            self.costs.observe_resource(run.resource, total)

    def record(self, run: Admitted, res: RecResult, total_ms: float) -> None:
        """A request's metrics, once its answer has left (the servicer calls it on the loop's next turn): every
        stage's time, each hop's overhead, the answer by policy and outcome, and a budget missed."""
        valid, st, hops = run.request, res.stats, run.hops
        # copies: a request cut at its deadline may still have a worker adding to its hops
        for method, ms in list(hops.server_ms.items()):
            HOP_OVERHEAD.labels(method).observe(max(0.0, hops.caller_ms.get(method, ms) - ms) / 1000.0)
        for stage, ms in list(st.stage_ms.items()):
            STAGE.labels(valid.policy, stage).observe(ms / 1000.0)
        RECS.labels(valid.policy, res.served_by, st.exit_reason or "", str(bool(res.degraded)).lower()).inc()
        if total_ms > valid.budget_ms:
            BUDGET_MISSES.labels(valid.policy).inc()

    def _down(self, dependency: str) -> bool:
        """Whether ``dependency`` is down for a new request: the verifier's breaker refuses (open, its probe not
        due), or the drafter failed a moment ago (its cooldown)."""
        return self.breaker.refusing() if dependency == "verifier" else self.drafter.is_down()

    def _log_down(self, e: DependencyDown) -> None:
        self.log.warning("dependency down", which=e.which, error=str(e))


_CUT = object()  # what the deadline's timer settles a request's answer with: nothing came in time


def _settle(answer: asyncio.Future, res, err: BaseException | None) -> None:
    """On the loop: the first of the worker and the deadline's timer settles the request's answer; the other finds
    it settled (or cancelled: its caller left) and its outcome is dropped."""
    if answer.done():
        return
    if err is None:
        answer.set_result(res)
    else:
        answer.set_exception(err)


def _cancel(deadline: Deadline) -> None:
    """The request was answered (or its caller left): whatever still runs for it stops."""
    if deadline.watch is not None:
        deadline.watch.cancel()
