"""Load benchmark: Recommend through the gateway at fixed offered rates, open loop.

    python bench/load.py --bundle bundles/beauty-loo --rates 5,10,20,30,40,60,80 --duration 20

Starts its own stack on this machine (Redis: ``--redis-url`` / ``$REDIS_URL``,
else 127.0.0.1:6379, else a private ``redis-server``; the item set, verifier,
drafter and gateway as subprocesses on free ports with a private Redis
namespace) and stops all of it at the end, Ctrl-C and SIGTERM included.

Requests are real histories: the leave-one-out test histories of the bundle's
dataset (``data_path`` in ``bundle.json``): per user, the last ``max_history``
items before the last one; a fixed sample (``--requests``, ``--seed``).

Per policy and offered rate, requests are sent on a Poisson schedule with
``grpc.aio`` (open loop: a send never waits for an earlier answer, so an
overloaded server shows up as queueing instead of a lower send rate). Latency
runs from the *scheduled* send time to the answer, so the client's own lag and
all queueing count. The first ``--warmup`` seconds of each run are not
measured. Reported: offered and achieved rps, p50/p95/p99/max latency, errors
(timeouts included), degraded answers, exit reasons, the fraction of answers
that exited on the budget. A rate *passes* when p99 <= ``--budget-ms``, no
request failed, and at most ``--max-degraded`` of the answers were degraded
(the gateway stays inside its budget under overload by degrading, which must
not count as keeping up); the figure per policy is the highest rate such that
it and every lower tested rate pass, refined by ``--refine`` bisection steps
towards the first failing rate.

gRPC overhead: the same histories and policy run closed loop (one request at a
time, interleaved) in this process (the bundle's Engine: local verifier,
retrieval drafter, the bundle's item set) and through the gateway; medians of
both and their difference.

Writes into ``--out`` (default bench/results): load.json (every row), load.md,
load_latency.png (p50/p99 against offered rate), the summary keys
``gateway.<policy>.max_rps_p99_<budget>ms``, ``gateway.<policy>.p99_ms_at_20rps``
and ``gateway.<policy>.grpc_overhead_p50_ms``, and the load section of
README.md there.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import platform
import re
import signal
import sys
import tempfile
import time
import uuid
from collections import Counter
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from specrec.eval.results import RESULTS_DIR, markdown_table, update_summary, write_json  # noqa: E402
from specrec_rpc.localstack import ServiceProcs, delete_namespace, find_or_start_redis, stop_process  # noqa: E402

SECTION_BEGIN = "<!-- bench/load.py: begin -->"
SECTION_END = "<!-- bench/load.py: end -->"


def say(msg: str) -> None:
    from tqdm.auto import tqdm

    tqdm.write(f"[load] {msg}")


# -- requests -------------------------------------------------------------------------------
def load_histories(bundle, n: int, seed: int) -> tuple[list[list[str]], str]:
    """A fixed seeded sample of leave-one-out test histories (item ids, oldest first)."""
    from specrec.pipeline import open_dataset

    ids = bundle.catalogue.ids
    h = bundle.cfg.max_history
    data = bundle.meta.get("data_path")
    rng = np.random.default_rng(seed)
    ds = None
    if data is not None and (str(data) == "synthetic" or Path(data).exists()):
        ds = open_dataset(data)
    elif data is None and bundle.meta.get("dataset") == "synthetic":
        ds = open_dataset(None)
    if ds is not None and ds.catalogue.ids == ids:
        seqs = [s.items for s in ds.sequences if len(s.items) >= 2]
        picks = rng.choice(len(seqs), size=min(n, len(seqs)), replace=False)
        hists = [[ids[x] for x in np.asarray(seqs[u][:-1])[-h:]] for u in picks]
        return hists, f"leave-one-out test histories of {data or 'synthetic'} ({len(hists)} of {len(seqs)} users, seed {seed})"
    say(f"WARNING: the bundle's dataset ({data}) is missing or has another catalogue: random histories instead")
    hists = [list(rng.choice(ids, size=int(rng.integers(3, h + 1)), replace=False)) for _ in range(n)]
    return hists, f"random histories of 3-{h} catalogue items (seed {seed}; the bundle's dataset was not available)"


def make_requests(hists, policy: str, k: int, budget_ms: float):
    from specrec_rpc.v1 import recommender_pb2

    return [recommender_pb2.RecommendRequest(history=h, k=k, policy=policy, budget_ms=budget_ms, user_id=f"load-{i}")
            for i, h in enumerate(hists)]


# -- measurements ---------------------------------------------------------------------------
def pct(x, q: float) -> float:
    return float(np.percentile(x, q)) if len(x) else float("nan")


async def open_loop(target: str, reqs, rate: float, duration: float, warmup: float, timeout_s: float, seed: int,
                    poisson: bool, desc: str) -> dict:
    """One run at a fixed offered rate; a row of results."""
    import grpc
    from tqdm.auto import tqdm

    from specrec_rpc.v1 import recommender_pb2_grpc

    rng = np.random.default_rng(seed)
    offsets, t = [], 0.0
    while True:
        t += rng.exponential(1.0 / rate) if poisson else 1.0 / rate
        if t >= warmup + duration:
            break
        offsets.append(t)
    results: list[tuple | None] = [None] * len(offsets)
    send_lag = np.zeros(len(offsets))
    loop = asyncio.get_running_loop()
    async with grpc.aio.insecure_channel(target) as channel:
        stub = recommender_pb2_grpc.RecommenderStub(channel)
        await channel.channel_ready()
        bar = tqdm(total=len(offsets), desc=desc, unit="req", leave=False, dynamic_ncols=True)
        inflight = 0

        async def one(i: int, sched: float) -> None:
            nonlocal inflight
            inflight += 1
            try:
                resp = await stub.Recommend(reqs[i % len(reqs)], timeout=timeout_s)
                st = resp.stats
                results[i] = (sched, loop.time(), None, st.exit_reason, bool(st.degraded), st.total_ms)
            except grpc.aio.AioRpcError as e:
                results[i] = (sched, loop.time(), e.code().name, "", False, float("nan"))
            finally:
                inflight -= 1
                bar.update()

        cpu0 = time.process_time()
        start = loop.time() + 0.1
        tasks = []
        for i, off in enumerate(offsets):
            sched = start + off
            d = sched - loop.time()
            if d > 0:
                await asyncio.sleep(d)
            send_lag[i] = loop.time() - sched
            tasks.append(asyncio.ensure_future(one(i, sched)))
            if i % 16 == 0:
                bar.set_postfix(inflight=inflight, refresh=False)
        await asyncio.gather(*tasks)
        bar.close()
        cpu = time.process_time() - cpu0
    t_measure = start + warmup
    rows = [(r, lag) for r, lag in zip(results, send_lag) if r[0] >= t_measure]
    ok = [r for r, _ in rows if r[2] is None]
    lat = np.asarray([(r[1] - r[0]) * 1000.0 for r in ok])
    errors = Counter(r[2] for r, _ in rows if r[2] is not None)
    exits = Counter(r[3] for r in ok)
    degraded = sum(r[4] for r in ok)
    last = max((r[1] for r, _ in rows), default=t_measure)
    n = len(rows)
    return {
        "offered_rps": rate, "sent": n, "ok": len(ok),
        "achieved_rps": len(ok) / (last - t_measure) if last > t_measure else float("nan"),
        "p50_ms": pct(lat, 50), "p95_ms": pct(lat, 95), "p99_ms": pct(lat, 99),
        "max_ms": float(lat.max()) if len(lat) else float("nan"), "mean_ms": float(lat.mean()) if len(lat) else float("nan"),
        "errors": sum(errors.values()), "error_codes": dict(errors), "timeouts": errors.get("DEADLINE_EXCEEDED", 0),
        "degraded": int(degraded), "degraded_frac": degraded / len(ok) if ok else float("nan"),
        "budget_exit_frac": exits.get("budget", 0) / len(ok) if ok else float("nan"),
        "exit_reasons": dict(exits),
        "server_p50_ms": pct([r[5] for r in ok], 50), "server_p99_ms": pct([r[5] for r in ok], 99),
        "send_lag_p99_ms": pct(np.asarray([lag for _, lag in rows]) * 1000.0, 99),
        "client_cpu_frac": cpu / (warmup + duration),
        "duration_s": duration, "warmup_s": warmup, "warmup_sent": len(offsets) - n,
    }


def overhead(bundle, target: str, hists, policy: str, k: int, budget_ms: float, warmup: int = 5) -> dict:
    """Closed loop, one request at a time, interleaved: in this process vs through the gateway."""
    from tqdm.auto import tqdm

    from specrec.policies import RecRequest, make_policy
    from specrec_rpc.client import Client

    eng = bundle.engine(drafter="retrieval")
    pol = make_policy(policy, eng)  # keeps its Budget (round-cost estimates) across requests, as the gateway does
    index = bundle.catalogue.index

    def local(h):
        rows = np.asarray([index[i] for i in h], dtype=np.int64)
        t0 = time.perf_counter()
        res = pol.run([RecRequest(rows, k, eng.clock() + budget_ms / 1000.0)])[0]
        return (time.perf_counter() - t0) * 1000.0, res.stats.exit_reason

    loc, gw, srv, exits_l, exits_g = [], [], [], Counter(), Counter()
    with Client(target, timeout_s=10.0) as c:
        for h in hists[:warmup]:
            local(h)
            c.recommend(h, k=k, policy=policy, budget_ms=budget_ms)
        for h in tqdm(hists, desc=f"overhead {policy}", unit="req", leave=False, dynamic_ncols=True):
            ms, ex = local(h)
            loc.append(ms)
            exits_l[ex] += 1
            t0 = time.perf_counter()
            resp = c.recommend(h, k=k, policy=policy, budget_ms=budget_ms)
            gw.append((time.perf_counter() - t0) * 1000.0)
            srv.append(resp.stats.total_ms)
            exits_g[resp.stats.exit_reason] += 1
    return {
        "policy": policy, "n": len(hists),
        "inprocess_p50_ms": pct(loc, 50), "inprocess_p99_ms": pct(loc, 99),
        "gateway_p50_ms": pct(gw, 50), "gateway_p99_ms": pct(gw, 99), "gateway_server_p50_ms": pct(srv, 50),
        "overhead_p50_ms": pct(gw, 50) - pct(loc, 50),
        "overhead_ratio": pct(gw, 50) / pct(loc, 50) if loc else float("nan"),
        "inprocess_exit_reasons": dict(exits_l), "gateway_exit_reasons": dict(exits_g),
    }


def passes(row: dict, budget_ms: float, max_degraded: float) -> bool:
    return (row["ok"] > 0 and row["errors"] == 0 and row["p99_ms"] <= budget_ms
            and row["degraded_frac"] <= max_degraded)


def max_passing(rows: list[dict]) -> tuple[float | None, float | None]:
    """(highest rate such that it and every lower tested rate pass, the lowest failing rate above it)."""
    best = None
    for r in sorted(rows, key=lambda r: r["offered_rps"]):
        if not r["pass"]:
            return best, r["offered_rps"]
        best = r["offered_rps"]
    return best, None


# -- outputs --------------------------------------------------------------------------------
def plot(rows: list[dict], policies: list[str], budget_ms: float, maxima: dict, path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import matplotlib.ticker

    fig, ax = plt.subplots(figsize=(7.5, 4.8))
    colours = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for c, pol in zip(colours, policies):
        rr = sorted((r for r in rows if r["policy"] == pol and r["ok"] > 0), key=lambda r: r["offered_rps"])
        if not rr:
            continue
        x = [r["offered_rps"] for r in rr]
        ax.plot(x, [r["p99_ms"] for r in rr], "-o", color=c, label=f"{pol} p99")
        ax.plot(x, [r["p50_ms"] for r in rr], "--s", color=c, alpha=0.7, markersize=4, label=f"{pol} p50")
        fails = [r for r in rr if not r["pass"]]
        if fails:
            ax.scatter([r["offered_rps"] for r in fails], [r["p99_ms"] for r in fails], marker="x", color="k", zorder=5,
                       s=30)
        if maxima.get(pol):
            ax.axvline(maxima[pol], color=c, linestyle=":", alpha=0.6, label=f"{pol} highest passing rate")
    ax.axhline(budget_ms, color="red", linewidth=1, label=f"{budget_ms:g} ms")
    ax.scatter([], [], marker="x", color="k", s=30, label="fails")
    ax.set_yscale("log")
    lo, hi = ax.get_ylim()
    for subs in ((1, 2, 3, 5), range(1, 10)):  # plain-number ticks, denser when the range is narrow
        ticks = [m * 10.0**e for e in range(-1, 6) for m in subs if lo <= m * 10.0**e <= hi]
        if len(ticks) >= 3:
            break
    ax.set_yticks(ticks)
    ax.yaxis.set_major_formatter(matplotlib.ticker.FuncFormatter(lambda v, _: f"{v:g}"))
    ax.yaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
    ax.set_ylim(lo, hi)
    ax.set_xlabel("offered rate (requests/s, Poisson arrivals)")
    ax.set_ylabel("latency from scheduled send (ms)")
    ax.set_title(title, fontsize=10)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def refresh_readme(path: Path, body: str) -> None:
    """Replace (or append) this benchmark's section of bench/results/README.md, keeping the rest."""
    section = f"{SECTION_BEGIN}\n{body.rstrip()}\n{SECTION_END}\n"
    text = path.read_text() if path.exists() else "# Measured results\n\n"
    if SECTION_BEGIN in text and SECTION_END in text:
        text = re.sub(re.escape(SECTION_BEGIN) + r".*?" + re.escape(SECTION_END) + r"\n?", lambda _: section, text,
                      flags=re.S)
    else:
        text = text.rstrip("\n") + "\n\n" + section
    path.write_text(text)


def no_nan(o):
    """NaN -> None throughout (JSON has no NaN)."""
    if isinstance(o, float) and math.isnan(o):
        return None
    if isinstance(o, dict):
        return {k: no_nan(v) for k, v in o.items()}
    if isinstance(o, (list, tuple)):
        return [no_nan(v) for v in o]
    return o


def fmt(v, spec: str = ".1f") -> str:
    return "n/a" if v is None or (isinstance(v, float) and math.isnan(v)) else format(v, spec)


# -- main -----------------------------------------------------------------------------------
def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    ap.add_argument("--bundle", required=True, help="bundle directory (with drafters)")
    ap.add_argument("--rates", default="5,10,20,30,40,60,80", help="offered rates, requests/s, comma-separated")
    ap.add_argument("--duration", type=float, default=20.0, help="measured seconds per rate")
    ap.add_argument("--warmup", type=float, default=3.0, help="seconds per rate sent first and not measured")
    ap.add_argument("--policies", default="specgr,beam")
    ap.add_argument("--k", type=int, default=10)
    ap.add_argument("--budget-ms", type=float, default=30.0, help="request budget, and the p99 target")
    ap.add_argument("--max-degraded", type=float, default=0.01, help="largest fraction of degraded answers a passing rate may have")
    ap.add_argument("--refine", type=int, default=2, help="bisection steps between the best passing and first failing rate")
    ap.add_argument("--stop-ms", type=float, default=2000.0, help="skip a policy's higher rates once its p99 exceeds this")
    ap.add_argument("--timeout-s", type=float, default=2.0, help="client deadline per request (counted as an error)")
    ap.add_argument("--fixed", action="store_true", help="fixed inter-arrival times instead of Poisson")
    ap.add_argument("--requests", type=int, default=1000, help="size of the history sample")
    ap.add_argument("--overhead-requests", type=int, default=200, help="closed-loop requests per policy for the overhead (0 = skip)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=int(os.environ.get("SPECREC_THREADS", 2)),
                    help="verifier intra-op threads, and this process's for the in-process runs (default $SPECREC_THREADS or 2)")
    ap.add_argument("--redis-url", default=os.environ.get("REDIS_URL"), help="Redis to use (default $REDIS_URL, else 127.0.0.1:6379, else a private redis-server)")
    ap.add_argument("--out", default=str(RESULTS_DIR), help="results directory")
    ap.add_argument("--startup-timeout", type=float, default=300.0, help="seconds to wait for each service")
    a = ap.parse_args(argv)
    command = "python " + " ".join(["bench/load.py", *(argv if argv is not None else sys.argv[1:])])
    rates = sorted({float(x) for x in a.rates.split(",") if x.strip()})
    policies = [p.strip() for p in a.policies.split(",") if p.strip()]
    out = Path(a.out)

    # SIGTERM (and SIGHUP) stop the run like Ctrl-C, so the stack is always stopped
    def _interrupt(signum, frame):
        raise KeyboardInterrupt(f"signal {signum}")

    signal.signal(signal.SIGTERM, _interrupt)
    signal.signal(signal.SIGHUP, _interrupt)

    import torch

    from specrec.bundle import Bundle
    from specrec.policies import POLICIES

    for p in policies:
        if p not in POLICIES:
            raise SystemExit(f"unknown policy {p!r} (known: {', '.join(sorted(POLICIES))})")
    torch.set_num_threads(a.threads)
    bundle_dir = Path(a.bundle).resolve()
    bundle = Bundle.load(bundle_dir)
    hists, hist_source = load_histories(bundle, a.requests, a.seed)
    say(f"bundle {bundle.name} ({len(bundle.catalogue)} items); {hist_source}")

    tmp = Path(tempfile.mkdtemp(prefix="specrec-load-"))
    namespace = f"bench-load-{uuid.uuid4().hex[:10]}"
    redis_url, redis_proc = find_or_start_redis(a.redis_url, workdir=tmp / "redis", log_path=tmp / "redis.log")
    say(f"redis {redis_url}" + (" (started here)" if redis_proc else "") + f", namespace {namespace}, logs {tmp}")
    procs = ServiceProcs(bundle_dir, redis_url, namespace, tmp / "logs", max_history=bundle.cfg.max_history,
                         env={"SPECREC_VERIFIER_THREADS": str(a.threads)})
    rows: list[dict] = []
    overheads: dict[str, dict] = {}
    maxima: dict[str, float | None] = {}
    try:
        t0 = time.time()
        procs.start(a.startup_timeout, say=say)
        target = procs.addr("gateway")
        say(f"stack SERVING after {time.time() - t0:.0f} s; gateway {target}")

        if a.overhead_requests > 0:
            for pol in policies:
                o = overhead(bundle, target, hists[: a.overhead_requests], pol, a.k, a.budget_ms)
                overheads[pol] = o
                say(f"{pol}: closed loop p50 in-process {o['inprocess_p50_ms']:.2f} ms, gateway "
                    f"{o['gateway_p50_ms']:.2f} ms (server {o['gateway_server_p50_ms']:.2f}), overhead {o['overhead_p50_ms']:.2f} ms")

        async def sweep() -> None:
            for pol in policies:
                reqs = make_requests(hists, pol, a.k, a.budget_ms)
                mine: list[dict] = []

                async def run(rate: float, refine: bool) -> dict:
                    row = await open_loop(target, reqs, rate, a.duration, a.warmup, a.timeout_s,
                                          a.seed + int(rate * 1000), not a.fixed, f"{pol} @ {rate:g} rps")
                    row.update(policy=pol, refine=refine)
                    row["pass"] = passes(row, a.budget_ms, a.max_degraded)
                    rows.append(row)
                    mine.append(row)
                    say(f"{pol} @ {rate:g} rps: achieved {fmt(row['achieved_rps'])}, p50 {fmt(row['p50_ms'])} "
                        f"p95 {fmt(row['p95_ms'])} p99 {fmt(row['p99_ms'])} max {fmt(row['max_ms'])} ms, "
                        f"errors {row['errors']}, degraded {row['degraded']}, budget exits {fmt(row['budget_exit_frac'], '.0%')}"
                        f" -> {'pass' if row['pass'] else 'FAIL'}")
                    await asyncio.sleep(1.0)  # let the previous run's stragglers and logs settle
                    return row

                for rate in rates:
                    row = await run(rate, False)
                    if not (row["p99_ms"] <= a.stop_ms) or row["errors"] > row["sent"] / 2:
                        skipped = [r for r in rates if r > rate]
                        if skipped:
                            say(f"{pol}: p99 {fmt(row['p99_ms'])} ms > {a.stop_ms:g} ms (or mostly errors): "
                                f"skipping {', '.join(f'{r:g}' for r in skipped)} rps")
                        break
                lo, hi = max_passing(mine)
                for _ in range(a.refine):
                    if lo is None or hi is None or hi - lo <= max(0.5, 0.05 * lo):
                        break
                    mid = round((lo + hi) / 2, 1)
                    await run(mid, True)
                    lo, hi = max_passing(mine)
                maxima[pol] = lo
                if lo is None:
                    say(f"WARNING: {pol} fails already at the lowest rate tested ({rates[0]:g} rps)")

        asyncio.run(sweep())
    except KeyboardInterrupt:
        say("interrupted: stopping the stack; nothing written")
        return 130
    finally:
        procs.stop(say=say)
        try:
            delete_namespace(redis_url, namespace)
        except Exception as e:  # noqa: BLE001
            say(f"could not delete Redis namespace {namespace}: {e}")
        stop_process(redis_proc)
        say(f"stack stopped (logs kept in {tmp})")

    # -- results ----------------------------------------------------------------------------
    tested_max = {p: max((r["offered_rps"] for r in rows if r["policy"] == p), default=None) for p in policies}
    key_budget = f"{a.budget_ms:g}"
    summary = {}
    for p in policies:
        summary[f"gateway.{p}.max_rps_p99_{key_budget}ms"] = maxima.get(p)
        at20 = [r for r in rows if r["policy"] == p and r["offered_rps"] == 20.0]
        if at20:
            summary[f"gateway.{p}.p99_ms_at_20rps"] = at20[0]["p99_ms"]
        if p in overheads:
            summary[f"gateway.{p}.grpc_overhead_p50_ms"] = overheads[p]["overhead_p50_ms"]
    cpu = platform.processor() or platform.machine()
    try:
        cpu = next(l.split(":", 1)[1].strip() for l in open("/proc/cpuinfo") if l.startswith("model name"))
    except (OSError, StopIteration):
        pass
    machine = f"{os.cpu_count()} CPUs ({cpu}), everything (Redis, four services, load generator) on this machine"
    res = {
        "command": command, "bundle": str(bundle.meta.get("name", bundle_dir.name)), "bundle_dir": str(bundle_dir),
        "histories": hist_source, "k": a.k, "budget_ms": a.budget_ms, "arrivals": "fixed" if a.fixed else "poisson",
        "duration_s": a.duration, "warmup_s": a.warmup, "timeout_s": a.timeout_s, "max_degraded": a.max_degraded,
        "verifier_threads": a.threads, "machine": machine,
        "env": {k: v for k, v in os.environ.items() if k.startswith("SPECREC_") and "TOKEN" not in k}, "redis": "given" if a.redis_url else (
            "private redis-server" if redis_proc else "127.0.0.1:6379"),
        "criterion": f"p99 <= {a.budget_ms:g} ms, no errors, degraded <= {a.max_degraded:.0%}; "
                     "the highest rate such that it and every lower tested rate pass",
        "max_rps": maxima, "max_rps_is_lower_bound": {p: maxima.get(p) is not None and maxima.get(p) == tested_max[p]
                                                       for p in policies},
        "overhead": overheads, "rows": sorted(rows, key=lambda r: (policies.index(r["policy"]), r["offered_rps"])),
        "summary": summary,
    }
    out.mkdir(parents=True, exist_ok=True)
    write_json("load", no_nan(res), out)
    table_rows = [{**r, "pass": "yes" if r["pass"] else "**no**",
                   "offered_rps": f"{r['offered_rps']:g}" + (" (bisect)" if r["refine"] else ""),
                   "budget_exit": fmt(r["budget_exit_frac"], ".1%"), "degraded": fmt(r["degraded_frac"], ".1%"),
                   "exits": ", ".join(f"{k or '?'} {v}" for k, v in sorted(r["exit_reasons"].items(), key=lambda kv: -kv[1])),
                   "errors": f"{r['errors']}" + (f" ({', '.join(f'{k} {v}' for k, v in r['error_codes'].items())})" if r["errors"] else "")}
                  for r in res["rows"]]
    cols = ["policy", "offered_rps", "achieved_rps", "p50_ms", "p95_ms", "p99_ms", "max_ms", "errors", "degraded",
            "budget_exit", "exits", "pass"]
    lines = ["# Load through the gateway\n", f"Command: `{command}`\n",
             f"Bundle `{res['bundle']}`; {hist_source}. K = {a.k}, budget {a.budget_ms:g} ms, {res['arrivals']} arrivals, "
             f"open loop (grpc.aio), {a.duration:g} s measured per rate after {a.warmup:g} s warm-up; latency from the "
             f"scheduled send time to the answer. Verifier threads {a.threads}; {machine}.\n",
             f"Pass: {res['criterion']}.\n", markdown_table(table_rows, cols, "{:.1f}")]
    lag = max((r["send_lag_p99_ms"] for r in rows if not math.isnan(r["send_lag_p99_ms"])), default=float("nan"))
    lines.append(f"Load generator: send lag p99 (how late a request left after its scheduled time; included in the "
                 f"latencies) at most {fmt(lag)} ms over all runs; its CPU share per run is `client_cpu_frac` in load.json.\n")
    lines.append("| policy | highest passing rate (rps) |\n|---|---|")
    for p in policies:
        m = maxima.get(p)
        lines.append(f"| {p} | {fmt(m, 'g') if m is not None else f'< {rates[0]:g}'}"
                     f"{' (every tested rate passed: a lower bound)' if res['max_rps_is_lower_bound'][p] else ''} |")
    if overheads:
        lines += ["", f"## gRPC overhead (closed loop, one request at a time, {a.overhead_requests} histories)\n",
                  "| policy | in-process p50 ms | gateway p50 ms | gateway server-side p50 ms | overhead p50 ms | ratio |",
                  "|---|---|---|---|---|---|"]
        for p, o in overheads.items():
            lines.append(f"| {p} | {o['inprocess_p50_ms']:.2f} | {o['gateway_p50_ms']:.2f} | {o['gateway_server_p50_ms']:.2f} "
                         f"| {o['overhead_p50_ms']:.2f} | {o['overhead_ratio']:.2f}x |")
        lines.append("\nIn-process: the bundle's Engine in the benchmark process (local torch verifier, retrieval drafter, "
                     "the bundle's item set), the same policy, budget and histories. Gateway: client-measured, through "
                     "the gateway, which calls the drafter and verifier over gRPC.")
    lines += ["", "![latency vs offered rate](load_latency.png)", ""]
    (out / "load.md").write_text("\n".join(lines))
    plot(rows, policies, a.budget_ms, maxima, out / "load_latency.png",
         f"{res['bundle']}: Recommend through the gateway, K={a.k}, budget {a.budget_ms:g} ms, {os.cpu_count()} CPUs")
    update_summary(summary, out / "summary.json")

    body = ["## Load through the gateway (`bench/load.py`)\n",
            f"Produced by:\n\n```bash\n{command}\n```\n",
            f"{res['arrivals'].capitalize()} arrivals at fixed offered rates, open loop; {machine}. "
            f"Full table: [`load.md`](load.md), rows in [`load.json`](load.json).\n",
            "| policy | highest rate with p99 <= " + key_budget + " ms (rps) | p99 at 20 rps (ms) | gRPC overhead p50 (ms) |",
            "|---|---|---|---|"]
    for p in policies:
        m = maxima.get(p)
        at20 = summary.get(f"gateway.{p}.p99_ms_at_20rps")
        oh = overheads.get(p, {}).get("overhead_p50_ms")
        body.append(f"| {p} | {fmt(m, 'g') if m is not None else f'< {rates[0]:g}'}"
                    f"{' (lower bound)' if res['max_rps_is_lower_bound'][p] else ''} | {fmt(at20)} | {fmt(oh, '.2f')} |")
    body.append("\n![latency vs offered rate](load_latency.png)\n")
    refresh_readme(out / "README.md", "\n".join(body))
    say(f"wrote {out / 'load.json'}, load.md, load_latency.png, summary.json, README.md")
    print(json.dumps(summary, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
