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
  ``redis-sentinel`` processes, all private: ``specrec_stack/localsentinel.py``).
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
import json
import os
import shutil
import signal
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from bench.chaos_failover import run_failover_phase
from bench.chaos_machine import MACHINE_FIGURES, MACHINE_REPLACED, MACHINE_SCENARIOS, machine_keys, run_machine_phase
from bench.chaos_report import markdown, plot, readme_body
from bench.chaos_services import (
    MODEL_FAULTS,
    PrivateRedis,
    catalogue_check,
    make_load,
    measure_capacity,
    run_scenario,
    scenario_row,
    upsert_items,
)
from bench.cpus import usable
from bench.harness import (
    Stack,
    add_common_args,
    command_line,
    fmt,
    machine_line,
    no_nan,
    publish,
    raise_on_signals,
    run_line,
    sample_users,
    sayer,
)
from specrec_rpc.processes import free_port

SCENARIOS = ("cpu-hog", "one-core", "pause-verifier", "kill-verifier", "pause-drafter", "kill-drafter",
             "pause-itemset", "kill-itemset", "redis-loss", "overload", "kill-redis-primary")
SENTINEL_SCENARIOS = {"kill-redis-primary"}  # run on a stack of their own, over a Sentinel-managed Redis
#: this benchmark's section of the results README
README_OWNER = "bench.chaos"

say = sayer("chaos", clock=True)


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
    publish(out, "chaos", res, markdown(res), summary, retire=retire,
            readme=(README_OWNER, readme_body(no_nan(res))), old_sections=("bench/chaos.py",))
    return summary


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
