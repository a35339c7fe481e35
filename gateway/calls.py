"""One downstream call: its timeout from the request's deadline, its failure as a core error, and its hop.

The status code and the status details decide (``google.rpc.ErrorInfo``
reasons, :mod:`specrec_rpc.errors`), never the message text. Every answered
call's time at the caller and the callee's own time (the ``x-server-ms``
trailing metadata every service sets, :data:`specrec_rpc.server.SERVER_TIME`)
go to the request's :class:`Hops`: the request path's overhead per hop.
"""

from __future__ import annotations

import time
from typing import NoReturn

import grpc

from specrec.policies.errors import BudgetExceeded, DependencyDown
from specrec_rpc.errors import Reason, reason_of_rpc
from specrec_rpc.server import SERVER_TIME

#: extra time granted to one downstream call beyond the request's budget, so a
#: call that starts just in time can still answer (keeps answers within budget + a few ms)
GRACE_S = 0.002


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


def call(which: str, fn, request, deadline: float | None, metadata=(), hops: Hops | None = None, method: str = ""):
    """``fn(request)`` with the time left until ``deadline`` as its gRPC timeout; failures as core errors; the hop
    recorded in ``hops`` (when given) under ``method`` (the RPC's name; default ``which``)."""
    t0 = time.perf_counter()
    try:
        if hops is None:
            return fn(request, timeout=timeout_for(deadline), metadata=metadata)
        resp, rpc = fn.with_call(request, timeout=timeout_for(deadline), metadata=metadata)
    except grpc.RpcError as e:
        raise_for(which, e)
    hops.add(method or which, time.perf_counter() - t0, rpc.trailing_metadata())
    return resp
