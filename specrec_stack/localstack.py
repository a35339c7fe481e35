"""The local stack as processes: a Redis (found, or started here) and the four
services as subprocesses, each waited on until its gRPC health check says
``SERVING``.

Used by ``specrec stack up`` (fixed ports, state under ``runs/stack``) and by
the benchmarks (``bench/harness.py``: free ports, a private Redis namespace,
everything stopped at the end):

    from specrec_stack.localstack import ServiceProcs, delete_namespace, find_or_start_redis

    url, redis_proc = find_or_start_redis(os.environ.get("REDIS_URL"), workdir=tmp, log_path=tmp / "redis.log")
    procs = ServiceProcs(bundle, url, "bench-1234", log_dir=tmp / "logs")
    try:
        procs.start()
        ... procs.addr("gateway") ...
    finally:
        procs.stop()
        delete_namespace(url, "bench-1234")
        stop_process(redis_proc)

Where the services run (``SPECREC_STACK_PLACEMENT``, :func:`placement`): ``shared`` (the default) lets every
service run on every CPU; ``split`` gives the verifier the upper half of the usable CPUs and the other three
services the lower half, so the verifier's passes no longer evict the gateway's and the drafter's code and data
from the caches of the core they run on. On two cores, one request at a time, split cost a fused request less
CPU time in the gateway and the drafter (11-26% and 6-25% less, CPU per fused request per service, twice each) and less
wall time; it is not the default because the verifier then has half the cores for its bursts (fused's p99 at
30 ms rose; figures: bench/results/HISTORY.md, thirteenth session).

Redis, in this order: the URL given (``$REDIS_URL``; it must answer), else a
server answering on 127.0.0.1:6379, else a private ``redis-server`` (no
persistence) on the given port or a free one.
"""

from __future__ import annotations

import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from specrec_rpc.processes import free_port

ROOT = Path(__file__).resolve().parents[1]
ORDER = ("itemset", "verifier", "drafter", "gateway")  # start order; stopped in reverse
# started together: the verifier and the drafter load their models while the item set starts (they ask it for the
# catalogue until it answers), and the gateway waits until all three serve before it warms up against them
# (``backends_wait_s``); one stage: a stage after it waited for the gateway's own start (its imports: 4-5 s)
STAGES = (("itemset", "verifier", "drafter", "gateway"),)
MODULES = {"itemset": "itemset_svc", "drafter": "drafter_svc", "verifier": "verifier_svc", "gateway": "gateway"}
DEFAULT_REDIS = "redis://127.0.0.1:6379/0"
PLACEMENTS = ("shared", "split")  # the first is the default


def placement(mode: str, cpus: list[int]) -> dict[str, set[int]]:
    """The CPUs each service's processes may run on under ``mode`` (:data:`PLACEMENTS`), of ``cpus`` (the usable
    ones, ascending): shared confines none; split gives the verifier the upper half (the larger, for an odd
    count: it costs a request most) and the item set, the drafter and the gateway the rest. {} (no service
    confined) for shared or fewer than two CPUs; ValueError for another mode."""
    if mode not in PLACEMENTS:
        raise ValueError(f"SPECREC_STACK_PLACEMENT: {mode!r} is none of {', '.join(PLACEMENTS)}")
    if mode == "shared" or len(cpus) < 2:
        return {}
    cut = len(cpus) // 2
    rest, own = set(cpus[:cut]), set(cpus[cut:])
    return {"verifier": own, **{name: rest for name in ORDER if name != "verifier"}}


def port_open(host: str, port: int) -> bool:
    with socket.socket() as s:
        s.settimeout(0.3)
        return s.connect_ex((host, port)) == 0


def redis_ping(url: str, timeout: float = 0.5) -> bool:
    from specrec_rpc.redis_url import close_sync, sync_client

    try:
        r = sync_client(url, socket_timeout=timeout, socket_connect_timeout=timeout)
        try:
            return bool(r.ping())
        finally:
            close_sync(r)
    except Exception:  # noqa: BLE001 - "does it answer" is all we ask
        return False


def find_or_start_redis(url: str | None, *, workdir: Path, log_path: Path | None = None,
                        port: int | None = None, private: bool = False) -> tuple[str, subprocess.Popen | None]:
    """(Redis URL, the redis-server process started here or None). ``private``: start one even when the
    default answers (a benchmark that places every process of its stack on CPUs of its choosing)."""
    if url:
        if not redis_ping(url, 2.0):
            raise SystemExit(f"Redis at {url} does not answer")
        return url, None
    if not private and redis_ping(DEFAULT_REDIS):
        return DEFAULT_REDIS, None
    exe = shutil.which("redis-server")
    if exe is None:
        raise SystemExit("no Redis answers on 127.0.0.1:6379 and redis-server is not installed "
                         "(apt-get install -y redis-server, or set REDIS_URL)")
    port = port or free_port()
    workdir.mkdir(parents=True, exist_ok=True)
    with open(log_path or os.devnull, "w") as out:  # the child keeps a descriptor of its own
        p = subprocess.Popen([exe, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
                              "--dir", str(workdir)], stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    url = f"redis://127.0.0.1:{port}/0"
    deadline = time.monotonic() + 15
    while not redis_ping(url):
        if p.poll() is not None or time.monotonic() > deadline:
            stop_process(p)
            raise SystemExit(f"redis-server did not start on port {port}" + (f" (see {log_path})" if log_path else ""))
        time.sleep(0.1)
    return url, p


def namespace_pattern(namespace: str) -> str:
    """SCAN pattern of an item-set namespace: every key starts with its hash tag ``{namespace}``."""
    return "{" + namespace.replace("[", "\\[").replace("*", "\\*").replace("?", "\\?") + "}*"


def delete_keys(url: str, pattern: str) -> int:
    """Delete the keys matching ``pattern`` (SCAN + UNLINK, in batches)."""
    from specrec_rpc.redis_url import close_sync, sync_client

    r = sync_client(url, socket_timeout=5)
    try:
        n, batch = 0, []
        for k in r.scan_iter(match=pattern, count=1000):
            batch.append(k)
            if len(batch) >= 500:
                n += r.unlink(*batch)
                batch = []
        if batch:
            n += r.unlink(*batch)
        return n
    finally:
        close_sync(r)


def delete_namespace(url: str, namespace: str) -> int:
    """Delete every key of an item-set namespace."""
    return delete_keys(url, namespace_pattern(namespace))


def health_status(port: int, host: str = "127.0.0.1", timeout: float = 1.0) -> str:
    """The server's health status name (``SERVING``, ``NOT_SERVING``, ...), or the gRPC error code's name."""
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    try:
        with grpc.insecure_channel(f"{host}:{port}") as ch:
            r = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(service=""), timeout=timeout)
            return health_pb2.HealthCheckResponse.ServingStatus.Name(r.status)
    except grpc.RpcError as e:
        return e.code().name


def stop_pid(pid: int, timeout: float = 15.0) -> bool:
    """SIGTERM, wait up to ``timeout`` s, then SIGKILL. False when there was no such process."""
    try:
        os.kill(pid, signal.SIGTERM)
    except ProcessLookupError:
        return False
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            # reap it if it is our child, so that it does not linger as a zombie
            if os.waitpid(pid, os.WNOHANG)[0] == pid:
                return True
        except ChildProcessError:
            pass
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return True
        time.sleep(0.1)
    try:
        os.kill(pid, signal.SIGKILL)
        try:
            os.waitpid(pid, 0)
        except ChildProcessError:
            pass
    except ProcessLookupError:
        pass
    return True


def stop_process(p: subprocess.Popen | None, timeout: float = 15.0) -> None:
    if p is None or p.poll() is not None:
        return
    p.terminate()
    try:
        p.wait(timeout)
    except subprocess.TimeoutExpired:
        p.kill()
        p.wait()


def _span(cpus: set[int]) -> str:
    lo, hi = min(cpus), max(cpus)
    return f"{lo}-{hi}" if len(cpus) == hi - lo + 1 and hi > lo else ",".join(map(str, sorted(cpus)))


def service_env(bundle: Path, redis_url: str, namespace: str, token: str, ports: dict[str, int],
                metrics_ports: dict[str, int], max_history: int | None = None, log_json: bool = True,
                base: dict | None = None) -> dict[str, str]:
    """Environment wiring the four services to one another, the bundle and Redis."""
    addrs = {n: f"127.0.0.1:{p}" for n, p in ports.items()}
    env = dict(os.environ if base is None else base)
    env.update(
        PYTHONUNBUFFERED="1",
        SPECREC_ITEMSET_REDIS_URL=redis_url,
        SPECREC_ITEMSET_NAMESPACE=namespace,
        SPECREC_ITEMSET_WRITE_TOKEN=token,
        SPECREC_ITEMSET_BUNDLE=str(bundle),
        SPECREC_DRAFTER_BUNDLE=str(bundle),
        SPECREC_VERIFIER_BUNDLE=str(bundle),
        SPECREC_DRAFTER_ITEMSET_ADDR=addrs["itemset"],
        SPECREC_VERIFIER_ITEMSET_ADDR=addrs["itemset"],
        SPECREC_GATEWAY_ITEMSET_ADDR=addrs["itemset"],
        SPECREC_GATEWAY_DRAFTER_ADDR=addrs["drafter"],
        SPECREC_GATEWAY_VERIFIER_ADDR=addrs["verifier"],
    )
    if max_history is not None:
        env["SPECREC_GATEWAY_MAX_HISTORY"] = str(max_history)
    for n in ORDER:
        env[f"SPECREC_{n.upper()}_PORT"] = str(ports[n])
        env[f"SPECREC_{n.upper()}_METRICS_PORT"] = str(metrics_ports.get(n, 0))
        env[f"SPECREC_{n.upper()}_LOG_JSON"] = "true" if log_json else "false"
    return env


@dataclass
class ServiceProcs:
    """The four services as subprocesses (each in its own session, so a
    terminal's Ctrl-C reaches only the caller, which stops them). A gateway or
    drafter whose settings give it several processes (``SPECREC_GATEWAY_PROCESSES``,
    auto from the cores: :mod:`specrec_rpc.processes`) runs as a group on its one port:
    ``procs[name]`` is the group's parent, and stopping it stops them all."""

    bundle: Path
    redis_url: str
    namespace: str
    log_dir: Path
    # None (the defaults, which __post_init__ replaces by dicts): free ports; metrics off
    ports: dict[str, int] = None  # type: ignore[assignment]
    metrics_ports: dict[str, int] = None  # type: ignore[assignment]
    token: str = field(default_factory=lambda: secrets.token_urlsafe(16))
    max_history: int | None = None  # the gateway's history window (None: the service's default)
    env: dict[str, str] = field(default_factory=dict)  # extra variables (e.g. SPECREC_VERIFIER_THREADS)
    replicas: dict[str, int] = field(default_factory=dict)  # more than one process of a service (drafter, verifier)
    procs: dict[str, subprocess.Popen] = field(default_factory=dict)
    # where each service runs (:func:`placement`); None: ``SPECREC_STACK_PLACEMENT`` in ``env`` or this
    # environment, else the default
    placement: str | None = None
    cpus: dict[str, set[int]] = field(init=False, default_factory=dict)

    def __post_init__(self) -> None:
        mode = self.placement or self.env.get("SPECREC_STACK_PLACEMENT") or os.environ.get(
            "SPECREC_STACK_PLACEMENT") or PLACEMENTS[0]
        self.placement = mode
        self.cpus = placement(mode, sorted(os.sched_getaffinity(0)))
        self.ports = dict(self.ports) if self.ports else {n: free_port() for n in ORDER}
        self.metrics_ports = dict(self.metrics_ports) if self.metrics_ports else {n: 0 for n in ORDER}
        for name, n in self.replicas.items():  # replica i > 1 is keyed name + str(i)
            for i in range(2, n + 1):
                self.ports.setdefault(f"{name}{i}", free_port())
                self.metrics_ports.setdefault(f"{name}{i}", free_port() if self.metrics_ports.get(name) else 0)

    def keys(self, name: str) -> list[str]:
        """The process keys of a service: name, name2, name3 ..."""
        return [name] + [f"{name}{i}" for i in range(2, self.replicas.get(name, 1) + 1)]

    def addr(self, name: str) -> str:
        return f"127.0.0.1:{self.ports[name]}"

    def log_path(self, name: str) -> Path:
        return self.log_dir / f"{name}.log"

    def start(self, timeout: float = 300.0, say: Callable[[str], None] = print,
              on_started: Callable[[str, int], None] | None = None) -> ServiceProcs:
        """Start the services together (:data:`STAGES`), each stage waited on until all of it is SERVING
        (SystemExit with the log tail otherwise; what was started keeps running: call :meth:`stop`)."""
        for stage in STAGES:
            keys = [key for name in stage for key in self.keys(name)]
            t0 = {}
            for key in keys:
                self._spawn(key, say, on_started)
                t0[key] = time.time()
            self._wait_serving(t0, timeout, say)
        return self

    def start_one(self, name: str, timeout: float = 300.0, say: Callable[[str], None] = print,
                  on_started: Callable[[str, int], None] | None = None, append_log: bool = False) -> subprocess.Popen:
        """Start (or restart, on the same port) one service process (``name``: a service, or a replica
        key such as ``verifier2``) and wait until it is SERVING."""
        p = self._spawn(name, say, on_started, append_log)
        self._wait_serving({name: time.time()}, timeout, say)
        return p

    def _spawn(self, name: str, say: Callable[[str], None], on_started: Callable[[str, int], None] | None = None,
               append_log: bool = False) -> subprocess.Popen:
        self.log_dir.mkdir(parents=True, exist_ok=True)
        env = service_env(self.bundle, self.redis_url, self.namespace, self.token, self.ports, self.metrics_ports,
                          self.max_history)
        for svc in ("drafter", "verifier"):  # the gateway calls every replica
            env[f"SPECREC_GATEWAY_{svc.upper()}_ADDR"] = ",".join(self.addr(k) for k in self.keys(svc))
        service = name.rstrip("0123456789")
        env[f"SPECREC_{service.upper()}_PORT"] = str(self.ports[name])
        env[f"SPECREC_{service.upper()}_METRICS_PORT"] = str(self.metrics_ports.get(name, 0))
        env.update(self.env)
        with open(self.log_path(name), "a" if append_log else "w") as log:
            p = subprocess.Popen(
                [sys.executable, "-m", MODULES[service]],
                env=env,
                stdout=log,
                stderr=subprocess.STDOUT,
                cwd=ROOT,
                start_new_session=True,
            )
        self.procs[name] = p
        cpus = self.cpus.get(service)
        if cpus:  # at once, before the interpreter has started a thread: its threads and processes inherit the mask
            try:
                os.sched_setaffinity(p.pid, cpus)
            except ProcessLookupError:
                pass  # gone already: _wait_serving reports it with its log
        if on_started:
            on_started(name, p.pid)
        m = self.metrics_ports.get(name, 0)
        say(f"started {name} (pid {p.pid}, port {self.ports[name]}" + (f", metrics :{m}" if m else "")
            + (f", CPUs {_span(cpus)}" if cpus else "") + "); waiting for SERVING")
        return p

    def _wait_serving(self, t0: dict[str, float], timeout: float, say: Callable[[str], None]) -> None:
        """Until every process of ``t0`` (key -> when it was started) is SERVING, polled side by side: each one's
        "SERVING after" is its own start, not the wait for the ones before it."""
        waiting = dict(t0)
        while waiting:
            for name, start in list(waiting.items()):
                status = health_status(self.ports[name])
                if status == "SERVING":
                    say(f"{name} SERVING after {time.time() - start:.1f} s")
                    del waiting[name]
                elif self.procs[name].poll() is not None or time.time() - start > timeout:
                    tail = self.log_path(name).read_text()[-2000:]
                    raise SystemExit(f"{name} did not become healthy (status {status}); log tail:\n{tail}")
            time.sleep(0.1)

    def stop(self, say: Callable[[str], None] | None = None) -> None:
        for name in reversed(ORDER):
            for key in self.keys(name):
                p = self.procs.pop(key, None)
                if p is None or p.poll() is not None:
                    continue
                stop_process(p)
                if say:
                    say(f"stopped {key} (pid {p.pid})")
