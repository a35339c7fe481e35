"""A service on several processes behind one port: how many (:func:`process_count`), and the group that runs
them (:class:`Group`, the parent; :class:`Member`, each process).

One Python process serves with one core at most (the GIL), so on a bigger machine the gateway and the drafter
run as several processes, each a whole service with its own event loop, its own health service and its own
metrics, all bound to the same port with ``SO_REUSEPORT`` (gRPC's ``grpc.so_reuseport``): the kernel hands
each new connection to one of them. The spread is per connection, not per call: a client with one channel
reaches one process, and many clients (or a client with several channels) reach them all.

``processes`` (``SPECREC_GATEWAY_PROCESSES``, ``SPECREC_DRAFTER_PROCESSES``; 0 or ``auto``: from the cores)::

    usable cores = the CPUs this process may run on (its affinity), capped by the cgroup's CPU quota (a container's
                   limit: /sys/fs/cgroup/cpu.max, or cpu.cfs_quota_us / cpu.cfs_period_us under cgroup v1)
    auto         = max(1, floor(usable cores / CORES_PER_PROCESS[service]))   gateway: 4, drafter: 6

The shares are those of a stack that shares one machine (``specrec stack up``, compose): of the CPU a fused
request costs the whole stack, the verifier's compute takes more than half, the gateway about a quarter and the
drafter about a sixth (``python -m bench.request_path``; figures in docs/scaling.md, "Processes"), so a 2- or
4-core machine runs one process of each (a second would only contend with the verifier's threads), 8 cores two
gateway processes, 16 cores four gateway and two drafter processes. A pod that has its cores to itself (the
chart) sets ``processes`` to its CPU limit instead.

The group's lifecycle (``python -m gateway`` with ``processes`` > 1 is the group's parent, which serves nothing
itself):

1. the parent starts ``processes`` copies of the same command (``python -m gateway ...``, the same settings),
   each told its index and two pipes in ``SPECREC_PROCESS``;
2. each loads and warms up without its port (a process still warming up takes no connection), then says so
   (its private metrics port with it) and waits;
3. once every process is warm the parent says go, and each binds the shared port (and ``health_port``) and
   answers SERVING: the port answers only once the whole group is warm;
4. SIGTERM or SIGINT to the parent reaches every process, each stops gracefully (``grace_s``), and the parent
   exits after them; a process that exits on its own stops the group, and the parent exits 1 (a container or a
   pod is restarted; the local stack reports it), and a process whose parent is gone (its pipe closes) stops
   itself.

Metrics: the parent serves ``metrics_port``, every process's metrics in one scrape, each series labelled
``process="<index>"`` (plus ``specrec_process_up{process}``, 1 while that process's metrics answer): one target per
pod, as with one process; a query that aggregates (``sum by (...)``) reads the group as one service. The processes'
own metrics ports are private (127.0.0.1, a free port each).
"""

from __future__ import annotations

import json
import math
import os
import select
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Annotated

from pydantic import BeforeValidator

#: usable cores per process of a service when ``processes`` is auto
CORES_PER_PROCESS = {"gateway": 4, "drafter": 6}
#: what a process of a group is told (JSON: index, count, port, health_port, report_fd, go_fd)
ENV = "SPECREC_PROCESS"


def _auto(v):
    return 0 if isinstance(v, str) and v.strip().lower() == "auto" else v


#: the ``processes`` setting: a count, or 0 / "auto" for :func:`process_count`'s rule
Processes = Annotated[int, BeforeValidator(_auto)]


def cgroup_cpu_limit(root: Path = Path("/sys/fs/cgroup")) -> float | None:
    """The cores a cgroup CPU quota allows this process (cgroup v2 ``cpu.max``, else v1 ``cpu.cfs_quota_us`` /
    ``cpu.cfs_period_us``); None without a quota."""
    try:
        quota, period = (root / "cpu.max").read_text().split()[:2]
        return None if quota == "max" else int(quota) / int(period)
    except (OSError, ValueError):
        pass
    try:
        q = int((root / "cpu" / "cpu.cfs_quota_us").read_text())
        p = int((root / "cpu" / "cpu.cfs_period_us").read_text())
        return q / p if q > 0 and p > 0 else None
    except (OSError, ValueError):
        return None


def usable_cores() -> float:
    """The CPUs this process may run on (affinity), capped by the cgroup's quota."""
    try:
        cpus: float = len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        cpus = os.cpu_count() or 1
    limit = cgroup_cpu_limit()
    return min(cpus, limit) if limit else cpus


def process_count(setting: int, service: str, cores: float | None = None) -> int:
    """The processes a service runs: ``setting`` when positive, else (0: auto) one per
    ``CORES_PER_PROCESS[service]`` usable cores (``cores``; None: this machine's), at least one."""
    if setting < 0:
        raise ValueError(f"processes must be 0 (auto) or more, not {setting}")
    if setting:
        return setting
    cores = usable_cores() if cores is None else cores
    return max(1, math.floor(cores / CORES_PER_PROCESS.get(service, 1)))


_GIVEN: set[int] = set()  # ports this process handed out (none is handed out twice)


def free_port() -> int:
    """A port free now on 127.0.0.1, never one this process handed out before: the kernel may give a port
    just closed again, and gRPC servers bind with SO_REUSEPORT, so two services started on one repeated port
    would share it silently (each answering the other's callers with UNIMPLEMENTED)."""
    while True:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        if port not in _GIVEN:
            _GIVEN.add(port)
            return port


def group_pids(pid: int) -> list[int]:
    """A service's processes: ``pid`` and, when it is a group's parent, the processes of its group (its children
    told their place in it, :data:`ENV`), from ``/proc`` (Linux; a process of another user is not seen)."""
    kids = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
            if int(stat[stat.rindex(")") + 2:].split()[1]) != pid:  # ppid, field 4 of proc(5)
                continue
            if any(v.startswith(f"{ENV}=".encode()) for v in Path(f"/proc/{entry}/environ").read_bytes().split(b"\0")):
                kids.append(int(entry))
        except (OSError, ValueError):
            continue
    return [pid, *sorted(kids)]


# -- a process of the group ------------------------------------------------------------------------
@dataclass
class Member:
    """This process's place in a group (None from :meth:`of_env` outside one)."""

    index: int
    count: int
    port: int
    health_port: int | None
    report_fd: int
    go_fd: int
    metrics_port: int = 0  # its private metrics port, set once it serves them

    @classmethod
    def of_env(cls, environ=None) -> Member | None:
        raw = (os.environ if environ is None else environ).get(ENV)
        if not raw:
            return None
        d = json.loads(raw)
        return cls(d["index"], d["count"], d["port"], d.get("health_port"), d["report_fd"], d["go_fd"])

    def settings(self, settings):
        """The group's settings for this process: the port the group shares, no public metrics port (the
        parent's), one process."""
        update = {"port": self.port, "health_port": self.health_port, "metrics_port": 0}
        if "processes" in type(settings).model_fields:
            update["processes"] = 1
        return settings.model_copy(update=update)

    async def join(self) -> None:
        """Warm: tell the parent and wait for its go (every process is warm). Then a thread watches the pipe: when
        the parent is gone it closes, and this process stops as on SIGTERM. SystemExit when the parent is gone
        before its go."""
        import asyncio

        os.write(self.report_fd, (json.dumps({"warm": True, "metrics_port": self.metrics_port}) + "\n").encode())
        if not await asyncio.to_thread(os.read, self.go_fd, 16):
            raise SystemExit(f"process {self.index}: the group's parent is gone")
        threading.Thread(target=self._watch_parent, name="group parent", daemon=True).start()

    def _watch_parent(self) -> None:
        while os.read(self.go_fd, 16):
            pass
        os.kill(os.getpid(), signal.SIGTERM)


# -- the group's parent ----------------------------------------------------------------------------
@dataclass
class _Proc:
    index: int
    popen: subprocess.Popen
    report_r: int
    go_w: int
    buf: bytes = b""
    warm: bool = False
    metrics_port: int = 0


@dataclass
class Group:
    """The parent of a service's processes: ``command`` (e.g. ``[python, -m, gateway, *flags]``) run ``count``
    times on ``port`` (and ``health_port``), ``metrics_port`` (0: off) serving all of their metrics."""

    command: list[str]
    count: int
    port: int
    health_port: int | None = None
    metrics_port: int = 0
    grace_s: float = 10.0
    log: object = None  # a structlog logger
    procs: list[_Proc] = field(default_factory=list)
    _stop: threading.Event = field(default_factory=threading.Event)

    def run(self) -> int:
        """Start, serve until SIGTERM/SIGINT or until a process exits, stop; the exit status."""
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, lambda *_: self._stop.set())
        metrics = self._serve_metrics() if self.metrics_port else None
        try:
            for i in range(self.count):
                self._spawn(i)
            self._say("starting", processes=self.count, port=self.port, pids=[p.popen.pid for p in self.procs])
            if not self._wait_warm():
                return self._stop_all(1 if not self._stop.is_set() else 0)
            for p in self.procs:
                os.write(p.go_w, b"go\n")
            self._say("serving", processes=self.count, port=self.port, pids=[p.popen.pid for p in self.procs])
            while not self._stop.wait(0.2):
                if (gone := self._exited()) is not None:
                    self._say("a process exited: stopping the group", process=gone.index, pid=gone.popen.pid,
                              code=gone.popen.returncode, level="error")
                    return self._stop_all(1)
            return self._stop_all(0)
        finally:
            if metrics is not None:
                metrics.shutdown()
                metrics.server_close()

    def _say(self, event: str, level: str = "info", **kw) -> None:
        if self.log is not None:
            getattr(self.log, level)(event, **kw)

    def _spawn(self, i: int) -> None:
        report_r, report_w = os.pipe()
        go_r, go_w = os.pipe()
        env = dict(os.environ)
        env[ENV] = json.dumps({"index": i, "count": self.count, "port": self.port, "health_port": self.health_port,
                               "report_fd": report_w, "go_fd": go_r})
        popen = subprocess.Popen(self.command, env=env, pass_fds=(report_w, go_r))
        os.close(report_w)
        os.close(go_r)
        self.procs.append(_Proc(i, popen, report_r, go_w))

    def _exited(self) -> _Proc | None:
        return next((p for p in self.procs if p.popen.poll() is not None), None)

    def _wait_warm(self) -> bool:
        """Until every process has said it is warm (True), or one exited or a stop came first (False)."""
        while not all(p.warm for p in self.procs):
            if self._stop.is_set():
                return False
            if (gone := self._exited()) is not None:
                self._say("a process exited while starting: stopping the group", process=gone.index,
                          code=gone.popen.returncode, level="error")
                return False
            waiting = [p for p in self.procs if not p.warm]
            ready, _, _ = select.select([p.report_r for p in waiting], [], [], 0.2)
            for p in waiting:
                if p.report_r in ready:
                    p.buf += os.read(p.report_r, 4096)
                    if b"\n" in p.buf:
                        msg = json.loads(p.buf.split(b"\n", 1)[0])
                        p.warm, p.metrics_port = True, int(msg.get("metrics_port", 0))
                        self._say("process warm", process=p.index, pid=p.popen.pid)
        return True

    def _stop_all(self, code: int) -> int:
        """SIGTERM to every process, ``grace_s`` + 5 s for them to finish, then SIGKILL; ``code``."""
        for p in self.procs:
            if p.popen.poll() is None:
                p.popen.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + self.grace_s + 5.0
        for p in self.procs:
            try:
                p.popen.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                p.popen.kill()
                p.popen.wait()
            for fd in (p.report_r, p.go_w):
                try:
                    os.close(fd)
                except OSError:
                    pass
        self._say("stopped", processes=self.count, code=code)
        return code

    # -- one metrics port for the group -------------------------------------------------------------
    def exposition(self, query: str = "") -> bytes:
        """Every process's metrics (``query``: the scrape's, e.g. ``name[]`` filters, passed on), each series
        labelled with its process, in the Prometheus text format."""
        from prometheus_client.exposition import generate_latest
        from prometheus_client.metrics_core import GaugeMetricFamily, Metric
        from prometheus_client.parser import text_string_to_metric_families
        from prometheus_client.samples import Sample

        fams: dict[str, Metric] = {}
        up = GaugeMetricFamily("specrec_process_up", "1 while a process of the group answers its metrics",
                               labels=["process"])
        opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
        for p in self.procs:
            text = None
            if p.metrics_port and p.popen.poll() is None:
                try:
                    with opener.open(f"http://127.0.0.1:{p.metrics_port}/metrics{'?' + query if query else ''}",
                                     timeout=5) as r:
                        text = r.read().decode()
                except OSError:
                    pass
            up.add_metric([str(p.index)], 0.0 if text is None else 1.0)
            for f in text_string_to_metric_families(text or ""):
                m = fams.setdefault(f.name, Metric(f.name, f.documentation, f.type, f.unit))
                m.samples += [Sample(s.name, {**s.labels, "process": str(p.index)}, s.value, s.timestamp, s.exemplar)
                              for s in f.samples]

        class _Families:
            def collect(self):
                return [*fams.values(), up]

        return generate_latest(_Families())  # type: ignore[arg-type]

    def _serve_metrics(self) -> ThreadingHTTPServer:
        group = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self):  # noqa: N802 - the name http.server calls
                body = group.exposition(self.path.partition("?")[2])
                self.send_response(200)
                self.send_header("Content-Type", "text/plain; version=0.0.4; charset=utf-8")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args):  # scrapes are not logged
                pass

        server = ThreadingHTTPServer(("0.0.0.0", self.metrics_port), Handler)  # (daemon threads, one per scrape)
        threading.Thread(target=server.serve_forever, name="group metrics", daemon=True).start()
        return server


def supervise(service_cls, settings, count: int, argv: list[str], log=None) -> int:
    """Run ``service_cls`` as a group of ``count`` processes (this one their parent) with ``settings`` (the
    command line ``argv`` passed on to each); the exit status. Port 0 (and health port 0) become one free port
    the group shares."""
    module = service_cls.__module__.rpartition(".")[0] or service_cls.__module__  # gateway.service -> gateway
    port = settings.port or free_port()
    health = settings.health_port
    if health == 0:
        health = free_port()
    group = Group([sys.executable, "-m", module, *argv], count, port, health, settings.metrics_port,
                  settings.grace_s, log)
    return group.run()
