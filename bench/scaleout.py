"""Scale-out: two verifier replicas against one, through the gateway, on this machine.

    python -m bench.scaleout --bundle bundles/beauty-loo --rates 10,20,30,40 --duration 10

Two stacks in turn (a private namespace each, on one Redis found or started as ``bench.harness.Redis`` does):
one verifier, then two verifier replicas (and two drafters), the gateway
spreading requests over them (per-request affinity, the less busy of two random replicas). Each
is driven open loop (Poisson, policy ``auto``, budget ``--budget-ms``) at
rising rates with the same seeded sample of test users; per rate: p99,
answers holding fill, the achieved rate. With two replicas, the share of
requests each verifier replica served (its ``Encode`` calls, read from its
Prometheus endpoint), and a kill of one replica in the middle of a run:
errors seen by the client.

Both replicas run on the same two CPU cores as everything else here, so a
second replica adds no compute: what this shows is that replicas get
traffic and that losing one costs no error, not that throughput doubles.
Writes ``scaleout.{json,md}`` and the ``scaleout.*`` summary keys.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

from bench.harness import (
    Redis,
    Stack,
    add_common_args,
    command_line,
    machine_line,
    no_nan,
    publish,
    sample_users,
    sayer,
)
from bench.serving_phases import best_rate, offline_beam, open_loop, passes, summarise
from specrec.terminal import markdown_table
from specrec_rpc.processes import free_port
from specrec_stack.localstack import ServiceProcs

say = sayer("scaleout")


def calls(metrics_port: int) -> float:
    """Calls a verifier answered, every method (its Prometheus counter; a request's calls all go to one replica)."""
    with urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=5) as r:
        text = r.read().decode()
    total = 0.0
    for line in text.splitlines():
        if line.startswith("specrec_rpc_requests_total{") and "grpc.health" not in line:
            total += float(line.rsplit(" ", 1)[1])
    return total


def sweep(procs: ServiceProcs, users, offline_hits, a, rates) -> list[dict]:
    rows = []
    for rate in rates:
        measured, sent, achieved = asyncio.run(open_loop(procs.addr("gateway"), users, "auto", 10, a.budget_ms, rate,
                                                         a.duration, a.warmup, a.seed + int(rate)))
        row = {"offered_rps": rate, "achieved_rps": achieved, **summarise(measured, offline_hits, sent)}
        row["pass"] = passes(row, a.budget_ms)
        rows.append(row)
        say(f"@ {rate:g} rps: p99 {row['p99_ms']:.1f} ms, fill {row['fill_share']:.1%}, R@10 {row['recall@10']:.4f}, "
            f"errors {row['error_codes'] or 'none'} -> {'pass' if row['pass'] else 'FAIL'}")
        time.sleep(1.0)
    return rows


def kill_during_load(procs: ServiceProcs, users, offline_hits, a) -> dict:
    """Open loop at --kill-rate; verifier2 and drafter2 are killed a third of the way in."""
    def killer():
        time.sleep(a.warmup + a.duration / 3)
        for key in ("verifier2", "drafter2"):
            p = procs.procs.get(key)
            if p is not None:
                p.kill()
                say(f"killed {key} (pid {p.pid})")

    t = threading.Thread(target=killer, daemon=True)
    t.start()
    measured, sent, achieved = asyncio.run(open_loop(procs.addr("gateway"), users, "auto", 10, a.budget_ms, a.kill_rate,
                                                     a.duration, a.warmup, a.seed + 999))
    t.join()
    row = {"offered_rps": a.kill_rate, "achieved_rps": achieved, **summarise(measured, offline_hits, sent)}
    say(f"kill one replica of each at {a.kill_rate:g} rps: errors {row['error_codes'] or 'none'}, "
        f"fill {row['fill_share']:.1%}, p99 {row['p99_ms']:.1f} ms (the gateway's {row['server_p99_ms']:.1f}), "
        f"served by {row['served_by']}")
    return row


def parse(argv):
    ap = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    ap.add_argument("--bundle", required=True)
    ap.add_argument("--rates", default="10,20,30,40")
    ap.add_argument("--duration", type=float, default=10.0)
    ap.add_argument("--warmup", type=float, default=2.0)
    ap.add_argument("--kill-rate", type=float, default=20.0)
    ap.add_argument("--budget-ms", type=float, default=30.0)
    ap.add_argument("--requests", type=int, default=300)
    add_common_args(ap)
    return ap.parse_args(argv)


def main(argv=None) -> int:
    a = parse(argv)
    command = command_line("bench.scaleout", argv)
    from specrec.bundle import Bundle

    bundle_dir = Path(a.bundle).resolve()
    bundle = Bundle.load(bundle_dir)
    users = sample_users(bundle, a.requests, a.seed)
    rates = sorted({float(x) for x in a.rates.split(",") if x.strip()})
    say(users.source)
    offline_hits = offline_beam(bundle, users, 10)
    tmp = Path(tempfile.mkdtemp(prefix="specrec-scaleout-"))
    redis = Redis(a.redis_url, tmp)  # one for both stacks, each on a namespace of its own
    res = {"command": command, "users": users.source, "machine": machine_line(), "budget_ms": a.budget_ms,
           "note": "both verifier replicas share the same 2 CPU cores with every other process here",
           "one": [], "two": [], "shares": {}, "kill": {}}
    try:
        for label, n in (("one", 1), ("two", 2)):
            stack = Stack(bundle_dir, redis.url, tmp / f"logs-{label}", "scaleout", threads=a.threads,
                          max_history=bundle.cfg.max_history,
                          metrics_ports={"itemset": 0, "verifier": free_port(), "drafter": 0, "gateway": 0},
                          replicas={"verifier": n, "drafter": n})
            procs = stack.procs
            try:
                say(f"{label} verifier replica(s)")
                procs.start(a.startup_timeout, say=say)
                before = {k: calls(procs.metrics_ports[k]) for k in procs.keys("verifier")}
                res[label] = sweep(procs, users, offline_hits, a, rates)
                if n > 1:
                    after = {k: calls(procs.metrics_ports[k]) for k in procs.keys("verifier")}
                    served = {k: after[k] - before[k] for k in after}
                    total = sum(served.values()) or 1.0
                    res["shares"] = {k: v / total for k, v in served.items()}
                    say(f"shares of the requests: {res['shares']}")
                    res["kill"] = kill_during_load(procs, users, offline_hits, a)
            finally:
                stack.stop(say=say)
    finally:
        redis.stop()
    b1, b2 = best_rate(res["one"]), best_rate(res["two"])
    summary = {"scaleout.replica_share_min": min(res["shares"].values()) if res["shares"] else float("nan"),
               "scaleout.errors_on_replica_kill": int(res["kill"].get("errors", 0)) if res["kill"] else None,
               # the run with the kill, every answer: holding catalogue fill, the gateway's own p99, GR-ranked
               "scaleout.fill_share_on_replica_kill": res["kill"].get("fill_share") if res["kill"] else None,
               "scaleout.server_p99_ms_on_replica_kill": res["kill"].get("server_p99_ms") if res["kill"] else None,
               "scaleout.gr_ranked_share_on_replica_kill": res["kill"].get("gr_ranked_share") if res["kill"] else None,
               "scaleout.max_rps_p99_one_replica": b1, "scaleout.max_rps_p99_two_replicas": b2}
    res["summary"] = summary
    out = Path(a.out)
    cols = ["replicas", "offered rps", "achieved rps", "p99 ms", "fill share", "R@10", "errors", "pass"]
    table = markdown_table([dict(zip(cols, [label, r["offered_rps"], r["achieved_rps"], r["p99_ms"], r["fill_share"],
                                            r["recall@10"], r["errors"], r["pass"]]))
                            for label in ("one", "two") for r in res[label]], cols, fmt="{:.3f}")
    kill = res["kill"]
    text = (f"# Scale-out: two verifier replicas against one\n\nProduced by `{command}` ({res['machine']}); "
            f"{users.source}; policy auto, budget {a.budget_ms:g} ms. {res['note']}: a second replica adds no CPU "
            f"here, so this measures that replicas get traffic and that losing one costs no error, not a "
            f"throughput gain.\n\n{table}\nShares of the requests per verifier replica (verifier calls answered): "
            f"{json.dumps({k: round(v, 3) for k, v in res['shares'].items()})}.\n\n"
            f"Killing verifier2 and drafter2 a third of the way into {a.duration:g} s at {a.kill_rate:g} rps: "
            f"{kill.get('errors', 'n/a')} errors ({kill.get('error_codes', {})}), fill share "
            f"{kill.get('fill_share', float('nan')):.1%}, p99 {kill.get('p99_ms', float('nan')):.1f} ms at the "
            f"client, {kill.get('server_p99_ms', float('nan')):.1f} ms at the gateway; served by "
            f"{json.dumps(kill.get('served_by', {}))} (GR-ranked {kill.get('gr_ranked_share', float('nan')):.1%})."
            f"\n\n"
            f"Highest rate passing (p99 <= {a.budget_ms:g} ms, no fill, R@10 >= 0.95 x offline beam): one replica "
            f"{b1}, two replicas {b2}.\n")
    publish(out, "scaleout", res, text, summary)
    print(json.dumps(no_nan(summary), indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
