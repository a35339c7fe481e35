"""Client-side load balancing over the replicas of a service.

A target names where the replicas are:

- ``host:port[,host:port...]``: a static list (the local stack, compose);
- ``dns:host:port``: every address the name resolves to, re-resolved every
  ``refresh_s`` (a Kubernetes headless Service);
- ``k8s:namespace/service:port``: the ready endpoints of the Service's
  EndpointSlices, kept current by a watch on the Kubernetes API (in-cluster
  credentials; see :mod:`.endpoints`).

:meth:`Replicas.pick` chooses a replica for a request by the power of two
choices on outstanding requests (two at random, the less busy one); the
caller keeps every call of that request on it (verifier sessions live in one
replica's memory) and asks :meth:`Replicas.pick` again, excluding it, when it
fails. :meth:`Replicas.next` round-robins, for stateless calls.

A replica whose call finds it unreachable leaves rotation at once (:meth:`Replicas.eject`, which its caller
calls on ``UNAVAILABLE``): neither :meth:`~Replicas.pick` nor :meth:`~Replicas.next` chooses it while another
is in rotation (an idle dead replica would otherwise win every power-of-two draw: its outstanding count stays
0), and a probe thread asks its health check every ``probe_s`` until it answers ``SERVING``, when it comes
back. When every candidate is out, they are chosen all the same (a call may find one back before its probe
does): ejection orders the choice, it never refuses a request. A static list learns of a dead address this
way; DNS and the EndpointSlice watch drop it too, in their own time.

Channels are made once per address and closed when the address goes away;
servers age connections out (``max_connection_age``), so long-lived clients
also notice changes that DNS alone would hide.
"""

from __future__ import annotations

import asyncio
import random
import socket
import threading
import time
from collections.abc import Callable, Set
from dataclasses import dataclass, field

import grpc
import structlog


@dataclass(eq=False)
class Replica:
    address: str
    channel: grpc.Channel
    stub: object
    outstanding: int = 0
    calls: int = 0  # requests picked onto it (for the scale-out benchmark)
    ejected: bool = False  # out of rotation after a call found it unreachable, until its health check answers
    lock: threading.Lock = field(default_factory=threading.Lock)
    aio: tuple | None = None  # (loop, channel, stub) for calls from an event loop, made there when first asked

    def __enter__(self) -> Replica:
        with self.lock:
            self.outstanding += 1
            self.calls += 1
        return self

    def __exit__(self, *exc) -> None:
        with self.lock:
            self.outstanding -= 1


class NoReplica(RuntimeError):
    """No replica is known (none resolved, or all excluded)."""


def parse_target(target: str) -> tuple[str, str]:
    """-> (kind, rest): 'static', 'dns' or 'k8s'."""
    for kind in ("dns:", "k8s:"):
        if target.startswith(kind):
            return kind[:-1], target[len(kind):].lstrip("/")
    return "static", target


def resolve_dns(hostport: str) -> list[str]:
    host, _, port = hostport.rpartition(":")
    infos = socket.getaddrinfo(host, int(port), type=socket.SOCK_STREAM)
    out = []
    for family, _, _, _, addr in infos:
        ip, port_no = str(addr[0]), str(addr[1])  # (IP address string, port int) for AF_INET and AF_INET6
        a = f"[{ip}]:{port_no}" if family == socket.AF_INET6 else f"{ip}:{port_no}"
        if a not in out:
            out.append(a)
    return out


class Replicas:
    """The replicas of one service, as blocking stubs (the gateway's policy threads use them) and, with
    ``make_aio_channel``, as asyncio stubs too (:meth:`aio_stub`: the policies the gateway runs on its event loop)."""

    def __init__(self, target: str, make_stub: Callable[[grpc.Channel], object],
                 make_channel: Callable[[str], grpc.Channel], refresh_s: float = 5.0, probe_s: float = 0.5,
                 make_aio_channel: Callable[[str], grpc.aio.Channel] | None = None):
        self.target, self.make_stub, self.make_channel = target, make_stub, make_channel
        self.make_aio_channel = make_aio_channel
        self.kind, self.rest = parse_target(target)
        self.refresh_s, self.probe_s = refresh_s, probe_s
        self._prober: threading.Thread | None = None
        self.replicas: dict[str, Replica] = {}
        self._lock = threading.Lock()
        self._rr = 0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._watcher = None
        self.log = structlog.get_logger("replicas").bind(target=target)
        if self.kind == "static":
            self.update([a.strip() for a in self.rest.split(",") if a.strip()])
        elif self.kind == "dns":
            self._refresh_dns()
            self._thread = threading.Thread(target=self._dns_loop, name=f"dns {self.rest}", daemon=True)
            self._thread.start()
        else:
            from .endpoints import EndpointSliceWatcher

            self._watcher = EndpointSliceWatcher.from_target(self.rest, on_change=self.update)
            self._watcher.start()

    # -- membership -------------------------------------------------------------------
    def update(self, addresses: list[str]) -> None:
        """Make the replica set exactly ``addresses`` (channels of the others are closed)."""
        with self._lock:
            gone = [a for a in self.replicas if a not in addresses]
            added = [a for a in addresses if a not in self.replicas]
            for a in added:
                ch = self.make_channel(a)
                self.replicas[a] = Replica(a, ch, self.make_stub(ch))
            for a in gone:
                _close(self.replicas.pop(a))
        if gone or added:
            self.log.info("replicas", addresses=sorted(self.replicas), added=added, gone=gone)

    def _refresh_dns(self) -> None:
        try:
            self.update(resolve_dns(self.rest))
        except OSError as e:
            self.log.warning("resolving failed; keeping the replicas known", error=str(e))

    def _dns_loop(self) -> None:
        while not self._stop.wait(self.refresh_s):
            self._refresh_dns()

    # -- ejection -----------------------------------------------------------------------
    def eject(self, replica: Replica, reason: str = "") -> None:
        """Take ``replica`` out of rotation (a call found it unreachable) until its health check answers
        SERVING (the probe thread, every ``probe_s``)."""
        with self._lock:
            if replica.ejected or self.replicas.get(replica.address) is not replica:
                return
            replica.ejected = True
            if self._prober is None or not self._prober.is_alive():
                self._prober = threading.Thread(target=self._probe_loop, name=f"probe {self.target}", daemon=True)
                self._prober.start()
        self.log.warning("replica ejected", address=replica.address, reason=reason)

    def ejected(self) -> list[str]:
        """The addresses out of rotation now."""
        with self._lock:
            return sorted(a for a, r in self.replicas.items() if r.ejected)

    def _probe_loop(self) -> None:
        from grpc_health.v1 import health_pb2, health_pb2_grpc

        while not self._stop.wait(self.probe_s):
            with self._lock:
                out = [r for r in self.replicas.values() if r.ejected]
            if not out:
                return  # the next ejection starts another
            for r in out:
                try:
                    resp = health_pb2_grpc.HealthStub(r.channel).Check(health_pb2.HealthCheckRequest(service=""),
                                                                        timeout=self.probe_s)
                except (grpc.RpcError, ValueError):  # ValueError: its channel was closed (the address went away)
                    continue
                if resp.status == health_pb2.HealthCheckResponse.SERVING:
                    r.ejected = False
                    self.log.info("replica back in rotation", address=r.address)

    def _options(self, exclude: Set[str]) -> list[Replica]:
        """The replicas not in ``exclude``: those in rotation, or when none is, the ejected ones."""
        with self._lock:
            options = [r for a, r in self.replicas.items() if a not in exclude]
        return [r for r in options if not r.ejected] or options

    # -- choosing -----------------------------------------------------------------------
    def pick(self, exclude: Set[str] = frozenset()) -> Replica:
        """Power of two choices on outstanding requests, among the replicas in rotation."""
        options = self._options(exclude)
        if not options:
            raise NoReplica(
                f"no replica of {self.target} to call" + (f" (excluded {sorted(exclude)})" if exclude else "")
            )
        if len(options) == 1:
            return options[0]
        a, b = random.sample(options, 2)
        return a if a.outstanding <= b.outstanding else b

    def next(self, exclude: Set[str] = frozenset()) -> Replica:
        """Round robin among the replicas in rotation (stateless calls); ``exclude``: those a retry must not
        land on again."""
        options = self._options(exclude)
        with self._lock:
            self._rr += 1
            rr = self._rr
        if not options:
            raise NoReplica(
                f"no replica of {self.target} to call" + (f" (excluded {sorted(exclude)})" if exclude else "")
            )
        return options[rr % len(options)]

    def aio_stub(self, replica: Replica):
        """``replica``'s stub for calls from the running event loop (its channel made on that loop when first
        asked; one per replica, beside the blocking one)."""
        made = replica.aio
        if made is None:
            assert self.make_aio_channel is not None, "Replicas made without make_aio_channel"
            channel = self.make_aio_channel(replica.address)
            made = replica.aio = (asyncio.get_running_loop(), channel, self.make_stub(channel))
        return made[2]

    async def close_aio(self) -> None:
        """Close the asyncio channels made on the running loop (before the loop ends; :meth:`close` the rest)."""
        loop = asyncio.get_running_loop()
        with self._lock:
            made = [r for r in self.replicas.values() if r.aio is not None and r.aio[0] is loop]
        for r in made:
            assert r.aio is not None
            channel, r.aio = r.aio[1], None
            await channel.close()

    def shares(self) -> dict[str, int]:
        return {a: r.calls for a, r in self.replicas.items()}

    def close(self) -> None:
        self._stop.set()
        if self._watcher is not None:
            self._watcher.stop()
        with self._lock:
            for r in self.replicas.values():
                _close(r)
            self.replicas.clear()


def _close(replica: Replica) -> None:
    """Close a replica's channels (its asyncio channel on its own loop, if that still runs)."""
    replica.channel.close()
    if replica.aio is not None:
        loop, channel, _ = replica.aio
        replica.aio = None
        try:
            loop.call_soon_threadsafe(lambda: loop.create_task(channel.close()))
        except RuntimeError:  # the loop is closed: nothing left to close it on
            pass


def wait_serving(replicas: Replicas, timeout_s: float, poll_s: float = 0.2) -> list[str]:
    """Until every replica answers its health check SERVING (a service is NOT_SERVING while it loads its models),
    or ``timeout_s`` is up: for a client's start, so that it can start beside the services it calls. Returns
    the addresses that answered SERVING (all of them, unless the time ran out)."""
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    deadline = time.monotonic() + timeout_s
    serving: set[str] = set()
    while True:
        with replicas._lock:
            waiting = [r for a, r in replicas.replicas.items() if a not in serving]
            known = len(replicas.replicas)
        for r in waiting:
            left = deadline - time.monotonic()
            if left <= 0:
                break
            try:
                resp = health_pb2_grpc.HealthStub(r.channel).Check(health_pb2.HealthCheckRequest(service=""),
                                                                    timeout=min(1.0, left))
                if resp.status == health_pb2.HealthCheckResponse.SERVING:
                    serving.add(r.address)
            except grpc.RpcError:
                pass  # not listening yet
        if (known and len(serving) >= known) or time.monotonic() + poll_s > deadline:
            return sorted(serving)
        time.sleep(poll_s)
