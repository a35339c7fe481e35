"""The server bootstrap every SpecRec service uses.

- ``grpc.aio`` server with message-size and keepalive options set on purpose;
- the standard health service: NOT_SERVING until the service's ``start()``
  (model loading and warm-up) has finished, SERVING after, NOT_SERVING again
  from the first moment of shutdown;
- server reflection;
- Prometheus metrics on an HTTP port: requests by method and status code,
  latency histograms by method, in-flight requests;
- an interceptor that sheds load beyond ``max_concurrency``
  (RESOURCE_EXHAUSTED) and turns any unexpected exception into INTERNAL with
  a message, so none reaches a client unhandled;
- structured logs (structlog, JSON by default);
- graceful shutdown on SIGTERM/SIGINT: stop accepting, let in-flight requests
  finish for ``grace_s``, then close the service's resources.
"""

from __future__ import annotations

import asyncio
import logging
import signal
import sys
import time
from typing import Iterable

import grpc
import structlog
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection
from prometheus_client import Counter, Gauge, Histogram, start_http_server

from .settings import ServiceSettings

LATENCY_BUCKETS = (0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.03, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 10.0)


def configure_logging(level: str = "INFO", json_logs: bool = True) -> None:
    logging.basicConfig(format="%(message)s", stream=sys.stderr, level=getattr(logging, level.upper(), logging.INFO))
    processors = [
        structlog.contextvars.merge_contextvars,
        structlog.processors.add_log_level,
        structlog.processors.TimeStamper(fmt="iso"),
        structlog.processors.format_exc_info,
        structlog.processors.JSONRenderer() if json_logs else structlog.dev.ConsoleRenderer(colors=False),
    ]
    structlog.configure(processors=processors, wrapper_class=structlog.make_filtering_bound_logger(
        getattr(logging, level.upper(), logging.INFO)), cache_logger_on_first_use=False)


def channel_options(settings: ServiceSettings) -> list[tuple[str, int]]:
    size = settings.max_message_mb * 1024 * 1024
    return [
        ("grpc.max_send_message_length", size),
        ("grpc.max_receive_message_length", size),
        ("grpc.keepalive_time_ms", settings.keepalive_s * 1000),
        ("grpc.keepalive_timeout_ms", 10_000),
        ("grpc.keepalive_permit_without_calls", 1),
        ("grpc.http2.min_ping_interval_without_data_ms", 5_000),
        ("grpc.http2.max_pings_without_data", 0),
        # a restarted dependency is found again within about a second (client side)
        ("grpc.initial_reconnect_backoff_ms", 100),
        ("grpc.min_reconnect_backoff_ms", 100),
        ("grpc.max_reconnect_backoff_ms", 1000),
    ]


# Process-wide metrics, labelled by service (tests run several services in one process).
RPC_REQUESTS = Counter("specrec_rpc_requests", "RPCs handled, by method and status code", ["service", "method", "code"])
RPC_LATENCY = Histogram("specrec_rpc_latency_seconds", "RPC latency by method", ["service", "method"], buckets=LATENCY_BUCKETS)
RPC_INFLIGHT = Gauge("specrec_rpc_inflight", "RPCs in progress", ["service"])


class RpcMetrics:
    """The RPC metrics of one service."""

    def __init__(self, service: str):
        self.requests, self.latency, self.inflight = RPC_REQUESTS, RPC_LATENCY, RPC_INFLIGHT
        self.service = service


class GuardInterceptor(grpc.aio.ServerInterceptor):
    """Metrics, load shedding and last-resort error mapping for unary RPCs."""

    def __init__(self, metrics: RpcMetrics, max_concurrency: int, log):
        self.m = metrics
        self.max = max_concurrency
        self.inflight = 0
        self.log = log

    async def intercept_service(self, continuation, details):
        handler = await continuation(details)
        if handler is None or handler.unary_unary is None:
            return handler
        inner, method = handler.unary_unary, details.method.rsplit("/", 1)[-1]
        m = self.m
        exempt = details.method.startswith("/grpc.health.")  # probes must answer even when shedding load

        async def guarded(request, context):
            t0 = time.perf_counter()
            code = grpc.StatusCode.OK
            if self.inflight >= self.max and not exempt:
                m.requests.labels(m.service, method, "RESOURCE_EXHAUSTED").inc()
                await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, f"overloaded: {self.inflight} requests in flight")
            self.inflight += 1
            m.inflight.labels(m.service).inc()
            try:
                resp = await inner(request, context)
                code = context.code() or grpc.StatusCode.OK
                return resp
            except grpc.aio.AbortError:
                code = context.code() or grpc.StatusCode.UNKNOWN
                raise
            except asyncio.CancelledError:
                code = grpc.StatusCode.CANCELLED
                raise
            except Exception as exc:  # never let an exception reach the client unhandled
                code = grpc.StatusCode.INTERNAL
                self.log.exception("unhandled error", method=method)
                await context.abort(grpc.StatusCode.INTERNAL, f"internal error in {method}: {type(exc).__name__}: {exc}")
            finally:
                self.inflight -= 1
                m.inflight.labels(m.service).dec()
                m.requests.labels(m.service, method, getattr(code, "name", str(code))).inc()
                m.latency.labels(m.service, method).observe(time.perf_counter() - t0)

        return grpc.unary_unary_rpc_method_handler(
            guarded, request_deserializer=handler.request_deserializer, response_serializer=handler.response_serializer,
        )


class Service:
    """A SpecRec service: subclasses fill in these hooks."""

    name = "service"
    #: fully qualified gRPC service names, for health and reflection
    grpc_services: tuple[str, ...] = ()

    def __init__(self, settings: ServiceSettings):
        self.settings = settings
        self.log = structlog.get_logger(self.name)

    def add_to_server(self, server: grpc.aio.Server) -> None:
        raise NotImplementedError

    async def start(self) -> None:
        """Load models, connect, warm up. The service is SERVING only after this."""

    async def stop(self) -> None:
        """Release resources after in-flight requests have finished."""


class Runner:
    """Runs a :class:`Service`: start, health, shutdown. Usable from tests."""

    def __init__(self, service: Service):
        self.service = service
        self.s = service.settings
        self.health = health.aio.HealthServicer()
        self.server: grpc.aio.Server | None = None
        self.port: int | None = None
        self.metrics = RpcMetrics(service.name)
        self._stopping: asyncio.Event | None = None

    async def _set_all(self, status) -> None:
        for name in ("", *self.service.grpc_services):
            await self.health.set(name, status)

    async def start(self) -> int:
        s, svc = self.s, self.service
        self._stopping = asyncio.Event()
        self.server = grpc.aio.server(
            options=channel_options(s),
            interceptors=[GuardInterceptor(self.metrics, s.max_concurrency, svc.log)],
        )
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.server)
        await self._set_all(health_pb2.HealthCheckResponse.NOT_SERVING)
        svc.add_to_server(self.server)
        reflection.enable_server_reflection(
            (*svc.grpc_services, health_pb2.DESCRIPTOR.services_by_name["Health"].full_name, reflection.SERVICE_NAME),
            self.server,
        )
        self.port = self.server.add_insecure_port(f"{s.host}:{s.port}")
        await self.server.start()
        svc.log.info("listening", port=self.port, service=svc.name)
        t0 = time.perf_counter()
        await svc.start()
        await self._set_all(health_pb2.HealthCheckResponse.SERVING)
        svc.log.info("serving", warmup_s=round(time.perf_counter() - t0, 2))
        return self.port

    async def stop(self, grace: float | None = None) -> None:
        if self.server is None:
            return
        svc = self.service
        await self._set_all(health_pb2.HealthCheckResponse.NOT_SERVING)
        svc.log.info("shutting down", grace_s=self.s.grace_s if grace is None else grace)
        await self.server.stop(self.s.grace_s if grace is None else grace)
        await svc.stop()
        self.server = None
        if self._stopping is not None:
            self._stopping.set()

    async def run_forever(self) -> None:
        loop = asyncio.get_running_loop()
        await self.start()
        stop = asyncio.Event()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        await stop.wait()
        await self.stop()


def main(service_cls, settings_cls, argv: Iterable[str] | None = None) -> None:
    """Entry point of a service process: settings from env + flags, metrics, run."""
    settings = settings_cls.from_args(list(sys.argv[1:] if argv is None else argv))
    configure_logging(settings.log_level, settings.log_json)
    if settings.metrics_port:
        start_http_server(settings.metrics_port)
    asyncio.run(Runner(service_cls(settings)).run_forever())
