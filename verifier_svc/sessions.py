"""Verifier sessions: encoder states (and what their passes verified) by id,
with a time-to-live and a size bound."""

from __future__ import annotations

import time
import uuid
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

from specrec.verifier import Session
from specrec_rpc.catalogue import Snapshot


class SessionNotFound(LookupError):
    """An unknown or expired session id."""


@dataclass
class Entry:
    session: Session
    snap: Snapshot  # the catalogue version the session decodes against
    touched: float


class SessionStore:
    """Sessions in least-recently-used order: an entry idle for ``ttl_s`` is
    dropped by :meth:`expire`; beyond ``max_sessions`` the oldest goes first."""

    def __init__(self, ttl_s: float, max_sessions: int, clock: Callable[[], float] = time.monotonic):
        self.ttl_s, self.max_sessions, self.clock = ttl_s, max_sessions, clock
        self._entries: OrderedDict[str, Entry] = OrderedDict()

    def __len__(self) -> int:
        return len(self._entries)

    def add(self, session: Session, snap: Snapshot) -> str:
        key = uuid.uuid4().hex
        self._entries[key] = Entry(session, snap, self.clock())
        while len(self._entries) > self.max_sessions:
            self._entries.popitem(last=False)
        return key

    def get(self, key: str) -> Entry:
        e = self._entries.get(key)
        if e is None:
            raise SessionNotFound(f"session: unknown or expired session {key!r} (send the history again)")
        e.touched = self.clock()
        self._entries.move_to_end(key)
        return e

    def pop(self, key: str) -> None:
        self._entries.pop(key, None)

    def expire(self) -> int:
        cutoff = self.clock() - self.ttl_s
        old = [k for k, e in self._entries.items() if e.touched < cutoff]
        for k in old:
            del self._entries[k]
        return len(old)
