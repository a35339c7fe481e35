"""``bench.chaos``'s faults of the services and of Redis, and what every phase of it shares: the private Redis,
the load (``auto`` as Poisson arrivals, each answer scored), the catalogue check, and a scenario's figures.

- ``pause-<service>``: SIGSTOP for ``--fault-s`` seconds, then SIGCONT; ``kill-<service>``: SIGKILL, then a new
  process on the same port; ``redis-loss``: the private Redis killed and restarted empty; ``overload``: the
  offered rate raised to ``--flood-x`` x the measured capacity (:func:`run_scenario`).
- Per scenario (:func:`scenario_row`): errors by gRPC code, the model share and p99 while the fault lasts, the
  time to recover after it (:func:`recovery_s`), catalogue items lost (:func:`catalogue_check`).
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import time
import uuid
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

from bench.harness import itemset_stub, pct, sayer
from bench.loadgen import InThread, capacity
from specrec_stack.localstack import redis_ping

#: the scenarios in which one of the two models is away
MODEL_FAULTS = {"pause-verifier", "kill-verifier", "pause-drafter", "kill-drafter"}

say = sayer("chaos", clock=True)


# -- the private Redis -----------------------------------------------------------------------------
@dataclass
class PrivateRedis:
    port: int
    workdir: Path
    proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> None:
        exe = shutil.which("redis-server")
        if exe is None:
            raise SystemExit("redis-server is not installed (apt-get install -y redis-server)")
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.proc = subprocess.Popen([exe, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "",
                                      "--appendonly", "no", "--dir", str(self.workdir)],
                                     stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT, start_new_session=True)
        deadline = time.monotonic() + 15
        while not redis_ping(self.url):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise SystemExit(f"redis-server did not start on port {self.port}")
            time.sleep(0.05)

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()


# -- load ------------------------------------------------------------------------------------------
def describing(targets: list[str]):
    """:func:`describe` that also scores each answer: ``hit``, the user's test target in the first 10 items."""
    def scored(i: int, resp, error) -> dict:
        rec = describe(i, resp, error)
        rec["hit"] = error is None and targets[i] in [it.item_id for it in resp.items[:10]]
        return rec
    return scored


def describe(i: int, resp, error) -> dict:
    """A chaos record of one answer (:class:`bench.loadgen.InThread` adds the times): ``model`` is a list
    ranked by a model (the GR model or the drafter), not made only of catalogue fill; ``any_fill``: some
    of it is fill (:func:`bench.loadgen.model_answer` reads both); a degraded answer's reason is kept
    (``detail``), as is an error's."""
    if error is not None:
        return {"code": error.code().name, "served_by": "", "degraded": True, "model": False, "any_fill": False,
                "detail": (error.details() or "")[:200]}
    sources = [it.source for it in resp.items]
    fill_only = bool(sources) and all(s == "fill" for s in sources)
    rec = {"code": "OK", "served_by": resp.stats.served_by or resp.stats.policy, "degraded": bool(resp.stats.degraded),
           "model": not fill_only and (resp.stats.served_by or "") != "fill" and len(sources) > 0,
           "any_fill": "fill" in sources, "exit": resp.stats.exit_reason,
           "server_ms": resp.stats.total_ms}  # the gateway's own time (latency_ms: the caller's)
    if resp.stats.degraded:
        rec["detail"] = resp.stats.degraded_reason[:200]
    return rec


def make_load(target: str, users, budget_ms: float, rate: float, seed: int) -> InThread:
    """``auto`` at ``rate`` requests/s (Poisson, open loop) for as long as the run lasts; each answer scored."""
    return InThread(target, users.ids, rate, budget_ms, seed=seed, describe=describing(users.targets))


# -- the catalogue --------------------------------------------------------------------------------
def upsert_items(addr: str, token: str, n: int) -> list[str]:
    from specrec_rpc.v1 import itemset_pb2

    ch, Stub = itemset_stub(addr)
    with ch:
        ids = [f"chaos-{uuid.uuid4().hex[:8]}" for _ in range(n)]
        Stub(ch).Upsert(itemset_pb2.UpsertRequest(items=[
            itemset_pb2.UpsertItem(item_id=i, title=f"chaos item {k}", text=f"chaos benchmark item {k}: a new lipstick")
            for k, i in enumerate(ids)]), metadata=(("authorization", f"Bearer {token}"),), timeout=30)
    return ids


def catalogue_check(addr: str, expected_n: int, upserted: list[str], timeout_s: float = 30.0) -> dict:
    """Items missing from the current catalogue (waits up to ``timeout_s`` for the item set to answer)."""
    import grpc

    from specrec_rpc.v1 import itemset_pb2

    ch, Stub = itemset_stub(addr)
    deadline = time.monotonic() + timeout_s
    with ch:
        stub = Stub(ch)
        while True:
            try:
                info = stub.GetVersion(itemset_pb2.GetVersionRequest(), timeout=5)
                res = stub.Resolve(itemset_pb2.ResolveRequest(item_ids=upserted), timeout=5)
                missing_upserted = len(res.missing)
                return {"version": info.version, "n_items": int(info.n_items),
                        "lost": max(0, expected_n - int(info.n_items)) + missing_upserted}
            except grpc.RpcError as e:
                if time.monotonic() > deadline:
                    return {"version": "", "n_items": 0, "lost": expected_n, "error": e.code().name}
                time.sleep(0.5)


# -- scenarios ------------------------------------------------------------------------------------
def measure_capacity(target: str, users, budget_ms: float, seconds: float = 4.0) -> float:
    """Answers/s of a closed loop, one request at a time (``auto`` at the budget: requests served one after
    another)."""
    return capacity(target, users.ids, 1, seconds, "auto", budget_ms)


def run_scenario(name: str, procs, redis: PrivateRedis, load: InThread, a, capacity: float) -> tuple[float, float]:
    """Inflict the fault; (start, end) of the fault in time.monotonic()."""
    t0 = time.monotonic()
    kind, _, svc = name.partition("-")
    if kind == "pause":
        p = procs.procs[svc]
        os.kill(p.pid, signal.SIGSTOP)
        time.sleep(a.fault_s)
        os.kill(p.pid, signal.SIGCONT)
    elif kind == "kill":
        p = procs.procs[svc]
        p.kill()
        p.wait()
        time.sleep(1.0)  # down for a moment before the new process starts (as a crash loop would)
        procs.start_one(svc, a.startup_timeout, say=say, append_log=True)
    elif name == "redis-loss":
        redis.kill()
        time.sleep(2.0)
        redis.start()  # empty: no persistence
    elif name == "overload":
        base = load.rate
        load.rate = a.flood_x * capacity
        time.sleep(a.fault_s)
        load.rate = base
    return t0, time.monotonic()


def recovery_s(recs: list[dict], t_end: float, streak: int) -> float:
    """Seconds from the end of the fault to the first of ``streak`` answers in a row served as with no fault:
    the policy's own choice, not degraded, no catalogue fill (NaN when it never happens in the records). The
    drafter's list counts when ``auto`` chose it (with the SASRec drafter it ranks above beam, and a tier that
    does not fit the budget hands over to it undegraded); a fallback to it is degraded and does not."""
    after = sorted((r for r in recs if r["t"] >= t_end - 1e-9), key=lambda r: r["t"])
    run = 0
    for i, r in enumerate(after):
        good = r["code"] == "OK" and r["model"] and not r["degraded"] and r["served_by"] != "fill"
        run = run + 1 if good else 0
        if run == streak:
            return max(0.0, after[i - streak + 1]["t"] - t_end)
    return float("nan")


def scenario_row(name: str, recs: list[dict], t0: float, t1: float, t_next: float, a, lost: int) -> dict:
    during = [r for r in recs if t0 <= r["t"] < t1]
    window = [r for r in recs if t0 <= r["t"] < t_next]
    codes = Counter(r["code"] for r in window)
    answered = [r for r in during if r["code"] == "OK"]
    row = {
        "scenario": name, "fault_s": t1 - t0, "requests_during": len(during),
        "model_share_during": (sum(r["model"] for r in during) / len(during)) if during else float("nan"),
        "degraded_share_during": (sum(r["degraded"] for r in during) / len(during)) if during else float("nan"),
        "p99_ms_during": pct([r["latency_ms"] for r in answered], 99),
        "p99_ms_window": pct([r["latency_ms"] for r in window if r["code"] == "OK"], 99),
        "shed_during": sum(r["code"] == "RESOURCE_EXHAUSTED" for r in during),
        "errors": {c: n for c, n in codes.items() if c != "OK"},
        "internal_errors": codes.get("INTERNAL", 0),
        "recovery_s": recovery_s(window, t1, a.streak),
        "served_by_during": dict(Counter(r["served_by"] or r["code"] for r in during)),
        "catalogue_items_lost": lost,
    }
    return row
