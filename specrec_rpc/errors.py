"""Request validation that names the bad field (INVALID_ARGUMENT), and
mapping of dependency failures to UNAVAILABLE."""

from __future__ import annotations

import grpc


class InvalidArgument(ValueError):
    """A request field is bad; the message starts with the field's name."""

    def __init__(self, field: str, problem: str):
        super().__init__(f"{field}: {problem}")
        self.field = field


class Unavailable(RuntimeError):
    """A dependency is down or does not answer in time."""


class FailedPrecondition(RuntimeError):
    """The request cannot be served in the current state (e.g. an unknown catalogue version)."""


class PermissionDenied(RuntimeError):
    pass


class Unauthenticated(RuntimeError):
    pass


_CODES = {
    InvalidArgument: grpc.StatusCode.INVALID_ARGUMENT,
    Unavailable: grpc.StatusCode.UNAVAILABLE,
    FailedPrecondition: grpc.StatusCode.FAILED_PRECONDITION,
    PermissionDenied: grpc.StatusCode.PERMISSION_DENIED,
    Unauthenticated: grpc.StatusCode.UNAUTHENTICATED,
}


def status_of(exc: BaseException) -> grpc.StatusCode | None:
    for cls, code in _CODES.items():
        if isinstance(exc, cls):
            return code
    return None


def handle_errors(fn):
    """Decorator for servicer methods: known errors become their gRPC status
    with the message (naming the field); anything else is left to the guard
    interceptor (INTERNAL)."""
    import functools

    @functools.wraps(fn)
    async def wrapper(self, request, context):
        try:
            return await fn(self, request, context)
        except grpc.aio.AbortError:
            raise
        except Exception as exc:
            code = status_of(exc)
            if code is None:
                raise
            await context.abort(code, str(exc))

    return wrapper


def require(cond: bool, field: str, problem: str) -> None:
    if not cond:
        raise InvalidArgument(field, problem)
