"""The Helm chart's Deployments of the four services, rendered by helm and started by podman (``podman kube play``):
the pods run as the chart says and every probe it declares passes (docs/containers.md, "Helm chart").

The chart is rendered with helm/specrec/ci/minimal-values.yaml, the local image and an external Redis, plus, through
the chart's own ``extraEnv``, what podman 4.3 cannot give a pod:

- no Services and no cluster DNS: the services' addresses are the pods' names on a podman network;
- ``secretKeyRef``: kube play 4.3 stores a Secret it reads back as JSON and fails ("secret rel-specrec is not valid
  JSON"): the Redis URL and the write token as plain values;
- no StatefulSet: Redis is a container beside the pods (the compose stack's image).

Then: the item-set pod first (it loads the bundle's catalogue into the empty Redis), the others once the name podman
gave it is known; each container runs as uid 10001 on a read-only root with the chart's memory limit; each gRPC
probe of the manifest (startup, readiness, liveness: their port, gateway's on its separate health port) run as the
kubelet would (podman 4.3 ignores gRPC probes: no health check is made from them) until it says SERVING within the
startup probe's budget; a Recommend through the gateway pod answered with ``served_by`` set; ``kube play --down``.

What stays with schema validation and tests/deploy/test_deploy.py: Services, NetworkPolicies, PDBs, HPAs, the
ServiceMonitor, RBAC, the loader Job, the helm-test Pod, the Redis StatefulSet, probe timing (podman runs none of
them), emptyDir size limits (podman makes plain volumes). Skipped without podman, a failure under SPECREC_CI=1.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import time
from pathlib import Path

import yaml

from . import tools
from .test_deploy import CHART, ROOT, container, env_of, named

VALUES = [CHART / "ci" / "minimal-values.yaml"]
PORTS = {"itemset": 50051, "drafter": 50052, "verifier": 50053, "gateway": 50050}
UNITS = {"Ki": 1 << 10, "Mi": 1 << 20, "Gi": 1 << 30}


def _run(cmd: list[str], env: dict, timeout: float = 300, **kw) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout, stdin=subprocess.DEVNULL,
                          **kw)


def _render(helm: str, extra: dict) -> list[dict]:
    sets = [a for f in VALUES for a in ("-f", str(f))]
    p = subprocess.run([helm, "template", "rel", str(CHART), "--namespace", "specrec-kube", *sets, "-f", "-"],
                       input=yaml.safe_dump(extra), capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr
    return [d for d in yaml.safe_load_all(p.stdout) if d]


def _env(pairs: dict[str, str]) -> list[dict]:
    return [{"name": k, "value": v} for k, v in pairs.items()]


def test_chart_deployments_under_podman_kube_play(podman, helm, tmp_path):
    env = tools.podman_env()
    log = tmp_path / "images.log"
    with log.open("w") as out:  # the images the compose test built, reused (or built: docs/containers.md)
        p = subprocess.run(["bash", "scripts/images.sh"], cwd=ROOT, env=env, stdin=subprocess.DEVNULL, stdout=out,
                           stderr=subprocess.STDOUT, timeout=45 * 60)
    assert p.returncode == 0, log.read_text()[-4000:]
    images = dict(line.split("=", 1) for line in (ROOT / "runs" / "images.env").read_text().split())
    repo, _, tag = images["SPECREC_IMAGE"].rpartition(":")
    net = f"specrec-kube-{os.getpid()}"
    redis = f"{net}-redis"
    token = "kube-play-token"
    url = f"redis://{redis}:6379/0"
    base = {"image": {"repository": repo if "/" in repo else f"localhost/{repo}", "tag": tag, "pullPolicy": "Never"},
            "redis": {"external": {"url": url}},
            "itemset": {"extraEnv": _env({"SPECREC_ITEMSET_REDIS_URL": url, "SPECREC_ITEMSET_WRITE_TOKEN": token})}}
    played: list[Path] = []
    try:
        assert _run(["podman", "network", "create", net], env).returncode == 0
        r = _run(["podman", "run", "-d", "--name", redis, "--network", net,
                  images.get("SPECREC_REDIS_IMAGE", "docker.io/library/redis:7.4.2-alpine"), "redis-server"], env)
        assert r.returncode == 0, r.stderr

        def play(docs: list[dict], name: str) -> None:
            f = tmp_path / name
            f.write_text(yaml.safe_dump_all(docs))
            played.append(f)
            r = _run(["podman", "kube", "play", "--network", net, str(f)], env)
            assert r.returncode == 0, r.stderr

        def pod_of(deployment: str) -> str:
            pods = _run(["podman", "pod", "ps", "--format", "{{.Name}}"], env).stdout.split()
            found = [p for p in pods if p.startswith(f"{deployment}-pod")]
            assert len(found) == 1, (deployment, pods)
            return found[0]

        docs = _render(helm, base)
        play([named(docs, "Deployment", "itemset")], "itemset.yaml")
        itemset = named(docs, "Deployment", "itemset")["metadata"]["name"]
        suffix = pod_of(itemset)[len(itemset):]  # podman 4.3: "-pod-0"
        addr = {c: f"{named(docs, 'Deployment', c)['metadata']['name']}{suffix}:{port}" for c, port in PORTS.items()}
        docs = _render(helm, {**base,
                              "drafter": {"extraEnv": _env({"SPECREC_DRAFTER_ITEMSET_ADDR": addr["itemset"]})},
                              "verifier": {"extraEnv": _env({"SPECREC_VERIFIER_ITEMSET_ADDR": addr["itemset"]})},
                              "gateway": {"extraEnv": _env({"SPECREC_GATEWAY_ITEMSET_ADDR": addr["itemset"],
                                                            "SPECREC_GATEWAY_DRAFTER_ADDR": addr["drafter"],
                                                            "SPECREC_GATEWAY_VERIFIER_ADDR": addr["verifier"]})}})
        play([named(docs, "Deployment", c) for c in ("drafter", "verifier", "gateway")], "services.yaml")

        for comp in PORTS:
            dep = named(docs, "Deployment", comp)
            c = container(dep)
            pod = pod_of(dep["metadata"]["name"])
            name = f"{pod}-{c['name']}"
            info = json.loads(_run(["podman", "inspect", name], env).stdout)[0]
            sec = c["securityContext"]
            assert info["Config"]["User"] == f"{sec['runAsUser']}:{sec['runAsGroup']}", (comp, info["Config"]["User"])
            assert info["HostConfig"]["ReadonlyRootfs"] is sec["readOnlyRootFilesystem"] is True, comp
            n, unit = re.fullmatch(r"(\d+)(\w+)", c["resources"]["limits"]["memory"]).groups()
            assert info["HostConfig"]["Memory"] == int(n) * UNITS[unit], comp
            assert env_of(c).get(f"SPECREC_{comp.upper()}_PORT") == str(PORTS[comp])
            # the probes, as the kubelet runs a gRPC probe (the standard health service, service ""), within the
            # startup probe's budget
            start = c["startupProbe"]
            deadline = time.monotonic() + start["failureThreshold"] * start["periodSeconds"]
            for kind in ("startupProbe", "readinessProbe", "livenessProbe"):
                probe = c[kind]
                assert set(probe["grpc"]) == {"port"}, (comp, kind, probe)
                cmd = ["podman", "exec", name, "python", "-m", "specrec_rpc.healthcheck",
                       f"127.0.0.1:{probe['grpc']['port']}", "--timeout", str(probe["timeoutSeconds"])]
                while (h := _run(cmd, env, timeout=60)).returncode != 0:
                    logs = _run(["podman", "logs", "--tail", "20", name], env)
                    assert time.monotonic() < deadline, (
                        f"{comp} {kind}: {h.stdout}{h.stderr}\n{logs.stdout}{logs.stderr}")
                    time.sleep(2)
                assert h.stdout.strip().endswith("SERVING"), (comp, kind, h.stdout)

        gateway = f"{pod_of(named(docs, 'Deployment', 'gateway')['metadata']['name'])}-gateway"
        users = json.loads((ROOT / "bundles" / "beauty-loo" / "demo_histories.json").read_text())["users"]
        r = _run(["podman", "exec", gateway, "specrec", "recommend", "--target", "127.0.0.1:50050", "--json",
                  "--history", ",".join(users[0]["history"]), "--k", "10", "--budget-ms", "1000"], env)
        assert r.returncode == 0, r.stderr
        answer = json.loads(r.stdout)
        assert len(answer["items"]) == 10 and answer["stats"]["servedBy"], answer["stats"]
    finally:
        for f in reversed(played):
            _run(["podman", "kube", "play", "--down", str(f)], env)
        _run(["podman", "rm", "-f", "-v", redis], env)
        _run(["podman", "network", "rm", net], env)
    left = _run(["podman", "pod", "ps", "-q", "--filter", "name=rel-specrec"], env).stdout.split()
    assert not left, left
