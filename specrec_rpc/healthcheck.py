"""Probe a service's standard gRPC health service (``grpc.health.v1.Health``).

    python -m specrec_rpc.healthcheck 127.0.0.1:50051 [--service NAME] [--timeout 3]

Exit 0 only when the answer is SERVING; 1 when the service answers anything
else (NOT_SERVING while a model loads or during shutdown, SERVICE_UNKNOWN);
2 when it cannot be reached or does not answer in time. One line goes to
stdout (exit 0) or stderr (otherwise). Used by the Docker/Compose
healthchecks, and by the chart's exec probes when TLS is on (kubelet's native
gRPC probes cannot speak TLS): with ``--tls-ca`` (and ``--tls-cert``/``--tls-key``
for mTLS) it dials with TLS, checking the certificate for ``--server-name``.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc


def _channel(target: str, ca: str | None, cert: str | None, key: str | None, server_name: str):
    if not ca:
        return grpc.insecure_channel(target)
    read = lambda p: Path(p).read_bytes() if p else None  # noqa: E731
    creds = grpc.ssl_channel_credentials(read(ca), read(key), read(cert))
    opts = [("grpc.ssl_target_name_override", server_name)] if server_name else []
    return grpc.secure_channel(target, creds, options=opts)


def check(target: str, service: str = "", timeout_s: float = 3.0, ca: str | None = None, cert: str | None = None,
          key: str | None = None, server_name: str = "") -> tuple[int, str]:
    """(exit code, message) for one health check of ``service`` at ``target``."""
    try:
        with _channel(target, ca, cert, key, server_name) as channel:
            stub = health_pb2_grpc.HealthStub(channel)
            resp = stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=timeout_s)
    except grpc.RpcError as e:
        code = e.code()
        name = code.name if code is not None else "UNKNOWN"
        return 2, f"{target}: health check failed: {name}: {e.details()}"
    status = health_pb2.HealthCheckResponse.ServingStatus.Name(resp.status)
    what = f"{target} ({service or 'server'})"
    if resp.status == health_pb2.HealthCheckResponse.SERVING:
        return 0, f"{what}: SERVING"
    return 1, f"{what}: {status}"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("target", nargs="?", default="127.0.0.1:50050", help="host:port (default %(default)s)")
    ap.add_argument("--service", default="", help="service name to check ('' = the whole server, the default)")
    ap.add_argument("--timeout", type=float, default=3.0, help="seconds to wait for the answer (default %(default)s)")
    ap.add_argument("--tls-ca", help="PEM CA bundle: dial with TLS and verify the server with it")
    ap.add_argument("--tls-cert", help="PEM client certificate (mTLS)")
    ap.add_argument("--tls-key", help="PEM client key (mTLS)")
    ap.add_argument("--server-name", default="", help="name expected in the server's certificate")
    a = ap.parse_args(argv)
    rc, msg = check(a.target, a.service, a.timeout, a.tls_ca, a.tls_cert, a.tls_key, a.server_name)
    print(msg, file=sys.stdout if rc == 0 else sys.stderr)
    return rc


if __name__ == "__main__":
    sys.exit(main())
