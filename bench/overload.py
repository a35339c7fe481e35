"""Overload at a 30 ms budget that measures the server: ``auto`` through the gateway at 1x, 2x and 3x the
stack's capacity, the load generator on a CPU of its own.

    python -m bench.overload --bundle bundles/beauty-loo --multiples 1,2,3 --duration 20
    python -m bench.overload --bundle bundles/beauty-loo --multiples 1 --duration 3 --warmup 1 \\
        --capacity-seconds 2 --requests 200 --out /tmp/overload-smoke        # a smoke run

Starts its own stack (``bench.harness.open_stack``: Redis found or started, the four services as
subprocesses, a private namespace, the gateway's ``/metrics`` on a free port) and stops it at the end.
Requests are a seeded random sample of leave-one-out test users.

0. **Placement**: once the stack is SERVING, every thread of every service (and of the private Redis, when
   the stack started one: ``--private-redis``, as the step runs it, so that no work of the stack lands on the
   generator's CPU; the machine's own Redis is not ours and is left where it runs) is confined to all CPUs
   but one (``bench.cpus.confine``), and this process to that one (``--generator-cpu``, default the last CPU
   this process may use): the capacity phase's callers and the load generator (also confined by its pid) run
   there, the services never. With fewer than two CPUs nothing is placed and every run is void.
1. **Capacity**: the GR model's answers/s of the services on their CPUs: a closed loop of ``--clients``
   concurrent callers (each sends its next request when the last is answered) asking ``beam`` with a budget
   that never acts, counting beam's own answers: what the stack serves at full quality when saturated.
2. **Load**: for each multiple m, Poisson arrivals at m x capacity for warm-up + ``--duration`` seconds from
   ``bench.loadgen`` in its own process. Reported over the measured part:

   - the **server p99** from the gateway's own latency histogram (``specrec_rpc_latency_seconds`` of
     ``Recommend``): read when the measured part starts and again once every answer is in, the difference
     is what the gateway observed in between (its p99 interpolated within a bucket, as PromQL's
     ``histogram_quantile``; the bucket and the share over the budget beside it); the answers'
     ``stats.total_ms`` p99 beside it;
   - the **caller p99** (scheduled send to answer, every request, shed ones included);
   - the **generator's send lag** p99 (how late it sent: its own tail, which the gateway never saw). A run
     whose lag p99 exceeds ``--max-lag-ms`` (2 ms) is **void**: it measured the generator, not the server.
     Its figures stay in ``overload.json`` with ``"void": true`` and the reason, but no summary key
     claims them;
   - the shed share (RESOURCE_EXHAUSTED), other errors, and the **model-answer share**: answers that the GR
     model made (served by a verifier policy, not the item drafter, no catalogue fill), of the answers.

Writes ``overload.{json,md,png}`` into ``--out``, its section of README.md there, and the summary keys
``serving.capacity_rps``, per multiple ``serving.overload_<m>x.void`` (1/0) and
``.generator_lag_p99_ms``, and from the runs that are not void ``serving.overload_<m>x.{server_p99_ms,
client_p99_ms,shed_share,model_answer_share,error_share,offered_rps,achieved_rps}`` (a void run retires
those of its multiple: an older figure is not left to stand for it).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from pathlib import Path

from bench.cpus import affinity, confine, split, usable
from bench.harness import (
    command_line,
    fmt,
    machine_line,
    machine_of,
    no_nan,
    open_stack,
    pct,
    publish,
    run_line,
    sayer,
    scrape_histogram,
    server_figures,
)
from bench.loadgen import CAPACITY_BUDGET_MS, add_load_args, in_process, measured_capacity, model_answer, py_spy
from specrec.eval.results import paragraph
from specrec.terminal import markdown_table
from specrec_rpc.processes import group_pids

#: this benchmark's section of the results README
README_OWNER = "bench.overload"
#: the figures of a run that are summary keys (only from a run that is not void)
FIGURES = ("server_p99_ms", "client_p99_ms", "shed_share", "model_answer_share", "error_share", "offered_rps",
           "achieved_rps", "goodput_rps", "goodput_ratio")
#: keys replaced: model_share counted the item drafter's lists as the model's (now model_answer_share)
REPLACED = ("model_share",)

say = sayer("overload")


def top_frames(path: Path, seconds: float, rate: float = 250.0, n: int = 15) -> dict:
    """A py-spy raw profile (collapsed stacks: ``thread;frame;frame... count``, active samples only) -> how busy
    each thread was (its samples over ``rate`` x ``seconds``: 1.0 = running the whole time) and, over all
    threads, the innermost frames with the most samples."""
    by_thread: dict[str, int] = {}
    leaf: dict[str, int] = {}
    total = 0
    for line in path.read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        if not stack or not count.isdigit():
            continue
        c = int(count)
        frames = stack.split(";")
        total += c
        by_thread[frames[0]] = by_thread.get(frames[0], 0) + c
        leaf[frames[-1]] = leaf.get(frames[-1], 0) + c
    top = sorted(leaf.items(), key=lambda kv: -kv[1])[:n]
    return {"samples": total,
            "busy": {t: round(c / (rate * seconds), 4) for t, c in sorted(by_thread.items(), key=lambda kv: -kv[1])},
            "top": [{"frame": f, "share": round(c / max(total, 1), 4)} for f, c in top]}


def summarise(recs: list[dict], t_from: float, t_to: float, budget_ms: float = 30.0,
              capacity_rps: float = float("nan")) -> dict:
    """The caller's figures of the records sent in [t_from, t_to). Goodput: the answers per second that kept up,
    at the caller inside ``budget_ms``, no catalogue fill, not degraded; its ratio to ``capacity_rps``."""
    part = [r for r in recs if t_from <= r["t"] < t_to]
    ok = [r for r in part if r["code"] == "OK"]
    n = max(1, len(part))
    lat = [r["latency_ms"] for r in part]
    good = sum(r["latency_ms"] <= budget_ms and bool(r.get("model")) and not r.get("degraded") for r in ok)
    goodput = good / max(t_to - t_from, 1e-9)
    return {
        "goodput_rps": goodput,
        "goodput_ratio": goodput / capacity_rps if capacity_rps > 0 else float("nan"),
        "sent": len(part),
        "answered": len(ok),
        "offered_rps": len(part) / max(t_to - t_from, 1e-9),
        "achieved_rps": len(ok) / max(t_to - t_from, 1e-9),
        "client_p50_ms": pct(lat, 50),
        "client_p99_ms": pct(lat, 99),
        "client_p99_answered_ms": pct([r["latency_ms"] for r in ok], 99),
        "generator_lag_p99_ms": pct([r.get("send_lag_ms", 0.0) for r in part], 99),
        "generator_lag_max_ms": max((r.get("send_lag_ms", 0.0) for r in part), default=float("nan")),
        "server_stats_p50_ms": pct([r["server_ms"] for r in ok], 50),
        "server_stats_p99_ms": pct([r["server_ms"] for r in ok], 99),
        "shed_share": sum(r["code"] == "RESOURCE_EXHAUSTED" for r in part) / n,
        "error_share": sum(r["code"] not in ("OK", "RESOURCE_EXHAUSTED") for r in part) / n,
        "model_answer_share": sum(model_answer(r) for r in ok) / max(1, len(ok)),
        "no_fill_share": sum(bool(r.get("model")) for r in ok) / max(1, len(ok)),
        "degraded_share": sum(bool(r.get("degraded")) for r in ok) / max(1, len(ok)),
        "served_by": {
            s: sum(r["served_by"] == s for r in ok) / max(1, len(ok)) for s in sorted({r["served_by"] for r in ok})
        },
    }


def void_reason(lag_p99_ms: float | None, max_lag_ms: float, placement: str | None = None,
                server_error: str | None = None) -> str | None:
    """Why a run's figures are not the server's (None: they are): the generator shared the services' CPUs
    (``placement``), its send lag p99 exceeded ``max_lag_ms`` (or was not measured), or the gateway's
    histogram could not be read."""
    why = [placement] if placement else []
    if lag_p99_ms is None or math.isnan(lag_p99_ms):
        why.append("no send lag measured (no request in the measured part)")
    elif lag_p99_ms > max_lag_ms:
        why.append(f"the load generator's send lag p99 {lag_p99_ms:.2f} ms > {max_lag_ms:g} ms: the run measured "
                   "the generator, not the server")
    if server_error:
        why.append(f"the gateway's histogram could not be read ({server_error})")
    return "; ".join(why) or None


def summary_keys(rows: list[dict], capacity_rps: float) -> tuple[dict, tuple[str, ...]]:
    """(the summary keys of a run, the keys it retires): per multiple, ``void`` and the generator's lag p99
    always, the :data:`FIGURES` only from a run that is not void (a void run retires its multiple's), and the
    :data:`REPLACED` keys retired."""
    keys: dict = {"serving.capacity_rps": capacity_rps}
    retire: list[str] = []
    for r in rows:
        p = f"serving.overload_{r['multiple']:g}x"
        keys[f"{p}.void"] = int(bool(r["void"]))
        keys[f"{p}.generator_lag_p99_ms"] = r["generator_lag_p99_ms"]
        retire += [f"{p}.{f}" for f in REPLACED]
        for f in FIGURES:
            if r["void"]:
                retire.append(f"{p}.{f}")
            else:
                keys[f"{p}.{f}"] = r[f]
    return keys, tuple(retire)


def place(stack, generator: set[int], services: set[int]) -> dict:
    """Confine every thread of every service (and of the stack's own Redis, when it started one) to
    ``services``, and this process (the capacity phase's callers; the load generator it starts inherits it)
    to ``generator`` -> where they ended up (each process: the CPUs its threads may use), for the results."""
    pids = {n: p.pid for n, p in stack.procs.procs.items()}
    own_redis = stack.redis is not None and stack.redis.proc is not None
    if own_redis:
        pids["redis"] = stack.redis.proc.pid
    confine([pid for p in pids.values() for pid in group_pids(p)], services)  # a group's processes too
    confine([os.getpid()], generator)
    return {"generator_cpus": sorted(generator), "service_cpus": sorted(services),
            "processes": {n: sorted(set().union(*map(set, affinity(pid).values()))) for n, pid in
                          {**pids, "bench": os.getpid()}.items()},
            "redis": "the stack's own redis-server, on the services' CPUs" if own_redis else
            f"the Redis at {stack.redis_url}: not started here, left where it runs"}


def plot(rows: list[dict], budget_ms: float, max_lag_ms: float, path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    m = [r["multiple"] for r in rows]
    fig, (ax, lx, bx) = plt.subplots(1, 3, figsize=(14, 4))
    ax.plot(m, [r["server_p99_ms"] for r in rows], "s-", label="gateway p99 (its histogram)")
    ax.plot(m, [r["client_p99_ms"] for r in rows], "o-", label="caller p99 (all requests)")
    ax.axhline(budget_ms, color="grey", ls="--", lw=1, label=f"budget {budget_ms:g} ms")
    void = [r for r in rows if r["void"]]
    if void:
        ax.scatter([r["multiple"] for r in void], [r["server_p99_ms"] for r in void], marker="x", s=80, color="red",
                   zorder=5, label="void (see overload.json)")
    ax.set_ylabel("ms")
    lx.plot(m, [r["generator_lag_p99_ms"] for r in rows], "o-", label="generator send lag p99")
    lx.axhline(max_lag_ms, color="red", ls="--", lw=1, label=f"void above {max_lag_ms:g} ms")
    lx.set_ylabel("ms")
    bx.plot(m, [r["model_answer_share"] for r in rows], "o-", label="model answers / answers")
    bx.plot(m, [r["shed_share"] for r in rows], "s-", label="shed / requests")
    bx.set_ylim(-0.02, 1.02)
    for x in (ax, lx, bx):
        x.set_xlabel("offered load / capacity")
        x.legend(fontsize=8)
        x.grid(alpha=0.3)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def readme_body(res: dict) -> str:
    """This benchmark's section of the results README (``res``: what ``overload.json`` holds; the words are the
    README's; every column, and why a run is void, ``overload.md``'s)."""
    def share(v) -> str:
        return fmt(100 * v if v is not None else None) + "%"

    rows = [f"| {r['multiple']:g}x | {'**void**' if r['void'] else 'no'} | {fmt(r['offered_rps'], '.0f')} | "
            f"{fmt(r['achieved_rps'], '.0f')} | {fmt(r['server_p99_ms'])} | {fmt(r['client_p99_ms'])} | "
            f"{fmt(r['generator_lag_p99_ms'], '.2f')} | {share(r['shed_share'])} | {share(r['model_answer_share'])} | "
            f"{share(r['error_share'])} | {fmt(r.get('goodput_rps'), '.0f')} ({fmt(r.get('goodput_ratio'), '.2f')}x) |"
            for r in res["rows"]]
    b = f"{res['budget_ms']:g}"
    pl = res.get("placement") or {}
    where = (f"the load generator (and the capacity phase's callers) on CPU {pl['generator_cpus']}, every thread "
             f"of the services on {pl['service_cpus']}; {pl['redis']}" if pl.get("generator_cpus") else
             "nothing placed: " + str(res.get("placement_void") or "n/a"))
    return "\n".join([
        f"## Overload at {b} ms (`bench.overload`, `serving.capacity_rps`, `serving.overload_<m>x.*`)\n",
        paragraph(f"Run: {res.get('run', 'n/a')}. {machine_of(res)}. {res['users']}. Placement: {where}. Capacity: "
                  f"{fmt(res['capacity_rps'])} beam answers/s ({res['clients']} closed-loop callers, a budget that "
                  f"never acts); then `auto` at {b} ms, Poisson arrivals at multiples of it. Void: send lag p99 over "
                  f"{res['max_lag_ms']:g} ms. The gateway's door (`max_concurrent_rpcs`): {res.get('door') or 'none'}. "
                  "Every column: [`overload.md`](overload.md)."),
        paragraph(f"Command (step `overload`): `{res['command']}`"),
        "| load | void | offered rps | achieved rps | gateway p99 ms | caller p99 ms | send lag p99 ms | shed "
        "| model answers | errors | goodput /s |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
        *rows,
        "",
        "![overload](overload.png)\n",
    ])


def parse(argv):
    ap = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    ap.add_argument("--multiples", default="1,2,3", help="offered load as multiples of the measured capacity")
    ap.add_argument("--duration", type=float, default=20.0, help="measured seconds per multiple")
    ap.add_argument("--warmup", type=float, default=3.0, help="seconds per multiple sent first and not measured")
    ap.add_argument("--generator-cpu", type=int, default=None, help="the CPU of the load generator (and of this "
                    "process); the services get the others. None: the last CPU this process may use")
    ap.add_argument("--max-lag-ms", type=float, default=2.0, help="a run whose load generator's send lag p99 is "
                    "over this is void")
    ap.add_argument("--door", type=int, default=None, help="the gateway's max_concurrent_rpcs (calls gRPC itself "
                    "admits; past it RESOURCE_EXHAUSTED before any Python runs); 0: none; None: the service's "
                    "setting (its default, or SPECREC_GATEWAY_MAX_CONCURRENT_RPCS)")
    ap.add_argument("--capacity-rps", type=float, default=None, help="the capacity to offer multiples of, from an "
                    "earlier run (the same reference for runs with different --door); None: measured")
    ap.add_argument("--profile", action="store_true", help="then one more run at the last multiple with py-spy on the "
                    "gateway, the verifier and the load generator (needs py-spy); where their samples are goes into "
                    "overload.json (not the table: samplers beside it stretch the tail)")
    add_load_args(ap)
    return ap.parse_args(argv)


def load_run(target: str, metrics: str, users_file: Path, m: float, cap: float, a, tmp: Path,
             cpus: set[int] | None, placement_void: str | None) -> dict:
    """One multiple: its records' figures over the measured part, the gateway's histogram over the same part
    (read when it starts, and again once every answer is in), and whether the run is void."""
    first: dict = {}

    def read_first() -> None:  # in this process, at the start of the measured part
        first["t"] = time.monotonic()
        try:
            first["h"] = scrape_histogram(metrics)
        except OSError as e:
            first["error"] = str(e)

    recs = in_process(target, users_file, m * cap, a.warmup + a.duration, a.budget_ms, a.seed + int(10 * m),
                      tmp / f"load_{m:g}x.jsonl", say=say, cpus=cpus, at=(a.warmup, read_first))
    t_from = first.get("t", min((r["t"] for r in recs), default=0.0) + a.warmup)
    row = {"multiple": m, **summarise(recs, t_from, t_from + a.duration, a.budget_ms, cap)}
    error = first.get("error")
    server: dict = {"server_p99_ms": float("nan")}
    if "h" in first:
        try:
            server = server_figures(scrape_histogram(metrics) - first["h"], a.budget_ms)
            if not server["server_count"]:
                error = "it observed no Recommend in the measured part"
        except (OSError, ValueError) as e:
            error = str(e)
    elif error is None:
        error = "the load generator never started its arrivals"
    row.update(server)
    why = void_reason(row["generator_lag_p99_ms"], a.max_lag_ms, placement_void, error)
    row.update(void=why is not None, void_reason=why)
    return row


def main(argv=None) -> int:
    a = parse(argv)
    if a.profile:
        py_spy()  # before anything starts
    command = command_line("bench.overload", argv)
    if a.generator_cpu is not None and a.generator_cpu not in usable():
        raise SystemExit(f"--generator-cpu {a.generator_cpu}: this process may use CPUs {usable()} only")
    gen_cpus: set[int] | None = None
    svc_cpus: set[int] | None = None
    placement_void: str | None = None
    try:
        gen_cpus, svc_cpus = split(usable(), a.generator_cpu)
    except ValueError as e:
        placement_void = f"{e}: the load generator cannot have a CPU of its own"
        say(f"{placement_void}; every run will be void")
    env = {} if a.door is None else {"SPECREC_GATEWAY_MAX_CONCURRENT_RPCS": str(a.door)}
    bundle, users, tmp, users_file, stack = open_stack(a, "overload", metrics=("gateway",), env=env)
    rows: list[dict] = []
    profiles: dict = {}
    placement: dict = {}
    try:
        stack.start(a.startup_timeout, say=say)
        if gen_cpus is not None and svc_cpus is not None:
            placement = place(stack, gen_cpus, svc_cpus)
            say(f"the load generator on CPU {sorted(gen_cpus)}, the services on {sorted(svc_cpus)}: "
                + ", ".join(f"{n} {c}" for n, c in placement["processes"].items()))
        target, metrics = stack.addr("gateway"), stack.metrics_url("gateway")
        if a.capacity_rps is None:
            cap = measured_capacity(target, users.ids, a)
            say(f"capacity: {cap:.1f} beam answers/s ({a.clients} closed-loop callers, budget "
                f"{CAPACITY_BUDGET_MS:g} ms)")
        else:
            cap = a.capacity_rps
            say(f"capacity: {cap:.1f} beam answers/s, given (--capacity-rps)")
        multiples = [float(x) for x in a.multiples.split(",") if x.strip()]
        for m in multiples:
            row = load_run(target, metrics, users_file, m, cap, a, tmp, gen_cpus, placement_void)
            rows.append(row)
            say(f"{m:g}x ({row['offered_rps']:.0f} rps offered): gateway p99 {fmt(row['server_p99_ms'])} ms, caller "
                f"p99 {fmt(row['client_p99_ms'])} ms, send lag p99 {fmt(row['generator_lag_p99_ms'], '.2f')} ms, shed "
                f"{row['shed_share']:.1%}, model answers {row['model_answer_share']:.1%}, errors "
                f"{row['error_share']:.1%}, goodput {row['goodput_rps']:.0f}/s ({row['goodput_ratio']:.2f}x capacity)"
                + (f" -> VOID: {row['void_reason']}" if row["void"] else ""))
            time.sleep(2.0)
        if a.profile:  # one more run at the last multiple, with the samplers: its figures are not the table's
            spy = {n: stack.procs.procs[n].pid for n in ("gateway", "verifier")}
            m = multiples[-1]
            in_process(target, users_file, m * cap, a.warmup + a.duration, a.budget_ms, a.seed + int(10 * m) + 1,
                       tmp / "load_profiled.jsonl", spy, tmp / "profile", say=say, cpus=gen_cpus)
            profiles = {n: top_frames(tmp / "profile" / f"{n}.txt", a.warmup + a.duration) for n in [*spy, "loadgen"]
                        if (tmp / "profile" / f"{n}.txt").exists()}
            profiles["multiple"] = m
    except KeyboardInterrupt:
        say("interrupted: stopping the stack; nothing written")
        return 130
    finally:
        stack.stop(say=say)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    res = {"command": command, "run": run_line(), "users": users.source, "budget_ms": a.budget_ms,
           "machine": machine_line(), "placement": placement, "placement_void": placement_void,
           "max_lag_ms": a.max_lag_ms, "capacity_rps": cap, "capacity_given": a.capacity_rps is not None,
           "door": a.door, "clients": a.clients, "rows": rows,
           **({"profiles": profiles} if profiles else {})}
    plot(rows, a.budget_ms, a.max_lag_ms, out / "overload.png",
         f"{bundle.name}: auto at {a.budget_ms:g} ms, capacity {cap:.0f} rps, load generator on CPU "
         f"{sorted(gen_cpus) if gen_cpus else 'shared'}")
    keys, retire = summary_keys(rows, cap)
    cols = ["multiple", "void", "offered_rps", "achieved_rps", "server_p99_ms", "server_over_budget_share",
            "server_stats_p99_ms", "client_p99_ms", "generator_lag_p99_ms", "shed_share", "model_answer_share",
            "no_fill_share", "error_share", "goodput_rps", "goodput_ratio"]
    voids = "".join(f"- {r['multiple']:g}x is void: {r['void_reason']}.\n" for r in rows if r["void"])
    md = (f"Produced by:\n\n```bash\n{command}\n```\n\n{res['machine']}; capacity {cap:.1f} beam answers/s "
          f"({a.clients} closed-loop callers). Gateway p99 (`server_p99_ms`): its own histogram over the measured "
          "part; `server_stats_p99_ms`: its answers' `stats.total_ms`. Caller p99: every request of the measured part, "
          f"shed ones included. A run whose generator lag p99 is over {a.max_lag_ms:g} ms is void.\n\n"
          + markdown_table(rows, cols) + ("\n" + voids if voids else "") + "\n![overload](overload.png)\n")
    publish(out, "overload", res, "# Overload at a budget\n\n" + md, keys, retire=retire,
            readme=(README_OWNER, readme_body(no_nan(res))), old_sections=("bench/overload.py",))
    print(json.dumps(no_nan(keys), indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
