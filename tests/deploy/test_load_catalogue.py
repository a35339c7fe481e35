"""docker/load_catalogue.py (``specrec-load-catalogue`` in the image): the
catalogue loader of the Compose one-shot service and the Helm hook Job,
against a real Redis and a tiny bundle."""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import socket
import subprocess
import time
import uuid
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _ping(url: str) -> bool:
    import redis

    try:
        r = redis.Redis.from_url(url, socket_timeout=0.5, socket_connect_timeout=0.5)
        try:
            return bool(r.ping())
        finally:
            r.close()
    except Exception:  # noqa: BLE001
        return False


@pytest.fixture(scope="module")
def redis_url(tmp_path_factory):
    url = os.environ.get("SPECREC_TEST_REDIS_URL")
    if url:
        yield url
        return
    binary = shutil.which("redis-server")
    if binary is None:
        pytest.skip("no redis-server binary and no $SPECREC_TEST_REDIS_URL")
    port = _free_port()
    d = tmp_path_factory.mktemp("redis")
    proc = subprocess.Popen([binary, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
                             "--dir", str(d)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"redis://127.0.0.1:{port}/0"
    try:
        for _ in range(100):
            if _ping(url):
                break
            time.sleep(0.05)
        else:
            pytest.fail("redis-server did not start")
        yield url
    finally:
        proc.terminate()
        proc.wait(10)


@pytest.fixture()
def namespace(redis_url):
    import redis

    ns = f"test-loader-{uuid.uuid4().hex[:8]}"
    yield ns
    r = redis.Redis.from_url(redis_url)
    try:
        keys = list(r.scan_iter(match="{" + ns + "}*", count=1000))
        if keys:
            r.unlink(*keys)
    finally:
        r.close()


@pytest.fixture(scope="module")
def bundle(tmp_path_factory) -> Path:
    from specrec.bundle import FORMAT_VERSION

    d = tmp_path_factory.mktemp("bundle")
    (d / "bundle.json").write_text(json.dumps({"format_version": FORMAT_VERSION, "model": {"level_sizes": [4, 4, 2]}}))
    with open(d / "items.jsonl", "w") as fh:
        for i in range(12):
            fh.write(json.dumps({"item_id": f"i{i}", "title": f"item {i}", "text": "", "seen": i < 10,
                                 "sid": [i % 4, (i // 4) % 4, 0]}) + "\n")
    return d


@pytest.fixture(scope="module")
def loader():
    spec = importlib.util.spec_from_file_location("specrec_load_catalogue", ROOT / "docker" / "load_catalogue.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _run(loader, capsys, *args) -> tuple[int, dict | None]:
    rc = loader.main(list(args))
    out = capsys.readouterr().out.strip().splitlines()
    return rc, (json.loads(out[-1]) if out else None)


def test_if_empty_loads_once_then_keeps_the_catalogue(loader, bundle, redis_url, namespace, capsys, monkeypatch):
    monkeypatch.delenv("SPECREC_ITEMSET_REDIS_URL", raising=False)
    common = ["--bundle", str(bundle), "--redis-url", redis_url, "--namespace", namespace, "--no-progress"]
    rc, first = _run(loader, capsys, "--if-empty", *common)
    assert rc == 0 and first["version"] and first.get("loaded", True)
    rc, again = _run(loader, capsys, "--if-empty", *common)
    assert rc == 0 and again == {"namespace": namespace, "version": first["version"], "loaded": False,
                                 "reason": "namespace already holds a catalogue (--if-empty)"}
    # without --if-empty: the bundle is published again as a new current version
    rc, forced = _run(loader, capsys, *common)
    assert rc == 0 and forced["version"] != first["version"]


def test_if_empty_waits_for_the_item_sets_lock(loader, bundle, redis_url, namespace, capsys):
    import redis

    r = redis.Redis.from_url(redis_url)
    try:
        r.set("{" + namespace + "}:loading", "held-by-itemset", px=1500)
    finally:
        r.close()
    t0 = time.monotonic()
    rc, out = _run(loader, capsys, "--if-empty", "--bundle", str(bundle), "--redis-url", redis_url,
                   "--namespace", namespace, "--no-progress")
    assert rc == 0 and out["version"]
    assert time.monotonic() - t0 >= 1.0, "loaded while another process held the loading lock"
    r = redis.Redis.from_url(redis_url)
    try:
        assert r.get("{" + namespace + "}:loading") is None, "lock not released"
    finally:
        r.close()


def test_no_redis_fails_after_the_wait(loader, bundle, capsys):
    t0 = time.monotonic()
    rc = loader.main(["--if-empty", "--wait-redis", "1", "--timeout", "0.5", "--bundle", str(bundle),
                      "--redis-url", f"redis://127.0.0.1:{_free_port()}/0"])
    assert rc == 1 and time.monotonic() - t0 < 30
    assert "error" in capsys.readouterr().err
