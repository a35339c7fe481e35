"""One downstream call: its timeout from the request's deadline, and its failure as a core error.

The status code and the status details decide (``google.rpc.ErrorInfo``
reasons, :mod:`specrec_rpc.errors`), never the message text.
"""

from __future__ import annotations

import time
from typing import NoReturn

import grpc

from specrec.policies.errors import BudgetExceeded, DependencyDown
from specrec_rpc.errors import Reason, reason_of_rpc

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


def call(which: str, fn, request, deadline: float | None, metadata=()):
    """``fn(request)`` with the time left until ``deadline`` as its gRPC timeout; failures as core errors."""
    try:
        return fn(request, timeout=timeout_for(deadline), metadata=metadata)
    except grpc.RpcError as e:
        raise_for(which, e)
