"""A Sentinel-managed Redis on loopback: a primary, its replicas and three sentinels.

For the failover test (``tests/integration/test_failover.py``) and the chaos
benchmark's ``kill-redis-primary`` scenario, never for serving. Every process
is started here, on free ports, with its own temporary directory and no
persistence; the machine's own Redis is never touched.

    rs = LocalSentinel(tmp_path).start()
    url = rs.url                       # redis+sentinel://127.0.0.1:p1,.../specrec/0
    old = rs.kill_primary()            # SIGKILL
    new, seconds = rs.wait_promoted(old)
    rs.stop()

The sentinels run with a short ``down-after-milliseconds`` and
``failover-timeout``, so a killed primary is replaced in about 1-3 s.
"""

from __future__ import annotations

import shutil
import signal
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

from .localstack import free_port


def sentinel_command(conf: Path | str) -> list[str] | None:
    """The command line of a sentinel reading ``conf``: ``redis-sentinel <conf>`` (Debian's package), else
    ``redis-server <conf> --sentinel`` (the same program in sentinel mode), else None.

    The config file comes first: Redis reads every argument after it as a config line, so
    ``redis-server --sentinel <conf>`` would be the line ``sentinel "<conf>"``, which it refuses.
    """
    exe = shutil.which("redis-sentinel")
    if exe:
        return [exe, str(conf)]
    exe = shutil.which("redis-server")
    return [exe, str(conf), "--sentinel"] if exe else None


def sentinel_available() -> bool:
    """Whether a sentinel can be started here (``redis-sentinel`` or ``redis-server``)."""
    return sentinel_command("sentinel.conf") is not None


@dataclass
class LocalSentinel:
    workdir: Path
    master: str = "specrec"
    replicas: int = 1
    sentinels: int = 3
    quorum: int = 2
    down_after_ms: int = 400
    failover_timeout_ms: int = 2000
    data_ports: list[int] = field(default_factory=list)  # [primary at start, replicas...]
    sentinel_ports: list[int] = field(default_factory=list)
    procs: dict[int, subprocess.Popen] = field(default_factory=dict)  # port -> process

    @property
    def url(self) -> str:
        hosts = ",".join(f"127.0.0.1:{p}" for p in self.sentinel_ports)
        return f"redis+sentinel://{hosts}/{self.master}/0"

    # -- start / stop -----------------------------------------------------------------------
    def _spawn(self, port: int, args: list[str], log: Path) -> None:
        out = open(log, "w")
        self.procs[port] = subprocess.Popen(args, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
        out.close()

    def _client(self, port: int, timeout: float = 0.5):
        import redis

        return redis.Redis(host="127.0.0.1", port=port, socket_timeout=timeout, socket_connect_timeout=timeout,
                           decode_responses=True)

    def _wait(self, what: str, check, timeout_s: float = 20.0, port: int | None = None,
              log: Path | None = None) -> None:
        """Poll ``check`` until it holds; a process (``port``'s) that exits meanwhile is reported at once,
        with the end of its ``log``, instead of after the whole timeout."""
        t0 = time.monotonic()
        while True:
            try:
                if check():
                    return
            except Exception:  # noqa: BLE001 - not up yet
                pass
            proc = self.procs.get(port) if port is not None else None
            if proc is not None and proc.poll() is not None:
                tail = log.read_text(errors="replace").strip().splitlines()[-5:] if log and log.exists() else []
                self.stop(keep_logs=True)
                raise RuntimeError(f"local sentinel: {what} exited at start with code {proc.returncode}"
                                   f" (log {log}): " + " | ".join(tail))
            if time.monotonic() - t0 > timeout_s:
                self.stop(keep_logs=True)
                raise RuntimeError(f"local sentinel: {what} not ready within {timeout_s:g} s (logs in {self.workdir})")
            time.sleep(0.05)

    def start(self) -> LocalSentinel:
        server = shutil.which("redis-server")
        if server is None or not sentinel_available():
            raise RuntimeError("needs redis-server and redis-sentinel (apt-get install redis-server redis-sentinel)")
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.data_ports = [free_port() for _ in range(1 + self.replicas)]
        primary = self.data_ports[0]
        for i, port in enumerate(self.data_ports):
            d = self.workdir / f"redis-{port}"
            d.mkdir(exist_ok=True)
            args = [server, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
                    "--dir", str(d), "--repl-diskless-sync-delay", "0"]
            if i:
                args += ["--replicaof", "127.0.0.1", str(primary)]
            self._spawn(port, args, d / "redis.log")
        for port in self.data_ports[1:]:
            self._wait(f"replica {port}", lambda p=port: self._client(p).info("replication")
                       .get("master_link_status") == "up", port=port,
                       log=self.workdir / f"redis-{port}" / "redis.log")
        # A replica's link is up before it acknowledges writes: for up to a second after the sync, WAIT on the
        # primary counts 0 replicas (seen here in half of the starts). Ready means a write reaches every replica.
        self._wait("replicas acknowledging writes", lambda: self._acknowledged(primary) == self.replicas,
                   port=primary, log=self.workdir / f"redis-{primary}" / "redis.log")
        self.sentinel_ports = [free_port() for _ in range(self.sentinels)]
        for port in self.sentinel_ports:
            d = self.workdir / f"sentinel-{port}"
            d.mkdir(exist_ok=True)
            conf = d / "sentinel.conf"
            conf.write_text("\n".join([
                f"port {port}", "bind 127.0.0.1", f"dir {d}", "daemonize no",
                f"sentinel monitor {self.master} 127.0.0.1 {primary} {self.quorum}",
                f"sentinel down-after-milliseconds {self.master} {self.down_after_ms}",
                f"sentinel failover-timeout {self.master} {self.failover_timeout_ms}",
                f"sentinel parallel-syncs {self.master} 1", ""]))
            command = sentinel_command(conf)
            assert command is not None  # sentinel_available() held above
            self._spawn(port, command, d / "sentinel.log")
        for port in self.sentinel_ports:
            self._wait(f"sentinel {port}", lambda p=port: self._sentinel_ready(p), port=port,
                       log=self.workdir / f"sentinel-{port}" / "sentinel.log")
        return self

    def _acknowledged(self, port: int) -> int:
        """Replicas that hold a write made now (a probe key, deleted again), within 100 ms."""
        p = self._client(port).pipeline(transaction=False)
        p.set("localsentinel:ready", "1")
        p.wait(self.replicas, 100)
        p.delete("localsentinel:ready")
        return int(p.execute()[1])

    def _sentinel_ready(self, port: int) -> bool:
        m = self._client(port).sentinel_master(self.master)
        return (int(m["num-other-sentinels"]) == self.sentinels - 1 and int(m["num-slaves"]) == self.replicas
                and not m["is_sdown"])

    def stop(self, keep_logs: bool = False) -> None:
        for p in self.procs.values():
            if p.poll() is None:
                p.kill()
        for p in self.procs.values():
            try:
                p.wait(10)
            except subprocess.TimeoutExpired:
                pass
        self.procs.clear()
        if not keep_logs:
            shutil.rmtree(self.workdir, ignore_errors=True)

    # -- faults -----------------------------------------------------------------------------
    def primary_port(self) -> int:
        """The primary's port, as the sentinels say (the first that answers)."""
        for port in self.sentinel_ports:
            try:
                host, p = self._client(port).sentinel_get_master_addr_by_name(self.master)
                return int(p)
            except Exception:  # noqa: BLE001 - ask the next one
                continue
        raise RuntimeError("no sentinel answers")

    def kill_primary(self) -> int:
        """SIGKILL the current primary; its port."""
        port = self.primary_port()
        proc = self.procs[port]
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        return port

    def wait_promoted(self, old_port: int, timeout_s: float = 30.0) -> tuple[int, float]:
        """(the new primary's port, seconds waited) once a majority of the sentinels name a new primary
        and it says it is one."""
        t0 = time.monotonic()
        while time.monotonic() - t0 < timeout_s:
            named = []
            for port in self.sentinel_ports:
                try:
                    named.append(int(self._client(port).sentinel_get_master_addr_by_name(self.master)[1]))
                except Exception:  # noqa: BLE001
                    pass
            new = [p for p in named if p != old_port]
            if len(new) > self.sentinels // 2 and len(set(new)) == 1:
                try:
                    if self._client(new[0]).info("replication")["role"] == "master":
                        return new[0], time.monotonic() - t0
                except Exception:  # noqa: BLE001
                    pass
            time.sleep(0.05)
        raise RuntimeError(f"no replica promoted within {timeout_s:g} s (logs in {self.workdir})")
