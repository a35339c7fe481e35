"""One downstream call: its timeout from the request's deadline, its failure as a core error, and its hop.

The request's one :class:`~specrec.deadline.Deadline` comes with the call (the
verifier's calls end at its ``verifier_at``, the drafter's at its ``at``; each
gRPC timeout is the time left until then plus :data:`GRACE_S`). A call is not
started once the request's watch is cancelled (the gateway answered at the
deadline); a call in flight ends at its timeout, which the deadline set (a
verifier call before the answer is due). What the gateway's long-lived adapters need of the request
besides (the request id forwarded as metadata, the hops recorded) is the
worker's :func:`request_calls` context.

The status code and the status details decide (``google.rpc.ErrorInfo``
reasons, :mod:`specrec_rpc.errors`), never the message text. Every answered
call's time at the caller and the callee's own time (the ``x-server-ms``
trailing metadata every service sets, :data:`specrec_rpc.server.SERVER_TIME`)
go to the request's :class:`Hops`: the request path's overhead per hop.
"""

from __future__ import annotations

import contextvars
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import NoReturn

import grpc

from specrec.deadline import Deadline
from specrec.policies.errors import BudgetExceeded, DependencyDown
from specrec_rpc.errors import Reason, reason_of_rpc
from specrec_rpc.server import SERVER_TIME

from .budget import GRACE_S


class SessionLost(RuntimeError):
    """The verifier no longer has the session (it restarted or evicted it)."""


def timeout_for(deadline: float | None, floor: float = 0.002) -> float | None:
    if deadline is None:
        return None
    return max(floor, deadline - time.monotonic() + GRACE_S)


def raise_for(which: str, e: grpc.RpcError) -> NoReturn:
    """The core error a failed call stands for: BudgetExceeded, SessionLost (by the status's ErrorInfo
    reason), else DependencyDown."""
    code = e.code()
    if code == grpc.StatusCode.DEADLINE_EXCEEDED:
        raise BudgetExceeded(which, e.details() or "deadline exceeded") from None
    if reason_of_rpc(e) == Reason.SESSION_LOST:  # the status details say so (ErrorInfo), never the message
        raise SessionLost(e.details()) from None
    # anything else (down, overloaded, starting, or a call it refused): the request degrades to what is
    # still available; the caller's own input was validated before any dependency was called
    raise DependencyDown(which, f"{code.name}: {e.details()}", unreachable=code == grpc.StatusCode.UNAVAILABLE,
                         code=code.name) from None


class Hops:
    """One request's downstream calls: per RPC method, the milliseconds at the caller (request built and sent, answer
    read) and at the callee (its own server time), summed over the request's calls of that method."""

    def __init__(self) -> None:
        self.caller_ms: dict[str, float] = {}
        self.server_ms: dict[str, float] = {}

    def add(self, method: str, caller_s: float, md) -> None:
        self.caller_ms[method] = self.caller_ms.get(method, 0.0) + caller_s * 1000.0
        for key, value in md or ():
            if key == SERVER_TIME:
                self.server_ms[method] = self.server_ms.get(method, 0.0) + float(value)


@dataclass
class RequestCalls:
    """What the adapters' calls for one request carry besides its deadline: the metadata forwarded (the request
    id) and where each hop is recorded."""

    metadata: tuple = ()
    hops: Hops = field(default_factory=Hops)


_CURRENT: contextvars.ContextVar[RequestCalls | None] = contextvars.ContextVar("specrec_request_calls", default=None)


@contextmanager
def request_calls(metadata=(), hops: Hops | None = None) -> Iterator[Hops]:
    """Within: this thread's calls are one request's (``metadata`` forwarded with each; their hops recorded in
    ``hops``, or a new record, which it yields)."""
    calls = RequestCalls(tuple(metadata), hops if hops is not None else Hops())
    token = _CURRENT.set(calls)
    try:
        yield calls.hops
    finally:
        _CURRENT.reset(token)


def current_metadata() -> tuple:
    """The metadata the current request's calls forward (none outside :func:`request_calls`)."""
    calls = _CURRENT.get()
    return () if calls is None else calls.metadata


def _cancelled(which: str) -> BudgetExceeded:
    return BudgetExceeded(which, "cancelled: the request was answered at its deadline")


def call(which: str, fn, request, deadline: Deadline | None, method: str = ""):
    """``fn(request)`` with the time left until ``deadline`` (its ``verifier_at`` for the verifier's calls, else
    its ``at``) as its gRPC timeout, cancelled with the request's watch; failures as core errors; the hop recorded
    for the current request (:func:`request_calls`) under ``method`` (the RPC's name; default ``which``)."""
    calls = _CURRENT.get()
    metadata, hops = ((), None) if calls is None else (calls.metadata, calls.hops)
    watch = None if deadline is None else deadline.watch
    if watch is not None and watch.cancelled:
        raise _cancelled(which)
    until = None if deadline is None else deadline.verifier_at if which == "verifier" else deadline.at
    t0 = time.perf_counter()
    try:
        # a blocking call, not a future the request's cancel could reach: its timeout already ends it where
        # the request's time for it ends (a verifier call at ``verifier_at``, before the answer is due; a
        # drafter call at ``at``), and a future costs the gateway 0.5-1 ms a request in thread hand-offs
        # (bench.serving side by side, HISTORY.md 2026-12-05); a cancelled request starts no call (above)
        if hops is None:
            return fn(request, timeout=timeout_for(until), metadata=metadata)
        else:
            resp, rpc = fn.with_call(request, timeout=timeout_for(until), metadata=metadata)
    except grpc.RpcError as e:
        if watch is not None and watch.cancelled:
            raise _cancelled(which) from None
        raise_for(which, e)
    if hops is not None:
        hops.add(method or which, time.perf_counter() - t0, rpc.trailing_metadata())
    return resp
