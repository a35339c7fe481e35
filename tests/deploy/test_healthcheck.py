"""``python -m specrec_rpc.healthcheck``: the probe of the Compose healthchecks.
Exit 0 only for SERVING, 1 for any other answer, 2 when nothing answers."""

from __future__ import annotations

import socket
import subprocess
import sys
from concurrent import futures

import grpc
import pytest
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from specrec_rpc.healthcheck import check, main


@pytest.fixture()
def health_server():
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    servicer = health.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        yield f"127.0.0.1:{port}", servicer
    finally:
        server.stop(0)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_serving_is_0_anything_else_is_1(health_server, capsys):
    target, servicer = health_server
    servicer.set("", health_pb2.HealthCheckResponse.SERVING)
    assert main([target]) == 0
    assert "SERVING" in capsys.readouterr().out
    servicer.set("", health_pb2.HealthCheckResponse.NOT_SERVING)
    assert main([target]) == 1
    assert "NOT_SERVING" in capsys.readouterr().err
    # a named service: unknown to the server -> not healthy
    servicer.set("specrec.v1.Verifier", health_pb2.HealthCheckResponse.SERVING)
    assert check(target, "specrec.v1.Verifier")[0] == 0
    assert check(target, "specrec.v1.Nope")[0] != 0


def test_dns_scheme_targets(health_server):
    """The Helm chart hands the services dns:///<name>:<port> addresses; gRPC Python resolves them."""
    target, servicer = health_server
    servicer.set("", health_pb2.HealthCheckResponse.SERVING)
    port = target.rsplit(":", 1)[1]
    assert check(f"dns:///localhost:{port}", timeout_s=5.0)[0] == 0


def test_unreachable_is_2():
    rc, msg = check(f"127.0.0.1:{_free_port()}", timeout_s=1.0)
    assert rc == 2 and "UNAVAILABLE" in msg


def test_module_entry_point(health_server):
    target, servicer = health_server
    servicer.set("", health_pb2.HealthCheckResponse.SERVING)
    p = subprocess.run([sys.executable, "-m", "specrec_rpc.healthcheck", target, "--timeout", "5"],
                       capture_output=True, text=True, timeout=60)
    assert p.returncode == 0, p.stderr
    servicer.set("", health_pb2.HealthCheckResponse.NOT_SERVING)
    p = subprocess.run([sys.executable, "-m", "specrec_rpc.healthcheck", target], capture_output=True, text=True,
                       timeout=60)
    assert p.returncode == 1
