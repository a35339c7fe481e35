"""One error model for every service: exceptions -> gRPC status codes.

Storage and core code raise plain domain errors and never import gRPC.
The servicers wrap their methods (unary and server-streaming alike) with
:func:`handle_errors`, which looks the exception up in one table
(:func:`status_of`: the classes below, plus what a service :func:`register`\\ s
for its own domain errors) and aborts with that code and the exception's
message, which names the field or the reason. Anything not in the table is a
bug: the client gets INTERNAL with a generic message and a log reference; the
details go to the service's log only.

Where a client must tell one failure from another with the same code (a lost
verifier session from any other FAILED_PRECONDITION), the error is registered
with a :class:`Reason`: the status then carries a ``google.rpc.ErrorInfo``
detail (grpcio-status rich error model, domain :data:`DOMAIN`) and the client
reads it with :func:`reason_of_rpc`, never from the message text.
"""

from __future__ import annotations

import asyncio
import functools
import inspect
import uuid
from enum import Enum

import grpc
import structlog
from google.protobuf import any_pb2
from google.rpc import error_details_pb2, status_pb2
from grpc_status import rpc_status

#: the ``ErrorInfo.domain`` of every reason SpecRec's services give
DOMAIN = "specrec"


class Reason(str, Enum):
    """Machine-readable reasons (``google.rpc.ErrorInfo.reason``) that clients switch on."""

    SESSION_LOST = "SESSION_LOST"  # the verifier no longer has the session (restart, eviction, expiry)
    # the service's device failed (a CUDA error, a lost GPU, a computation that hung): it is out of rotation for
    # good (health NOT_SERVING); the call is to be retried on another replica
    DEVICE_FAILED = "DEVICE_FAILED"


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


_CODES: list[tuple[type[BaseException] | tuple, grpc.StatusCode, str | None, Reason | None]] = [
    (InvalidArgument, grpc.StatusCode.INVALID_ARGUMENT, None, None),
    (Unavailable, grpc.StatusCode.UNAVAILABLE, None, None),
    (FailedPrecondition, grpc.StatusCode.FAILED_PRECONDITION, None, None),
    (ResourceExhausted, grpc.StatusCode.RESOURCE_EXHAUSTED, None, None),
    (PermissionDenied, grpc.StatusCode.PERMISSION_DENIED, None, None),
    (Unimplemented, grpc.StatusCode.UNIMPLEMENTED, None, None),
    (Unauthenticated, grpc.StatusCode.UNAUTHENTICATED, None, None),
]


def register(exc: type[BaseException] | tuple, code: grpc.StatusCode, prefix: str | None = None,
             reason: Reason | None = None) -> None:
    """Map a service's own domain error(s) to a status code (``prefix`` goes before the message; ``reason``,
    when given, goes into the status details as an ErrorInfo)."""
    _CODES.insert(0, (exc, code, prefix, reason))


def _lookup(exc: BaseException) -> tuple[grpc.StatusCode, str, Reason | None] | None:
    for cls, code, prefix, reason in _CODES:
        if isinstance(exc, cls):
            return code, f"{prefix}{type(exc).__name__}: {exc}" if prefix else str(exc), reason
    return None


def status_of(exc: BaseException) -> tuple[grpc.StatusCode, str] | None:
    """(code, message) of a known failure; None: unexpected (INTERNAL)."""
    found = _lookup(exc)
    return None if found is None else (found[0], found[1])


def rich_status(code: grpc.StatusCode, message: str, reason: Reason) -> grpc.Status:
    """A status whose details hold ``google.rpc.ErrorInfo(reason, domain=DOMAIN)``."""
    info = any_pb2.Any()
    info.Pack(error_details_pb2.ErrorInfo(reason=reason.value, domain=DOMAIN))
    return rpc_status.to_status(status_pb2.Status(code=code.value[0], message=message, details=[info]))


def reason_of_rpc(e: grpc.RpcError) -> Reason | None:
    """The :class:`Reason` in a failed call's ErrorInfo detail (domain :data:`DOMAIN`); None when it has none."""
    trailing = getattr(e, "trailing_metadata", None)
    try:
        status = rpc_status.from_call(e) if trailing is not None else None  # type: ignore[arg-type]
    except (ValueError, TypeError):  # details that do not match the call's code or message
        return None
    for detail in status.details if status is not None else ():
        info = error_details_pb2.ErrorInfo()
        if detail.Unpack(info) and info.domain == DOMAIN:
            try:
                return Reason(info.reason)
            except ValueError:  # a reason this client does not know
                return None
    return None


async def abort_for(context, exc: BaseException, method: str, log) -> None:
    if context.done():
        # the caller has gone (its deadline passed or it cancelled): there is no one to tell, and this
        # is no fault of the service; e.g. a job that expired in the verifier's queue
        log.debug("call ended before its answer", method=method, error=f"{type(exc).__name__}: {exc}")
        return
    found = _lookup(exc)
    if found is None:
        ref = uuid.uuid4().hex[:12]
        log.error("unhandled error", method=method, ref=ref, exc_info=exc)
        await context.abort(grpc.StatusCode.INTERNAL,
                            f"internal error in {method} (ref {ref}; details in the service's log)")
        return
    if found[0] == grpc.StatusCode.UNAVAILABLE:
        log.warning("unavailable", method=method, error=found[1], reason=found[2].value if found[2] else None)
    await refuse(context, exc)


async def refuse(context, exc: BaseException) -> None:
    """Abort the call with the status the table maps ``exc`` to (its :class:`Reason` in the details when it has
    one; an exception not in the table: UNAVAILABLE with its message). Logs nothing."""
    code, message, reason = _lookup(exc) or (grpc.StatusCode.UNAVAILABLE, f"{type(exc).__name__}: {exc}", None)
    if reason is not None:
        await context.abort_with_status(rich_status(code, message, reason))
        return
    await context.abort(code, message)


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
