"""A request's deadline: one immutable object from the caller down to every downstream call.

:class:`Deadline` is made once, when the request arrives (the gateway:
:mod:`gateway.budget`; in-process: ``RecRequest(deadline=at)``), and passed down
with the request: to the policy (its budget checks, :meth:`PolicyCosts.fits`),
to the verifier's session (:meth:`Verifier.encode`) and to each draft request
(:class:`~specrec.drafters.base.DraftRequest`). The gRPC adapters derive every
call's timeout from it. Nothing changes it: a caller that keeps time back from
the verifier's calls for a fallback's answer hands the policy
``deadline.keeping(seconds)`` (the verifier's calls end at
:attr:`Deadline.verifier_at`), and a fallback that needs no such time runs with
``deadline.whole()``.

The one mutable part is the request's :class:`Watch`, shared by every copy: the
caller cancels it when it answers at the deadline (policies stop at their next
step, none of its calls is started after; one in flight ends at its timeout, from this deadline), and a policy
that already holds an answer (``fused``: the item drafter's list) puts it there
for the caller to answer with.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any


class Watch:
    """What the caller watching a request and the code running it share (thread-safe): :meth:`cancel` (the
    caller answered: stop) and the answer the running policy holds (:meth:`hold`)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._cancelled = False
        self._on_cancel: dict[int, Callable[[], Any]] = {}
        self._next = 0
        self.held: Callable[[], Any] | None = None  # builds the answer the policy holds (a RecResult)

    @property
    def cancelled(self) -> bool:
        return self._cancelled

    def cancel(self) -> None:
        """Stop the request: every callback registered with :meth:`on_cancel` runs now (once), and every later
        one at once."""
        with self._lock:
            if self._cancelled:
                return
            self._cancelled = True
            callbacks, self._on_cancel = list(self._on_cancel.values()), {}
        for fn in callbacks:
            fn()

    def on_cancel(self, fn: Callable[[], Any]) -> Callable[[], None]:
        """Call ``fn`` when the request is cancelled (now, if it is already); returns what unregisters it (a call
        that ended)."""
        with self._lock:
            if not self._cancelled:
                key, self._next = self._next, self._next + 1
                self._on_cancel[key] = fn
                return lambda: self._forget(key)
        fn()
        return lambda: None

    def _forget(self, key: int) -> None:
        with self._lock:
            self._on_cancel.pop(key, None)

    def hold(self, answer: Callable[[], Any]) -> None:
        """The running policy has an answer in hand (``answer`` builds it): a caller cut at its deadline answers
        with it, not with the catalogue's fill."""
        self.held = answer


@dataclass(frozen=True)
class Deadline:
    at: float  # absolute time on the engine's clock (seconds)
    reserve: float = 0.0  # seconds before ``at`` at which the verifier's calls end (time kept for a fallback)
    watch: Watch | None = field(default=None, compare=False)  # the request's cancellation and held answer

    @property
    def verifier_at(self) -> float:
        return self.at - self.reserve

    @property
    def cancelled(self) -> bool:
        """The caller has answered (and cancelled the request): nothing more should run for it."""
        return self.watch is not None and self.watch.cancelled

    def left(self, now: float) -> float:
        """Seconds until ``at`` (negative once passed)."""
        return self.at - now

    def keeping(self, reserve: float) -> Deadline:
        """This deadline with the verifier's calls ending ``reserve`` seconds before it."""
        return replace(self, reserve=reserve)

    def whole(self) -> Deadline:
        """This deadline with nothing kept back (a fallback whose own answer needs no time after it)."""
        return replace(self, reserve=0.0)

    def hold(self, answer: Callable[[], Any]) -> None:
        """Tell the caller the answer the policy holds (:meth:`Watch.hold`; nothing without a watch)."""
        if self.watch is not None:
            self.watch.hold(answer)
