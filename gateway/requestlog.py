"""One log line per Recommend request that did not go as asked.

Every degraded answer, every shed request and every failed one is logged as
one line (JSON with the services' default ``log_json``), event ``request``,
with its request id and the reason; answers that went as asked are logged
only at ``log_sample_rate`` (default 0). Fields:

- ``outcome``: ``degraded`` (answered by a fallback), ``shed`` (refused with
  RESOURCE_EXHAUSTED), ``failed`` (any other status), or ``ok`` (sampled);
- ``request_id``, ``method``, ``code`` (the gRPC status name), ``reason``
  (``stats.degraded_reason`` or the status message);
- ``policy`` (asked), ``served_by``, ``exit_reason``, ``k``, ``history``
  (ids sent), ``ignored`` (ids not in the catalogue), ``catalogue_version``,
  ``total_ms``, ``user_id``.

Shedding by the concurrency limit happens before the handler runs: the guard
interceptor (``specrec_rpc/server.py``) logs those with the same event name.
"""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import Callable
from typing import Any

import grpc

from specrec_rpc.errors import ResourceExhausted, status_of


class RequestLog:
    def __init__(self, log: Any, sample_rate: float, draw: Callable[[], float] = random.random):
        self.log, self.sample_rate, self.draw = log, sample_rate, draw

    @staticmethod
    def _request_fields(r, rid: str, method: str) -> dict:
        return {"request_id": rid, "method": method, "policy": r.policy, "k": r.k, "history": len(r.history),
                "user_id": r.user_id}

    def answered(self, r, resp, rid: str, method: str = "Recommend") -> None:
        st = resp.stats
        if not st.degraded and not (self.sample_rate > 0 and self.draw() < self.sample_rate):
            return
        fields = {**self._request_fields(r, rid, method), "policy": st.policy, "served_by": st.served_by,
                  "exit_reason": st.exit_reason, "ignored": len(st.ignored_history),
                  "catalogue_version": st.catalogue_version, "total_ms": round(st.total_ms, 3), "code": "OK"}
        if st.degraded:
            self.log.warning("request", outcome="degraded", reason=st.degraded_reason, **fields)
        else:
            self.log.info("request", outcome="ok", reason="", **fields)

    def refused(self, r, rid: str, exc: BaseException, t0: float, method: str = "Recommend") -> None:
        """The request ended without an answer: shed (RESOURCE_EXHAUSTED) or failed (any other status)."""
        if isinstance(exc, asyncio.CancelledError):
            code, reason = grpc.StatusCode.CANCELLED, "the caller cancelled, or its deadline passed"
        else:
            mapped = status_of(exc)
            code, reason = mapped if mapped else (grpc.StatusCode.INTERNAL, f"{type(exc).__name__}: {exc}")
        outcome = "shed" if isinstance(exc, ResourceExhausted) else "failed"
        self.log.warning("request", outcome=outcome, code=code.name, reason=reason,
                         total_ms=round((time.monotonic() - t0) * 1000.0, 3), **self._request_fields(r, rid, method))
