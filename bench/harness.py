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
- **Timing**: :func:`pct`, :func:`hit_and_ndcg`, :func:`rss_mb`; the gateway's own latency histogram
  (``specrec_rpc_latency_seconds`` of ``Recommend``, which its metrics port serves when the stack is started
  with ``metrics=("gateway",)``): :func:`scrape_histogram` reads it, two readings subtract into a
  :class:`Histogram` of what was observed between them, and :func:`server_figures` gives its p50/p99 (as
  PromQL's ``histogram_quantile``) and the share over the budget.
- **Results**: :func:`command_line` (the command as a reader types it, into every result), :func:`run_line`
  (the date and commit), :func:`machine_line`, :func:`no_nan`, :func:`fmt`, :func:`add_common_args`;
  :func:`publish`, the one writer every benchmark of the stack calls (its JSON, its table, its summary keys, its
  section of the results README, through :mod:`specrec.eval.results`).
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

from specrec.eval.results import RESULTS_DIR, readme_section, update_summary, write_json

ROOT = Path(__file__).resolve().parents[1]

__all__ = ["ROOT", "RESULTS_DIR", "Histogram", "Redis", "Stack", "Users", "Writer", "add_common_args", "command_line",
           "fmt", "hit_and_ndcg", "histogram_of", "itemset_stub", "machine_line", "no_nan", "open_stack", "pct",
           "publish", "raise_on_signals", "request", "rss_mb", "run_line", "sample_users", "sayer",
           "scrape_histogram", "server_figures", "write_users"]


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

    def _interrupt(signum, _frame):
        raise KeyboardInterrupt(f"signal {signum}")

    for s in signums or (signal.SIGTERM,):
        signal.signal(s, _interrupt)


# -- requests ---------------------------------------------------------------------------------------
@dataclass
class Users:
    """The sampled test users: histories (item ids, for the gateway; rows, in-process) and targets; ``unseen``:
    whether each target is an item the model never saw in training (the temporal split's new items)."""

    ids: list[list[str]]
    rows: list[np.ndarray]
    targets: list[str]
    source: str
    unseen: list[bool] | None = None


def sample_users(bundle, n: int, seed: int, protocol: str = "loo") -> Users:
    """A seeded random sample of ``n`` test users of the bundle's dataset under ``protocol`` (leave-one-out, or
    ``temporal``: the bundle's own cut-off; :func:`specrec.bundle.bundle_split`, as ``specrec eval`` reads
    it, so the same seed picks the same users): history = the last ``max_history`` items before the test target;
    the target is kept to score the answers."""
    from specrec.bundle import bundle_split
    from specrec.data.splits import sample_examples

    data = bundle.data_path
    if data is not None and Path(data).resolve().is_relative_to(ROOT):  # the repository's copy: data/beauty
        data = os.path.relpath(Path(data).resolve(), ROOT)
    _, split = bundle_split(bundle, protocol=protocol)
    test = sample_examples(split.test, n, seed)
    ids = bundle.catalogue.ids
    rows = test.histories()
    kind = "leave-one-out" if protocol == "loo" else protocol
    return Users([[ids[r] for r in h] for h in rows], rows, [ids[t] for t in test.target],
                 f"{len(rows)} {kind} test users of {data}, a random sample (seed {seed})",
                 [not bool(split.seen[t]) for t in test.target])


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
    127.0.0.1:6379, else (or with ``private``) a private ``redis-server`` (no persistence) under ``tmp``, which
    :meth:`stop` ends."""

    def __init__(self, url: str | None, tmp: Path, private: bool = False):
        from specrec_stack.localstack import find_or_start_redis

        self.url, self.proc = find_or_start_redis(url, workdir=tmp / "redis", log_path=tmp / "redis.log",
                                                  private=private)

    def stop(self) -> None:
        from specrec_stack.localstack import stop_process

        stop_process(self.proc)


class Stack:
    """The four services as subprocesses on free ports, on a private namespace of ``redis`` (a URL, or a
    :class:`Redis` that :meth:`stop` ends too). Not started: :meth:`start` waits until every service is
    SERVING; :meth:`stop` stops them and deletes the namespace. ``threads``: the verifier's intra-op threads
    (``SPECREC_VERIFIER_THREADS``; None: the service's default); ``metrics``: the services whose Prometheus
    ``/metrics`` is served (on a free port each, :meth:`metrics_url`; the others' is off); the rest goes to
    ``ServiceProcs``. The gateway and the drafter run as many processes as their settings say
    (``SPECREC_GATEWAY_PROCESSES``, ``SPECREC_DRAFTER_PROCESSES`` in this environment or ``env``; auto: from the
    cores, :mod:`specrec_rpc.processes`); ``procs.procs[name]`` is then the group's parent, and
    :func:`specrec_rpc.processes.group_pids` gives its processes."""

    def __init__(self, bundle_dir: Path, redis: str | Redis, logs: Path, prefix: str, *, threads: int | None = 1,
                 max_history: int | None = None, env: dict[str, str] | None = None, metrics: tuple[str, ...] = (),
                 **procs_kw):
        from specrec_rpc.processes import free_port
        from specrec_stack.localstack import ServiceProcs

        self.redis = redis if isinstance(redis, Redis) else None
        self.redis_url = redis.url if isinstance(redis, Redis) else redis
        self.namespace = f"bench-{prefix}-{uuid.uuid4().hex[:10]}"
        base = {} if threads is None else {"SPECREC_VERIFIER_THREADS": str(threads)}
        if metrics:
            procs_kw["metrics_ports"] = {**{n: free_port() for n in metrics}, **procs_kw.get("metrics_ports", {})}
        self.procs = ServiceProcs(Path(bundle_dir), self.redis_url, self.namespace, logs, max_history=max_history,
                                  env={**base, **(env or {})}, **procs_kw)

    @property
    def token(self) -> str:
        return self.procs.token

    def addr(self, name: str) -> str:
        return self.procs.addr(name)

    def metrics_url(self, name: str) -> str:
        return metrics_url(self.procs, name)

    def start(self, timeout: float = 600.0, say: Callable[[str], None] = print) -> Stack:
        self.procs.start(timeout, say=say)
        return self

    def stop(self, say: Callable[[str], None] = print, delete_namespace: bool = True) -> None:
        from specrec_stack.localstack import delete_namespace as _delete

        self.procs.stop(say=say)
        if delete_namespace:
            try:
                _delete(self.redis_url, self.namespace)
            except Exception as e:  # noqa: BLE001
                say(f"could not delete Redis namespace {self.namespace}: {e}")
        if self.redis is not None:
            self.redis.stop()


def metrics_url(procs, name: str) -> str:
    """Where a service process of a ``ServiceProcs`` serves its Prometheus metrics (ValueError when it does not)."""
    port = procs.metrics_ports.get(name, 0)
    if not port:
        raise ValueError(f"{name} serves no metrics: start the stack with metrics=({name!r},)")
    return f"http://127.0.0.1:{port}/metrics"


def open_stack(a, prefix: str, **stack_kw) -> tuple:
    """What a benchmark of the stack under load starts from (``a``: its options, :func:`add_common_args` and
    ``--bundle``, ``--requests``): the bundle, its sampled users (also written where the load generator reads
    them), a scratch directory, and the stack on them (``stack_kw``: more of :class:`Stack`'s options), not
    started -> (bundle, users, tmp, users_file, stack)."""
    from specrec.bundle import Bundle

    bundle = Bundle.load(Path(a.bundle).resolve())
    users = sample_users(bundle, a.requests, a.seed)
    tmp = Path(tempfile.mkdtemp(prefix=f"specrec-{prefix}-"))
    users_file = write_users(users, tmp / "users.json")
    stack = Stack(Path(a.bundle).resolve(), Redis(a.redis_url, tmp, a.private_redis), tmp / "logs", prefix,
                  threads=a.threads, max_history=bundle.cfg.max_history, **stack_kw)
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


#: the kernel's counters of what can stall every process at once: reclaim and compaction of memory (transparent
#: huge pages), major page faults, swap-ins
STALL_COUNTERS = ("allocstall_normal", "compact_stall", "compact_fail", "thp_fault_alloc", "thp_fault_fallback",
                  "pgmajfault", "pswpin")


def kernel_stalls() -> dict[str, int]:
    """:data:`STALL_COUNTERS` as ``/proc/vmstat`` has them now ({} where it cannot be read): what a step subtracts
    from a later reading to tell whether a slow stretch was the machine's."""
    try:
        rows = (line.split() for line in Path("/proc/vmstat").read_text().splitlines())
        return {k: int(v) for k, v in rows if k in STALL_COUNTERS}
    except (OSError, ValueError):
        return {}


#: the gateway's own latency histogram: every Recommend its handler ran, from the server's interceptor to the
#: answer (auto's own refusals included; the calls the interceptor sheds at its concurrency limit are not observed)
RPC_LATENCY = "specrec_rpc_latency_seconds"
GATEWAY_RECOMMEND = {"service": "gateway", "method": "Recommend"}


@dataclass(frozen=True)
class Histogram:
    """A Prometheus histogram read at one moment: ``buckets`` = (upper bound, cumulative count), rising, the
    last +Inf. ``later - earlier`` is what was observed between two readings of one process."""

    buckets: tuple[tuple[float, float], ...] = ()

    @property
    def count(self) -> float:
        return self.buckets[-1][1] if self.buckets else 0.0

    def __sub__(self, earlier: Histogram) -> Histogram:
        if not earlier.buckets:
            return self
        before = dict(earlier.buckets)
        if set(before) != {b for b, _ in self.buckets}:
            raise ValueError("the readings have different bucket bounds")
        diff = tuple((b, c - before[b]) for b, c in self.buckets)
        if any(c < 0 for _, c in diff):
            raise ValueError("a count fell between the readings: the process restarted")
        return Histogram(diff)

    def quantile(self, q: float) -> float:
        """The ``q``-quantile (0..1), as PromQL's ``histogram_quantile``: the rank ``q`` x count found in its
        bucket and interpolated linearly within it (the first bucket from 0); in the +Inf bucket, the highest
        finite bound. NaN with no observation."""
        n = self.count
        if n <= 0:
            return float("nan")
        rank = q * n
        lower, below = 0.0, 0.0
        for bound, c in self.buckets:
            if c >= rank and c > below:
                if math.isinf(bound):
                    return lower
                return lower + (bound - lower) * (rank - below) / (c - below)
            lower, below = bound, c
        return lower

    def bucket_of(self, q: float) -> tuple[float, float] | None:
        """(lower, upper) bound of the bucket the ``q``-quantile falls in (None with no observation)."""
        n = self.count
        if n <= 0:
            return None
        lower, below = 0.0, 0.0
        for bound, c in self.buckets:
            if c >= q * n and c > below:
                return lower, bound
            lower, below = bound, c
        return None

    def share_over(self, bound: float) -> float | None:
        """The share of observations above ``bound``, exact when it is one of the buckets' bounds (None when it
        is not, or with no observation)."""
        for b, c in self.buckets:
            if math.isclose(b, bound, rel_tol=1e-9) and self.count > 0:
                return 1.0 - c / self.count
        return None


def histogram_of(text: str, name: str = RPC_LATENCY, labels: dict[str, str] | None = None) -> Histogram:
    """The histogram ``name`` in a Prometheus text exposition, its series whose labels include ``labels``
    summed bucket by bucket (an empty :class:`Histogram` when none is there)."""
    from prometheus_client.parser import text_string_to_metric_families

    want = GATEWAY_RECOMMEND if labels is None else labels
    counts: dict[float, float] = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            if s.name == f"{name}_bucket" and all(s.labels.get(k) == v for k, v in want.items()):
                le = float(s.labels["le"])  # "+Inf" -> inf
                counts[le] = counts.get(le, 0.0) + float(s.value)
    return Histogram(tuple(sorted(counts.items())))


def scrape_histogram(url: str, name: str = RPC_LATENCY, labels: dict[str, str] | None = None,
                     timeout_s: float = 5.0) -> Histogram:
    """Read the histogram ``name`` from a service's ``/metrics`` (``url``), asking for that family alone (the
    exporter's ``name[]`` filter) so that a reading costs the service little; no proxy."""
    import urllib.parse
    import urllib.request

    query = urllib.parse.urlencode([("name[]", f"{name}_bucket"), ("name[]", f"{name}_count")])
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    with opener.open(f"{url}?{query}", timeout=timeout_s) as r:
        return histogram_of(r.read().decode(), name, labels)


def server_figures(h: Histogram, budget_ms: float) -> dict:
    """What the gateway's own histogram over a window says: its count, p50 and p99 (ms, interpolated within a
    bucket, as PromQL does), the bucket the p99 falls in (ms: the interpolation's bounds), and the share over
    the budget (exact when the budget is a bucket bound, else None); the p99 bucket's upper bound None when it
    is +Inf."""
    b99 = h.bucket_of(0.99)
    return {"server_count": int(h.count), "server_p50_ms": 1000.0 * h.quantile(0.50),
            "server_p99_ms": 1000.0 * h.quantile(0.99),
            "server_p99_bucket_ms": None if b99 is None else [1000.0 * b99[0],
                                                              None if math.isinf(b99[1]) else 1000.0 * b99[1]],
            "server_over_budget_share": h.share_over(budget_ms / 1000.0)}


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


def machine_line(in_process: bool = False) -> str:
    """This machine's CPUs and what shares them, as every result of the stack says where it was measured
    (``in_process``: a benchmark that runs no stack says so, and the load average it started under)."""
    cpu = platform.processor() or platform.machine()
    try:
        cpu = next(line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                   if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    if in_process:
        return f"{os.cpu_count()} CPUs ({cpu}); in process, load average {os.getloadavg()[0]:.1f} at the start"
    return (f"{os.cpu_count()} CPUs ({cpu}); everything co-located on this machine: Redis, the four services "
            f"and the load generator")


def machine_of(res: dict) -> str:
    """A result's machine for the results README: its CPUs (``2 CPUs (AMD EPYC)``); that the stack, Redis and the
    load generator share them the README says once."""
    return str(res.get("machine", "n/a")).split(";")[0]


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
    import shlex

    return "python -m " + " ".join([module, *map(shlex.quote, argv if argv is not None else sys.argv[1:])])


def add_common_args(ap: argparse.ArgumentParser, redis_url: bool = True) -> None:
    """Options every benchmark of the stack takes (serving, overload, soak, chaos, scaleout)."""
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=1, help="verifier intra-op threads (each verifier process)")
    if redis_url:
        ap.add_argument("--redis-url", default=os.environ.get("REDIS_URL"))
        ap.add_argument("--private-redis", action="store_true", help="start a redis-server of the benchmark's own "
                        "even when one answers on 127.0.0.1:6379 (placed on the services' CPUs where a benchmark "
                        "places them; the machine's own is left where it runs)")
    ap.add_argument("--out", default=str(RESULTS_DIR))
    ap.add_argument("--startup-timeout", type=float, default=600.0)


def publish(out: Path, name: str, res: dict, markdown: str, keys: dict, *, retire: tuple[str, ...] = (),
            readme: tuple[str, str] | None = None, old_sections: tuple[str, ...] = ()) -> None:
    """A benchmark's results in ``out``: ``<name>.json`` (``res``), ``<name>.md`` (``markdown``), its summary
    ``keys`` set in ``summary.json`` (and the ``retire`` keys deleted), and with ``readme`` = (owner, body) its
    section of ``README.md`` (``old_sections``: sections of owners gone, dropped). NaN is written as null."""
    out.mkdir(parents=True, exist_ok=True)
    write_json(name, no_nan(res), out)
    (out / f"{name}.md").write_text(markdown)
    update_summary(no_nan(keys), out / "summary.json", retire=retire)
    if readme is not None:
        readme_section(out / "README.md", *readme, retire=old_sections)


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
