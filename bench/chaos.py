"""Chaos benchmark: faults under open-loop load through the gateway.

    python -m bench.chaos --bundle bundles/beauty-loo --rate 10 --budget-ms 100

Starts its own stack: a private ``redis-server`` without persistence (it is
killed in one scenario: never the machine's Redis), the item set, verifier,
drafter and gateway as subprocesses, a private namespace. A seeded random
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
``chaos.png`` (timeline) into ``--out``, the ``chaos.*`` summary keys, and its
section of README.md there.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from bench.harness import (
    Stack,
    Writer,
    add_common_args,
    command_line,
    fmt,
    itemset_stub,
    machine_line,
    no_nan,
    pct,
    raise_on_signals,
    run_line,
    sample_users,
    sayer,
)
from bench.loadgen import InThread, capacity
from specrec.eval.results import markdown_table, readme_section, update_summary, write_json
from specrec_rpc.localstack import free_port, redis_ping

SCENARIOS = ("pause-verifier", "kill-verifier", "pause-drafter", "kill-drafter", "pause-itemset", "kill-itemset",
             "redis-loss", "overload", "kill-redis-primary")
SENTINEL_SCENARIOS = {"kill-redis-primary"}  # run on a stack of their own, over a Sentinel-managed Redis
MODEL_FAULTS = {"pause-verifier", "kill-verifier", "pause-drafter", "kill-drafter"}  # one of the two models is away
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
def describe(i: int, resp, error) -> dict:
    """A chaos record of one answer (:class:`bench.loadgen.InThread` adds the times): ``model`` is a list
    ranked by a model (the GR model or the drafter), not made only of catalogue fill; a degraded answer's
    reason is kept (``detail``), as is an error's."""
    if error is not None:
        return {"code": error.code().name, "served_by": "", "degraded": True, "model": False,
                "detail": (error.details() or "")[:200]}
    sources = [it.source for it in resp.items]
    fill_only = bool(sources) and all(s == "fill" for s in sources)
    rec = {"code": "OK", "served_by": resp.stats.served_by or resp.stats.policy, "degraded": bool(resp.stats.degraded),
           "model": not fill_only and (resp.stats.served_by or "") != "fill" and len(sources) > 0,
           "server_ms": resp.stats.total_ms}  # the gateway's own time (latency_ms: the caller's)
    if resp.stats.degraded:
        rec["detail"] = resp.stats.degraded_reason[:200]
    return rec


def make_load(target: str, users, budget_ms: float, rate: float, seed: int) -> InThread:
    """``auto`` at ``rate`` requests/s (Poisson, open loop) for as long as the run lasts."""
    return InThread(target, users.ids, rate, budget_ms, seed=seed, describe=describe)


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
    """Seconds from the end of the fault to the first of ``streak`` answers in a row served as before any
    fault: by the GR model through the verifier (not the drafter, not fill), not degraded (NaN when it never
    happens in the records)."""
    after = sorted((r for r in recs if r["t"] >= t_end - 1e-9), key=lambda r: r["t"])
    run = 0
    for i, r in enumerate(after):
        good = r["code"] == "OK" and r["model"] and not r["degraded"] and r["served_by"] not in ("drafter", "fill")
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


# -- outputs --------------------------------------------------------------------------------------
def plot(recs: list[dict], windows: list[tuple[str, float, float]], t_base: float, budget_ms: float, path: Path,
         title: str) -> None:
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
    ax.axhline(budget_ms, color="k", ls="--", lw=0.8, label=f"budget {budget_ms:g} ms")
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
    rows = res["scenarios"]
    faults = [r for r in rows if r["scenario"] in MODEL_FAULTS]
    during = sum(r["requests_during"] for r in faults)
    model = sum(r["model_share_during"] * r["requests_during"] for r in faults if r["requests_during"])
    over = [r for r in rows if r["scenario"] == "overload"]
    fo = [r for r in rows if r["scenario"] == "kill-redis-primary"]
    summary = {
        "chaos.catalogue_items_lost": int(max([r["catalogue_items_lost"] for r in rows], default=0)),
        "chaos.internal_errors": int(sum(r["internal_errors"] for r in rows)),
        "chaos.model_answer_share_during_faults": model / during if during else float("nan"),
        "chaos.recovery_s_max": float(np.nanmax([r["recovery_s"] for r in rows])) if rows else float("nan"),
        "chaos.overload_p99_over_budget_ms": (over[0]["p99_ms_during"] - res["budget_ms"]) if over else float("nan"),
    }
    if fo:
        summary.update({"chaos.redis_failover_acked_writes_lost": int(fo[0]["acked_writes_lost"]),
                        "chaos.redis_failover_internal_errors": int(fo[0]["internal_errors"]),
                        "chaos.redis_failover_recovery_s": float(fo[0]["recovery_s"])})
    if any(np.isnan(r["recovery_s"]) for r in rows):
        summary["chaos.recovery_s_max"] = float("inf")  # a scenario never recovered within the run
    res["summary"] = summary
    write_json("chaos", no_nan(res), out)
    table = scenario_table(rows)
    (out / "chaos.md").write_text(f"# Chaos benchmark\n\n{head_line(res)}\n\n{table}\n")
    readme_section(out / "README.md", README_OWNER, readme_body(no_nan(res)), retire=("bench/chaos.py",))
    update_summary(no_nan(summary), out / "summary.json")
    return summary


def scenario_table(rows: list[dict]) -> str:
    cols = ["scenario", "fault s", "requests", "model share", "degraded share", "p99 ms (during)", "shed", "errors",
            "recovery s", "items lost"]
    return markdown_table([dict(zip(cols, [
        r["scenario"], fmt(r["fault_s"], ".1f"), r["requests_during"], fmt(r["model_share_during"], ".1%"),
        fmt(r["degraded_share_during"], ".1%"), fmt(r["p99_ms_during"], ".1f"), r["shed_during"],
        ", ".join(f"{c} {n}" for c, n in sorted(r["errors"].items())) or "none", fmt(r["recovery_s"], ".2f"),
        r["catalogue_items_lost"]])) for r in rows], cols)


def head_line(res: dict) -> str:
    return (f"Produced by `{res['command']}` ({res['machine']}). {res['users']}; policy auto, budget "
            f"{res['budget_ms']:g} ms, {res['rate']:g} requests/s offered (Poisson), capacity measured at "
            f"{fmt(res['capacity_rps'])} answers/s (closed loop, one at a time), overload at {res['flood_x']:g}x that.")


def readme_body(res: dict) -> str:
    """This benchmark's section of the results README (``res``: what ``chaos.json`` holds)."""
    keys = ", ".join(f"`{k.removeprefix('chaos.')}` {fmt(v, '.3g') if isinstance(v, float) else v}"
                     for k, v in res["summary"].items())
    return "\n".join([
        "## Chaos: faults under load (`bench.chaos`, `chaos.*`)\n",
        f"Command (rerun step `chaos`): `{res['command']}`\n",
        f"Run: {res.get('run', 'n/a')}. {res['machine']}. {res['users']}; `auto` at {res['budget_ms']:g} ms, "
        f"{res['rate']:g} requests/s offered "
        f"(Poisson); `overload` offers {res['flood_x']:g}x the capacity measured first ({fmt(res['capacity_rps'])} "
        "answers/s, closed loop, one at a time). Model share: the requests sent during the fault answered by the GR "
        "model or the drafter, not catalogue fill (errors count as not); recovery: from the fault's end (SIGCONT, or "
        f"the new process SERVING) to the first of {res['streak']} undegraded answers in a row from the GR model "
        "through the verifier. `kill-redis-primary` runs last, on a stack of its own over a Sentinel-managed Redis "
        "(a primary, a replica, three sentinels) with a writer upserting one item at a time: its fault lasts from "
        "the SIGKILL to the promotion, its recovery until writes are acknowledged again and the answers have "
        "recovered; its items lost are acknowledged writes missing afterwards. Table: [`chaos.md`](chaos.md).\n",
        scenario_table(res["scenarios"]),
        f"Keys: {keys}.\n",
        "![timeline](chaos.png)\n",
    ])


def run_failover_phase(a, bundle_dir: Path, bundle, users, tmp: Path, name: str = "kill-redis-primary") -> dict:
    """The ``kill-redis-primary`` scenario on a stack of its own over a Sentinel-managed Redis."""
    from specrec_rpc.localsentinel import LocalSentinel

    rs = LocalSentinel(tmp / "sentinel").start()
    say(f"{name}: Sentinel-managed Redis up ({rs.url}); starting the stack on it")
    stack = Stack(bundle_dir, rs.url, tmp / "logs-failover", "chaos-fo", threads=a.threads,
                  max_history=bundle.cfg.max_history, env={"SPECREC_ITEMSET_REDIS_TIMEOUT_S": "1.0"})
    procs = stack.procs
    load = writer = None
    try:
        procs.start(a.startup_timeout, say=say)
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
        t_next = time.monotonic()
        acked = dict(writer.acked)
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
                   internal_errors=row["internal_errors"] + w_codes.get("INTERNAL", 0))
        say(f"{name}: {len(acked)} writes acknowledged, {check['lost']} of them lost; writes {dict(w_codes)}; "
            f"recovery {row['recovery_s']:.2f} s (writes {write_recovery:.2f} s, reads {read_recovery:.2f} s)")
        return {"row": row, "records": recs, "window": (name, t0, t1)}
    finally:
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
    add_common_args(ap, redis_url=False)  # chaos starts (and kills) a redis-server of its own
    return ap.parse_args(argv)


def main(argv=None) -> int:
    a = parse(argv)
    command = command_line("bench.chaos", argv)
    scenarios = [s.strip() for s in a.scenarios.split(",") if s.strip()]
    bad = [s for s in scenarios if s not in SCENARIOS]
    if bad:
        raise SystemExit(f"unknown scenarios {bad}; known: {', '.join(SCENARIOS)}")
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
                  max_history=bundle.cfg.max_history).procs
    res = {"command": command, "run": run_line(), "users": users.source, "machine": machine_line(),
           "budget_ms": a.budget_ms, "rate": a.rate, "flood_x": a.flood_x, "streak": a.streak, "scenarios": []}
    res["capacity_rps"] = float("nan")  # measured by the first phase (when it runs)
    single = [s for s in scenarios if s not in SENTINEL_SCENARIOS]
    failover = [s for s in scenarios if s in SENTINEL_SCENARIOS]
    load = None
    windows: list[tuple[str, float, float]] = []
    recs: list[dict] = []
    t_base = time.monotonic()
    try:
        if single:
            procs.start(a.startup_timeout, say=say)
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
            t_base = time.monotonic()
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
    plot(
        recs,
        windows,
        t_base,
        a.budget_ms,
        out / "chaos.png",
        f"{bundle.name}: auto at {a.rate:g} rps, budget {a.budget_ms:g} ms, {os.cpu_count()} CPUs, "
        "everything co-located",
    )
    summary = write_results(out, res)
    print(json.dumps(no_nan(summary), indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
