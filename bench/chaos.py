"""Chaos benchmark: faults under open-loop load through the gateway, faults of the machine included.

    python -m bench.chaos --bundle bundles/beauty-loo --rate 10 --budget-ms 100 --machine-budget-ms 30
    python -m bench.chaos --bundle bundles/beauty-loo --scenarios cpu-hog,one-core \\
        --machine-fault-s 3 --settle-s 2 --requests 200 --out /tmp/chaos-smoke      # a smoke run

Starts its own stack: a private ``redis-server`` without persistence (it is
killed in one scenario: never the machine's Redis), the item set, verifier,
drafter and gateway as subprocesses (the gateway's ``/metrics`` on a free
port), a private namespace.

**Faults of the machine** run first, on the fresh stack, at the budget
``--machine-budget-ms`` (30 ms) and at ``--machine-load`` (half) the
capacity measured at that budget (closed loop, one request at a time, as
below): Poisson arrivals of ``auto`` for ``--settle-s`` of warm-up, then
windows of ``--machine-fault-s`` seconds each, ``--settle-s`` apart:

- ``baseline``: no fault (the reference, in the same run);
- ``cpu-hog``: a busy process (a Python loop) on each CPU the request path
  runs on (the gateway, the drafter and the verifier: every CPU here), each
  confined to its CPU with ``sched_setaffinity``, started before its window
  and killed after it; the services stay where they were;
- ``one-core``: every thread of the whole request path (gateway, drafter and
  verifier) confined to one CPU (``--fault-cpu``, default the last this
  process may use; ``bench.cpus.confine``) for its window, their masks
  restored after.

Per window: the **undegraded share** (of the requests sent: answered with the
policy's own choice, not degraded, no catalogue fill, no budget exit; shed and
errors counting as not), the **recall ratio against no fault** (recall@10 of
the window's requests, shed and errors as misses, over recall@10 of the same
users asked again in the same run at the same rate with no fault, replayed
after the last window), the GR-ranked share (answers the GR model made or
ranked: not the item drafter's own list, no fill), the fill share (answers
holding catalogue fill, of the answers), the gateway's own p99 (its latency
histogram, ``specrec_rpc_latency_seconds`` of ``Recommend``, read when the
window opens and when it closes: the difference, interpolated within a
bucket as PromQL does), the caller's p99 (every request, from its scheduled
send), the shed share, and the CPU time each process used over the window
(the hog's share shows it took its CPU). With fewer than two CPUs they are
skipped, saying so (a fault that takes one CPU leaves none).

Then the other faults: a seeded random
sample of leave-one-out test users is sent as Poisson arrivals at ``--rate``
(policy ``auto``, budget ``--budget-ms``) for the whole run, while, in turn:

- ``pause-verifier`` / ``pause-drafter`` / ``pause-itemset``: SIGSTOP for
  ``--fault-s`` seconds, then SIGCONT;
- ``kill-verifier`` / ``kill-drafter`` / ``kill-itemset``: SIGKILL, then a new
  process on the same port (the fault lasts until it reports SERVING);
- ``redis-loss``: Redis killed and restarted empty on the same port (the item
  set restores the catalogue from its copy);
- ``overload``: the offered rate is raised to ``--flood-x`` times the
  capacity measured at the start (closed loop, one request at a time) for
  ``--fault-s`` seconds;
- ``kill-redis-primary``: run last, on a stack of its own over a
  Sentinel-managed Redis (a ``redis-server`` primary, one replica, three
  ``redis-sentinel`` processes, all private: ``specrec_rpc/localsentinel.py``).
  While the load runs, a writer upserts one item at a time through the item
  set; the primary is SIGKILLed and the sentinels promote the replica. It
  reports the acknowledged writes missing from the catalogue afterwards
  (``chaos.redis_failover_acked_writes_lost``), INTERNAL answers of writer and
  readers (``chaos.redis_failover_internal_errors``), and the recovery time
  from the kill (``chaos.redis_failover_recovery_s``: until writes are
  acknowledged again and ``--streak`` answers in a row are undegraded model
  answers, whichever comes later).

Before the faults a few items are upserted; after each scenario the current
catalogue must still hold every item (``catalogue_items_lost``).

Per scenario: errors by gRPC code; the share of answers ranked by a model
(not catalogue fill, errors counted as not) while the fault lasts; p99 of
the client latency (from the scheduled send); the time to recover after the
fault ends (until ``--streak`` answers in a row are model answers that are
not degraded); catalogue items lost. Writes ``chaos.{json,md}`` and
``chaos.png`` (timeline) into ``--out``, the ``chaos.*`` summary keys of the
scenarios that ran (the faults of the machine:
``chaos.{cpu_hog,one_core}.{server_p99_ms,client_p99_ms,undegraded_share,
recall_ratio_vs_no_fault,gr_ranked_share,fill_share,shed_share}``; a fault of
the machine skipped retires its keys),
and its section of README.md there.
"""

from __future__ import annotations

import argparse
import asyncio
import bisect
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from bench.cpus import Hog, affinity, confine, cpu_seconds, restore, usable
from bench.harness import (
    Stack,
    Writer,
    add_common_args,
    command_line,
    fmt,
    itemset_stub,
    machine_line,
    metrics_url,
    no_nan,
    pct,
    raise_on_signals,
    run_line,
    sample_users,
    sayer,
    scrape_histogram,
    server_figures,
)
from bench.loadgen import InThread, capacity, model_answer, poisson
from specrec.eval.results import markdown_table, readme_section, update_summary, write_json
from specrec_rpc.localstack import free_port, redis_ping

SCENARIOS = ("cpu-hog", "one-core", "pause-verifier", "kill-verifier", "pause-drafter", "kill-drafter",
             "pause-itemset", "kill-itemset", "redis-loss", "overload", "kill-redis-primary")
SENTINEL_SCENARIOS = {"kill-redis-primary"}  # run on a stack of their own, over a Sentinel-managed Redis
MODEL_FAULTS = {"pause-verifier", "kill-verifier", "pause-drafter", "kill-drafter"}  # one of the two models is away
MACHINE_SCENARIOS = ("cpu-hog", "one-core")  # faults of the machine: run first, at their own budget and rate
#: a fault of the machine's summary keys: chaos.<scenario, with _>.<figure>
MACHINE_FIGURES = ("server_p99_ms", "client_p99_ms", "undegraded_share", "recall_ratio_vs_no_fault", "gr_ranked_share",
                   "fill_share", "shed_share")
#: a fault of the machine's keys retired: model_answer_share counted only the lists the verifier made while ``auto``
#: served SASRec's, ~0 with or without the fault
MACHINE_REPLACED = ("model_answer_share",)
#: from a fault of the machine starting to its window opening: the hog's interpreter starting (the window then
#: holds how the stack adapts to the fault)
HOLD_S = 0.25
#: this benchmark's section of the results README
README_OWNER = "bench.chaos"

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


# -- faults of the machine ----------------------------------------------------------------------------
class Fault:
    """A fault of the machine for one window: :meth:`start` it (-> the processes of the fault itself, to account
    their CPU time), :meth:`stop` it. This one does nothing: the ``baseline`` window, the same load alone."""

    def start(self) -> dict[str, int]:
        return {}

    def stop(self) -> None:
        pass


class CpuHog(Fault):
    """``cpu-hog``: a busy process on each of ``cpus`` (:class:`bench.cpus.Hog`), the CPUs the request path runs on;
    the services untouched."""

    def __init__(self, cpus: list[int]):
        self.hogs = [Hog(c) for c in cpus]

    def start(self) -> dict[str, int]:
        return {f"hog{h.cpu}": h.start().pid for h in self.hogs}

    def stop(self) -> None:
        for h in self.hogs:
            h.stop()


class OneCore(Fault):
    """``one-core``: every thread of the request path's processes (``pids``: gateway, drafter, verifier) confined to
    ``cpu``; their masks back after."""

    def __init__(self, pids: list[int], cpu: int):
        self.pids, self.cpu = pids, cpu
        self.before: dict[int, dict[int, set[int]]] = {}

    def start(self) -> dict[str, int]:
        self.before = confine(self.pids, {self.cpu})
        return {}

    def stop(self) -> None:
        restore(self.before)


def cpu_shares(before: dict[str, float | None], after: dict[str, float | None], seconds: float) -> dict[str, float]:
    """CPU seconds per second of each process over a window (1.0: one CPU the whole time), from two readings of
    :func:`bench.cpus.cpu_seconds` (a process unread at either end left out)."""
    out = {}
    for n, b in before.items():
        e = after.get(n)
        if b is not None and e is not None and seconds > 0:
            out[n] = round((e - b) / seconds, 3)
    return out


def machine_row(name: str, recs: list[dict], s0: float, s1: float, server: dict, extra: dict) -> dict:
    """The figures of a window of a fault of the machine: the records sent in [s0, s1) and the gateway's
    histogram over it (``server``: :func:`bench.harness.server_figures`)."""
    part = [r for r in recs if s0 <= r["t"] < s1]
    ok = [r for r in part if r["code"] == "OK"]
    nan = float("nan")
    codes = Counter(r["code"] for r in part)
    return {
        "scenario": name, "seconds": s1 - s0, "requests": len(part), "offered_rps": len(part) / max(s1 - s0, 1e-9),
        # the policy's own choice, answered whole: not degraded, no fill, no budget exit (of the requests sent)
        "undegraded_share": sum(undegraded(r) for r in part) / len(part) if part else nan,
        "recall@10": sum(bool(r.get("hit")) for r in part) / len(part) if part else nan,
        "users": [r["user"] for r in part],
        "gr_ranked_share": sum(model_answer(r) for r in ok) / len(ok) if ok else nan,
        "fill_share": sum(bool(r.get("any_fill")) for r in ok) / len(ok) if ok else nan,
        "drafter_share": sum(r["served_by"] == "drafter" for r in ok) / len(ok) if ok else nan,
        "degraded_share": sum(bool(r["degraded"]) for r in ok) / len(ok) if ok else nan,
        "shed_share": codes.get("RESOURCE_EXHAUSTED", 0) / len(part) if part else nan,
        "errors": {c: n for c, n in codes.items() if c != "OK"},
        "internal_errors": codes.get("INTERNAL", 0),
        "client_p99_ms": pct([r["latency_ms"] for r in part], 99),
        "client_p99_answered_ms": pct([r["latency_ms"] for r in ok], 99),
        "generator_lag_p99_ms": pct([r["send_lag_ms"] for r in part], 99),  # the load thread's own, in this process
        "server_stats_p99_ms": pct([r["server_ms"] for r in ok], 99),
        "served_by": dict(Counter(r["served_by"] or r["code"] for r in part)),
        **server, **extra,
    }


def undegraded(rec: dict) -> bool:
    """An answer that is the policy's own choice, whole: OK, not degraded, no catalogue fill, no budget exit."""
    return (rec["code"] == "OK" and not rec["degraded"] and not rec.get("any_fill") and rec.get("model", False)
            and rec.get("exit") != "budget")


def replay(target: str, users, idx: list[int], rate: float, budget_ms: float, seed: int) -> float:
    """recall@10 of users ``idx`` (in that order) asked again as Poisson arrivals at ``rate`` with no fault, shed
    and errors as misses: the reference a fault window's recall is divided by (the same users, the same run)."""
    if not idx:
        return float("nan")
    hist = [users.ids[i] for i in idx]
    score = describing([users.targets[i] for i in idx])
    recs, _, _ = asyncio.run(poisson(target, hist, rate=rate, duration=len(idx) / rate * 1.5, policy="auto",
                                     budget_ms=budget_ms, seed=seed, describe=score))
    seen: dict[int, bool] = {}
    for r in recs:  # each user once (the arrivals may run past the list and wrap)
        seen.setdefault(r["user"], bool(r.get("hit")))
    return sum(seen.values()) / len(idx)


def machine_keys(rows: list[dict]) -> dict:
    """The summary keys of the faults of the machine (``chaos.cpu_hog.server_p99_ms`` ...; not the baseline's)."""
    return {f"chaos.{r['scenario'].replace('-', '_')}.{f}": r.get(f, float("nan")) for r in rows
            if r["scenario"] in MACHINE_SCENARIOS for f in MACHINE_FIGURES}


def run_machine_phase(a, procs, users, names: list[str]) -> dict:
    """The faults of the machine (``names``, after a ``baseline`` window) under ``auto`` at ``a.machine_load`` x
    the capacity measured at ``a.machine_budget_ms``. -> rows, records, windows, what was measured first; or
    ``skipped`` (why) with fewer than two CPUs."""
    cpus = usable()
    res: dict = {"names": names, "rows": [], "records": [], "windows": [], "budget_ms": a.machine_budget_ms}
    if len(cpus) < 2:
        res["skipped"] = (f"{', '.join(names)} skipped: this process may use {len(cpus)} CPU ({cpus}), and a fault "
                          "that takes one CPU leaves the stack none")
        say(res["skipped"])
        return res
    cpu = cpus[-1] if a.fault_cpu is None else a.fault_cpu
    path = [procs.procs[k].pid for n in ("gateway", "drafter", "verifier") for k in procs.keys(n)
            if k in procs.procs]  # the request path
    target, metrics = procs.addr("gateway"), metrics_url(procs, "gateway")
    cap = measure_capacity(target, users, a.machine_budget_ms)
    rate = a.machine_load * cap
    res.update(capacity_rps=cap, rate=rate, cpu=cpu)
    say(f"faults of the machine: capacity {cap:.1f} answers/s at {a.machine_budget_ms:g} ms (closed loop, one at a "
        f"time); {rate:.1f} rps offered, faults on CPU {cpu}")
    watched = {k: p.pid for k, p in procs.procs.items()}
    load = make_load(target, users, a.machine_budget_ms, rate, seed=a.seed + 2)
    windows = []
    load.start()
    try:
        time.sleep(a.settle_s)  # warm-up at the rate, not measured
        for name in ["baseline", *names]:
            fault = Fault() if name == "baseline" else CpuHog(cpus) if name == "cpu-hog" else OneCore(path, cpu)
            try:
                pids = {**watched, **fault.start()}
                time.sleep(HOLD_S)
                extra: dict = {"cpu": None if name == "baseline" else ",".join(map(str, cpus)) if name == "cpu-hog"
                               else cpu}
                error = None
                try:
                    h0 = scrape_histogram(metrics)
                except OSError as e:
                    h0, error = None, str(e)
                s0 = time.monotonic()
                c0 = {n: cpu_seconds(pid) for n, pid in pids.items()}
                if name == "one-core":  # where the request path's threads may run while its window lasts
                    extra["path_cpus"] = sorted({c for v in path for cs in affinity(v).values() for c in cs})
                time.sleep(a.machine_fault_s)
                s1 = time.monotonic()
                c1 = {n: cpu_seconds(pid) for n, pid in pids.items()}
                server: dict = {"server_p99_ms": float("nan")}
                try:
                    if h0 is not None:
                        server = server_figures(scrape_histogram(metrics) - h0, a.machine_budget_ms)
                        if not server["server_count"]:
                            error = "the gateway's histogram observed no Recommend in the window"
                except (OSError, ValueError) as e:
                    error = str(e)
            finally:
                fault.stop()
            extra["cpu_share"] = cpu_shares(c0, c1, s1 - s0)
            if error:
                extra["server_error"] = error
            windows.append((name, s0, s1, server, extra))
            say(f"{name}: {s1 - s0:.1f} s, gateway p99 {fmt(server['server_p99_ms'])} ms; CPU "
                + ", ".join(f"{n} {v:.2f}" for n, v in extra["cpu_share"].items()))
            time.sleep(a.settle_s)
    finally:
        load.stop()
    recs = list(load.records)
    res["rows"] = [machine_row(name, recs, s0, s1, server, extra) for name, s0, s1, server, extra in windows]
    for n, r in enumerate(res["rows"]):  # each window's users again, no fault: the same users, the same run
        if r["scenario"] == "baseline":
            continue
        r["recall@10_no_fault"] = ref = replay(target, users, r.pop("users"), rate, a.machine_budget_ms, a.seed + n)
        r["recall_ratio_vs_no_fault"] = r["recall@10"] / ref if ref else float("nan")
        say(f"{r['scenario']}: recall@10 {fmt(r['recall@10'], '.4f')} against {fmt(ref, '.4f')} for the same users "
            "with no fault")
    for r in res["rows"]:
        r.pop("users", None)
    res["records"] = recs
    res["windows"] = [(name, s0, s1) for name, s0, s1, _, _ in windows if name != "baseline"]
    for r in res["rows"]:
        say(f"{r['scenario']}: undegraded {fmt(r['undegraded_share'], '.1%')}, GR-ranked "
            f"{fmt(r['gr_ranked_share'], '.1%')}, fill "
            f"{fmt(r['fill_share'], '.1%')}, gateway p99 {fmt(r['server_p99_ms'])} ms, caller p99 "
            f"{fmt(r['client_p99_ms'])} ms, shed {fmt(r['shed_share'], '.1%')}")
    return res


# -- outputs --------------------------------------------------------------------------------------
def plot(recs: list[dict], windows: list[tuple[str, float, float]], t_base: float, budgets_ms: list[float],
         path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax, ax2) = plt.subplots(2, 1, figsize=(13, 6.5), sharex=True, gridspec_kw={"height_ratios": [3, 1]})
    kinds = {"model": ("tab:blue", lambda r: r["code"] == "OK" and r["model"] and not r["degraded"]),
             "model, degraded": ("tab:orange", lambda r: r["code"] == "OK" and r["model"] and r["degraded"]),
             "fill": ("tab:red", lambda r: r["code"] == "OK" and not r["model"]),
             "shed": ("tab:gray", lambda r: r["code"] == "RESOURCE_EXHAUSTED"),
             "error": ("black", lambda r: r["code"] not in ("OK", "RESOURCE_EXHAUSTED"))}
    for label, (color, pred) in kinds.items():
        sel = [r for r in recs if pred(r)]
        if sel:
            ax.scatter([r["t"] - t_base for r in sel], [r["latency_ms"] for r in sel], s=6, c=color, label=label)
    for name, t0, t1 in windows:
        for a_ in (ax, ax2):
            a_.axvspan(t0 - t_base, t1 - t_base, color="tab:red", alpha=0.08)
        ax.text((t0 + t1) / 2 - t_base, 1.02, name, transform=ax.get_xaxis_transform(), ha="center", fontsize=7,
                rotation=20)
    for budget_ms, ls in zip(sorted(set(budgets_ms)), ("--", ":", "-.")):
        ax.axhline(budget_ms, color="k", ls=ls, lw=0.8, label=f"budget {budget_ms:g} ms")
    ax.set_yscale("log")
    ax.set_ylabel("client latency, ms")
    ax.legend(loc="upper right", fontsize=7, ncol=3)
    # model share per second
    t = np.asarray([r["t"] - t_base for r in recs])
    good = np.asarray([r["code"] == "OK" and r["model"] for r in recs], dtype=float)
    if len(t):
        bins = np.arange(0, t.max() + 1.0, 1.0)
        idx = np.digitize(t, bins)
        share = [good[idx == i].mean() if (idx == i).any() else np.nan for i in range(1, len(bins))]
        ax2.plot(bins[:-1], share, drawstyle="steps-post")
    ax2.set_ylim(-0.05, 1.05)
    ax2.set_ylabel("model answers")
    ax2.set_xlabel("seconds")
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def write_results(out: Path, res: dict) -> dict:
    """The summary keys of the scenarios that ran (a fault of the machine skipped retires its keys), then
    ``chaos.{json,md}``, the README section and ``summary.json``."""
    rows = res["scenarios"]
    mf = res.get("machine_faults") or {}
    mrows = mf.get("rows", [])
    faults = [r for r in rows if r["scenario"] in MODEL_FAULTS]
    during = sum(r["requests_during"] for r in faults)
    model = sum(r["model_share_during"] * r["requests_during"] for r in faults if r["requests_during"])
    over = [r for r in rows if r["scenario"] == "overload"]
    fo = [r for r in rows if r["scenario"] == "kill-redis-primary"]
    summary: dict = {}
    if rows:
        summary["chaos.catalogue_items_lost"] = int(max([r["catalogue_items_lost"] for r in rows], default=0))
        summary["chaos.recovery_s_max"] = float(np.nanmax([r["recovery_s"] for r in rows]))
        if any(np.isnan(r["recovery_s"]) for r in rows):
            summary["chaos.recovery_s_max"] = float("inf")  # a scenario never recovered within the run
        # over every fault of the run, the machine's included (alone, theirs are in their table)
        summary["chaos.internal_errors"] = int(sum(r["internal_errors"] for r in [*rows, *mrows]))
    if faults:
        summary["chaos.model_answer_share_during_faults"] = model / during if during else float("nan")
    if over:
        summary["chaos.overload_p99_over_budget_ms"] = over[0]["p99_ms_during"] - res["budget_ms"]
    if fo:
        summary.update({"chaos.redis_failover_acked_writes_lost": int(fo[0]["acked_writes_lost"]),
                        "chaos.redis_failover_internal_errors": int(fo[0]["internal_errors"]),
                        "chaos.redis_failover_recovery_s": float(fo[0]["recovery_s"]),
                        "chaos.redis_failover.acked_without_replica": int(fo[0].get("acked_without_replica", -1))})
    summary.update(machine_keys(mrows))
    retire = tuple(f"chaos.{n.replace('-', '_')}.{f}" for n in mf.get("names", []) for f in MACHINE_FIGURES
                   if mf.get("skipped")) + tuple(f"chaos.{n.replace('-', '_')}.{f}" for n in MACHINE_SCENARIOS
                                                 for f in MACHINE_REPLACED)
    res["summary"] = summary
    write_json("chaos", no_nan(res), out)
    parts = [f"# Chaos benchmark\n\n{head_line(res)}\n"]
    if mf:
        table = "" if mf.get("skipped") else machine_table(mrows)
        parts.append(f"## Faults of the machine\n\n{machine_line_of(mf)}\n\n{table}")
    if rows:
        parts.append(f"## Faults of the services and of Redis\n\n{scenario_table(rows)}")
    (out / "chaos.md").write_text("\n".join(parts) + "\n")
    readme_section(out / "README.md", README_OWNER, readme_body(no_nan(res)), retire=("bench/chaos.py",))
    update_summary(no_nan(summary), out / "summary.json", retire=retire)
    return summary


def scenario_table(rows: list[dict]) -> str:
    cols = ["scenario", "fault s", "requests", "model share", "degraded share", "p99 ms (during)", "shed", "errors",
            "recovery s", "items lost"]
    return markdown_table([dict(zip(cols, [
        r["scenario"], fmt(r["fault_s"], ".1f"), r["requests_during"], fmt(r["model_share_during"], ".1%"),
        fmt(r["degraded_share_during"], ".1%"), fmt(r["p99_ms_during"], ".1f"), r["shed_during"],
        ", ".join(f"{c} {n}" for c, n in sorted(r["errors"].items())) or "none", fmt(r["recovery_s"], ".2f"),
        r["catalogue_items_lost"]])) for r in rows], cols)


def machine_table(rows: list[dict]) -> str:
    """The windows of the faults of the machine, the baseline first."""
    cols = ["window", "CPU", "seconds", "requests", "undegraded", "R@10 / no fault", "GR-ranked", "fill", "drafter",
            "shed", "errors", "gateway p99 ms", "its bucket ms", "over budget", "caller p99 ms", "CPU s / s"]

    def bucket(b) -> str:
        return "n/a" if not b else f"{fmt(b[0], 'g')}-{fmt(b[1], 'g') if b[1] is not None else 'inf'}"

    return markdown_table([dict(zip(cols, [
        r["scenario"], "all" if r.get("cpu") is None else r["cpu"], fmt(r["seconds"], ".1f"), r["requests"],
        fmt(r.get("undegraded_share"), ".1%"),
        f"{fmt(r.get('recall@10'), '.3f')} / {fmt(r.get('recall@10_no_fault'), '.3f')}"
        f" = {fmt(r.get('recall_ratio_vs_no_fault'), '.2f')}" if r.get("recall@10_no_fault") is not None else "",
        fmt(r.get("gr_ranked_share"), ".1%"), fmt(r["fill_share"], ".1%"), fmt(r["drafter_share"], ".1%"),
        fmt(r["shed_share"], ".1%"), ", ".join(f"{c} {n}" for c, n in sorted(r["errors"].items())) or "none",
        fmt(r["server_p99_ms"]), bucket(r.get("server_p99_bucket_ms")), fmt(r.get("server_over_budget_share"), ".1%"),
        fmt(r["client_p99_ms"]), ", ".join(f"{n} {v:.2f}" for n, v in r.get("cpu_share", {}).items())]))
        for r in rows], cols)


def machine_line_of(mf: dict) -> str:
    """What the faults of the machine ran at (``mf``: what ``chaos.json`` holds of them)."""
    if mf.get("skipped"):
        return f"Skipped: {mf['skipped']}."
    return (f"`auto` at {mf['budget_ms']:g} ms, {fmt(mf.get('rate'))} requests/s offered (Poisson): "
            f"{mf.get('load', 0.5):g} x the capacity measured at that budget first ({fmt(mf.get('capacity_rps'))} "
            f"answers/s, closed loop, one at a time); `cpu-hog`'s hogs on every CPU, `one-core` on CPU "
            f"{mf.get('cpu')}, each for a window of its own "
            "after a `baseline` window without one. Undegraded: the policy's own choice, answered whole (not degraded, "
            "no fill, no budget exit), of the requests sent, shed and errors counting as not; R@10 / no fault: the "
            "window's recall@10 (shed and errors as misses) over that of the same users asked again after the last "
            "window, at the same rate, with no fault; GR-ranked: the GR model's lists (made or ranked by it: not the "
            "item drafter's own, no fill) of the answers; fill: answers holding "
            "catalogue fill, of the answers; gateway p99: its own latency histogram over the window (the difference "
            "of two readings, interpolated within the bucket as PromQL does; the bucket and the share over the budget "
            "beside it); caller p99: every request from its scheduled send; CPU s / s: the CPU time each process "
            "used over the window.")


def head_line(res: dict) -> str:
    line = f"Produced by `{res['command']}` ({res['machine']}). {res['users']}."
    if res["scenarios"]:
        line += (f" Faults of the services: policy auto, budget {res['budget_ms']:g} ms, {res['rate']:g} requests/s "
                 f"offered (Poisson), capacity measured at {fmt(res['capacity_rps'])} answers/s (closed loop, one at "
                 f"a time), overload at {res['flood_x']:g}x that.")
    return line


def readme_body(res: dict) -> str:
    """This benchmark's section of the results README (``res``: what ``chaos.json`` holds)."""
    keys = ", ".join(f"`{k.removeprefix('chaos.')}` {fmt(v, '.3g') if isinstance(v, float) else v}"
                     for k, v in res["summary"].items())
    mf = res.get("machine_faults") or {}
    parts = [
        "## Chaos: faults under load (`bench.chaos`, `chaos.*`)\n",
        f"Command (rerun step `chaos`): `{res['command']}`\n",
        f"Run: {res.get('run', 'n/a')}. {res['machine']}. {res['users']}. Table: [`chaos.md`](chaos.md).\n",
    ]
    if mf:
        parts += [f"Faults of the machine (`cpu-hog`: a busy process on each CPU the request path runs on; `one-core`: "
                  f"the gateway, the drafter and the verifier confined to one CPU together), run first: "
                  f"{machine_line_of(mf)}\n",
                  *([] if mf.get("skipped") else [machine_table(mf.get("rows", []))])]
    if res["scenarios"]:
        parts += [
            f"Faults of the services and of Redis: `auto` at {res['budget_ms']:g} ms, {res['rate']:g} requests/s "
            f"offered (Poisson); `overload` offers {res['flood_x']:g}x the capacity measured first "
            f"({fmt(res['capacity_rps'])} answers/s, closed loop, one at a time). Model share: the requests sent "
            "during the fault answered by the GR model or the drafter, not catalogue fill (errors count as not); "
            "recovery: from the fault's end (SIGCONT, or the new process SERVING) to the first of "
            f"{res['streak']} undegraded answers in a row from the GR model through the verifier. "
            "`kill-redis-primary` runs last, on a stack of its own over a Sentinel-managed Redis (a primary, a "
            "replica, three sentinels) with a writer upserting one item at a time: its fault lasts from the SIGKILL "
            "to the promotion, its recovery until writes are acknowledged again and the answers have recovered; its "
            "items lost are acknowledged writes missing afterwards.\n",
            scenario_table(res["scenarios"]),
        ]
    return "\n".join([*parts, f"Keys: {keys}.\n", "![timeline](chaos.png)\n"])


class ReplicaWatch:
    """The replicas connected to whichever data server is the primary, read every ``every_s`` in a thread of its
    own (``polls``: (time, connected replicas), None while no server is primary): which acknowledged writes no
    replica can have held."""

    def __init__(self, ports: list[int], every_s: float = 0.02):
        import redis

        self.clients = [redis.Redis(port=p, socket_timeout=0.2, socket_connect_timeout=0.2) for p in ports]
        self.every_s, self.polls = every_s, []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="replica-watch", daemon=True)

    def _run(self) -> None:
        import redis

        while not self._stop.is_set():
            n = None
            for c in self.clients:
                try:
                    info = c.info("replication")
                except redis.RedisError:
                    continue  # killed, or not answering
                if info.get("role") == "master":
                    n = int(info.get("connected_slaves", 0) or 0)
                    break
            self.polls.append((time.monotonic(), n))
            self._stop.wait(self.every_s)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(5)
        for c in self.clients:
            c.close()

    def without_replica(self, done: list[float]) -> int:
        """The writes acknowledged at times ``done`` when the primary had no replica: the last reading before
        the acknowledgement and the first after it both say none (a replica that connected in between is given
        the benefit of the doubt)."""
        times = [t for t, _ in self.polls]
        count = 0
        for d in done:
            i = bisect.bisect_right(times, d)
            if 0 < i < len(self.polls) and not self.polls[i - 1][1] and not self.polls[i][1]:
                count += 1
        return count


def run_failover_phase(a, bundle_dir: Path, bundle, users, tmp: Path, name: str = "kill-redis-primary") -> dict:
    """The ``kill-redis-primary`` scenario on a stack of its own over a Sentinel-managed Redis: a primary and two
    replicas (the failover leaves one), three sentinels."""
    from specrec_rpc.localsentinel import LocalSentinel

    rs = LocalSentinel(tmp / "sentinel", replicas=2).start()
    say(f"{name}: Sentinel-managed Redis up ({rs.url}); starting the stack on it")
    stack = Stack(bundle_dir, rs.url, tmp / "logs-failover", "chaos-fo", threads=a.threads,
                  max_history=bundle.cfg.max_history, env={"SPECREC_ITEMSET_REDIS_TIMEOUT_S": "1.0"})
    procs = stack.procs
    load = writer = None
    watch = ReplicaWatch(rs.data_ports)
    try:
        procs.start(a.startup_timeout, say=say)
        watch.start()
        load = make_load(procs.addr("gateway"), users, a.budget_ms, a.rate, seed=a.seed + 1)
        writer = Writer(procs.addr("itemset"), procs.token)
        load.start()
        writer.start()
        time.sleep(a.settle_s)
        old = rs.kill_primary()
        t0 = time.monotonic()
        new, promoted_s = rs.wait_promoted(old, 60.0)
        t1 = time.monotonic()
        say(f"{name}: primary {old} killed, {new} promoted after {promoted_s:.2f} s")
        time.sleep(a.settle_s)
        writer.stop()
        load.stop()
        watch.stop()
        t_next = time.monotonic()
        acked = dict(writer.acked)
        without = watch.without_replica([r["done"] for r in writer.records if r["code"] == "OK"])
        check = catalogue_check(procs.addr("itemset"), 0, list(acked))
        recs = list(load.records)
        row = scenario_row(name, recs, t0, t1, t_next, a, check["lost"])
        # recovery from the kill: writes acknowledged again, and the readers' answers undegraded model answers
        w_after = sorted(r["done"] for r in writer.records if r["t"] >= t0 and r["code"] == "OK")
        write_recovery = (w_after[0] - t0) if w_after else float("inf")
        read_recovery = recovery_s([r for r in recs if r["t"] >= t0], t0, a.streak)
        w_codes = Counter(r["code"] for r in writer.records)
        row.update(recovery_s=max(write_recovery, read_recovery if not np.isnan(read_recovery) else float("inf")),
                   write_recovery_s=write_recovery, read_recovery_s=read_recovery, promoted_s=promoted_s,
                   acked_writes=len(acked), acked_writes_lost=check["lost"], write_codes=dict(w_codes),
                   acked_without_replica=without,
                   internal_errors=row["internal_errors"] + w_codes.get("INTERNAL", 0))
        say(f"{name}: {len(acked)} writes acknowledged, {check['lost']} of them lost, {without} with no replica "
            f"connected to the primary; writes {dict(w_codes)}; "
            f"recovery {row['recovery_s']:.2f} s (writes {write_recovery:.2f} s, reads {read_recovery:.2f} s)")
        return {"row": row, "records": recs, "window": (name, t0, t1)}
    finally:
        watch.stop()
        if writer is not None:
            writer.stop()
        if load is not None:
            load.stop()
        stack.stop(say=say, delete_namespace=False)  # the private Sentinel-managed Redis goes with the run
        rs.stop()


def parse(argv):
    ap = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    ap.add_argument("--bundle", required=True)
    ap.add_argument("--rate", type=float, default=10.0, help="offered requests/s outside the overload scenario")
    ap.add_argument("--budget-ms", type=float, default=100.0)
    ap.add_argument("--fault-s", type=float, default=6.0, help="length of a pause or of the overload")
    ap.add_argument("--settle-s", type=float, default=6.0, help="seconds of load after each fault, before the next")
    ap.add_argument("--flood-x", type=float, default=2.0, help="overload: offered rate / measured capacity")
    ap.add_argument("--streak", type=int, default=5, help="answers in a row that mark recovery")
    ap.add_argument("--scenarios", default=",".join(SCENARIOS))
    ap.add_argument("--requests", type=int, default=500, help="test users sampled")
    ap.add_argument("--upserts", type=int, default=5, help="items upserted before the faults")
    ap.add_argument("--machine-budget-ms", type=float, default=30.0, help="faults of the machine: the budget")
    ap.add_argument("--machine-load", type=float, default=0.5,
                    help="faults of the machine: offered rate / the capacity measured at their budget")
    ap.add_argument("--machine-fault-s", type=float, default=20.0,
                    help="faults of the machine: the length of each window (and of the baseline's)")
    ap.add_argument("--fault-cpu", type=int, default=None,
                    help="faults of the machine: the CPU the hog takes and the verifier is confined to. None: the "
                    "last CPU this process may use")
    add_common_args(ap, redis_url=False)  # chaos starts (and kills) a redis-server of its own
    return ap.parse_args(argv)


def main(argv=None) -> int:
    a = parse(argv)
    command = command_line("bench.chaos", argv)
    scenarios = [s.strip() for s in a.scenarios.split(",") if s.strip()]
    bad = [s for s in scenarios if s not in SCENARIOS]
    if bad:
        raise SystemExit(f"unknown scenarios {bad}; known: {', '.join(SCENARIOS)}")
    if a.fault_cpu is not None and a.fault_cpu not in usable():
        raise SystemExit(f"--fault-cpu {a.fault_cpu}: this process may use CPUs {usable()} only")
    raise_on_signals(signal.SIGTERM)

    from specrec.bundle import Bundle

    bundle_dir = Path(a.bundle).resolve()
    bundle = Bundle.load(bundle_dir)
    users = sample_users(bundle, a.requests, a.seed)
    say(users.source)
    tmp = Path(tempfile.mkdtemp(prefix="specrec-chaos-"))
    redis = PrivateRedis(free_port(), tmp / "redis")
    redis.start()
    # the namespace is never deleted: the private Redis goes with the run
    procs = Stack(bundle_dir, redis.url, tmp / "logs", "chaos", threads=a.threads,
                  max_history=bundle.cfg.max_history, metrics=("gateway",)).procs
    res = {"command": command, "run": run_line(), "users": users.source, "machine": machine_line(),
           "budget_ms": a.budget_ms, "rate": a.rate, "flood_x": a.flood_x, "streak": a.streak, "scenarios": []}
    res["capacity_rps"] = float("nan")  # measured by the first phase (when it runs)
    machine = [s for s in scenarios if s in MACHINE_SCENARIOS]
    single = [s for s in scenarios if s not in SENTINEL_SCENARIOS and s not in MACHINE_SCENARIOS]
    failover = [s for s in scenarios if s in SENTINEL_SCENARIOS]
    load = None
    windows: list[tuple[str, float, float]] = []
    recs: list[dict] = []
    t_base: float | None = None  # where the timeline starts: the first load's start
    mf: dict = {}
    try:
        if machine or single:
            procs.start(a.startup_timeout, say=say)
        if machine:  # first, on the fresh stack
            mf = run_machine_phase(a, procs, users, machine)
            mf["load"] = a.machine_load
            res["machine_faults"] = {k: v for k, v in mf.items() if k not in ("records", "windows")}
            recs.extend(mf["records"])
            windows.extend(mf["windows"])
            t_base = min((r["t"] for r in mf["records"]), default=None)
        if single:
            target = procs.addr("gateway")
            capacity = measure_capacity(target, users, a.budget_ms)
            res["capacity_rps"] = capacity
            say(f"capacity (closed loop, one at a time): {capacity:.1f} answers/s")
            base = catalogue_check(procs.addr("itemset"), 0, [])
            upserted = upsert_items(procs.addr("itemset"), procs.token, a.upserts)
            expected = base["n_items"] + len(upserted)
            say(f"catalogue: {base['n_items']} items, {len(upserted)} upserted -> {expected} expected")
            load = make_load(target, users, a.budget_ms, a.rate, seed=a.seed)
            load.start()
            t_base = time.monotonic() if t_base is None else t_base
            time.sleep(a.settle_s)
            marks = []
            for name in single:
                say(f"scenario {name}")
                t0, t1 = run_scenario(name, procs, redis, load, a, capacity)
                windows.append((name, t0, t1))
                time.sleep(a.settle_s)
                check = catalogue_check(procs.addr("itemset"), expected, upserted)
                marks.append((name, t0, t1, time.monotonic(), check))
                say(f"{name}: fault {t1 - t0:.1f} s; catalogue {check['n_items']} items (version {check['version']}), "
                    f"lost {check['lost']}")
            load.stop()
            recs.extend(load.records)
            for name, t0, t1, t_next, check in marks:
                row = scenario_row(name, recs, t0, t1, t_next, a, check["lost"])
                res["scenarios"].append(row)
                say(
                    f"{name}: model share {fmt(row['model_share_during'], '.1%')}, "
                    f"p99 {fmt(row['p99_ms_during'], '.1f')} ms, "
                    f"errors {row['errors'] or 'none'}, recovery {fmt(row['recovery_s'], '.2f')} s"
                )
        if machine or single:
            procs.stop(say=say)  # the next phase runs a stack of its own on the same cores
            redis.kill()
        if failover:
            ph = run_failover_phase(a, bundle_dir, bundle, users, tmp)
            res["scenarios"].append(ph["row"])
            recs.extend(ph["records"])
            windows.append(ph["window"])
        res["records"] = recs
    except KeyboardInterrupt:
        say("interrupted: stopping the stack; nothing written")
        return 130
    finally:
        if load is not None:
            load.stop()
        for p in procs.procs.values():  # a paused process cannot stop
            try:
                os.kill(p.pid, signal.SIGCONT)
            except ProcessLookupError:
                pass
        procs.stop(say=say)
        redis.kill()
        shutil.rmtree(tmp / "redis", ignore_errors=True)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    budgets = ([a.machine_budget_ms] if machine else []) + ([a.budget_ms] if single or failover else [])
    first = (f"faults of the machine at {fmt(mf.get('rate'), '.0f')} rps, {a.machine_budget_ms:g} ms"
             if machine and not mf.get("skipped") else "")
    rest = f"auto at {a.rate:g} rps, budget {a.budget_ms:g} ms" if single or failover else ""
    plot(
        recs,
        windows,
        t_base if t_base is not None else min((r["t"] for r in recs), default=0.0),
        budgets,
        out / "chaos.png",
        f"{bundle.name}: {'; then '.join(x for x in (first, rest) if x) or 'no load'}; {os.cpu_count()} CPUs, "
        "everything co-located",
    )
    summary = write_results(out, res)
    print(json.dumps(no_nan(summary), indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
