"""``bench.chaos``'s faults of the machine: ``cpu-hog`` (a busy process on each CPU the request path runs on) and
``one-core`` (the whole request path confined to one CPU), each for a window of its own after a ``baseline``
window, under ``auto`` at a share of the capacity measured at their budget (:func:`run_machine_phase`).

Per window (:func:`machine_row`): the undegraded share, recall@10 over that of the same users asked again with no
fault (:func:`replay`), the GR-ranked, fill and shed shares, the gateway's own p99 (its histogram over the window)
and the caller's, and the CPU time each process used (:func:`cpu_shares`); the summary keys
``chaos.{cpu_hog,one_core}.<figure>`` (:func:`machine_keys`).
"""

from __future__ import annotations

import asyncio
import time
from collections import Counter

from bench.chaos_services import describing, make_load, measure_capacity
from bench.cpus import Hog, affinity, confine, cpu_seconds, restore, usable
from bench.harness import fmt, metrics_url, pct, sayer, scrape_histogram, server_figures
from bench.loadgen import model_answer, poisson

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

say = sayer("chaos", clock=True)


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
