"""Chaos benchmark: faults under open-loop load through the gateway.

    python bench/chaos.py --bundle bundles/beauty-loo --rate 10 --budget-ms 100

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
import asyncio
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
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from serving import add_common_args, command_line, fmt, machine_line, no_nan, pct, request, sample_users  # noqa: E402

from specrec.eval.results import markdown_table, readme_section, update_summary, write_json  # noqa: E402
from specrec_rpc.localstack import ServiceProcs, free_port, redis_ping  # noqa: E402

SCENARIOS = ("pause-verifier", "kill-verifier", "pause-drafter", "kill-drafter", "pause-itemset", "kill-itemset",
             "redis-loss", "overload", "kill-redis-primary")
SENTINEL_SCENARIOS = {"kill-redis-primary"}  # run on a stack of their own, over a Sentinel-managed Redis
MODEL_FAULTS = {"pause-verifier", "kill-verifier", "pause-drafter", "kill-drafter"}  # one of the two models is away


def say(msg: str) -> None:
    from tqdm.auto import tqdm

    tqdm.write(f"[chaos] {time.strftime('%H:%M:%S')} {msg}")


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
@dataclass
class Load:
    """Open-loop Poisson load in its own thread and event loop; every answer recorded."""

    target: str
    users: object
    budget_ms: float
    rate: float
    k: int = 10
    seed: int = 0
    records: list[dict] = field(default_factory=list)
    _stop: threading.Event = field(default_factory=threading.Event)
    _thread: threading.Thread | None = None

    def start(self) -> None:
        self._thread = threading.Thread(target=lambda: asyncio.run(self._run()), name="load", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(30)

    async def _run(self) -> None:
        import grpc

        from specrec_rpc.v1 import recommender_pb2_grpc

        rng = np.random.default_rng(self.seed)
        n = len(self.users.ids)
        async with grpc.aio.insecure_channel(self.target) as ch:
            stub = recommender_pb2_grpc.RecommenderStub(ch)
            await ch.channel_ready()
            tasks: set[asyncio.Task] = set()
            j, t_next = 0, time.monotonic()
            while not self._stop.is_set():
                t_next += rng.exponential(1.0 / self.rate)  # the rate may change between arrivals
                d = t_next - time.monotonic()
                if d > 0:
                    await asyncio.sleep(d)
                task = asyncio.ensure_future(self._one(stub, j % n, t_next))
                tasks.add(task)
                task.add_done_callback(tasks.discard)
                j += 1
            if tasks:
                await asyncio.gather(*tasks, return_exceptions=True)

    async def _one(self, stub, i: int, sched: float) -> None:
        import grpc

        rec = {"t": sched, "user": i}
        try:
            resp = await stub.Recommend(request(self.users, i, "auto", self.k, self.budget_ms), timeout=5.0)
            sources = [it.source for it in resp.items]
            fill_only = bool(sources) and all(s == "fill" for s in sources)
            rec.update(
                code="OK",
                served_by=resp.stats.served_by or resp.stats.policy,
                degraded=bool(resp.stats.degraded),
                model=not fill_only and (resp.stats.served_by or "") != "fill" and len(sources) > 0,
                server_ms=resp.stats.total_ms,  # the gateway's own time (latency_ms: the caller's)
            )
            if resp.stats.degraded:
                rec["detail"] = resp.stats.degraded_reason[:200]
        except grpc.aio.AioRpcError as e:
            rec.update(code=e.code().name, served_by="", degraded=True, model=False, detail=(e.details() or "")[:200])
        rec["latency_ms"] = (time.monotonic() - sched) * 1000.0
        self.records.append(rec)


# -- the catalogue --------------------------------------------------------------------------------
def itemset_stub(addr: str):
    import grpc

    from specrec_rpc.v1 import itemset_pb2_grpc

    return grpc.insecure_channel(addr), itemset_pb2_grpc.ItemSetStub


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


class Writer:
    """Upserts one item at a time through the item set, in its own thread; every answer recorded."""

    def __init__(self, addr: str, token: str, pause_s: float = 0.05):
        self.addr, self.token, self.pause_s = addr, token, pause_s
        self.acked: dict[str, float] = {}  # item id -> when its write was sent (acknowledged ones only)
        self.records: list[dict] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="writer", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
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


# -- scenarios ------------------------------------------------------------------------------------
def measure_capacity(target: str, users, budget_ms: float, seconds: float = 4.0) -> float:
    """Answers/s of a closed loop, one request at a time (requests served one after another)."""
    import grpc

    from specrec_rpc.v1 import recommender_pb2_grpc

    with grpc.insecure_channel(target) as ch:
        stub = recommender_pb2_grpc.RecommenderStub(ch)
        n, t0 = 0, time.monotonic()
        while time.monotonic() - t0 < seconds:
            stub.Recommend(request(users, n % len(users.ids), "auto", 10, budget_ms), timeout=5)
            n += 1
    return n / (time.monotonic() - t0)


def run_scenario(
    name: str, procs: ServiceProcs, redis: PrivateRedis, load: Load, a, capacity: float
) -> tuple[float, float]:
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
    cols = ["scenario", "fault s", "requests", "model share", "degraded share", "p99 ms (during)", "shed", "errors",
            "recovery s", "items lost"]
    table = markdown_table([dict(zip(cols, [
        r["scenario"], fmt(r["fault_s"], ".1f"), r["requests_during"], fmt(r["model_share_during"], ".1%"),
        fmt(r["degraded_share_during"], ".1%"), fmt(r["p99_ms_during"], ".1f"), r["shed_during"],
        ", ".join(f"{c} {n}" for c, n in sorted(r["errors"].items())) or "none", fmt(r["recovery_s"], ".2f"),
        r["catalogue_items_lost"]])) for r in rows], cols)
    head = (f"Produced by `{res['command']}` ({res['machine']}). {res['users']}; policy auto, budget "
            f"{res['budget_ms']:g} ms, {res['rate']:g} requests/s offered (Poisson), capacity measured at "
            f"{res['capacity_rps']:.1f} answers/s (closed loop, one at a time), overload at {res['flood_x']:g}x that.")
    (out / "chaos.md").write_text(f"# Chaos benchmark\n\n{head}\n\n{table}\n")
    keys = "\n".join(f"| `{k}` | {fmt(v, '.3f') if isinstance(v, float) else v} |" for k, v in summary.items())
    body = (f"## Chaos: faults under load (`bench/chaos.py`, `chaos.*`)\n\n```bash\n{res['command']}\n```\n\n{head}\n\n"
            f"{table}\n\n| key | value |\n|---|---|\n{keys}\n\n![timeline](chaos.png)\n\n"
            "Model share: answers ranked by the GR model or the drafter (not catalogue fill; errors count as not), "
            "among the requests sent while the fault lasted. Recovery: from the end of the fault (SIGCONT, or the "
            f"restarted process SERVING) to the first of {res['streak']} answers in a row served by the GR model "
            "through the verifier again (not the drafter, not fill, not degraded). kill-redis-primary runs on a "
            "stack of its own over a Sentinel-managed Redis (a primary, one replica, three sentinels) with a writer "
            "upserting one item at a time through the item set: its fault lasts from the SIGKILL to the promotion, "
            "its recovery from the SIGKILL until a write sent after it is acknowledged and the answers have "
            "recovered as above, whichever is later (so it includes one write's duration); items lost counts "
            "acknowledged writes missing from the catalogue afterwards.\n")
    readme_section(out / "README.md", "bench/chaos.py", body)
    update_summary(no_nan(summary), out / "summary.json")
    return summary


def run_failover_phase(a, bundle_dir: Path, bundle, users, tmp: Path, name: str = "kill-redis-primary") -> dict:
    """The ``kill-redis-primary`` scenario on a stack of its own over a Sentinel-managed Redis."""
    from specrec_rpc.localsentinel import LocalSentinel

    rs = LocalSentinel(tmp / "sentinel").start()
    say(f"{name}: Sentinel-managed Redis up ({rs.url}); starting the stack on it")
    namespace = f"bench-chaos-fo-{uuid.uuid4().hex[:10]}"
    procs = ServiceProcs(bundle_dir, rs.url, namespace, tmp / "logs-failover", max_history=bundle.cfg.max_history,
                         env={"SPECREC_VERIFIER_THREADS": str(a.threads), "SPECREC_ITEMSET_REDIS_TIMEOUT_S": "1.0"})
    load = writer = None
    try:
        procs.start(a.startup_timeout, say=say)
        load = Load(procs.addr("gateway"), users, a.budget_ms, a.rate, seed=a.seed + 1)
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
        procs.stop(say=say)
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
    command = command_line("bench/chaos.py", argv)
    scenarios = [s.strip() for s in a.scenarios.split(",") if s.strip()]
    bad = [s for s in scenarios if s not in SCENARIOS]
    if bad:
        raise SystemExit(f"unknown scenarios {bad}; known: {', '.join(SCENARIOS)}")

    def _interrupt(signum, frame):
        raise KeyboardInterrupt(f"signal {signum}")

    signal.signal(signal.SIGTERM, _interrupt)

    from specrec.bundle import Bundle

    bundle_dir = Path(a.bundle).resolve()
    bundle = Bundle.load(bundle_dir)
    users = sample_users(bundle, a.requests, a.seed)
    say(users.source)
    tmp = Path(tempfile.mkdtemp(prefix="specrec-chaos-"))
    redis = PrivateRedis(free_port(), tmp / "redis")
    redis.start()
    namespace = f"bench-chaos-{uuid.uuid4().hex[:10]}"
    procs = ServiceProcs(bundle_dir, redis.url, namespace, tmp / "logs", max_history=bundle.cfg.max_history,
                         env={"SPECREC_VERIFIER_THREADS": str(a.threads)})
    res = {"command": command, "users": users.source, "machine": machine_line(), "budget_ms": a.budget_ms,
           "rate": a.rate, "flood_x": a.flood_x, "streak": a.streak, "scenarios": []}
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
            load = Load(target, users, a.budget_ms, a.rate, seed=a.seed)
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
