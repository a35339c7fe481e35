"""Serving subcommands of the ``specrec`` tool, added through the ``specrec.commands`` entry point
(``register``, declared in ``pyproject.toml``; the core library itself knows nothing of gRPC):

    specrec stack up       start Redis (if needed) and the four services, wait for health, send real requests
    specrec stack down     stop everything ``stack up`` started
    specrec recommend      one ad-hoc Recommend call through the gateway
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import subprocess
import sys
import time
from pathlib import Path

from specrec.bundle import sid_space_fingerprint

from .localstack import PLACEMENTS, ServiceProcs, find_or_start_redis, port_open, stop_pid

ROOT = Path(__file__).resolve().parents[1]
STATE = ROOT / "runs" / "stack"
PORTS = {"itemset": 50051, "drafter": 50052, "verifier": 50053, "gateway": 50050}
METRICS = {"itemset": 9101, "drafter": 9102, "verifier": 9103, "gateway": 9100}
BEAUTY_BUNDLE = ROOT / "bundles" / "beauty-loo"
SYNTH_BUNDLE = ROOT / "runs" / "synthetic-stack" / "bundle"
SYNTH_RECIPE = ROOT / "recipes" / "synthetic-stack.json"


def _say(msg: str) -> None:
    print(f"[stack] {msg}", flush=True)


def _ensure_bundle(a) -> Path:
    if a.bundle:
        return Path(a.bundle)
    if (BEAUTY_BUNDLE / "bundle.json").exists():  # the committed real model (demo histories ship with it)
        return BEAUTY_BUNDLE
    if (SYNTH_BUNDLE / "retrieval.safetensors").exists():
        return SYNTH_BUNDLE
    _say("no committed bundle here: building a small synthetic bundle (specrec build-bundle with "
         f"{SYNTH_RECIPE.relative_to(ROOT)}; a few minutes, once)")
    # the core CLI trains it: serving code never imports training (pyproject [tool.importlinter])
    subprocess.run([sys.executable, "-m", "specrec.cli", "build-bundle", "--data", "synthetic", "--protocol",
                    "temporal", "--out", str(SYNTH_BUNDLE.parent), "--recipe", str(SYNTH_RECIPE)], check=True)
    return SYNTH_BUNDLE


def _start_redis(a) -> tuple[str, int | None]:
    url, proc = find_or_start_redis(a.redis_url, workdir=STATE / "redis", log_path=STATE / "logs" / "redis.log",
                                    port=6390)
    return url, proc.pid if proc else None


def _ensure_graphs(bundle: Path) -> None:
    """The verifier's ONNX graphs, built once beside the bundle (``specrec export-onnx``) when they are not there
    for its weights and this code: the verifier then loads them instead of exporting them at every start."""
    from specrec.bundle import Bundle

    b = Bundle.load(bundle)
    if b.prebuilt_graphs(b.sid_mlp) is not None or not os.access(bundle, os.W_OK):
        return
    _say("building the verifier's graphs once (specrec export-onnx; a few minutes: the precision of its "
         "scoring pass is chosen for this machine on validation users)")
    subprocess.run([sys.executable, "-m", "specrec.cli", "export-onnx", "--bundle", str(bundle)], check=True)


def cmd_up(a) -> int:
    t_start = time.time()
    if (STATE / "pids.json").exists():
        _say("a stack seems to be running (runs/stack/pids.json); stopping it first")
        cmd_down(a)
    (STATE / "logs").mkdir(parents=True, exist_ok=True)
    bundle = _ensure_bundle(a)
    _say(f"bundle: {bundle.relative_to(ROOT) if bundle.is_relative_to(ROOT) else bundle}")
    _ensure_graphs(bundle)
    redis_url, redis_pid = _start_redis(a)
    _say(f"redis: {redis_url}" + (" (started here)" if redis_pid else ""))
    for name, port in PORTS.items():
        if port_open("127.0.0.1", port):
            raise SystemExit(f"port {port} ({name}) is already in use; run `specrec stack down` or free it")
    token = os.environ.get("SPECREC_WRITE_TOKEN") or secrets.token_urlsafe(16)
    pids = {"redis": redis_pid} if redis_pid else {}

    def started(name: str, pid: int) -> None:
        pids[name] = pid
        (STATE / "pids.json").write_text(json.dumps(pids))

    # one namespace per SID space: another bundle's catalogue is never in the way
    namespace = a.namespace or f"specrec-local-{sid_space_fingerprint(bundle)[:8]}"
    _say(f"namespace: {namespace}")
    ServiceProcs(bundle, redis_url, namespace, STATE / "logs", ports=PORTS, metrics_ports=METRICS,
                 token=token, placement=a.placement).start(a.timeout, say=_say, on_started=started)
    (STATE / "token").write_text(token)
    _say(f"all four services SERVING, {time.time() - t_start:.0f} s after start; write token in runs/stack/token")
    _demo(bundle, a.requests, a.budget_ms)
    _say("stop everything with: specrec stack down")
    return 0


def _demo(bundle: Path, n: int, budget_ms: float) -> None:
    from specrec_rpc.client import Client, format_response, timed_recommend

    meta = json.loads((bundle / "bundle.json").read_text())
    items = [json.loads(line) for line in open(bundle / "items.jsonl")]
    ids = [it["item_id"] for it in items]
    titles = {it["item_id"]: it["title"] for it in items}
    histories = _sample_histories(meta, ids, n, bundle)
    with Client() as c:
        for i, hist in enumerate(histories):
            for policy in ("auto", "fused", "beam") if i == 0 else ("auto",):
                resp, ms = timed_recommend(c, hist, k=10, policy=policy, budget_ms=budget_ms)
                print()
                print(format_response(resp, ms, [titles.get(h, h) for h in hist]))
    print()


def _sample_histories(meta: dict, ids: list[str], n: int, bundle: Path | None = None) -> list[list[str]]:
    import numpy as np

    from specrec.bundle import DEMO_HISTORIES, data_path_of

    demo = bundle / DEMO_HISTORIES if bundle is not None else None
    if demo is not None and demo.exists():  # held-out test histories shipped with the bundle
        return [u["history"] for u in json.loads(demo.read_text())["users"][:n]]
    data = data_path_of(meta.get("data_path"), bundle)  # relative to the bundle's directory
    if data and Path(data).is_dir():
        from specrec.data import load_dataset

        ds = load_dataset(data)
        rng = np.random.default_rng(7)
        picks = rng.choice(len(ds.sequences), size=n, replace=False)
        return [[ds.catalogue.ids[x] for x in ds.sequences[u].items[:-1][-20:]] for u in picks]
    rng = np.random.default_rng(7)
    return [list(rng.choice(ids, size=8, replace=False)) for _ in range(n)]


def cmd_down(a) -> int:
    f = STATE / "pids.json"
    if not f.exists():
        _say("nothing to stop")
        return 0
    pids = json.loads(f.read_text())
    for name in ("gateway", "drafter", "verifier", "itemset", "redis"):
        pid = pids.get(name)
        if not pid:
            continue
        if not stop_pid(pid):
            continue
        _say(f"stopped {name} (pid {pid})")
    f.unlink()
    return 0


def cmd_recommend(a) -> int:
    from specrec_rpc.client import Client, format_response, timed_recommend

    params = {}
    for it in a.param or []:
        k, _, v = it.partition("=")
        params[k] = v
    import grpc

    try:
        with Client(a.target, timeout_s=a.timeout) as c:
            resp, ms = timed_recommend(c, a.history.split(","), k=a.k, policy=a.policy, budget_ms=a.budget_ms,
                                       params=params)
    except grpc.RpcError as e:  # the gateway's status, as `STATUS: message` (no traceback)
        code = e.code() if hasattr(e, "code") else grpc.StatusCode.UNKNOWN
        details = e.details() if hasattr(e, "details") else str(e)
        print(f"{code.name}: {details}", file=sys.stderr)
        return 1
    if a.json:
        from google.protobuf.json_format import MessageToJson

        print(MessageToJson(resp))
    else:
        print(format_response(resp, ms))
    return 0


def register(sub: argparse._SubParsersAction) -> None:
    st = sub.add_parser(
        "stack",
        help="run the local stack: Redis + item set, drafter, verifier, gateway",
        description="`up` installs nothing: it prepares a bundle (the Beauty bundle, or a small synthetic "
        "one), starts Redis unless one answers (or REDIS_URL is set), starts the four services as "
        "processes, waits for their health checks and sends real Recommend calls. `down` stops them.",
    )
    st.add_argument("action", choices=["up", "down"])
    st.add_argument("--bundle", help="bundle directory (default: bundles/beauty-loo, else a synthetic one)")
    st.add_argument("--redis-url", default=os.environ.get("REDIS_URL"), help="use this Redis (default: $REDIS_URL)")
    st.add_argument("--namespace", help="Redis key namespace (default: specrec-local-<the bundle's SID-space "
                    "fingerprint>, so that two bundles never share one)")
    st.add_argument("--requests", type=int, default=3, help="demo requests to send after start")
    st.add_argument("--budget-ms", type=float, default=30.0,
                    help="latency budget of the demo requests (the production budget: auto answers with the best list "
                    "that fits, the fused list where it does; a request that cannot finish answers on the budget with "
                    "the best list it holds, flagged)")
    st.add_argument("--timeout", type=float, default=300.0, help="seconds to wait for each service")
    st.add_argument("--placement", choices=PLACEMENTS, default=None,
                    help="shared: every service on every CPU; split: the verifier on the upper half of the CPUs, the "
                    "rest on the lower half (default: $SPECREC_STACK_PLACEMENT, else shared)")
    st.set_defaults(func=lambda a: cmd_up(a) if a.action == "up" else cmd_down(a))

    r = sub.add_parser("recommend", help="one Recommend call through the gateway")
    r.add_argument("--history", required=True, help="comma-separated item ids, oldest first")
    r.add_argument("--k", type=int, default=10)
    r.add_argument(
        "--policy", default="",
        help="auto, fused, beam, specgr, nezha, strict, relaxed, sample or drafter (default: the server's, auto)"
    )
    r.add_argument("--budget-ms", type=float, default=0.0, help="latency budget (0 = the server's default)")
    r.add_argument("--param", action="append", metavar="NAME=VALUE", help="policy parameter (repeatable)")
    r.add_argument("--target", default="127.0.0.1:50050", help="gateway address")
    r.add_argument("--timeout", type=float, default=5.0)
    r.add_argument("--json", action="store_true")
    r.set_defaults(func=cmd_recommend)
