"""docker-compose.yml's stack as users start it, for real: the images built (or reused while their content hash
is unchanged) and the containers answering (docs/containers.md).

``bash scripts/compose.sh up``, the documented command, builds the images with podman (a Python base and Redis
from Debian's packages where no registry image can be pulled: scripts/images.sh), makes the containers with
podman-compose from docker-compose.yml and starts Redis, the catalogue loader and the four services in the
file's order, running each health check until it passes. Then, from this process, over loopback:

- every container as the file says: its health check passed with SERVING, non-root, read-only root; the loader
  done, exit 0;
- ``Recommend`` through the gateway's published port: K items from the catalogue, ``served_by`` set;
- items upserted through the item set's port (published on loopback by tests/deploy/compose.test.yml),
  then recommended through the gateway (with the drafter's unseen share set: 0, the default, drafts none of them);
- ``compose.sh stop``: every service exits 0 on SIGTERM (the entrypoint's exec, the graceful shutdown);
- ``compose.sh down -v`` (the fixture's teardown): no container, volume or network of the project left.

The stack has its own network namespace and its own Redis (not the one on 127.0.0.1:6379); only those two ports
are published, on 127.0.0.1. Skipped without podman and podman-compose, a failure under ``SPECREC_CI=1``
(.ci/run installs them). Cold (nothing cached) and warm times: docs/containers.md.
"""

from __future__ import annotations

import json
import os
import secrets
import socket
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest

from . import tools

ROOT = Path(__file__).resolve().parents[2]
BUNDLE = ROOT / "bundles" / "beauty-loo"
SERVICES = ("itemset", "drafter", "verifier", "gateway")
#: a cold build (the Debian base, the wheels, the image with its ONNX graphs) took ~12 min on 2 shared cores
UP_TIMEOUT_S = 45 * 60


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class Stack:
    project: str
    env: dict[str, str]
    gateway: str
    itemset: str
    token: str
    log: Path
    up_s: float = 0.0

    def compose(self, *args: str, timeout: float = 300) -> subprocess.CompletedProcess:
        # into a file, not a pipe: conmon and aardvark-dns, which stay after the command, would hold a pipe open
        with self.log.open("a") as out:
            out.write(f"\n$ bash scripts/compose.sh {' '.join(args)}\n")
            out.flush()
            return subprocess.run(["bash", "scripts/compose.sh", *args], cwd=ROOT, env=self.env,
                                  stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT, timeout=timeout)

    def podman(self, *args: str) -> subprocess.CompletedProcess:
        return subprocess.run(["podman", *args], env=self.env, capture_output=True, text=True, timeout=120)

    def inspect(self, service: str) -> dict:
        label = f"label=com.docker.compose.project={self.project}"
        names = self.podman("ps", "-a", "--filter", label, "--filter", f"label=com.docker.compose.service={service}",
                            "--format", "{{.Names}}").stdout.split()
        assert len(names) == 1, f"{service}: containers {names}"
        return json.loads(self.podman("inspect", names[0]).stdout)[0]

    def left(self) -> list[str]:
        label = f"label=com.docker.compose.project={self.project}"
        out = [*self.podman("ps", "-a", "-q", "--filter", label).stdout.split(),
               *self.podman("volume", "ls", "-q", "--filter", label).stdout.split()]
        if self.podman("network", "exists", f"{self.project}_default").returncode == 0:
            out.append(f"{self.project}_default")
        return out

    def tail(self, n: int = 60) -> str:
        return "\n".join(self.log.read_text().splitlines()[-n:])


@pytest.fixture(scope="module")
def stack(podman, tmp_path_factory) -> Iterator[Stack]:
    project = f"specrec-test-{os.getpid()}"
    gateway, itemset, token = _free_port(), _free_port(), secrets.token_hex(16)
    env = {**tools.podman_env(),
           "SPECREC_COMPOSE_PROJECT": project,
           "SPECREC_COMPOSE_FILES": "tests/deploy/compose.test.yml",
           "SPECREC_GATEWAY_PORT": f"127.0.0.1:{gateway}",
           "SPECREC_TEST_ITEMSET_PORT": f"127.0.0.1:{itemset}",
           "SPECREC_ITEMSET_WRITE_TOKEN": token,
           "SPECREC_DRAFTER_UNSEEN_SHARE": "0.2"}
    s = Stack(project, env, f"127.0.0.1:{gateway}", f"127.0.0.1:{itemset}", token,
              tmp_path_factory.mktemp("compose") / "compose.log")
    t0 = time.monotonic()
    try:
        p = s.compose("up", timeout=UP_TIMEOUT_S)
        s.up_s = time.monotonic() - t0
        assert p.returncode == 0, f"scripts/compose.sh up failed:\n{s.tail()}"
        print(f"\n[compose] images and stack up in {s.up_s:.0f} s (log: {s.log})")
        yield s
    finally:
        down = s.compose("down", "-v", timeout=300)
        assert down.returncode == 0 and not s.left(), f"left behind: {s.left()}\n{s.tail(20)}"


def test_containers_as_the_file_says(stack):
    loader = stack.inspect("catalogue-loader")
    assert (loader["State"]["Status"], loader["State"]["ExitCode"]) == ("exited", 0), loader["State"]
    for service in ("redis", *SERVICES):
        c = stack.inspect(service)
        assert c["State"]["Status"] == "running", (service, c["State"])
        # the compose file's own check, run once more now, and what it said
        assert stack.podman("healthcheck", "run", c["Name"]).returncode == 0, service
        health = stack.inspect(service)["State"]["Health"]
        assert health["Status"] == "healthy", (service, health)
        if service != "redis":
            assert health["Log"][-1]["Output"].strip().endswith("SERVING"), (service, health["Log"][-1])
            assert c["Config"]["User"] == "10001:10001" and c["HostConfig"]["ReadonlyRootfs"] is True, service


def _catalogue_ids() -> set[str]:
    with (BUNDLE / "items.jsonl").open() as f:
        return {json.loads(line)["item_id"] for line in f}


def test_recommend_through_the_published_gateway(stack):
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    from specrec_rpc.v1 import recommender_pb2, recommender_pb2_grpc

    ids = _catalogue_ids()
    users = json.loads((BUNDLE / "demo_histories.json").read_text())["users"][:3]
    with grpc.insecure_channel(stack.gateway) as ch:
        h = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=30)
        assert h.status == health_pb2.HealthCheckResponse.SERVING
        rec = recommender_pb2_grpc.RecommenderStub(ch)
        for user in users:
            # a generous budget: this asks whether the containers answer, not how fast on a loaded machine
            r = rec.Recommend(recommender_pb2.RecommendRequest(history=user["history"], k=10, budget_ms=1000),
                              timeout=60)
            got = [it.item_id for it in r.items]
            assert len(got) == 10 == len(set(got)) and set(got) <= ids, got
            assert r.stats.served_by and r.stats.catalogue_version and not r.stats.degraded, r.stats
        # the production budget (30 ms): an answer, whoever made it
        r = rec.Recommend(recommender_pb2.RecommendRequest(history=users[0]["history"], k=10), timeout=60)
        assert len(r.items) == 10 and r.stats.served_by, r.stats


def test_upserted_items_are_recommended(stack):
    """New items, upserted through the item set, reach the default policy's list through the gateway: the item set
    gives them SIDs from their texts (its tokenizer, in the image), the gateway, drafter and verifier follow the
    new catalogue version, and the drafter drafts them by text similarity (SPECREC_DRAFTER_UNSEEN_SHARE)."""
    from specrec_rpc.v1 import itemset_pb2, itemset_pb2_grpc, recommender_pb2, recommender_pb2_grpc

    new = {"new-1": "Aurel velvet lipstick, long-wear matte red, 0.5 oz",
           **{f"near-{i}": f"Aurel velvet lipstick, long-wear matte red, shade {i}" for i in range(3)}}
    auth = (("authorization", f"Bearer {stack.token}"),)
    with grpc.insecure_channel(stack.itemset) as ch:
        items = [itemset_pb2.UpsertItem(item_id=i, text=t, title=t) for i, t in new.items()]
        w = itemset_pb2_grpc.ItemSetStub(ch).Upsert(itemset_pb2.UpsertRequest(items=items), metadata=auth, timeout=60)
        assert [it.item_id for it in w.items] == list(new) and all(len(it.sid.codes) == 4 for it in w.items), w
        with pytest.raises(grpc.RpcError) as refused:  # and the token is what lets it write
            itemset_pb2_grpc.ItemSetStub(ch).Upsert(itemset_pb2.UpsertRequest(items=items[:1]), timeout=60)
        assert refused.value.code() == grpc.StatusCode.UNAUTHENTICATED
    # a demo user who then looked at three of the new items
    history = json.loads((BUNDLE / "demo_histories.json").read_text())["users"][0]["history"] + list(new)[1:]
    req = recommender_pb2.RecommendRequest(history=history, k=10, budget_ms=1000)
    t0, last = time.monotonic(), None
    with grpc.insecure_channel(stack.gateway) as ch:
        rec = recommender_pb2_grpc.RecommenderStub(ch)
        while time.monotonic() - t0 < 120:  # the services follow the new version on their own
            last = rec.Recommend(req, timeout=60)
            hit = [it for it in last.items if it.item_id == "new-1"]
            if last.stats.catalogue_version == w.version and hit:
                assert hit[0].unseen and last.stats.served_by and not last.stats.degraded, (hit[0], last.stats)
                return
            time.sleep(0.5)
    pytest.fail(f"new-1 not recommended within 120 s of the upsert (version {w.version}): "
                f"{[(it.item_id, it.unseen) for it in last.items] if last else None}, {last.stats if last else None}")


def test_services_stop_gracefully(stack):
    p = stack.compose("stop", timeout=300)
    assert p.returncode == 0, stack.tail()
    for service in ("redis", *SERVICES):
        c = stack.inspect(service)
        logs = stack.podman("logs", "--tail", "20", c["Name"])
        assert (c["State"]["Status"], c["State"]["ExitCode"]) == ("exited", 0), (
            f"{service}: {c['State']}\n{logs.stdout[-4000:]}{logs.stderr[-4000:]}")
