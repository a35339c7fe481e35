"""What the verifier replicas' bundles offer (:class:`specrec.verifier.Parts`), as each replica says.

The gateway asks every replica (``Describe``) at start, and asks a replica
again after it was unreachable (it may come back with another bundle). A
replica not described yet (it did not answer) counts as offering everything,
and a call it refuses as UNIMPLEMENTED marks that part missing at once. A
part the bundle lacks is never a failure: it excludes no replica and opens no
breaker (the remote verifier, :mod:`.remote`, and the fallback ladder see to
that). Each replica's ``api`` (2: one Search RPC) is logged with its parts.

Policies plan with :meth:`VerifierParts.current`, what every known replica
offers (a request may land on any of them): ``auto`` offers only what can run,
and an explicit request for a policy that cannot is FAILED_PRECONDITION naming
the missing part.
"""

from __future__ import annotations

import math
import threading
import time

import grpc
import structlog

from specrec.verifier import Parts
from specrec_rpc.v1 import verifier_pb2


class VerifierParts:
    """Per replica address, the :class:`Parts` its bundle offers (``replicas``: a
    :class:`specrec_rpc.replicas.Replicas` of verifier stubs)."""

    def __init__(self, replicas, timeout_s: float = 2.0, retry_s: float = 5.0):
        self.replicas, self.timeout_s, self.retry_s = replicas, timeout_s, retry_s
        self._known: dict[str, Parts] = {}
        self._asked: dict[str, float] = {}  # address -> when it was last asked (time.monotonic())
        self._lock = threading.Lock()
        self._changes = 0  # bumped whenever what a replica offers is learned or forgotten
        self._current: tuple[tuple[str, ...], int, Parts] | None = None  # (replicas, _changes, what they offer)
        self.log = structlog.get_logger("verifier-parts")

    def describe_all(self) -> dict[str, Parts]:
        """Ask every replica now (blocking; the gateway's start): address -> parts, for those that answered."""
        for replica in list(self.replicas.replicas.values()):
            self._describe(replica)
        with self._lock:
            return dict(self._known)

    def current(self) -> Parts:
        """What every replica offers; a replica not described yet is asked in the background (at most every
        ``retry_s``) and counts as offering everything meanwhile."""
        replicas = list(self.replicas.replicas.items())
        key = tuple(a for a, _ in replicas)
        with self._lock:  # every request asks (admission, the policies): the answer is kept while nothing changes
            if self._current is not None and self._current[:2] == (key, self._changes):
                return self._current[2]
            changes = self._changes
        out = Parts()
        now = time.monotonic()
        unknown = False
        for address, replica in replicas:
            with self._lock:
                parts = self._known.get(address)
                ask = parts is None and now - self._asked.get(address, -math.inf) >= self.retry_s
                if ask:
                    self._asked[address] = now
            if ask:
                threading.Thread(target=self._describe, args=(replica,), name=f"describe {address}",
                                 daemon=True).start()
            if parts is not None:
                out = out & parts
            else:
                unknown = True
        if not unknown:  # (a replica not described yet is asked again on a later request)
            with self._lock:
                self._current = (key, changes, out)
        return out

    def lacks(self, address: str, part: str) -> None:
        """``address`` refused a call to ``part`` (a field of :class:`Parts`) as UNIMPLEMENTED."""
        with self._lock:
            was = self._known.get(address, Parts())
            if getattr(was, part):
                self._known[address] = Parts(**{**vars(was), part: False})
                self._changes += 1
                self.log.info("verifier lacks a part", replica=address, part=part)

    def forget(self, address: str) -> None:
        """``address`` was unreachable: ask it again before trusting what it said (it may have restarted with
        another bundle, or another version)."""
        with self._lock:
            self._known.pop(address, None)
            self._asked.pop(address, None)
            self._changes += 1

    def _describe(self, replica) -> None:
        with self._lock:
            self._asked[replica.address] = time.monotonic()
        try:
            resp = replica.stub.Describe(verifier_pb2.DescribeRequest(), timeout=self.timeout_s)
        except grpc.RpcError as e:  # not up yet: learned from its calls meanwhile
            self.log.info("describe failed", replica=replica.address, code=e.code().name)
        else:
            parts = Parts(distilled_drafter=resp.distilled_drafter, draft_head=resp.draft_head)
            with self._lock:
                self._known[replica.address] = parts
                self._changes += 1
            self.log.info("verifier parts", replica=replica.address, sid_space=resp.sid_space, api=resp.api,
                          **vars(parts))
