"""What the serving layer knows about its dependencies' health.

:class:`Breaker` is the verifier's circuit breaker: ``failures`` in a row
open it for ``open_s``; then one request at a time probes (half-open) until
one succeeds. :class:`Cooldown` is the drafter's simpler rule: after a call
that found it unreachable it counts as down for ``down_s`` (no time is kept
back for its answer meanwhile). Both are thread-safe and take their clock as
an argument, so tests run them on a fake one.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable


class Breaker:
    """Verifier circuit breaker: ``failures`` in a row open it for ``open_s``;
    then one request at a time probes (half-open) until one succeeds."""

    def __init__(self, failures: int, open_s: float, clock: Callable[[], float] = time.monotonic):
        self.failures, self.open_s, self.clock = failures, open_s, clock
        self.count, self.until, self.probing = 0, 0.0, 0.0  # probing: when the half-open probe started (0: none)
        self.lock = threading.Lock()

    def is_open(self) -> bool:
        """Open or half-open (no state change: for callers that will not report a result)."""
        with self.lock:
            return self.count >= self.failures

    def refusing(self) -> bool:
        """Whether :meth:`allow` would refuse now (open, or its half-open probe out), without taking the probe:
        for a planner that skips the verifier's policies while it is down and comes back to them when a probe
        may go."""
        with self.lock:
            if self.count < self.failures:
                return False
            now = self.clock()
            return now < self.until or bool(self.probing and now - self.probing < self.open_s)

    def allow(self) -> bool:
        """Whether a request may call the verifier now (closed, or it is the half-open probe)."""
        with self.lock:
            if self.count < self.failures:
                return True
            now = self.clock()
            # a probe that never reported (its request ended otherwise) stops blocking after open_s
            if now < self.until or (self.probing and now - self.probing < self.open_s):
                return False
            self.probing = now
            return True

    def settle(self) -> None:
        """The request ended without a verdict on the verifier (e.g. a budget too small): a probe may go again."""
        with self.lock:
            self.probing = 0.0

    def result(self, ok: bool) -> None:
        with self.lock:
            self.probing = 0.0
            if ok:
                self.count = 0
            else:
                self.count += 1
                if self.count >= self.failures:
                    self.until = self.clock() + self.open_s


class Cooldown:
    """A dependency that failed as unreachable counts as down for ``down_s``."""

    def __init__(self, down_s: float, clock: Callable[[], float] = time.monotonic):
        self.down_s, self.clock = down_s, clock
        self.until = 0.0
        self._lock = threading.Lock()

    def failed(self) -> None:
        with self._lock:
            self.until = self.clock() + self.down_s

    def is_down(self) -> bool:
        with self._lock:
            return self.clock() < self.until
