"""One error model for every service: exceptions -> gRPC status codes.

Storage and core code raise plain domain errors and never import gRPC.
The servicers wrap their methods (unary and server-streaming alike) with
:func:`handle_errors`, which looks the exception up in one table
(:func:`status_of`: the classes below, plus what a service :func:`register`\\ s
for its own domain errors) and aborts with that code and the exception's
message, which names the field or the reason. Anything not in the table is a
bug: the client gets INTERNAL with a generic message and a log reference; the
details go to the service's log only.
"""

from __future__ import annotations

import asyncio
import functools
import inspect
import uuid

import grpc
import structlog


class InvalidArgument(ValueError):
    """A request field is bad; the message starts with the field's name."""

    def __init__(self, field: str, problem: str):
        super().__init__(f"{field}: {problem}")
        self.field = field


class Unavailable(RuntimeError):
    """A dependency is down or does not answer in time."""


class FailedPrecondition(RuntimeError):
    """The request cannot be served in the current state (e.g. an unknown catalogue version)."""


class ResourceExhausted(RuntimeError):
    """Overloaded: the request is refused now rather than answered late."""


class PermissionDenied(RuntimeError):
    pass


class Unimplemented(RuntimeError):
    """This server does not offer the operation (e.g. its bundle has no distilled drafter)."""


class Unauthenticated(RuntimeError):
    pass


_CODES: list[tuple[type[BaseException] | tuple, grpc.StatusCode, str | None]] = [
    (InvalidArgument, grpc.StatusCode.INVALID_ARGUMENT, None),
    (Unavailable, grpc.StatusCode.UNAVAILABLE, None),
    (FailedPrecondition, grpc.StatusCode.FAILED_PRECONDITION, None),
    (ResourceExhausted, grpc.StatusCode.RESOURCE_EXHAUSTED, None),
    (PermissionDenied, grpc.StatusCode.PERMISSION_DENIED, None),
    (Unimplemented, grpc.StatusCode.UNIMPLEMENTED, None),
    (Unauthenticated, grpc.StatusCode.UNAUTHENTICATED, None),
]


def register(exc: type[BaseException] | tuple, code: grpc.StatusCode, prefix: str | None = None) -> None:
    """Map a service's own domain error(s) to a status code (``prefix`` goes before the message)."""
    _CODES.insert(0, (exc, code, prefix))


def status_of(exc: BaseException) -> tuple[grpc.StatusCode, str] | None:
    """(code, message) of a known failure; None: unexpected (INTERNAL)."""
    for cls, code, prefix in _CODES:
        if isinstance(exc, cls):
            return code, f"{prefix}{type(exc).__name__}: {exc}" if prefix else str(exc)
    return None


async def abort_for(context, exc: BaseException, method: str, log) -> None:
    if context.done():
        # the caller has gone (its deadline passed or it cancelled): there is no one to tell, and this
        # is no fault of the service; e.g. a job that expired in the verifier's queue
        log.debug("call ended before its answer", method=method, error=f"{type(exc).__name__}: {exc}")
        return
    mapped = status_of(exc)
    if mapped is None:
        ref = uuid.uuid4().hex[:12]
        log.error("unhandled error", method=method, ref=ref, exc_info=exc)
        mapped = grpc.StatusCode.INTERNAL, f"internal error in {method} (ref {ref}; details in the service's log)"
    elif mapped[0] == grpc.StatusCode.UNAVAILABLE:
        log.warning("dependency unavailable", method=method, error=mapped[1])
    await context.abort(*mapped)


def handle_errors(fn):
    """Decorator for servicer methods, unary or server-streaming: every failure gets a status."""
    log = structlog.get_logger("rpc")
    name = fn.__name__

    if inspect.isasyncgenfunction(fn):
        @functools.wraps(fn)
        async def stream(self, request, context):
            try:
                async for msg in fn(self, request, context):
                    yield msg
            except (grpc.aio.AbortError, asyncio.CancelledError):
                raise
            except Exception as exc:  # noqa: BLE001 - the guard interceptor does not see streams
                await abort_for(context, exc, name, getattr(self, "log", log))

        return stream

    @functools.wraps(fn)
    async def unary(self, request, context):
        try:
            return await fn(self, request, context)
        except (grpc.aio.AbortError, asyncio.CancelledError):
            raise
        except Exception as exc:  # noqa: BLE001 - every failure gets a status
            await abort_for(context, exc, name, getattr(self, "log", log))

    return unary


def require(cond: bool, field: str, problem: str) -> None:
    if not cond:
        raise InvalidArgument(field, problem)
