"""A fake gateway for the bench tests (chaos, overload): a real gRPC server on loopback that answers at
once and observes each answer (12 ms) in a histogram of its own registry, served over HTTP as the
gateway's ``/metrics`` is, with the buckets the gateway's interceptor uses."""

from __future__ import annotations

from collections.abc import Iterator
from concurrent import futures
from contextlib import contextmanager

import grpc
from prometheus_client import CollectorRegistry, start_http_server
from prometheus_client import Histogram as PromHistogram

from specrec_rpc.server import LATENCY_BUCKETS
from specrec_rpc.v1 import recommender_pb2, recommender_pb2_grpc
from specrec_stack.localstack import free_port


class FakeGateway(recommender_pb2_grpc.RecommenderServicer):
    """Answers at once; with ``drafter_every`` = n, every n-th list is the item drafter's, else nezha's."""

    def __init__(self, registry: CollectorRegistry, drafter_every: int = 0):
        self.latency = PromHistogram("specrec_rpc_latency_seconds", "RPC latency", ["service", "method"],
                                     buckets=LATENCY_BUCKETS, registry=registry)
        self.drafter_every = drafter_every
        self.n = 0

    def Recommend(self, request, context):
        self.n += 1
        self.latency.labels("gateway", "Recommend").observe(0.012)
        drafter = self.drafter_every and self.n % self.drafter_every == 0
        return recommender_pb2.RecommendResponse(
            items=[recommender_pb2.RecommendedItem(item_id="x", source="beam")],
            stats=recommender_pb2.RecommendStats(policy=request.policy, total_ms=12.0,
                                                 served_by="drafter" if drafter else "nezha"))


@contextmanager
def fake_gateway(drafter_every: int = 0) -> Iterator[tuple[int, int]]:
    """Serves a :class:`FakeGateway` on loopback; yields its gRPC port and its metrics port."""
    registry = CollectorRegistry()
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
    recommender_pb2_grpc.add_RecommenderServicer_to_server(FakeGateway(registry, drafter_every), server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    mport = free_port()
    http, thread = start_http_server(mport, addr="127.0.0.1", registry=registry)
    try:
        yield port, mport
    finally:
        http.shutdown()
        http.server_close()
        thread.join(5)
        server.stop(None)
