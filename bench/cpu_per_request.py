"""CPU time per fused request, per service: what each service's processes spend on one request through the gateway.

    python -m bench.cpu_per_request --bundle bundles/beauty-loo --requests 300

Starts its own stack (as ``bench.serving``: Redis, a private namespace, the four services as subprocesses on free
ports, each with the processes its settings give it, ``SPECREC_GATEWAY_PROCESSES`` and
``SPECREC_DRAFTER_PROCESSES``, auto by default), then:

1. idle: each service's CPU time over ``--idle-s`` seconds with no request (catalogue polls, timers), as CPU ms
   per second;
2. ``--requests`` fused requests through the gateway, closed loop, one at a time
   (:func:`bench.serving_phases.closed_loop`, its 5 unmeasured warm-up requests counted too: they cost the same),
   at ``--budget-ms`` (1000 by default: no request is cut at its deadline, every one runs the fused policy to
   its end); each service's CPU time before and after, user and system, every process of the service
   (``/proc/<pid>/stat``: a group's parent and its processes, :func:`specrec_rpc.processes.group_pids`).

CPU ms per request = the CPU time a service used during phase 2 / the requests sent; the idle rate is reported
beside it, not subtracted (a service's timers are part of what it costs). CPU time per request is far less
sensitive than latency to other load on the machine (a busy machine delays a request more than it makes it
cost more cycles; caches and contention aside), so it compares code side by side: issue 52 asks that the
gateway's halve.

Writes ``cpu_per_request.{json,md}`` into ``--out`` and the summary keys ``gateway.fused.cpu_ms_per_request``,
``drafter.fused.cpu_ms_per_request`` and ``verifier.fused.cpu_ms_per_request``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import tempfile
import time
from pathlib import Path

from bench.cpus import cpu_seconds
from bench.harness import (
    Redis,
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
from bench.serving_phases import closed_loop

say = sayer("cpu")
SERVICES = ("gateway", "drafter", "verifier", "itemset")
KEYED = ("gateway", "drafter", "verifier")  # the summary keys issue 52 names
WARMUP = 5  # closed_loop's unmeasured requests


def cpu_of(stack: Stack) -> dict[str, tuple[float, int]]:
    """Each service's CPU seconds, every process of it (its group's parent and processes), and how many."""
    from specrec_rpc.processes import group_pids

    out = {}
    for name in SERVICES:
        pids = group_pids(stack.procs.procs[name].pid)
        out[name] = (sum(cpu_seconds(p) or 0.0 for p in pids), len(pids))
    return out


def measure(stack: Stack, users, policy: str, k: int, budget_ms: float, n: int, idle_s: float) -> dict:
    target = stack.addr("gateway")
    c0 = cpu_of(stack)
    time.sleep(idle_s)
    c1 = cpu_of(stack)
    t0 = time.perf_counter()
    answers = asyncio.run(closed_loop(target, users, policy, k, budget_ms, n))
    wall = time.perf_counter() - t0
    c2 = cpu_of(stack)
    sent = len(answers) + min(WARMUP, n)
    ok = [a for a in answers if a["error"] is None]
    rows = {}
    for name in SERVICES:
        per_req = 1000.0 * (c2[name][0] - c1[name][0]) / sent
        idle = 1000.0 * (c1[name][0] - c0[name][0]) / idle_s
        # processes: the group's parent (no service of its own) is not one
        procs = c2[name][1] - 1 if c2[name][1] > 1 else 1
        rows[name] = {"cpu_ms_per_request": per_req, "idle_cpu_ms_per_s": idle, "processes": procs}
    return {"policy": policy, "sent": sent, "answered": len(ok), "errors": len(answers) - len(ok),
            "served_by_policy_share": sum(a["served_by"] == policy and not a["degraded"] for a in ok) / max(1, len(ok)),
            "wall_ms_per_request": 1000.0 * wall / sent, "services": rows}


def parse(argv):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    ap.add_argument("--bundle", required=True, help="bundle directory (with a SASRec drafter and a fusion)")
    ap.add_argument("--policy", default="fused")
    ap.add_argument("--requests", type=int, default=300, help="closed-loop requests measured (test users sampled)")
    ap.add_argument("--k", type=int, default=10)
    ap.add_argument("--budget-ms", type=float, default=1000.0, help="generous: no request is cut at its deadline")
    ap.add_argument("--idle-s", type=float, default=5.0, help="seconds of no request, for the idle CPU rate")
    add_common_args(ap)
    return ap.parse_args(argv)


def markdown(res: dict) -> str:
    m = res["measured"]
    lines = [f"# CPU time per {m['policy']} request, per service\n",
             f"Produced by `{res['command']}` ({res['run']}; {res['machine']}; load average {res['load_before']:.1f} "
             f"before, {res['load_after']:.1f} after). {res['users']}; {m['sent']} closed-loop requests through the "
             f"gateway, one at a time, budget {res['budget_ms']:g} ms: {m['answered']} answered, "
             f"{m['served_by_policy_share']:.2f} of them by {m['policy']} itself, "
             f"{m['wall_ms_per_request']:.1f} ms of wall time per request. The stack's placement: "
             f"{res.get('placement', 'shared')} (`SPECREC_STACK_PLACEMENT`).\n",
             "CPU time (user + system) of every process of a service during the requests, over the requests sent; "
             "idle: the same with no request, per second, not subtracted.\n",
             "| service | processes | CPU ms per request | idle CPU ms per s |", "|---|---|---|---|"]
    for name, row in m["services"].items():
        lines.append(f"| {name} | {row['processes']} | {fmt(row['cpu_ms_per_request'], '.2f')} | "
                     f"{fmt(row['idle_cpu_ms_per_s'], '.2f')} |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    a = parse(argv)
    command = command_line("bench.cpu_per_request", argv)
    raise_on_signals(signal.SIGTERM, signal.SIGHUP)
    from specrec.bundle import Bundle

    bundle_dir = Path(a.bundle).resolve()
    bundle = Bundle.load(bundle_dir)
    users = sample_users(bundle, a.requests, a.seed)
    say(users.source)
    tmp = Path(tempfile.mkdtemp(prefix="specrec-cpu-"))
    stack = Stack(bundle_dir, Redis(a.redis_url, tmp, a.private_redis), tmp / "logs", "cpu", threads=a.threads,
                  max_history=bundle.cfg.max_history)
    res: dict = {"command": command, "run": run_line(), "machine": machine_line(), "users": users.source,
                 "k": a.k, "budget_ms": a.budget_ms, "load_before": os.getloadavg()[0]}
    try:
        stack.start(a.startup_timeout, say=say)
        res["placement"] = stack.procs.placement
        res["measured"] = measure(stack, users, a.policy, a.k, a.budget_ms, len(users.ids), a.idle_s)
    finally:
        stack.stop(say=say)
    res["load_after"] = os.getloadavg()[0]
    for name, row in res["measured"]["services"].items():
        say(f"{name} ({row['processes']} process(es)): {row['cpu_ms_per_request']:.2f} CPU ms per request, "
            f"idle {row['idle_cpu_ms_per_s']:.2f} ms/s")
    keys = {f"{name}.{a.policy}.cpu_ms_per_request": res["measured"]["services"][name]["cpu_ms_per_request"]
            for name in KEYED}
    publish(Path(a.out), "cpu_per_request", res, markdown(res), keys)
    print(json.dumps(no_nan(keys), indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
