"""The local Sentinel's command line, and a sentinel that dies at start reported at once with its log."""

from __future__ import annotations

import shutil
import time

import pytest

from specrec_stack import localsentinel
from specrec_stack.localsentinel import LocalSentinel, sentinel_command


def _which(present: set[str]):
    return lambda name: f"/usr/bin/{name}" if name in present else None


def test_redis_sentinel_is_preferred(monkeypatch):
    monkeypatch.setattr(localsentinel.shutil, "which", _which({"redis-sentinel", "redis-server"}))
    assert sentinel_command("/t/s.conf") == ["/usr/bin/redis-sentinel", "/t/s.conf"]


def test_the_redis_server_fallback_puts_the_config_file_first(monkeypatch):
    """``redis-server --sentinel <conf>`` is read as the config line ``sentinel "<conf>"`` and refused."""
    monkeypatch.setattr(localsentinel.shutil, "which", _which({"redis-server"}))
    assert sentinel_command("/t/s.conf") == ["/usr/bin/redis-server", "/t/s.conf", "--sentinel"]


def test_no_redis_no_sentinel(monkeypatch):
    monkeypatch.setattr(localsentinel.shutil, "which", _which(set()))
    assert sentinel_command("/t/s.conf") is None
    assert not localsentinel.sentinel_available()


@pytest.mark.skipif(shutil.which("redis-server") is None, reason="needs redis-server")
def test_a_sentinel_that_exits_at_start_is_reported_at_once_with_its_log(tmp_path, monkeypatch):
    server = shutil.which("redis-server")
    # the order the fallback used to have: Redis refuses it and exits
    monkeypatch.setattr(localsentinel, "sentinel_command", lambda conf: [server, "--sentinel", str(conf)])
    t0 = time.monotonic()
    with pytest.raises(RuntimeError, match=r"exited at start.*sentinel") as err:
        LocalSentinel(tmp_path / "rs", replicas=0, sentinels=1).start()
    assert time.monotonic() - t0 < 10, "found by the poll's timeout, not by the process's exit"
    assert "log" in str(err.value)


@pytest.mark.skipif(shutil.which("redis-server") is None, reason="needs redis-server")
def test_sentinels_start_from_what_is_installed(tmp_path):
    rs = LocalSentinel(tmp_path / "rs", replicas=1, sentinels=3).start()
    try:
        assert rs.primary_port() == rs.data_ports[0]
    finally:
        rs.stop()
