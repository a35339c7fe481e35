"""Following a request across the services: trace context and request ids.

Tracing is off unless ``otlp_endpoint`` is set: then the gRPC server and
client instrumentation of OpenTelemetry records a span per RPC and carries
the trace context in the metadata of every downstream call (gateway ->
drafter / verifier / item set), and spans go to the OTLP endpoint
(``http://collector:4317``). :func:`setup` must run before the service makes
its server and channels (the instrumentation patches grpc).

Independently of tracing, a request id travels as ``x-request-id`` metadata:
the gateway takes it from its caller or mints one, every service binds it to
its log lines (:func:`bind_request_id`), and the gateway forwards it.
"""

from __future__ import annotations

import uuid

import structlog

REQUEST_ID = "x-request-id"
_configured = False


def setup(service: str, endpoint: str, exporter=None) -> bool:
    """Install tracing for this process (once); ``exporter`` replaces OTLP (tests). True when on."""
    global _configured
    if not endpoint and exporter is None:
        return False
    if _configured:
        return True
    from opentelemetry import trace
    from opentelemetry.instrumentation.grpc import (
        GrpcAioInstrumentorClient,
        GrpcAioInstrumentorServer,
        GrpcInstrumentorClient,
    )
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor, SimpleSpanProcessor

    provider = TracerProvider(resource=Resource.create({"service.name": f"specrec-{service}"}))
    if exporter is None:
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter

        provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter(endpoint=endpoint, insecure=endpoint.startswith("http://"))))
    else:
        provider.add_span_processor(SimpleSpanProcessor(exporter))
    trace.set_tracer_provider(provider)
    GrpcAioInstrumentorServer().instrument()
    GrpcAioInstrumentorClient().instrument()
    GrpcInstrumentorClient().instrument()
    _configured = True
    return True


def request_id_of(context) -> str:
    """The caller's request id, or the one already bound to this call's logs (minted once per call by the
    server's interceptor), or a new one."""
    for md in context.invocation_metadata() or ():
        if md.key == REQUEST_ID and md.value:
            return str(md.value)[:64]
    bound = structlog.contextvars.get_contextvars().get("request_id")
    return bound or uuid.uuid4().hex[:16]


def bind_request_id(rid: str) -> None:
    structlog.contextvars.bind_contextvars(request_id=rid)


def metadata(rid: str) -> tuple[tuple[str, str], ...]:
    return ((REQUEST_ID, rid),) if rid else ()
