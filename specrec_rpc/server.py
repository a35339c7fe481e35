"""The server bootstrap every SpecRec service uses.

- ``grpc.aio`` server with message-size and keepalive options set on purpose;
- the standard health service: NOT_SERVING until the service's ``start()``
  (model loading and warm-up) has finished, SERVING after, NOT_SERVING again
  from the first moment of shutdown, or for good once the service takes itself
  out of rotation (:meth:`Service.take_out_of_rotation`: the verifier whose
  device failed), when every call answers with that failure's status;
- server reflection;
- Prometheus metrics on an HTTP port: requests by method and status code,
  latency histograms by method, in-flight requests;
- a door: with ``max_concurrent_rpcs``, gRPC itself answers the calls past
  that many in flight with RESOURCE_EXHAUSTED before any Python runs (under
  overload calls otherwise wait in gRPC's queue, seconds, before the service
  sees them), and ``health_port`` serves the health service on a port of its
  own, outside the bound, so probes still answer;
- an interceptor that sheds load beyond ``max_concurrency``
  (RESOURCE_EXHAUSTED) and turns any unexpected exception into INTERNAL with
  a message, so none reaches a client unhandled;
- structured logs (structlog, JSON by default);
- graceful shutdown on SIGTERM/SIGINT: stop accepting, let in-flight requests
  finish for ``grace_s``, then close the service's resources.
"""

from __future__ import annotations

import asyncio
import gc
import logging
import signal
import sys
import time
from collections.abc import Awaitable, Callable, Iterable

import grpc
import structlog
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection
from prometheus_client import Counter, Gauge, Histogram, Info, start_http_server

from . import processes, tracing
from .errors import abort_for, refuse
from .settings import ServiceSettings

# buckets around the 30 ms budget, where the SLO is read
LATENCY_BUCKETS = (0.0005, 0.001, 0.002, 0.005, 0.01, 0.015, 0.02, 0.025, 0.03, 0.035, 0.04, 0.05, 0.075, 0.1, 0.25,
                   0.5, 1.0, 2.5, 10.0)


def configure_logging(level: str = "INFO", json_logs: bool = True, service: str = "",
                      process: int | None = None) -> None:
    """One log stream per service (stderr): structlog's lines and the standard library's (grpc,
    redis, ...) alike, JSON by default, each with the service's name (and, in a group of processes on one
    port, the process's index) and, inside an RPC, its request id."""
    lvl = getattr(logging, level.upper(), logging.INFO)
    shared: list[structlog.typing.Processor] = [
        structlog.contextvars.merge_contextvars,
        structlog.processors.add_log_level,
        structlog.processors.TimeStamper(fmt="iso"),
    ]
    if service:
        shared.insert(1, lambda _l, _m, ev: {"service": service, **ev})
    if process is not None:
        shared.insert(1, lambda _l, _m, ev: {"process": process, **ev})
    renderer = structlog.processors.JSONRenderer() if json_logs else structlog.dev.ConsoleRenderer(
        colors=False, exception_formatter=structlog.dev.plain_traceback)  # rich's, with locals, takes ~1 s
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(structlog.stdlib.ProcessorFormatter(
        foreign_pre_chain=[*shared, structlog.stdlib.add_logger_name],
        processors=[structlog.stdlib.ProcessorFormatter.remove_processors_meta, structlog.processors.format_exc_info,
                    renderer]))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(lvl)
    structlog.configure(processors=[*shared, structlog.processors.format_exc_info, renderer],
                        wrapper_class=structlog.make_filtering_bound_logger(lvl), cache_logger_on_first_use=False)


def channel_options(settings: ServiceSettings) -> list[tuple[str, int]]:
    """Client channel options: keepalive pings every ``keepalive_s`` (the servers accept them, see
    :func:`server_options`), fast reconnection, message limits."""
    size = settings.max_message_mb * 1024 * 1024
    return [
        ("grpc.max_send_message_length", size),
        ("grpc.max_receive_message_length", 64 * 1024 * 1024),  # answers from our own services
        ("grpc.keepalive_time_ms", settings.keepalive_s * 1000),
        ("grpc.keepalive_timeout_ms", 10_000),
        ("grpc.keepalive_permit_without_calls", 1),
        ("grpc.http2.max_pings_without_data", 0),
        # a restarted dependency is found again within about a second
        ("grpc.initial_reconnect_backoff_ms", 100),
        ("grpc.min_reconnect_backoff_ms", 100),
        ("grpc.max_reconnect_backoff_ms", 1000),
    ]


def server_credentials(settings: ServiceSettings) -> grpc.ServerCredentials | None:
    """TLS (mTLS with ``tls_require_client_auth``) from the settings; None: plaintext."""
    if not (settings.tls_cert_file and settings.tls_key_file):
        return None
    ca = settings.tls_ca_file.read_bytes() if settings.tls_ca_file else None
    if settings.tls_require_client_auth and ca is None:
        raise ValueError("tls_require_client_auth needs tls_ca_file (the CA that signs client certificates)")
    return grpc.ssl_server_credentials([(settings.tls_key_file.read_bytes(), settings.tls_cert_file.read_bytes())],
                                       root_certificates=ca, require_client_auth=settings.tls_require_client_auth)


def channel_credentials(settings: ServiceSettings) -> grpc.ChannelCredentials | None:
    """TLS towards the other services when ``tls_ca_file`` is set (presenting our certificate for mTLS)."""
    if not settings.tls_ca_file:
        return None
    key = settings.tls_key_file.read_bytes() if settings.tls_key_file else None
    cert = settings.tls_cert_file.read_bytes() if settings.tls_cert_file else None
    return grpc.ssl_channel_credentials(settings.tls_ca_file.read_bytes(), key, cert)


def make_channel(address: str, settings: ServiceSettings, aio: bool = False):
    """A channel to another service: TLS when configured, our options either way."""
    opts: list[tuple[str, int | str]] = [*channel_options(settings)]
    creds = channel_credentials(settings)
    mod = grpc.aio if aio else grpc
    if creds is None:
        return mod.insecure_channel(address, options=opts)
    if settings.tls_server_name:
        opts = [*opts, ("grpc.ssl_target_name_override", settings.tls_server_name)]
    return mod.secure_channel(address, creds, options=opts)


def server_options(settings: ServiceSettings) -> list[tuple[str, int]]:
    """Server options: accept the clients' keepalive pings (gRPC's default minimum interval of
    5 minutes would answer 30 s pings with GOAWAY too_many_pings), age connections out so
    clients re-resolve and reach new replicas, and limit what a caller may send."""
    size = settings.max_message_mb * 1024 * 1024
    return [
        ("grpc.max_receive_message_length", size),
        ("grpc.max_send_message_length", 64 * 1024 * 1024),
        ("grpc.keepalive_time_ms", settings.keepalive_s * 1000),
        ("grpc.keepalive_timeout_ms", 10_000),
        ("grpc.keepalive_permit_without_calls", 1),
        ("grpc.http2.min_recv_ping_interval_without_data_ms", max(1000, settings.keepalive_s * 500)),
        ("grpc.http2.max_ping_strikes", 0),
        ("grpc.max_connection_age_ms", int(settings.max_connection_age_s * 1000)),
        ("grpc.max_connection_age_grace_ms", int(settings.max_connection_age_grace_s * 1000)),
    ]


#: trailing metadata of every successful call: the milliseconds the service spent on it (from its handler's start
#: to its answer), so a caller can tell its own overhead per hop from the callee's time
SERVER_TIME = "x-server-ms"

# Process-wide metrics, labelled by service (tests run several services in one process).
RPC_REQUESTS = Counter("specrec_rpc_requests", "RPCs handled, by method and status code", ["service", "method", "code"])
RPC_LATENCY = Histogram(
    "specrec_rpc_latency_seconds", "RPC latency by method", ["service", "method"], buckets=LATENCY_BUCKETS
)
RPC_INFLIGHT = Gauge("specrec_rpc_inflight", "RPCs in progress", ["service"])
BUILD_INFO = Info(
    "specrec_build", "What this service runs: version, backend, ONNX Runtime provider, bundle fingerprint"
)


class RpcMetrics:
    """The RPC metrics of one service."""

    def __init__(self, service: str):
        self.requests, self.latency, self.inflight = RPC_REQUESTS, RPC_LATENCY, RPC_INFLIGHT
        self.service = service


class Admission:
    """The concurrency limit of a service: RPCs in flight (a batch RPC reserves a slot per item)."""

    def __init__(self, limit: int):
        self.limit, self.inflight = limit, 0

    def try_take(self, n: int = 1) -> bool:
        if self.inflight + n > self.limit:
            return False
        self.inflight += n
        return True

    def release(self, n: int = 1) -> None:
        self.inflight -= n


class GuardInterceptor(grpc.aio.ServerInterceptor):
    """Metrics, load shedding and last-resort error mapping for unary RPCs."""

    def __init__(self, metrics: RpcMetrics, admission: Admission, log, ready=lambda: True, out=lambda: None):
        self.m = metrics
        self.admission = admission
        self.log = log
        self.ready = ready  # False while the service starts: calls get UNAVAILABLE, which clients retry elsewhere
        self.out = out  # the failure that took the service out of rotation (None: in): every call answers with it
        self._wrapped: dict[str, grpc.RpcMethodHandler | None] = {}  # full method name -> its guarded handler

    async def intercept_service(self, continuation, details):
        """The method's handler wrapped, made once per method (a call looks it up here, nothing is built per call)."""
        wrapped = self._wrapped.get(details.method)
        if wrapped is None:
            wrapped = self._wrap(await continuation(details), details.method)
            if wrapped is not None:  # (an unknown method is not remembered: callers choose the names)
                self._wrapped[details.method] = wrapped
        return wrapped

    def _wrap(self, handler, full_method: str):
        if handler is None or handler.unary_unary is None:
            return handler
        inner, method = handler.unary_unary, full_method.rsplit("/", 1)[-1]
        m = self.m
        latency, inflight = m.latency.labels(m.service, method), m.inflight.labels(m.service)
        # probes must answer even when shedding load or starting
        exempt = full_method.startswith(("/grpc.health.", "/grpc.reflection."))

        async def guarded(request, context):
            t0 = time.perf_counter()
            code = grpc.StatusCode.OK
            structlog.contextvars.clear_contextvars()  # this call's own request id, never one left over
            tracing.bind_request_id(tracing.request_id_of(context))
            if not exempt and (failure := self.out()) is not None:
                m.requests.labels(m.service, method, "UNAVAILABLE").inc()
                self.log.warning("request", outcome="failed", method=method, code="UNAVAILABLE",
                                 reason=f"out of rotation: {failure}")
                await refuse(context, failure)
            if not exempt and not self.ready():
                m.requests.labels(m.service, method, "UNAVAILABLE").inc()
                self.log.warning("request", outcome="failed", method=method, code="UNAVAILABLE",
                                 reason="starting: not serving yet")
                await context.abort(grpc.StatusCode.UNAVAILABLE, "starting: not serving yet")
            if not exempt and not self.admission.try_take():
                m.requests.labels(m.service, method, "RESOURCE_EXHAUSTED").inc()
                why = f"overloaded: {self.admission.inflight} requests in flight"
                # one line per shed call (event "request", as the gateway's per-request lines); the id is bound
                self.log.warning("request", outcome="shed", method=method, code="RESOURCE_EXHAUSTED", reason=why)
                await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, why)
            if exempt:
                self.admission.inflight += 1
            inflight.inc()
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
                await abort_for(context, exc, method, self.log)
            finally:
                self.admission.release()
                inflight.dec()
                m.requests.labels(m.service, method, getattr(code, "name", str(code))).inc()
                took = time.perf_counter() - t0
                latency.observe(took)
                if code == grpc.StatusCode.OK:  # the caller subtracts it from its own time: each hop's overhead
                    context.set_trailing_metadata(((SERVER_TIME, f"{took * 1000.0:.3f}"),))

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
        self.admission = Admission(settings.max_concurrency)
        #: the failure that took the service out of rotation for good (:meth:`take_out_of_rotation`); None: in
        self.out_of_rotation: BaseException | None = None
        self._on_out_of_rotation: Callable[[], None] = lambda: None  # the Runner's: health NOT_SERVING

    def take_out_of_rotation(self, failure: BaseException) -> None:
        """Leave rotation for good (call it on the event loop's thread; the first failure is the one kept): health
        NOT_SERVING from now on, and every call, new or one whose work ``failure`` ended, answers with the status
        the error table maps ``failure`` to (:mod:`.errors`; the verifier's failed device: UNAVAILABLE with the
        reason DEVICE_FAILED), so that its callers go to another replica. Only a new process comes back."""
        if self.out_of_rotation is not None:
            return
        self.out_of_rotation = failure
        self.log.error("out of rotation", service=self.name, error=f"{type(failure).__name__}: {failure}")
        self._on_out_of_rotation()

    def add_to_server(self, server: grpc.aio.Server) -> None:
        raise NotImplementedError

    def build_info(self, **extra: str) -> None:
        """Export ``specrec_build_info`` (service, version and what the service reports)."""
        from importlib.metadata import PackageNotFoundError, version

        try:
            v = version("specrec")
        except PackageNotFoundError:  # pragma: no cover - running from a source tree
            v = "dev"
        BUILD_INFO.info({"service": self.name, "version": v, **{k: str(x) for k, x in extra.items()}})

    async def start(self) -> None:
        """Load models, connect, warm up. The service is SERVING only after this."""

    async def stop(self) -> None:
        """Release resources after in-flight requests have finished."""


def settle_heap() -> int:
    """Collect once, then move everything that survived start-up (models, catalogue, modules, warm-up
    state) into the collector's permanent generation (:func:`gc.freeze`, as vLLM does after loading).
    A full collection while serving then scans only what was allocated since, instead of the whole
    heap: measured on the in-process test stack, such a collection held every thread for 130-530 ms
    (2 cores shared with other load) and showed up as a request answered a second after its worker
    finished. Frozen objects are still freed by reference counting; only cycles among them stay.

    Then the memory start-up freed goes back to the system now (:func:`release_free_memory`), not in
    the middle of a request."""
    gc.collect()
    gc.freeze()
    release_free_memory()
    return gc.get_freeze_count()


def release_free_memory() -> bool:
    """glibc's ``malloc_trim(0)``: every free page of the heap back to the system at once (False where the C
    library has none). Start-up frees hundreds of MB on a large catalogue (the copy of ten million items a
    follower unpacks); left to glibc, they went back by ``madvise`` when a later free happened to merge with
    the top of the heap: 25-30 ms of the kernel zapping pages on the thread that freed, in the gateway
    0.4 s and in the drafter 7 s after SERVING (perf, 10M items, 2 cores): a request answered past its
    deadline, and ``auto`` learned a tail that fused no longer fitted."""
    trim = _glibc("malloc_trim")
    if trim is None:
        return False
    trim(0)
    return True


def _glibc(name: str):
    """The C library's function ``name``, None where it has none (not glibc: musl has no mallopt or malloc_trim
    to speak of)."""
    import ctypes

    try:
        return getattr(ctypes.CDLL(None), name)
    except (OSError, AttributeError):
        return None


class Runner:
    """Runs a :class:`Service`: start, health, shutdown. Usable from tests."""

    def __init__(self, service: Service, join: Callable[[], Awaitable[None]] | None = None):
        self.service = service
        #: a process of a group (:mod:`.processes`): warm up first, then await ``join`` (every process of the group
        #: warm), then bind the port the group shares; None: bind first, NOT_SERVING while warming up
        self.join = join
        self.s = service.settings
        self.health = health.aio.HealthServicer()
        self.server: grpc.aio.Server | None = None
        self.port: int | None = None
        self.health_server: grpc.aio.Server | None = None  # the health service alone (``health_port``)
        self.health_port: int | None = None
        self.metrics = RpcMetrics(service.name)
        self._stopping: asyncio.Event | None = None
        self.ready = False  # set once the service's start() has finished
        self._health_tasks: set[asyncio.Task] = set()  # health changes on the service's word (out of rotation)

    async def _set_all(self, status) -> None:
        for name in ("", *self.service.grpc_services):
            if self.service.out_of_rotation is not None:  # never SERVING again, whatever was under way
                status = health_pb2.HealthCheckResponse.NOT_SERVING
            await self.health.set(name, status)

    async def start(self) -> int:
        s, svc = self.s, self.service
        tracing.setup(svc.name, s.otlp_endpoint)  # before any server or channel exists
        self._stopping = asyncio.Event()
        self.server = grpc.aio.server(
            options=self._options(),
            maximum_concurrent_rpcs=s.max_concurrent_rpcs or None,
            interceptors=[GuardInterceptor(self.metrics, svc.admission, svc.log, ready=lambda: self.ready,
                                           out=lambda: svc.out_of_rotation)],
        )
        svc._on_out_of_rotation = self._out_of_rotation
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.server)
        await self._set_all(health_pb2.HealthCheckResponse.NOT_SERVING)
        svc.add_to_server(self.server)
        if s.reflection:
            reflection.enable_server_reflection(
                (
                    *svc.grpc_services,
                    health_pb2.DESCRIPTOR.services_by_name["Health"].full_name,
                    reflection.SERVICE_NAME,
                ),
                self.server,
            )
        if self.join is None:
            port = await self._listen()
        t0 = time.perf_counter()
        await svc.start()
        frozen = settle_heap()
        if self.join is not None:  # a process of a group takes connections once the whole group is warm
            await self.join()
            port = await self._listen()
        self.ready = True
        if svc.out_of_rotation is None:  # (one that failed while starting stays NOT_SERVING)
            await self._set_all(health_pb2.HealthCheckResponse.SERVING)
            svc.log.info("serving", warmup_s=round(time.perf_counter() - t0, 2), gc_frozen=frozen)
        return port

    def _options(self) -> list[tuple[str, int]]:
        # a group's processes share their port (the kernel spreads connections over them): gRPC's SO_REUSEPORT
        return server_options(self.s) + ([("grpc.so_reuseport", 1)] if self.join is not None else [])

    async def _listen(self) -> int:
        """Bind the port (and ``health_port``) and start taking calls; the port."""
        s, svc = self.s, self.service
        assert self.server is not None
        creds = server_credentials(s)
        address = f"{s.host}:{s.port}"
        self.port = self.server.add_secure_port(address, creds) if creds else self.server.add_insecure_port(address)
        await self.server.start()
        if s.health_port is not None:  # probes must not wait behind, or be shed by, the door of the main port
            self.health_server = grpc.aio.server(options=self._options())
            health_pb2_grpc.add_HealthServicer_to_server(self.health, self.health_server)
            where = f"{s.host}:{s.health_port}"
            self.health_port = (self.health_server.add_secure_port(where, creds) if creds
                                else self.health_server.add_insecure_port(where))
            await self.health_server.start()
        svc.log.info("listening", port=self.port, health_port=self.health_port, service=svc.name,
                     max_concurrent_rpcs=s.max_concurrent_rpcs or None)
        return self.port

    def _out_of_rotation(self) -> None:
        """The service took itself out of rotation: NOT_SERVING, for good."""
        task = asyncio.get_running_loop().create_task(self._set_all(health_pb2.HealthCheckResponse.NOT_SERVING))
        self._health_tasks.add(task)
        task.add_done_callback(self._health_tasks.discard)

    async def stop(self, grace: float | None = None) -> None:
        if self.server is None:
            return
        svc = self.service
        await self._set_all(health_pb2.HealthCheckResponse.NOT_SERVING)
        self.ready = False
        svc.log.info("shutting down", grace_s=self.s.grace_s if grace is None else grace)
        await self.server.stop(self.s.grace_s if grace is None else grace)
        if self.health_server is not None:
            await self.health_server.stop(0)
            self.health_server = None
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


# glibc mallopt parameters (malloc.h)
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD, _M_ARENA_MAX = -1, -3, -8


def tune_allocator(environ: dict | None = None) -> dict[str, int]:
    """Keep a long-running service's heap from creeping up (glibc only; a no-op elsewhere).

    glibc gives each thread that allocates its own arena (up to 8 per core) and raises its mmap
    threshold every time a large block is freed, so that later large blocks (a catalogue version's
    tables, a big batch's tensors) come from arenas that are never returned to the system: in a
    10-minute soak with an upsert a second the verifier's RSS rose 24% over its first minute and
    swung between 1.1 and 1.9 GB. Two arenas and a fixed 1 MiB mmap threshold (the usual settings for threaded
    Python servers: blocks above it are mapped and unmapped on their own, and the threshold no
    longer grows) keep RSS at what is live. A ``MALLOC_ARENA_MAX`` / ``MALLOC_MMAP_THRESHOLD_`` /
    ``MALLOC_TRIM_THRESHOLD_`` set in the environment wins (glibc read it at start-up).

    numpy asks the kernel for transparent huge pages on every array of 4 MB and more
    (``madvise(MADV_HUGEPAGE)``): here it does not, unless ``NUMPY_MADVISE_HUGEPAGE`` is set. The stack on ten
    million items, `auto` at 30 ms in a closed loop (bench.catalogue_scale, 2 cores): with numpy's huge pages
    3 runs of 7 served GR-ranked lists for 0.997 of answers and 4 for 0.28-0.45 (a request or two stalled 20-25 ms
    past its deadline taught `auto` a tail that fused no longer fitted); without them 0.993 in 3 runs of 3,
    each service SERVING a few seconds later (its start-up arrays fault 4 KB pages)."""
    import os

    env = os.environ if environ is None else environ
    want = {"MALLOC_ARENA_MAX": (_M_ARENA_MAX, 2), "MALLOC_MMAP_THRESHOLD_": (_M_MMAP_THRESHOLD, 1 << 20),
            "MALLOC_TRIM_THRESHOLD_": (_M_TRIM_THRESHOLD, 4 << 20)}
    if not sys.platform.startswith("linux"):
        return {}
    huge = {}
    if "NUMPY_MADVISE_HUGEPAGE" not in env:
        from numpy._core.multiarray import (  # type: ignore[attr-defined]
            _set_madvise_hugepage,  # what that variable sets, at import
        )

        _set_madvise_hugepage(False)
        huge["NUMPY_MADVISE_HUGEPAGE"] = 0
    mallopt = _glibc("mallopt")
    if mallopt is None:
        return huge
    done = dict(huge)
    for var, (param, value) in want.items():
        if var not in env and mallopt(param, value) == 1:
            done[var] = value
    return done


def main(service_cls, settings_cls, argv: Iterable[str] | None = None) -> None:
    """Entry point of a service process: allocator, settings from env + flags, metrics, run. With ``processes``
    above one (the gateway's and the drafter's setting), the parent of a group of such processes on one port
    (:mod:`.processes`)."""
    args = list(sys.argv[1:] if argv is None else argv)
    settings = settings_cls.from_args(args)
    member = processes.Member.of_env()
    count = processes.process_count(getattr(settings, "processes", 1), service_cls.name) if member is None else 1
    configure_logging(settings.log_level, settings.log_json, service_cls.name,
                      process=None if member is None else member.index)
    log = structlog.get_logger(service_cls.name)
    if count > 1:
        raise SystemExit(processes.supervise(service_cls, settings, count, args, log))
    tuned = tune_allocator()
    log.info("allocator", **{k.lower().strip("_"): v for k, v in tuned.items()})
    if member is not None:  # its metrics on a private port, which the group's parent serves with the others'
        if settings.metrics_port:
            member.metrics_port = start_http_server(0, addr="127.0.0.1")[0].server_port
        settings = member.settings(settings)
    elif settings.metrics_port:
        start_http_server(settings.metrics_port)
    asyncio.run(Runner(service_cls(settings), join=None if member is None else member.join).run_forever())
