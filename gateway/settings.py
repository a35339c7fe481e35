"""The gateway's settings (environment ``SPECREC_GATEWAY_*``; documented by ``scripts/settings_doc.py``)."""

from __future__ import annotations

from typing import Annotated

from pydantic import Field
from pydantic_settings import SettingsConfigDict

from specrec_rpc.processes import Processes
from specrec_rpc.settings import ServiceSettings


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
    drafter_mode: str = Field("", description="item drafter mode for fused, specgr and drafter ('' = the drafter's "
                              "default: sasrec where the bundle has a fusion)")
    workers: int = Field(16, ge=1, le=1024, description="threads running policy loops (every policy but those "
                         "fast_path serves on the event loop)")
    fast_path: bool = Field(True, description="serve fused and drafter, the lists auto serves most, on the event "
                            "loop with asyncio stubs (no worker thread, no blocking call); off: in worker threads "
                            "like every other policy (gateway/fastpath.py)")
    processes: Processes = Field(0, ge=0, le=1024, description="gateway processes sharing the port (each with its "
                                 "own event loop and threads; the kernel spreads connections over them); 0 or "
                                 "'auto': one per 4 usable cores (affinity, capped by the cgroup's CPU quota), at "
                                 "least one (specrec_rpc/processes.py)")
    cut_early: bool = Field(True, description="fire the deadline's cut early by how late the event loop runs (the "
                            "tail of how late it took up the answers its workers finished, plus a cut's own time), and "
                            "plan auto's tiers to end before it: on a busy machine answers still leave by the deadline")
    reserve_ms: float = Field(6.0, ge=0.0, le=1000.0, description="verifier calls end this long before the deadline "
                              "(or twice the drafter's mean request time when more, plus the tail of the wait "
                              "behind the requests queued at the drafter; at most 80% of the budget), so the drafter "
                              "can still answer when the verifier does not")
    cost_quantile: float = Field(0.99, ge=0.5, lt=1.0, description="the quantile every learned cost is tracked at "
                                 "(each policy's request time per K, its stages, each service's time per request, "
                                 "the queue's time between completions): auto admits a tier only if this tail of its "
                                 "time fits (a stage's budget check and the drafter's reserve read the window's "
                                 "mean). 0.99: the p99 the latency SLO is on; 0.999 needs a window of 1000 or "
                                 "more to be more than the window's maximum, and such a window forgets an old "
                                 "machine 5x slower")
    cost_window: int = Field(200, ge=10, le=100_000, description="observations each cost's tail is taken over (the "
                             "last ones only, so it follows a machine that slows down: a 2x slowdown moves a p99 of "
                             "200 within 3 observations, and the old machine is forgotten after 200). 200 holds a "
                             "p99's tail twice over (two outliers barely move it); fewer observations than 1/(1 - "
                             "cost_quantile) read as a normal fitted robustly to them (median, absolute deviation)")
    respond_ms: float = Field(1.5, ge=0.0, le=1000.0, description="time kept at the end of the budget to build and "
                              "send the answer: the request's deadline, its downstream calls and the cut that answers "
                              "a request still running (the catalogue's fill, exit_reason budget) come this long "
                              "before the budget ends")
    reply_margin_ms: float = Field(5.0, ge=0.0, le=1000.0, description="when the caller's gRPC deadline comes before "
                                   "the budget, the answer is planned to leave this long before that deadline")
    backends_wait_s: float = Field(120.0, ge=0.0, le=3600.0, description="at start, how long the gateway waits for "
                                   "every verifier and drafter replica to be SERVING before it plans and warms up "
                                   "with those that are (so it can start beside them)")
    warmup_requests: int = Field(10, ge=0, le=1000, description="at start, after one cold request of every policy "
                                 "auto may pick (connections, first calls; forgotten), this many measured requests "
                                 "of each through the real verifier and drafter, before the health check says "
                                 "SERVING: auto's cost estimates for the first requests are their tails. 0: none "
                                 "measured, auto tries each tier on live requests first")
    warmup_k: list[Annotated[int, Field(ge=1, le=100_000)]] = Field(
        [10], min_length=1, description="list lengths K the warm-up measures every policy at (a K not measured reads "
        "the policy's tail across every K until a request of it ran)")
    breaker_failures: int = Field(3, ge=1, le=1000, description="verifier failures in a row that open the breaker")
    breaker_open_s: float = Field(
        1.0, gt=0, le=600, description="how long an open breaker sends requests to the drafter"
    )
    policy_defaults: dict[str, dict] = Field(
        default_factory=dict, description='per-policy default parameters, e.g. {"specgr": {"gamma": -1.0}}'
    )
    log_sample_rate: float = Field(0.0, ge=0.0, le=1.0, description="share of answers that went as asked logged "
                                   "as one line each (event `request`); degraded, shed and failed requests always are")
