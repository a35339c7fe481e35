"""Probe a service's standard gRPC health service (``grpc.health.v1.Health``).

    python -m specrec_rpc.healthcheck 127.0.0.1:50051 [--service NAME] [--timeout 3]

Exit 0 only when the answer is SERVING; 1 when the service answers anything
else (NOT_SERVING while a model loads or during shutdown, SERVICE_UNKNOWN);
2 when it cannot be reached or does not answer in time. One line goes to
stdout (exit 0) or stderr (otherwise). Used by the Docker/Compose
healthchecks; Kubernetes uses its native gRPC probes instead.
"""

from __future__ import annotations

import argparse
import sys

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc


def check(target: str, service: str = "", timeout_s: float = 3.0) -> tuple[int, str]:
    """(exit code, message) for one health check of ``service`` at ``target``."""
    try:
        with grpc.insecure_channel(target) as channel:
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
    a = ap.parse_args(argv)
    rc, msg = check(a.target, a.service, a.timeout)
    print(msg, file=sys.stdout if rc == 0 else sys.stderr)
    return rc


if __name__ == "__main__":
    sys.exit(main())
