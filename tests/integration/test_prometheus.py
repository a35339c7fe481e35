"""The Grafana dashboard and the alerting rules against a real Prometheus (Debian's ``prometheus``).

The four services run as processes (``specrec_stack.localstack.ServiceProcs``, as ``specrec stack up`` runs
them), each with its own metrics port; a ``prometheus`` on a free port scrapes them every second, with the
rules file loaded. Traffic covers every kind of answer the dashboard shows: each policy, shed requests
(a budget nothing fits: RESOURCE_EXHAUSTED), catalogue fill and budget misses (a budget no call fits).
Then, through Prometheus' HTTP API:

- every query of every dashboard panel parses and returns data with a finite value;
- every metric named by a dashboard query or an alert is one the services export (one Prometheus scraped);
- every rule was loaded and evaluates without error.

Without a ``prometheus`` binary the test skips locally and fails under ``SPECREC_CI=1`` (.ci/run installs it).
"""

from __future__ import annotations

import json
import math
import re
import shutil
import subprocess
import time
import urllib.parse
import urllib.request
import uuid
from pathlib import Path

import grpc
import numpy as np
import pytest
import yaml

from specrec_rpc.v1 import recommender_pb2, recommender_pb2_grpc
from specrec_stack.localstack import ORDER, ServiceProcs, delete_namespace, free_port

from ..deploy import tools

ROOT = Path(__file__).resolve().parents[2]
DASHBOARD = ROOT / "helm" / "specrec" / "files" / "grafana-dashboard.json"
RULES = ROOT / "helm" / "specrec" / "files" / "prometheus-rules.yaml"
#: Grafana's variables, as a Prometheus query sees them with the dashboard's defaults
VARIABLES = {"$namespace": ".*", "$__rate_interval": "1m"}
KEYWORDS = {"and", "or", "unless", "bool", "offset", "by", "without", "on", "ignoring", "group_left", "group_right",
            "inf", "nan", "atan2"}


def metric_names(expr: str) -> set[str]:
    """The metric names a PromQL expression selects (not functions, aggregations, keywords or labels)."""
    e = re.sub(r'"(?:[^"\\]|\\.)*"', '""', expr)  # strings (label values, label_replace arguments)
    e = re.sub(r"\{[^}]*\}", " ", e)  # label matchers
    e = re.sub(r"\[[^\]]*\]", " ", e)  # ranges
    e = re.sub(r"\b(by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)", " ", e)  # label lists
    names = set()
    for m in re.finditer(r"(?<![\w.$])[A-Za-z_:][A-Za-z0-9_:]*", e):
        if e[m.end():].lstrip().startswith("(") or m.group().lower() in KEYWORDS:
            continue  # a function or an aggregation
        names.add(m.group())
    return names


def test_metric_names_finds_every_selector():
    """The check below can fail: it sees the metrics of a query, and only those."""
    q = (
        'sum by (policy) (rate(specrec_a_total{x="y(z)",namespace=~"$namespace"}[$__rate_interval])) '
        "/ ignoring(policy) "
        'group_left sum(label_replace(rate(specrec_b_total[5m]), "p", "$1", "served_by", "(.*)")) > bool 0.01 '
        "or histogram_quantile(0.99, sum by (le) (rate(nope_seconds_bucket[1m]))) and on (job) up == 0"
    )
    assert metric_names(q) == {"specrec_a_total", "specrec_b_total", "nope_seconds_bucket", "up"}


def dashboard_queries() -> list[tuple[str, str]]:
    d = json.loads(DASHBOARD.read_text())
    out = []
    for p in d["panels"]:
        for t in p.get("targets", []):
            expr = t["expr"]
            for k, v in VARIABLES.items():
                expr = expr.replace(k, v)
            assert "$" not in expr.replace('"$1"', ""), f"{p['title']}: a variable the test does not know: {expr}"
            out.append((f"{p['title']} [{t['refId']}]", expr))
    return out


def alert_exprs() -> list[tuple[str, str]]:
    return [(r["alert"], r["expr"]) for g in yaml.safe_load(RULES.read_text())["groups"] for r in g["rules"]]


class Prometheus:
    def __init__(self, url: str):
        self.url = url

    def get(self, path: str, **params) -> dict:
        q = urllib.parse.urlencode(params)
        with urllib.request.urlopen(f"{self.url}{path}{'?' + q if q else ''}", timeout=30) as r:
            body = json.loads(r.read())
        assert body["status"] == "success", body
        return body["data"]

    def query(self, expr: str) -> list[dict]:
        try:
            data = self.get("/api/v1/query", query=expr)
        except urllib.error.HTTPError as e:  # 400: the query does not parse
            raise AssertionError(f"{expr}: {e.read().decode()}") from None
        return data["result"]


@pytest.fixture(scope="module")
def prometheus_binary() -> str:
    binary = tools.prometheus_tool("prometheus")
    if binary is None:
        tools.missing(f"no prometheus binary: {tools.PROMETHEUS_HINT}")
    return binary


@pytest.fixture(scope="module")
def stack_procs(redis_url, serving_bundle_dir, tmp_path_factory, prometheus_binary):
    ns = f"prom-{uuid.uuid4().hex[:8]}"
    tmp = tmp_path_factory.mktemp("prom-stack")
    procs = ServiceProcs(serving_bundle_dir, redis_url, ns, tmp / "logs", metrics_ports={n: free_port() for n in ORDER},
                         max_history=8, env={"SPECREC_VERIFIER_THREADS": "1", "SPECREC_VERIFIER_WARMUP_K": "[10]"})
    try:
        procs.start(timeout=300, say=lambda _m: None)
        yield procs
    finally:
        procs.stop()
        delete_namespace(redis_url, ns)


@pytest.fixture(scope="module")
def prom(stack_procs, prometheus_binary, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("prometheus")
    port = free_port()
    cfg = {
        "global": {"scrape_interval": "1s", "scrape_timeout": "900ms", "evaluation_interval": "1s"},
        "rule_files": [str(RULES)],
        # the labels a Kubernetes scrape gives (the ServiceMonitor's podTargetLabels, the namespace)
        "scrape_configs": [{"job_name": "specrec", "static_configs": [
            {"targets": [f"127.0.0.1:{stack_procs.metrics_ports[n]}"],
             "labels": {"app_kubernetes_io_component": n, "namespace": "specrec-test"}} for n in ORDER]}],
    }
    (tmp / "prometheus.yml").write_text(yaml.safe_dump(cfg))
    log = open(tmp / "prometheus.log", "w")
    proc = subprocess.Popen([prometheus_binary, f"--config.file={tmp / 'prometheus.yml'}",
                             f"--storage.tsdb.path={tmp / 'data'}", f"--web.listen-address=127.0.0.1:{port}",
                             "--log.level=warn"], stdout=log, stderr=subprocess.STDOUT)
    p = Prometheus(f"http://127.0.0.1:{port}")
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                with urllib.request.urlopen(f"{p.url}/-/ready", timeout=2) as r:
                    if r.status == 200:
                        break
            except OSError:
                pass
            if proc.poll() is not None or time.monotonic() > deadline:
                pytest.fail(f"prometheus did not start: {(tmp / 'prometheus.log').read_text()[-2000:]}")
            time.sleep(0.2)
        yield p
    finally:
        proc.terminate()
        try:
            proc.wait(15)
        except subprocess.TimeoutExpired:
            proc.kill()
        log.close()
        shutil.rmtree(tmp / "data", ignore_errors=True)


def send_traffic(addr: str, ids: list[str], seconds: float = 12.0) -> dict[str, int]:
    """Every kind of answer, interleaved over ``seconds`` so that every rate sees increases."""
    rng = np.random.default_rng(3)
    kinds = [("auto", 500.0), ("beam", 500.0), ("strict", 500.0), ("nezha", 500.0), ("specgr", 500.0),
             ("drafter", 500.0), ("relaxed", 500.0), ("sample", 500.0),
             ("auto", 0.001),  # nothing fits: shed (RESOURCE_EXHAUSTED)
             ("beam", 0.05),  # no call fits: catalogue fill, degraded, a budget miss
             ("drafter", 0.05)]
    counts: dict[str, int] = {}
    with grpc.insecure_channel(addr) as ch:
        stub = recommender_pb2_grpc.RecommenderStub(ch)
        t_end = time.monotonic() + seconds
        while time.monotonic() < t_end:
            for policy, budget in kinds:
                hist = [ids[i] for i in rng.choice(len(ids), size=5, replace=False)] + ["not-an-item"]
                req = recommender_pb2.RecommendRequest(history=hist, k=10, policy=policy, budget_ms=budget)
                try:
                    r = stub.Recommend(req, timeout=10)
                    key = r.stats.served_by + (" degraded" if r.stats.degraded else "")
                except grpc.RpcError as e:
                    key = e.code().name
                counts[key] = counts.get(key, 0) + 1
            time.sleep(0.05)
    return counts


@pytest.fixture(scope="module")
def traffic(prom, stack_procs, serving_bundle):
    # a few scrapes before the traffic: every counter's rate starts from a sample taken before it rose
    time.sleep(3)
    counts = send_traffic(stack_procs.addr("gateway"), serving_bundle.catalogue.ids)
    sent = sum(v for k, v in counts.items() if k != "RESOURCE_EXHAUSTED")
    deadline = time.monotonic() + 30
    while True:  # until a scrape after the last answer
        got = prom.query("sum(specrec_gateway_recommendations_total)")
        if got and float(got[0]["value"][1]) >= sent:
            break
        assert time.monotonic() < deadline, f"Prometheus never saw the {sent} answers: {got} ({counts})"
        time.sleep(0.5)
    time.sleep(2)  # and the rules evaluated on it
    return counts


def test_traffic_covers_every_kind_of_answer(traffic):
    assert traffic.get("RESOURCE_EXHAUSTED", 0) > 0, traffic
    assert traffic.get("fill degraded", 0) > 0, traffic
    assert sum(v for k, v in traffic.items() if k in ("beam", "strict", "nezha", "drafter")) > 0, traffic


@pytest.mark.parametrize("name, expr", dashboard_queries(), ids=[n for n, _ in dashboard_queries()])
def test_dashboard_query_returns_data(prom, traffic, name, expr):
    result = prom.query(expr)
    assert result, f"{name}: no data for {expr}"
    values = [float(r["value"][1]) for r in result]
    assert any(math.isfinite(v) for v in values), f"{name}: only NaN/Inf: {result}"


#: alerts on an event counter: its series exists only after the event (an item set that restored a catalogue)
EVENT_ALERTS = {"SpecRecCatalogueRestored"}


def exported_names(prom: Prometheus) -> set[str]:
    """Metric names the scraped services export: every sampled series, and every family their /metrics
    declares (# TYPE, from Prometheus' metadata API) even before it has a sample (a labelled counter nothing
    has incremented yet), with a histogram's _bucket/_sum/_count."""
    names = set(prom.get("/api/v1/label/__name__/values"))
    # metadata is keyed by family (OpenMetrics: a counter's family has no _total), samples carry suffixes
    suffixes = {"counter": ("_total",), "histogram": ("_bucket", "_sum", "_count"), "summary": ("_sum", "_count"),
                "info": ("_info",)}
    for name, metas in prom.get("/api/v1/metadata").items():
        names.add(name)
        for m in metas:
            names |= {name + x for x in suffixes.get(m["type"], ())}
    return names


def test_every_metric_named_is_exported(prom, traffic):
    """Every metric a dashboard query or an alert selects is one the services export (Prometheus scraped it)."""
    exported = exported_names(prom)
    assert "specrec_itemset_restores_total" in exported  # declared, never incremented: seen through the metadata
    assert "specrec_gateway_recommendation_total" not in exported  # so a typo in a query would be caught here
    named = {n: (where, e) for where, e in [*dashboard_queries(), *alert_exprs()] for n in metric_names(e)}
    assert "specrec_gateway_recommendations_total" in named and "up" in named
    unknown = {n: where for n, (where, _) in named.items() if n not in exported}
    assert not unknown, f"metrics not exported by any service: {unknown}"


def test_every_rule_loads_and_evaluates(prom, traffic):
    groups = prom.get("/api/v1/rules")["groups"]
    rules = {r["name"]: r for g in groups for r in g["rules"]}
    assert set(rules) == {a for a, _ in alert_exprs()}
    for name, r in rules.items():
        assert r["health"] == "ok" and not r.get("lastError"), (name, r.get("lastError"))
        assert r.get("lastEvaluation", "").startswith("20"), (name, r)  # evaluated at least once
    # the ratio alerts' left-hand sides evaluate to data on this traffic (the alert compares them with a threshold)
    for name, expr in alert_exprs():
        lhs = re.split(r"\s(?:>|==)\s", expr.strip())[0]
        assert prom.query(lhs) or name in EVENT_ALERTS, f"{name}: no data for {lhs}"
