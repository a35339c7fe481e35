"""Replica discovery from the Kubernetes API, against a small fake API server
that speaks the real EndpointSlice JSON (list, then a streamed watch). Not run
against a live cluster here."""

from __future__ import annotations

import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import parse_qs, urlsplit

import pytest

from specrec_rpc.endpoints import EndpointSliceWatcher, ready_addresses


def endpoint_slice(name: str, ips_ready: dict[str, bool], port: int = 50053, version: str = "1") -> dict:
    return {
        "apiVersion": "discovery.k8s.io/v1", "kind": "EndpointSlice", "addressType": "IPv4",
        "metadata": {"name": name, "namespace": "specrec", "resourceVersion": version,
                     "labels": {"kubernetes.io/service-name": "specrec-verifier"}},
        "ports": [{"name": "grpc", "port": port, "protocol": "TCP"}],
        "endpoints": [{"addresses": [ip], "conditions": {"ready": ok, "serving": ok, "terminating": not ok}}
                      for ip, ok in ips_ready.items()],
    }


class FakeApi:
    """GET .../endpointslices: the list; with watch=true: the queued events, streamed one JSON per line."""

    def __init__(self, initial: list[dict]):
        self.items = initial
        self.events: list[dict] = []
        self.cond = threading.Condition()
        self.requests: list[str] = []
        api = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"  # chunked transfer (the watch stream) is HTTP/1.1

            def log_message(self, *a):
                pass

            def do_GET(self):
                api.requests.append(self.path)
                if "/apis/discovery.k8s.io/v1/namespaces/specrec/endpointslices" not in self.path:
                    self.send_error(404)
                    return
                query = parse_qs(urlsplit(self.path).query)
                if query.get("labelSelector") != ["kubernetes.io/service-name=specrec-verifier"]:
                    self.send_error(400, "wrong label selector")
                    return
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                if "watch=true" not in self.path:
                    body = json.dumps({"apiVersion": "discovery.k8s.io/v1", "kind": "EndpointSliceList",
                                       "metadata": {"resourceVersion": "1"}, "items": api.items}).encode()
                    self.send_header("Content-Length", str(len(body)))
                    self.end_headers()
                    self.wfile.write(body)
                    return
                self.send_header("Transfer-Encoding", "chunked")
                self.end_headers()
                sent = 0
                deadline = time.monotonic() + 5
                while time.monotonic() < deadline:
                    with api.cond:
                        api.cond.wait(0.1)
                        pending = api.events[sent:]
                    for ev in pending:
                        line = (json.dumps(ev) + "\n").encode()
                        self.wfile.write(f"{len(line):x}\r\n".encode() + line + b"\r\n")
                        self.wfile.flush()
                        sent += 1
                self.wfile.write(b"0\r\n\r\n")

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"

    def push(self, kind: str, obj: dict) -> None:
        with self.cond:
            self.events.append({"type": kind, "object": obj})
            self.cond.notify_all()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


def test_ready_addresses_skip_endpoints_that_are_not_ready():
    slices = {"a": endpoint_slice("a", {"10.0.0.1": True, "10.0.0.2": False}),
              "b": endpoint_slice("b", {"10.0.0.3": True})}
    assert ready_addresses(slices, 50053) == ["10.0.0.1:50053", "10.0.0.3:50053"]
    assert ready_addresses(slices, "grpc") == ["10.0.0.1:50053", "10.0.0.3:50053"]  # by port name


def test_watcher_follows_endpoints_as_pods_come_and_go():
    from kubernetes import client

    api = FakeApi([endpoint_slice("s1", {"10.0.0.1": True, "10.0.0.2": True})])
    seen: list[list[str]] = []
    cfg = client.Configuration()
    cfg.host = api.url
    w = EndpointSliceWatcher(client.ApiClient(cfg), "specrec", "specrec-verifier", 50053, seen.append, retry_s=0.1)
    w.start()

    def wait_for(addresses, timeout=5.0):
        t0 = time.monotonic()
        while not seen or seen[-1] != addresses:
            assert time.monotonic() - t0 < timeout, (addresses, seen)
            time.sleep(0.02)

    try:
        wait_for(["10.0.0.1:50053", "10.0.0.2:50053"])
        # a new pod becomes ready; another stops being ready (terminating)
        api.push("MODIFIED", endpoint_slice("s1", {"10.0.0.1": True, "10.0.0.2": False, "10.0.0.4": True}, version="2"))
        wait_for(["10.0.0.1:50053", "10.0.0.4:50053"])
        # a second slice appears, then the first is deleted
        api.push("ADDED", endpoint_slice("s2", {"10.0.0.9": True}, version="3"))
        wait_for(["10.0.0.1:50053", "10.0.0.4:50053", "10.0.0.9:50053"])
        api.push("DELETED", endpoint_slice("s1", {}, version="4"))
        wait_for(["10.0.0.9:50053"])
    finally:
        w.stop()
        api.close()


def test_replicas_from_a_static_list_pick_the_less_busy():
    import grpc

    from specrec_rpc.replicas import NoReplica, Replicas

    r = Replicas("127.0.0.1:1,127.0.0.1:2", lambda ch: ch, lambda a: grpc.insecure_channel(a))
    try:
        a, b = r.replicas.values()
        with a, a:  # two outstanding on a
            assert all(r.pick() is b for _ in range(20))
        assert r.pick(exclude={"127.0.0.1:2"}) is a
        with pytest.raises(NoReplica):
            r.pick(exclude={"127.0.0.1:1", "127.0.0.1:2"})
        assert {r.next().address for _ in range(4)} == {"127.0.0.1:1", "127.0.0.1:2"}
    finally:
        r.close()


def _health_server(port: int = 0):
    """A real gRPC server on loopback that answers its health check SERVING -> (server, port)."""
    from concurrent import futures

    import grpc
    from grpc_health.v1 import health, health_pb2_grpc

    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    health_pb2_grpc.add_HealthServicer_to_server(health.HealthServicer(), server)
    port = server.add_insecure_port(f"127.0.0.1:{port}")
    server.start()
    return server, port


def test_an_unreachable_replica_leaves_rotation_and_comes_back_when_it_serves():
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    from specrec_rpc.replicas import Replicas

    up, a_port = _health_server()
    down, b_port = _health_server()
    a_addr, b_addr = f"127.0.0.1:{a_port}", f"127.0.0.1:{b_port}"
    r = Replicas(f"{a_addr},{b_addr}", health_pb2_grpc.HealthStub, grpc.insecure_channel, probe_s=0.1)
    back = None
    try:
        a, b = r.replicas[a_addr], r.replicas[b_addr]
        down.stop(None).wait()
        with pytest.raises(grpc.RpcError) as e:  # a call finds it gone
            b.stub.Check(health_pb2.HealthCheckRequest(service=""), timeout=1.0)
        assert e.value.code() == grpc.StatusCode.UNAVAILABLE
        r.eject(b, "UNAVAILABLE")
        assert r.ejected() == [b_addr]
        # the dead replica has nothing outstanding, the live one is busy: it is still never chosen
        with a, a, a:
            assert all(r.pick() is a for _ in range(50))
            assert all(r.next() is a for _ in range(10))
        # a retry that must not land on the live one again gets the ejected one rather than no replica at all
        assert r.next(exclude={a_addr}) is b and r.pick(exclude={a_addr}) is b
        time.sleep(0.5)
        assert r.ejected() == [b_addr]  # its probes fail while it is down
        back, _ = _health_server(b_port)  # it serves again on its address
        deadline = time.monotonic() + 10.0
        while r.ejected() and time.monotonic() < deadline:
            time.sleep(0.05)
        assert r.ejected() == []
        assert {r.next().address for _ in range(4)} == {a_addr, b_addr}
    finally:
        r.close()
        up.stop(None)
        if back is not None:
            back.stop(None)
