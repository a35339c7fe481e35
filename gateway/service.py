"""The gateway: Recommend over gRPC.

Validates the request, pins one catalogue version, and runs the chosen
policy (the core library's loop) in a worker thread against gRPC-backed
verifier and drafter adapters, with the remaining budget as every downstream
call's deadline. When a dependency is down it degrades instead of failing:

- verifier down: the drafter's list (``drafter-only``);
- drafter down, policy needs it: ``beam``-only;
- both down, or out of budget before anything came back: items of the
  catalogue in SID order (``catalogue-only``).

Degraded answers say so in ``stats.degraded`` / ``degraded_reason``.
"""

from __future__ import annotations

import asyncio
import json
import time
from concurrent.futures import ThreadPoolExecutor

import grpc
import numpy as np
from prometheus_client import Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, REGISTRY
from pydantic import Field, ValidationError
from pydantic_settings import SettingsConfigDict

from specrec.drafters.base import DraftRequest
from specrec.policies import POLICIES, Engine, RecRequest, RecResult, SpecMetrics, make_policy
from specrec.policies.base import Budget, fill_to_k
from specrec.policies.metrics import RequestStats
from specrec_rpc.catalogue import CatalogueWatcher, Snapshot
from specrec_rpc.errors import InvalidArgument, handle_errors, require
from specrec_rpc.server import Service, channel_options
from specrec_rpc.settings import ServiceSettings
from specrec_rpc.v1 import common_pb2, drafter_pb2_grpc, recommender_pb2, recommender_pb2_grpc, verifier_pb2_grpc

from .remote import BudgetExceeded, DependencyDown, RemoteDrafter, RemoteVerifier

RECS = Counter("specrec_gateway_recommendations", "Recommend answers by policy, exit reason and degradation",
               ["policy", "exit_reason", "degraded"])
STAGE = Histogram("specrec_gateway_stage_seconds", "Time per policy stage", ["policy", "stage"],
                  buckets=(0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.03, 0.05, 0.1))
NEEDS_DRAFTER = {"specgr"}


class GatewaySettings(ServiceSettings):
    model_config = SettingsConfigDict(env_prefix="SPECREC_GATEWAY_", extra="ignore")

    port: int = Field(50050, description="gRPC port")
    metrics_port: int = Field(9100, description="Prometheus port (0 = off)")
    itemset_addr: str = Field("127.0.0.1:50051", description="item-set service address")
    drafter_addr: str = Field("127.0.0.1:50052", description="drafter service address")
    verifier_addr: str = Field("127.0.0.1:50053", description="verifier service address")
    default_policy: str = Field("specgr", description="policy when a request names none")
    default_budget_ms: float = Field(30.0, description="budget when a request gives none, ms")
    max_budget_ms: float = Field(10_000.0, description="largest budget accepted, ms")
    max_k: int = Field(1000, description="largest list length accepted")
    max_history_items: int = Field(1000, description="most history ids accepted per request")
    max_history: int = Field(20, description="history items fed to the model (the model's window)")
    max_batch: int = Field(256, description="most requests in one RecommendBatch")
    drafter_mode: str = Field("", description="drafter mode for specgr ('' = the drafter's default)")
    workers: int = Field(32, description="threads running policy loops")
    policy_defaults: dict[str, dict] = Field(default_factory=dict,
                                             description='per-policy default parameters, e.g. {"specgr": {"gamma": -1.0}}')


class SpecCollector:
    """Exports the core library's spec-decode counters to Prometheus."""

    def __init__(self, metrics: SpecMetrics):
        self.m = metrics

    def collect(self):
        snap = self.m.snapshot()
        fams = {
            "drafts": CounterMetricFamily("specrec_spec_drafts", "Draft rounds", labels=["policy"]),
            "draft_items": CounterMetricFamily("specrec_spec_draft_items", "Drafted candidate items", labels=["policy"]),
            "accepted_items": CounterMetricFamily("specrec_spec_accepted_items", "Accepted candidate items", labels=["policy"]),
            "draft_tokens": CounterMetricFamily("specrec_spec_draft_tokens", "Drafted SID tokens", labels=["policy"]),
            "accepted_tokens": CounterMetricFamily("specrec_spec_accepted_tokens", "Accepted SID tokens", labels=["policy"]),
            "verifier_calls": CounterMetricFamily("specrec_spec_verifier_calls", "Verifier calls", labels=["policy"]),
        }
        rate = GaugeMetricFamily("specrec_spec_acceptance_rate", "Accepted / drafted (tokens where counted, else items)",
                                 labels=["policy"])
        by_pos = CounterMetricFamily("specrec_spec_accepted_by_position", "Accepted tokens by SID level",
                                     labels=["policy", "position"])
        by_round = CounterMetricFamily("specrec_spec_accepted_by_round", "Accepted items by draft round",
                                       labels=["policy", "round"])
        for p, v in snap.items():
            for k, fam in fams.items():
                fam.add_metric([p], v[k])
            if v["acceptance_rate"] == v["acceptance_rate"]:
                rate.add_metric([p], v["acceptance_rate"])
            for j, n in v["accepted_by_position"].items():
                by_pos.add_metric([p, str(j)], n)
            for r, n in v["accepted_by_round"].items():
                by_round.add_metric([p, str(r)], n)
        yield from fams.values()
        yield rate
        yield by_pos
        yield by_round


class GatewayService(Service):
    name = "gateway"
    grpc_services = ("specrec.v1.Recommender",)

    def __init__(self, settings: GatewaySettings):
        super().__init__(settings)
        self.s = settings
        self.metrics = SpecMetrics()
        self.pool = ThreadPoolExecutor(max_workers=settings.workers, thread_name_prefix="policy")
        self._collector = SpecCollector(self.metrics)
        # round-cost estimates persist across requests (a policy object lives for one request)
        self.budgets: dict[str, Budget] = {}

    async def start(self) -> None:
        s = self.s
        opts = channel_options(s)
        self.itemset_channel = grpc.aio.insecure_channel(s.itemset_addr, options=opts)
        self.catalogue = CatalogueWatcher(self.itemset_channel)
        await self.catalogue.start()
        # blocking channels: policies run in worker threads
        self.verifier = verifier_pb2_grpc.VerifierStub(grpc.insecure_channel(s.verifier_addr, options=opts))
        self.drafter = drafter_pb2_grpc.DrafterStub(grpc.insecure_channel(s.drafter_addr, options=opts))
        try:
            REGISTRY.register(self._collector)
        except ValueError:
            pass  # already registered in this process
        # warm up every path that is reachable (dependencies may still be starting: not fatal)
        snap = self.catalogue.current
        rows = np.nonzero(snap.itemset.active)[0][:3]
        for policy in ("beam", "specgr"):
            try:
                res = await asyncio.get_running_loop().run_in_executor(
                    self.pool, self.run_policy, policy, {}, rows, 10, None, snap)
                self.log.info("warm-up", policy=policy, exit=res.stats.exit_reason, degraded=res.degraded)
            except Exception as e:  # pragma: no cover - logged, not fatal
                self.log.warning("warm-up failed", policy=policy, error=str(e))

    async def stop(self) -> None:
        await self.catalogue.stop()
        await self.itemset_channel.close()
        self.pool.shutdown(wait=True)
        try:
            REGISTRY.unregister(self._collector)
        except KeyError:
            pass

    def add_to_server(self, server) -> None:
        recommender_pb2_grpc.add_RecommenderServicer_to_server(Servicer(self), server)

    # -- the policy loop, in a worker thread ---------------------------------------------
    def engine(self, snap: Snapshot, deadline: float | None) -> Engine:
        L = snap.level_sizes
        return Engine(
            verifier=RemoteVerifier(self.verifier, snap, deadline, L),
            itemset=snap.itemset, max_history=self.s.max_history,
            drafter=RemoteDrafter(self.drafter, snap, deadline, self.s.drafter_mode),
            clock=time.monotonic, metrics=self.metrics,
        )

    def run_policy(self, name: str, params: dict, rows: np.ndarray, k: int, deadline: float | None, snap: Snapshot) -> RecResult:
        eng = self.engine(snap, deadline)
        req = RecRequest(rows, k, deadline)
        t0 = time.monotonic()
        try:
            pol = make_policy(name, eng, **params)
            pol.budget = self.budgets.setdefault(name, Budget(time.monotonic))
            res = pol.run([req])[0]
        except DependencyDown as e:
            res = self._degraded(name, params, eng, req, e)
        except BudgetExceeded:
            res = self._catalogue_only(eng, req, "budget", "out of budget before any list came back")
        res.stats.stage_ms["total"] = (time.monotonic() - t0) * 1000.0
        for stage, ms in res.stats.stage_ms.items():
            STAGE.labels(name, stage).observe(ms / 1000.0)
        return res

    def _degraded(self, name, params, eng: Engine, req: RecRequest, err: DependencyDown) -> RecResult:
        self.log.warning("dependency down", which=err.which, error=str(err))
        if err.which == "verifier":
            try:
                d = eng.drafter.draft([DraftRequest(req.history, req.k)])[0]
                st = RequestStats(exit_reason="degraded", drafted=len(d.items))
                items, scores, sources = fill_to_k(req.k, eng.itemset, d.items.tolist(), d.scores.tolist(),
                                                   ["draft"] * len(d.items))
                res = RecResult(np.asarray(items, np.int64), np.asarray(scores), sources, st)
                res.degraded = f"verifier unavailable: drafter-only ({err})"
                return res
            except (DependencyDown, BudgetExceeded) as e2:
                return self._catalogue_only(eng, req, "degraded", f"verifier and drafter unavailable ({err}; {e2})")
        # the drafter is down: the verifier alone (beam search)
        try:
            res = make_policy("beam", eng).run([req])[0]
            res.degraded = f"drafter unavailable: beam-only ({err})"
            return res
        except (DependencyDown, BudgetExceeded) as e2:
            return self._catalogue_only(eng, req, "degraded", f"verifier and drafter unavailable ({err}; {e2})")

    @staticmethod
    def _catalogue_only(eng: Engine, req: RecRequest, reason: str, why: str) -> RecResult:
        items, scores, sources = fill_to_k(req.k, eng.itemset, [], [], [])
        res = RecResult(np.asarray(items, np.int64), np.asarray(scores), sources, RequestStats(exit_reason=reason))
        res.degraded = f"catalogue-only: {why}"
        return res


class Servicer(recommender_pb2_grpc.RecommenderServicer):
    def __init__(self, svc: GatewayService):
        self.svc = svc

    def _validate(self, r, prefix: str = ""):
        s, svc = self.svc.s, self.svc
        f = lambda name: f"{prefix}{name}"  # noqa: E731
        require(len(r.history) > 0, f("history"), "empty: send at least one item id")
        require(len(r.history) <= s.max_history_items, f("history"), f"at most {s.max_history_items} item ids")
        k = r.k
        require(1 <= k <= s.max_k, f("k"), f"must be 1..{s.max_k}, got {r.k}")
        require(r.budget_ms >= 0, f("budget_ms"), f"must not be negative, got {r.budget_ms}")
        require(r.budget_ms <= s.max_budget_ms, f("budget_ms"), f"at most {s.max_budget_ms}")
        policy = r.policy or s.default_policy
        if policy not in POLICIES:
            raise InvalidArgument(f("policy"), f"unknown policy {policy!r} (known: {', '.join(sorted(POLICIES))})")
        params = dict(s.policy_defaults.get(policy, {}))
        for key, raw in r.params.items():
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
        rows = [snap.index[i] for i in r.history if i in snap.index]
        rows = np.asarray([x for x in rows if snap.itemset.active[x]], dtype=np.int64)
        require(len(rows) > 0, f("history"), f"none of the {len(r.history)} item ids is in catalogue version {snap.version}")
        budget = r.budget_ms or s.default_budget_ms
        return policy, params, rows, min(k, len(snap.itemset)), budget, snap

    def _response(self, policy: str, res: RecResult, snap: Snapshot, t0: float) -> recommender_pb2.RecommendResponse:
        it = snap.itemset
        items = [recommender_pb2.RecommendedItem(
            item_id=snap.ids[r], sid=common_pb2.Sid(codes=it.sids[r].tolist()),
            score=float(sc), title=snap.titles[r], unseen=not bool(it.seen[r]), source=src)
            for r, sc, src in zip(res.items.tolist(), res.scores.tolist(), res.sources)]
        st = res.stats
        degraded = res.degraded
        RECS.labels(policy, st.exit_reason or "", str(bool(degraded)).lower()).inc()
        stats = recommender_pb2.RecommendStats(
            policy=policy, rounds=st.rounds, drafted=st.drafted, accepted=st.accepted, verifier_calls=st.verifier_calls,
            encoder_calls=st.encoder_calls, exit_reason=st.exit_reason, stage_ms={k: float(v) for k, v in st.stage_ms.items()},
            catalogue_version=snap.version, degraded=bool(degraded), degraded_reason=degraded,
            total_ms=(time.monotonic() - t0) * 1000.0)
        return recommender_pb2.RecommendResponse(items=items, stats=stats)

    async def _recommend(self, r, prefix: str = "") -> recommender_pb2.RecommendResponse:
        t0 = time.monotonic()
        policy, params, rows, k, budget_ms, snap = self._validate(r, prefix)
        deadline = t0 + budget_ms / 1000.0
        res = await asyncio.get_running_loop().run_in_executor(
            self.svc.pool, self.svc.run_policy, policy, params, rows, k, deadline, snap)
        return self._response(policy, res, snap, t0)

    @handle_errors
    async def Recommend(self, request, context):
        return await self._recommend(request)

    @handle_errors
    async def RecommendBatch(self, request, context):
        require(1 <= len(request.requests) <= self.svc.s.max_batch, "requests", f"1..{self.svc.s.max_batch} requests")

        async def one(i, r):
            try:
                return recommender_pb2.RecommendResult(response=await self._recommend(r, f"requests[{i}]."))
            except InvalidArgument as e:
                return recommender_pb2.RecommendResult(error_code=grpc.StatusCode.INVALID_ARGUMENT.value[0], error_message=str(e))
            except Exception as e:
                self.svc.log.exception("batch item failed", index=i)
                return recommender_pb2.RecommendResult(error_code=grpc.StatusCode.INTERNAL.value[0], error_message=f"{type(e).__name__}: {e}")

        results = await asyncio.gather(*(one(i, r) for i, r in enumerate(request.requests)))
        return recommender_pb2.RecommendBatchResponse(results=results)
