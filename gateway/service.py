"""The gateway: Recommend over gRPC.

Validates the request, pins one catalogue version, and runs the chosen
policy (the core library's loop; ``auto`` by default) in a worker thread
against gRPC-backed verifier and drafter adapters, with the remaining budget
as every downstream call's deadline. Answers degrade, in this order, and say
so in ``stats.degraded`` / ``degraded_reason`` with ``served_by`` naming what
answered:

- the asked policy's own list;
- the verifier down, slow or hung: the drafter's list (``drafter``). Verifier
  calls stop ``reserve_ms`` before the deadline, leaving the drafter time to
  answer; after ``breaker_failures`` verifier failures in a row the gateway
  stops asking it for ``breaker_open_s`` (one probe request at a time then);
- the drafter down (policies that need it): ``beam``, else ``nezha``;
- both down, or nothing came back in time: the catalogue's first items
  (fill, the last resort).

Admission control is ``auto``'s, decided when a request arrives (on the event
loop, seeing every request admitted before it): the most accurate policy
whose estimated cost plus the queue ahead of it (at the service it uses)
fits the remaining budget; a request that nothing fits, not even the
drafter's list, is refused at once with RESOURCE_EXHAUSTED.
"""

from __future__ import annotations

import asyncio
import contextvars
import json
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import grpc
import numpy as np
from prometheus_client import Counter, Gauge, Histogram
from prometheus_client.core import CounterMetricFamily, REGISTRY
from pydantic import Field, ValidationError
from pydantic_settings import SettingsConfigDict

from specrec.costs import CostModel
from specrec.policies import POLICIES, Engine, Overloaded, RecRequest, RecResult, SpecMetrics, make_policy
from specrec.policies.auto import AutoPolicy
from specrec.policies.base import fill_to_k
from specrec.policies.metrics import RequestStats
from specrec_rpc.catalogue import CatalogueWatcher, Snapshot
from specrec_rpc.errors import InvalidArgument, ResourceExhausted, handle_errors, require
from specrec_rpc.server import Service, make_channel
from specrec_rpc.settings import ServiceSettings
from specrec_rpc.v1 import common_pb2, drafter_pb2_grpc, recommender_pb2, recommender_pb2_grpc, verifier_pb2_grpc

from specrec_rpc import tracing
from specrec_rpc.replicas import Replicas

from .remote import GRACE_S, BudgetExceeded, DependencyDown, RemoteDrafter, RemoteVerifier
from .requestlog import RequestLog

RECS = Counter("specrec_gateway_recommendations", "Recommend answers by policy asked, policy that served, exit reason "
               "and degradation", ["policy", "served_by", "exit_reason", "degraded"])
STAGE = Histogram("specrec_gateway_stage_seconds", "Time per policy stage", ["policy", "stage"],
                  buckets=(0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.025, 0.03, 0.035, 0.04, 0.05, 0.1))
BUDGET_MISSES = Counter("specrec_gateway_budget_misses", "Answers that took longer than their budget (server side), "
                        "by policy asked", ["policy"])
DEFAULT_BUDGET = Gauge("specrec_gateway_default_budget_seconds", "The budget of a request that gives none")
DEPENDENCY_UP = Gauge("specrec_gateway_dependency_up", "The gateway's view of a dependency: 0 while the verifier's "
                      "breaker is open, the drafter counts as down after a failure, or the item set has not answered "
                      "a catalogue poll for 5 s", ["dependency"])
NEEDS_DRAFTER = {"specgr", "drafter"}


class GatewaySettings(ServiceSettings):
    model_config = SettingsConfigDict(env_prefix="SPECREC_GATEWAY_", extra="ignore")

    port: int = Field(50050, ge=0, le=65535, description="gRPC port")
    metrics_port: int = Field(9100, ge=0, le=65535, description="Prometheus port (0 = off)")
    max_message_mb: int = Field(1, ge=1, le=64, description="largest request accepted (public port), MiB")
    itemset_addr: str = Field("127.0.0.1:50051", description="item-set service address")
    drafter_addr: str = Field("127.0.0.1:50052", description="drafter replicas: 'host:port[,host:port]', "
                              "'dns:name:port' (re-resolved) or 'k8s:namespace/service:port' (EndpointSlices)")
    verifier_addr: str = Field("127.0.0.1:50053", description="verifier replicas, as drafter_addr; a request's calls "
                               "stay on one replica")
    default_policy: str = Field("auto", description="policy when a request names none")
    default_budget_ms: float = Field(30.0, gt=0, le=60_000, description="budget when a request gives none, ms")
    max_budget_ms: float = Field(1000.0, gt=0, le=60_000, description="largest budget accepted, ms")
    max_k: int = Field(1000, ge=1, le=100_000, description="largest list length accepted")
    max_history_items: int = Field(1000, ge=1, le=100_000, description="most history ids accepted per request")
    max_id_length: int = Field(256, ge=1, le=65_536, description="longest item id accepted, characters")
    max_params: int = Field(16, ge=0, le=1000, description="most policy parameters per request")
    max_history: int = Field(20, ge=1, le=10_000, description="history items fed to the model (the model's window)")
    max_batch: int = Field(256, ge=1, le=10_000, description="most requests in one RecommendBatch")
    drafter_mode: str = Field("", description="drafter mode for specgr ('' = the drafter's default)")
    workers: int = Field(16, ge=1, le=1024, description="threads running policy loops")
    reserve_ms: float = Field(6.0, ge=0.0, le=1000.0, description="verifier calls end this long before the deadline "
                              "(or twice the drafter's running cost when more, at most 80% of the budget), so "
                              "the drafter can still answer when the verifier does not")
    reply_margin_ms: float = Field(5.0, ge=0.0, le=1000.0, description="when the caller's gRPC deadline comes before "
                                   "the budget, the answer is planned to leave this long before that deadline")
    breaker_failures: int = Field(3, ge=1, le=1000, description="verifier failures in a row that open the breaker")
    breaker_open_s: float = Field(1.0, gt=0, le=600, description="how long an open breaker sends requests to the drafter")
    policy_defaults: dict[str, dict] = Field(default_factory=dict,
                                             description='per-policy default parameters, e.g. {"specgr": {"gamma": -1.0}}')
    log_sample_rate: float = Field(0.0, ge=0.0, le=1.0, description="share of answers that went as asked logged "
                                   "as one line each (event `request`); degraded, shed and failed requests always are")


class SpecCollector:
    """Exports the core library's spec-decode counters to Prometheus (counters only;
    rates are PromQL, e.g. accepted_items / draft_items)."""

    def __init__(self, metrics: SpecMetrics):
        self.m = metrics

    def collect(self):
        snap = self.m.snapshot()
        fams = {k: CounterMetricFamily(f"specrec_spec_{k}", h, labels=["policy"]) for k, h in (
            ("draft_rounds", "Draft rounds"), ("draft_items", "Drafted candidate items"),
            ("accepted_items", "Accepted candidate items"), ("verifier_calls", "Verifier calls"),
            ("fallback_steps", "Level-wise beam steps the drafts did not cover"))}
        tokens = CounterMetricFamily("specrec_spec_draft_tokens", "Drafted SID tokens by position", labels=["policy", "position"])
        accepted = CounterMetricFamily("specrec_spec_accepted_tokens", "Accepted SID tokens by position",
                                       labels=["policy", "position"])
        for p, v in snap.items():
            for k, fam in fams.items():
                fam.add_metric([p], v[k])
            for j, n in v["draft_tokens_by_position"].items():
                tokens.add_metric([p, str(j)], n)
            for j, n in v["accepted_tokens_by_position"].items():
                accepted.add_metric([p, str(j)], n)
        yield from fams.values()
        yield tokens
        yield accepted


class Breaker:
    """Verifier circuit breaker: ``failures`` in a row open it for ``open_s``;
    then one request at a time probes (half-open) until one succeeds."""

    def __init__(self, failures: int, open_s: float):
        self.failures, self.open_s = failures, open_s
        self.count, self.until, self.probing = 0, 0.0, 0.0  # probing: when the half-open probe started (0: none)
        self.lock = threading.Lock()

    def is_open(self) -> bool:
        """Open or half-open (no state change: for callers that will not report a result)."""
        with self.lock:
            return self.count >= self.failures

    def allow(self) -> bool:
        with self.lock:
            if self.count < self.failures:
                return True
            now = time.monotonic()
            # a probe that never reported (its request ended otherwise) stops blocking after open_s
            if now < self.until or (self.probing and now - self.probing < self.open_s):
                return False
            self.probing = now
            return True

    def settle(self) -> None:
        """The request ended without a verdict on the verifier (e.g. a budget too small): a probe may go again."""
        with self.lock:
            self.probing = 0.0

    def result(self, ok: bool) -> None:
        with self.lock:
            self.probing = 0.0
            if ok:
                self.count = 0
            else:
                self.count += 1
                if self.count >= self.failures:
                    self.until = time.monotonic() + self.open_s


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
        self.costs = CostModel()  # what every policy's stages and requests cost, shared by every request's engine
        self.breaker = Breaker(settings.breaker_failures, settings.breaker_open_s)
        self.pending = {"verifier": 0, "drafter": 0}  # admitted requests not finished, by the service they use
        self._pending_lock = threading.Lock()
        self.cost_s = {"verifier": 0.004, "drafter": 0.002}  # running mean time of a request, by service
        self.drafter_down_until = 0.0  # after the drafter failed: no time is kept back for it until then
        self.requests_log = RequestLog(self.log, settings.log_sample_rate)
        DEFAULT_BUDGET.set(settings.default_budget_ms / 1000.0)

    async def start(self) -> None:
        s = self.s
        self.itemset_channel = make_channel(s.itemset_addr, s, aio=True)
        self.catalogue = CatalogueWatcher(self.itemset_channel)
        await self.catalogue.start()
        # blocking channels (policies run in worker threads), one per replica
        self.verifiers = Replicas(s.verifier_addr, verifier_pb2_grpc.VerifierStub, self.client_channel)
        self.drafters = Replicas(s.drafter_addr, drafter_pb2_grpc.DrafterStub, self.client_channel)
        try:
            REGISTRY.register(self._collector)
        except ValueError:
            pass  # already registered in this process
        DEPENDENCY_UP.labels("verifier").set_function(lambda: 0.0 if self.breaker.is_open() else 1.0)
        DEPENDENCY_UP.labels("drafter").set_function(lambda: 0.0 if self.drafter_down() else 1.0)
        DEPENDENCY_UP.labels("itemset").set_function(
            lambda: 1.0 if time.monotonic() - self.catalogue.last_ok < 5.0 else 0.0)
        await self._warmup()

    async def _warmup(self) -> None:
        """Every policy auto may pick, a few times: connections up, cost estimates seeded (not fatal)."""
        snap = self.catalogue.current
        rows = np.nonzero(snap.itemset.active)[0]
        rng = np.random.default_rng(0)
        loop = asyncio.get_running_loop()
        for policy in ("beam", "strict", "nezha", "drafter", "specgr"):
            for _ in range(3):
                hist = rng.choice(rows, size=min(len(rows), 5))
                deadline = time.monotonic() + 1.0
                try:
                    run = self.admit(policy, hist, 10, deadline, snap)
                    res = await loop.run_in_executor(self.pool, self.run_policy, run, {}, hist, 10, deadline, snap)
                except Exception as e:  # pragma: no cover - logged, not fatal
                    self.log.warning("warm-up failed", policy=policy, error=str(e))
                    break
            self.log.info("warm-up", policy=policy, served_by=res.served_by, degraded=res.degraded)

    def client_channel(self, address: str) -> grpc.Channel:
        return make_channel(address, self.s)

    async def stop(self) -> None:
        await self.catalogue.stop()
        await self.itemset_channel.close()
        self.pool.shutdown(wait=True)
        self.verifiers.close()
        self.drafters.close()
        try:
            REGISTRY.unregister(self._collector)
        except KeyError:
            pass

    def add_to_server(self, server) -> None:
        recommender_pb2_grpc.add_RecommenderServicer_to_server(Servicer(self), server)

    # -- admission and the policy loop ------------------------------------------------------
    def queue_wait(self, policy: str = "") -> float:
        """Expected wait (s) before a new request's first call is served: the requests admitted
        ahead of it that use the same service (the drafter for ``drafter``, else the verifier),
        at that service's running mean cost per request."""
        if policy == "drafter":
            return max(0, self.pending["drafter"] - 1) * self.cost_s["drafter"]
        return max(0, self.pending["verifier"] - 1) * self.cost_s["verifier"]

    def engine(self, snap: Snapshot, deadline: float | None, verifier_deadline: float | None, rid: str = "") -> Engine:
        md = tracing.metadata(rid)
        return Engine(
            verifier=RemoteVerifier(self.verifiers, snap, verifier_deadline, snap.level_sizes, md),
            itemset=snap.itemset, max_history=self.s.max_history,
            drafter=RemoteDrafter(self.drafters, snap, deadline, self.s.drafter_mode, md),
            clock=time.monotonic, metrics=self.metrics, online=self.online, load=self.queue_wait, costs=self.costs,
        )

    def admit(self, name: str, rows: np.ndarray, k: int, deadline: float, snap: Snapshot) -> str:
        """On arrival (event loop): the policy to run (``auto`` picks one now, seeing every request
        admitted before it) and its resource counted as busy; Overloaded when nothing fits."""
        if name == "auto":
            eng = self.engine(snap, deadline, deadline)
            name = AutoPolicy(eng, online=eng.learned("auto")).choose(RecRequest(rows, k, deadline))
        with self._pending_lock:
            self.pending["drafter" if name == "drafter" else "verifier"] += 1
        return name

    def run_policy(self, name: str, params: dict, rows: np.ndarray, k: int, deadline: float | None,
                   snap: Snapshot, rid: str = "", asked: str = "") -> RecResult:
        """In a worker thread: ``name`` (already admitted) answers, or a fallback does."""
        t0 = time.monotonic()
        resource = "drafter" if name == "drafter" else "verifier"
        try:
            res = self._answer(name, params, rows, k, deadline, snap, rid)
        finally:
            with self._pending_lock:
                self.pending[resource] -= 1
        total = time.monotonic() - t0
        res.stats.stage_ms["total"] = total * 1000.0
        if res.served_by == name and not res.degraded:
            self.learn_cost(resource, total)
        for stage, ms in res.stats.stage_ms.items():
            STAGE.labels(asked or name, stage).observe(ms / 1000.0)
        return res

    def _answer(self, name: str, params: dict, rows: np.ndarray, k: int, deadline: float | None,
                snap: Snapshot, rid: str = "") -> RecResult:
        req = RecRequest(rows, k, deadline)
        reserve = 0.0 if deadline is None else self.reserve_s(deadline - time.monotonic())
        # the verifier's calls end (their grace included) when the reserve starts
        vdeadline = None if deadline is None else deadline - reserve - GRACE_S
        eng = self.engine(snap, deadline, vdeadline, rid)
        if deadline is not None and deadline - time.monotonic() < GRACE_S:  # no dependency call can come back in time
            return self._catalogue_only(eng, req, "no time left for any call")
        if name != "drafter" and not self.breaker.allow():
            return self._fallback(eng, req, "verifier", "verifier breaker open (recent failures)")
        try:
            res = make_policy(name, eng, **params).run([req])[0]
            self.breaker.result(True)
            return res
        except DependencyDown as e:
            self.log.warning("dependency down", which=e.which, error=str(e))
            if e.which == "verifier":
                self.breaker.result(False)
            else:
                self.breaker.settle()
                if e.unreachable:
                    self.drafter_failed()
            return self._fallback(eng, req, e.which, str(e))
        except BudgetExceeded as e:
            # a budget too small is not a fault of the service: the breaker is left as it is
            self.breaker.settle()
            if e.which == "drafter":  # the budget is spent: no time for a verifier answer either
                return self._catalogue_only(eng, req, f"drafter did not answer in time ({e})")
            return self._fallback(eng, req, "verifier", f"verifier did not answer in time ({e})")

    def learn_cost(self, resource: str, seconds: float) -> None:
        """One answer's time into ``resource``'s running mean cost per request (admission, auto, reserve)."""
        self.cost_s[resource] = 0.9 * self.cost_s[resource] + 0.1 * seconds

    def drafter_failed(self) -> None:
        """A drafter call failed as unavailable: the drafter counts as down for ``breaker_open_s``."""
        self.drafter_down_until = time.monotonic() + self.s.breaker_open_s

    def drafter_down(self) -> bool:
        return time.monotonic() < self.drafter_down_until

    def reserve_s(self, left_s: float) -> float:
        """Time kept back from the verifier's calls for the drafter's answer: reserve_ms, or twice the
        drafter's running cost (fallback calls included: they are the ones made under pressure) when that
        is more, at most 80% of what is left;
        none while the drafter is down (for ``breaker_open_s`` after it failed): the verifier gets it all."""
        if self.drafter_down():
            return 0.0
        want = max(self.s.reserve_ms / 1000.0, 2.0 * self.cost_s["drafter"])
        return min(want, 0.8 * max(left_s, 0.0))

    def _fallback(self, eng: Engine, req: RecRequest, down: str, why: str) -> RecResult:
        """The best answer still available without ``down``; catalogue fill when none."""
        order = ["drafter"] if down == "verifier" else ["beam", "nezha"]
        reasons = [why]
        for name in order:
            if down == "drafter" and self.breaker.is_open():
                break
            if name == "drafter" and self.drafter_down():
                reasons.append("drafter down (recent failure)")
                break
            try:
                if name != "drafter":
                    eng.verifier.deadline = None if req.deadline is None else req.deadline.at
                t0 = time.monotonic()
                res = make_policy(name, eng).run([req])[0]
                if name == "drafter":  # the drafter's own time: what the next requests keep back for it
                    self.learn_cost("drafter", time.monotonic() - t0)
                res.degraded = f"{down} unavailable: {name} answered ({why})"
                return res
            except (DependencyDown, BudgetExceeded) as e:
                if isinstance(e, DependencyDown) and e.which == "drafter" and e.unreachable:
                    self.drafter_failed()
                reasons.append(str(e))
        return self._catalogue_only(eng, req, "; ".join(reasons))

    @staticmethod
    def _catalogue_only(eng: Engine, req: RecRequest, why: str) -> RecResult:
        items, scores, sources = fill_to_k(req.k, eng.itemset, [], [], [])
        res = RecResult(np.asarray(items, np.int64), np.asarray(scores), sources, RequestStats(exit_reason="degraded"),
                        served_by="fill")
        res.degraded = f"catalogue fill: {why}"
        return res


class Servicer(recommender_pb2_grpc.RecommenderServicer):
    def __init__(self, svc: GatewayService):
        self.svc = svc

    def _validate(self, r, prefix: str = ""):
        s, svc = self.svc.s, self.svc
        f = lambda name: f"{prefix}{name}"  # noqa: E731
        require(len(r.history) > 0, f("history"), "empty: send at least one item id")
        require(len(r.history) <= s.max_history_items, f("history"), f"at most {s.max_history_items} item ids")
        require(all(len(i) <= s.max_id_length for i in r.history), f("history"),
                f"item ids are at most {s.max_id_length} characters")
        require(len(r.user_id) <= s.max_id_length, f("user_id"), f"at most {s.max_id_length} characters")
        k = r.k
        require(1 <= k <= s.max_k, f("k"), f"must be 1..{s.max_k}, got {r.k}")
        require(r.budget_ms >= 0, f("budget_ms"), f"must not be negative, got {r.budget_ms}")
        require(r.budget_ms <= s.max_budget_ms, f("budget_ms"), f"at most {s.max_budget_ms}")
        policy = r.policy or s.default_policy
        if policy not in POLICIES:
            raise InvalidArgument(f("policy"), f"unknown policy {policy!r} (known: {', '.join(sorted(POLICIES))})")
        require(len(r.params) <= s.max_params, f("params"), f"at most {s.max_params} parameters")
        params = dict(s.policy_defaults.get(policy, {}))
        for key, raw in r.params.items():
            require(len(key) <= 64 and len(raw) <= 1024, f(f"params[{key[:64]}]"), "name or value too long")
            try:
                params[key] = json.loads(raw)
            except json.JSONDecodeError:
                params[key] = raw
        try:
            POLICIES[policy].Config(**params)
        except ValidationError as e:
            err = e.errors()[0]
            loc = ".".join(str(x) for x in err["loc"]) or "?"
            raise InvalidArgument(f("params." + loc), err["msg"]) from None
        snap = svc.catalogue.current
        known = [(i, snap.index.get(i)) for i in r.history]
        ignored = [i for i, x in known if x is None or not snap.itemset.active[x]]
        rows = np.asarray([x for _, x in known if x is not None and snap.itemset.active[x]], dtype=np.int64)
        require(len(rows) > 0, f("history"), f"none of the {len(r.history)} item ids is in catalogue version {snap.version}")
        budget = r.budget_ms or s.default_budget_ms
        return policy, params, rows, min(k, len(snap.itemset)), budget, snap, ignored

    def _response(self, policy: str, res: RecResult, snap: Snapshot, t0: float) -> recommender_pb2.RecommendResponse:
        it = snap.itemset
        items = [recommender_pb2.RecommendedItem(
            item_id=snap.ids[r], sid=common_pb2.Sid(codes=it.sids[r].tolist()),
            score=float(sc), title=snap.titles[r], unseen=not bool(it.seen[r]), source=src)
            for r, sc, src in zip(res.items.tolist(), res.scores.tolist(), res.sources)]
        st = res.stats
        degraded = res.degraded
        RECS.labels(policy, res.served_by, st.exit_reason or "", str(bool(degraded)).lower()).inc()
        stats = recommender_pb2.RecommendStats(
            policy=policy, served_by=res.served_by, rounds=st.rounds, drafted=st.draft_items, accepted=st.accepted_items,
            draft_tokens=st.draft_tokens, accepted_tokens=st.accepted_tokens, verifier_calls=st.verifier_calls,
            encoder_calls=st.encoder_calls, exit_reason=st.exit_reason, stage_ms={k: float(v) for k, v in st.stage_ms.items()},
            catalogue_version=snap.version, degraded=bool(degraded), degraded_reason=degraded,
            total_ms=(time.monotonic() - t0) * 1000.0)
        return recommender_pb2.RecommendResponse(items=items, stats=stats)

    def caller_deadline(self, context) -> float | None:
        """The caller's gRPC deadline (time.monotonic()), less the reply margin; None when it set none."""
        left = context.time_remaining()
        return None if left is None else time.monotonic() + left - self.svc.s.reply_margin_ms / 1000.0

    async def _recommend(self, r, prefix: str = "", rid: str = "",
                         caller_deadline: float | None = None) -> recommender_pb2.RecommendResponse:
        """One request, and its log line when it was degraded, shed or failed (requestlog.py)."""
        t0 = time.monotonic()
        method = "RecommendBatch" if prefix else "Recommend"
        try:
            resp = await self._serve(r, t0, prefix, rid, caller_deadline)
        except BaseException as e:
            self.svc.requests_log.refused(r, rid, e, t0, method)
            raise
        self.svc.requests_log.answered(r, resp, rid, method)
        return resp

    async def _serve(self, r, t0: float, prefix: str, rid: str,
                     caller_deadline: float | None) -> recommender_pb2.RecommendResponse:
        policy, params, rows, k, budget_ms, snap, ignored = self._validate(r, prefix)
        # the budget, or the caller's own deadline when that comes first (the time the request waited in
        # the server before this handler ran is then spent already, and an answer after it is never read)
        deadline = t0 + budget_ms / 1000.0
        if caller_deadline is not None:
            deadline = min(deadline, caller_deadline)
        try:
            run = self.svc.admit(policy, rows, k, deadline, snap)
        except Overloaded as e:
            raise ResourceExhausted(f"overloaded: {e}") from None
        # the worker thread runs in a copy of this context: the trace span (and log bindings) follow the request
        ctx = contextvars.copy_context()
        res = await asyncio.get_running_loop().run_in_executor(
            self.svc.pool, ctx.run, self.svc.run_policy, run, params if run == policy else {}, rows, k, deadline, snap,
            rid, policy)
        resp = self._response(policy, res, snap, t0)
        resp.stats.request_id = rid
        resp.stats.ignored_history.extend(ignored)
        if resp.stats.total_ms > budget_ms:
            BUDGET_MISSES.labels(policy).inc()
        return resp

    @handle_errors
    async def Recommend(self, request, context):
        return await self._recommend(request, rid=tracing.request_id_of(context), caller_deadline=self.caller_deadline(context))

    @handle_errors
    async def RecommendBatch(self, request, context):
        rid, caller_deadline = tracing.request_id_of(context), self.caller_deadline(context)
        require(1 <= len(request.requests) <= self.svc.s.max_batch, "requests", f"1..{self.svc.s.max_batch} requests")

        async def one(i, r):
            try:
                return recommender_pb2.RecommendResult(response=await self._recommend(r, f"requests[{i}].", f"{rid}-{i}",
                                                                                      caller_deadline))
            except InvalidArgument as e:
                return recommender_pb2.RecommendResult(error_code=grpc.StatusCode.INVALID_ARGUMENT.value[0], error_message=str(e))
            except ResourceExhausted as e:
                return recommender_pb2.RecommendResult(error_code=grpc.StatusCode.RESOURCE_EXHAUSTED.value[0],
                                                       error_message=str(e))
            except Exception:
                self.svc.log.exception("batch item failed", index=i)
                return recommender_pb2.RecommendResult(error_code=grpc.StatusCode.INTERNAL.value[0],
                                                       error_message="internal error (see the gateway's log)")

        extra = len(request.requests) - 1  # the RPC holds one slot; every further item counts too
        if not self.svc.admission.try_take(extra):
            e = ResourceExhausted(f"overloaded: {self.svc.admission.inflight} requests in flight, "
                                  f"{len(request.requests)} more asked")
            self.svc.log.warning("request", outcome="shed", request_id=rid, method="RecommendBatch",
                                 code="RESOURCE_EXHAUSTED", reason=str(e), requests=len(request.requests))
            raise e
        try:
            results = await asyncio.gather(*(one(i, r) for i, r in enumerate(request.requests)))
        finally:
            self.svc.admission.release(extra)
        return recommender_pb2.RecommendBatchResponse(results=results)
