"""What the benchmarks share: the requests (sampled test users), the stack they run against, timing and
result helpers, and the catalogue writer.

Every script of ``bench/`` runs from the repository root as a module (``python -m bench.serving ...``);
the load they send comes from :mod:`bench.loadgen`, the one load generator.

- **Requests**: :func:`sample_users` (a seeded random sample of leave-one-out test users of the bundle's
  dataset: item-id histories for the gateway, rows for in-process runs, the targets kept to score the
  answers), :func:`write_users` (for a load generator in its own process), :func:`request`.
- **Stack**: :class:`Redis` (the URL given, else 127.0.0.1:6379, else a private ``redis-server``),
  :class:`Stack` (a private namespace and the four services as subprocesses on free ports, stopped with
  the namespace deleted), :func:`open_stack` (bundle, users and stack from a script's options).
- **Timing**: :func:`pct`, :func:`hit_and_ndcg`, :func:`rss_mb`.
- **Results**: :func:`command_line` (the command as a reader types it, into every result), :func:`run_line`
  (the date and commit), :func:`machine_line`, :func:`no_nan`, :func:`fmt`, :func:`add_common_args`; writing
  goes through :mod:`specrec.eval.results`.
- **Writes**: :class:`Writer` (one item upserted at a time through the item set, each answer recorded).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import signal
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from specrec.eval.results import RESULTS_DIR

ROOT = Path(__file__).resolve().parents[1]

__all__ = ["ROOT", "RESULTS_DIR", "Redis", "Stack", "Users", "Writer", "add_common_args", "command_line", "fmt",
           "hit_and_ndcg", "itemset_stub", "machine_line", "no_nan", "open_stack", "pct", "raise_on_signals",
           "request", "rss_mb", "run_line", "sample_users", "sayer", "write_users"]


# -- messages ---------------------------------------------------------------------------------------
def sayer(tag: str, clock: bool = False) -> Callable[[str], None]:
    """A ``say(msg)`` printing ``[tag] msg`` above any progress bar (with the time of day if ``clock``)."""

    def say(msg: str) -> None:
        from tqdm.auto import tqdm

        tqdm.write(f"[{tag}] {time.strftime('%H:%M:%S') + ' ' if clock else ''}{msg}")

    return say


def raise_on_signals(*signums: int) -> None:
    """Turn these signals into KeyboardInterrupt, so that a script's ``finally`` stops the stack it started
    (its services run in sessions of their own and would outlive it)."""

    def _interrupt(signum, frame):
        raise KeyboardInterrupt(f"signal {signum}")

    for s in signums or (signal.SIGTERM,):
        signal.signal(s, _interrupt)


# -- requests ---------------------------------------------------------------------------------------
@dataclass
class Users:
    """The sampled test users: histories (item ids, for the gateway; rows, in-process) and targets."""

    ids: list[list[str]]
    rows: list[np.ndarray]
    targets: list[str]
    source: str


def sample_users(bundle, n: int, seed: int) -> Users:
    """A seeded random sample of ``n`` leave-one-out test users of the bundle's dataset: history = the last
    ``max_history`` items before the test target; the target is kept to score the answers."""
    from specrec.data.splits import make_split, sample_examples
    from specrec.pipeline import open_dataset

    data = bundle.meta.get("data_path")
    ds = open_dataset(data)
    if ds.catalogue.ids != bundle.catalogue.ids:
        raise SystemExit(f"the bundle's dataset ({data}) has another catalogue")
    test = sample_examples(make_split(ds, "loo", bundle.cfg.max_history).test, n, seed)
    ids = bundle.catalogue.ids
    rows = test.histories()
    return Users([[ids[r] for r in h] for h in rows], rows, [ids[t] for t in test.target],
                 f"{len(rows)} leave-one-out test users of {data}, a random sample (seed {seed})")


def write_users(users: Users, path: Path) -> Path:
    """The users as the load generator's ``--users`` file reads them."""
    path.write_text(json.dumps({"ids": users.ids, "targets": users.targets}))
    return path


def request(history: list[str], i: int, policy: str, k: int, budget_ms: float, user_prefix: str = "bench"):
    """The gateway's RecommendRequest for user ``i`` of a sample."""
    from specrec_rpc.v1 import recommender_pb2

    return recommender_pb2.RecommendRequest(history=history, k=k, policy=policy, budget_ms=budget_ms,
                                            user_id=f"{user_prefix}-{i}")


# -- the stack --------------------------------------------------------------------------------------
class Redis:
    """The Redis a benchmark runs on: ``url`` if given (it must answer), else one answering on
    127.0.0.1:6379, else a private ``redis-server`` (no persistence) under ``tmp``, which :meth:`stop` ends."""

    def __init__(self, url: str | None, tmp: Path):
        from specrec_rpc.localstack import find_or_start_redis

        self.url, self.proc = find_or_start_redis(url, workdir=tmp / "redis", log_path=tmp / "redis.log")

    def stop(self) -> None:
        from specrec_rpc.localstack import stop_process

        stop_process(self.proc)


class Stack:
    """The four services as subprocesses on free ports, on a private namespace of ``redis`` (a URL, or a
    :class:`Redis` that :meth:`stop` ends too). Not started: :meth:`start` waits until every service is
    SERVING; :meth:`stop` stops them and deletes the namespace. ``threads``: the verifier's intra-op threads
    (``SPECREC_VERIFIER_THREADS``; None: the service's default); the rest goes to ``ServiceProcs``."""

    def __init__(self, bundle_dir: Path, redis: str | Redis, logs: Path, prefix: str, *, threads: int | None = 1,
                 max_history: int | None = None, env: dict[str, str] | None = None, **procs_kw):
        from specrec_rpc.localstack import ServiceProcs

        self.redis = redis if isinstance(redis, Redis) else None
        self.redis_url = redis.url if isinstance(redis, Redis) else redis
        self.namespace = f"bench-{prefix}-{uuid.uuid4().hex[:10]}"
        base = {} if threads is None else {"SPECREC_VERIFIER_THREADS": str(threads)}
        self.procs = ServiceProcs(Path(bundle_dir), self.redis_url, self.namespace, logs, max_history=max_history,
                                  env={**base, **(env or {})}, **procs_kw)

    @property
    def token(self) -> str:
        return self.procs.token

    def addr(self, name: str) -> str:
        return self.procs.addr(name)

    def start(self, timeout: float = 600.0, say: Callable[[str], None] = print) -> Stack:
        self.procs.start(timeout, say=say)
        return self

    def stop(self, say: Callable[[str], None] = print, delete_namespace: bool = True) -> None:
        from specrec_rpc.localstack import delete_namespace as _delete

        self.procs.stop(say=say)
        if delete_namespace:
            try:
                _delete(self.redis_url, self.namespace)
            except Exception as e:  # noqa: BLE001
                say(f"could not delete Redis namespace {self.namespace}: {e}")
        if self.redis is not None:
            self.redis.stop()


def open_stack(a, prefix: str) -> tuple:
    """What a benchmark of the stack under load starts from (``a``: its options, :func:`add_common_args` and
    ``--bundle``, ``--requests``): the bundle, its sampled users (also written where the load generator reads
    them), a scratch directory, and the stack on them, not started -> (bundle, users, tmp, users_file, stack)."""
    from specrec.bundle import Bundle

    bundle = Bundle.load(Path(a.bundle).resolve())
    users = sample_users(bundle, a.requests, a.seed)
    tmp = Path(tempfile.mkdtemp(prefix=f"specrec-{prefix}-"))
    users_file = write_users(users, tmp / "users.json")
    stack = Stack(Path(a.bundle).resolve(), Redis(a.redis_url, tmp), tmp / "logs", prefix, threads=a.threads,
                  max_history=bundle.cfg.max_history)
    return bundle, users, tmp, users_file, stack


# -- timing ------------------------------------------------------------------------------------------
def pct(x, q: float) -> float:
    """The ``q``-th percentile of ``x`` (NaN when empty)."""
    return float(np.percentile(x, q)) if len(x) else float("nan")


def hit_and_ndcg(items: list[str], target: str, k: int = 10) -> tuple[float, float]:
    for i, it in enumerate(items[:k]):
        if it == target:
            return 1.0, 1.0 / math.log2(i + 2)
    return 0.0, 0.0


def rss_mb(pid: int) -> float | None:
    """A process's resident memory (``VmRSS``), MB; None when it cannot be read."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024.0
    except OSError:
        return None
    return None


# -- results -----------------------------------------------------------------------------------------
def no_nan(o):
    """NaN -> None, recursively (JSON has no NaN)."""
    if isinstance(o, float) and math.isnan(o):
        return None
    if isinstance(o, dict):
        return {k: no_nan(v) for k, v in o.items()}
    if isinstance(o, (list, tuple)):
        return [no_nan(v) for v in o]
    return o


def fmt(v, spec: str = ".1f") -> str:
    return "n/a" if v is None or (isinstance(v, float) and math.isnan(v)) else format(v, spec)


def machine_line() -> str:
    """This machine's CPUs and what shares them, as every result of the stack says where it was measured."""
    cpu = platform.processor() or platform.machine()
    try:
        cpu = next(line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    return (f"{os.cpu_count()} CPUs ({cpu}); everything co-located on this machine: Redis, the four services "
            f"and the load generator")


def run_line() -> str:
    """When and on which code a run is: ``2026-12-02, commit 5a1728f`` (``with local changes`` when tracked
    files outside ``bench/results`` differ from the commit; the date alone outside a git checkout)."""
    date = time.strftime("%Y-%m-%d", time.gmtime())
    try:
        git = ["git", "-C", str(ROOT)]
        sha = subprocess.run([*git, "rev-parse", "--short", "HEAD"], capture_output=True, text=True, timeout=10)
        dirty = subprocess.run([*git, "status", "--porcelain", "--untracked-files=no", "--", ".", ":!bench/results"],
                               capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return date
    if sha.returncode != 0 or not sha.stdout.strip():
        return date
    return f"{date}, commit {sha.stdout.strip()}" + (" with local changes" if dirty.stdout.strip() else "")


def command_line(module: str, argv=None) -> str:
    """The command that produced the results, as a reader would type it from the repository root
    (``module``: ``bench.serving``; ``argv``: the arguments main() was given, None: the process's own)."""
    return "python -m " + " ".join([module, *(argv if argv is not None else sys.argv[1:])])


def add_common_args(ap: argparse.ArgumentParser, redis_url: bool = True) -> None:
    """Options every benchmark of the stack takes (serving, overload, soak, chaos, scaleout)."""
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=1, help="verifier intra-op threads (each verifier process)")
    if redis_url:
        ap.add_argument("--redis-url", default=os.environ.get("REDIS_URL"))
    ap.add_argument("--out", default=str(RESULTS_DIR))
    ap.add_argument("--startup-timeout", type=float, default=600.0)


# -- catalogue writes --------------------------------------------------------------------------------
def itemset_stub(addr: str):
    """(a channel to the item set, its stub class)."""
    import grpc

    from specrec_rpc.v1 import itemset_pb2_grpc

    return grpc.insecure_channel(addr), itemset_pb2_grpc.ItemSetStub


class Writer:
    """Upserts one new item at a time through the item set (with the write token), ``pause_s`` apart, in its
    own thread; every answer recorded (``records``: sent, done, code) and the acknowledged ids kept
    (``acked``: id -> when its write was sent)."""

    def __init__(self, addr: str, token: str, pause_s: float = 0.05):
        self.addr, self.token, self.pause_s = addr, token, pause_s
        self.acked: dict[str, float] = {}
        self.records: list[dict] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="writer", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(30)

    def _run(self) -> None:
        import grpc

        from specrec_rpc.v1 import itemset_pb2

        ch, Stub = itemset_stub(self.addr)
        words = ("lipstick matte red velvet serum hydrating night cream shampoo argan oil mascara volume black "
                 "eyeliner waterproof blush peach powder foundation liquid beige nail polish coral perfume floral "
                 "musk sunscreen mineral toner rose clay mask charcoal brush comb bamboo lotion shea vanilla").split()
        rng = np.random.default_rng(7)
        with ch:
            stub = Stub(ch)
            k = 0
            while not self._stop.is_set():
                item_id = f"failover-{uuid.uuid4().hex[:8]}"
                text = " ".join(rng.choice(words, size=5, replace=False))
                t = time.monotonic()
                try:
                    stub.Upsert(itemset_pb2.UpsertRequest(items=[itemset_pb2.UpsertItem(
                        item_id=item_id, title=f"failover item {k}", text=text)]),
                        metadata=(("authorization", f"Bearer {self.token}"),), timeout=5)
                    self.acked[item_id] = t
                    code = "OK"
                except grpc.RpcError as e:
                    code = e.code().name
                self.records.append({"t": t, "done": time.monotonic(), "code": code})
                k += 1
                self._stop.wait(self.pause_s)
