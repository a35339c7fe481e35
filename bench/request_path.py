"""The request path: the same users in process and through the stack, side by side in one run.

    python -m bench.request_path --bundle bundles/beauty-loo --requests 300

Starts its own stack (as ``bench.serving``: Redis, a private namespace, the four services as subprocesses on free
ports) and a bare gRPC front beside it (:mod:`bench.bare_front`), then, one request at a time, on a seeded random
sample of test users (K = 10, a budget that never acts):

1. **in process against the stack** (``--policies``, fused and beam): each block of ``--block`` users runs in
   this process (the bundle's own engine with the verifier's intra-op threads, ``--threads``, and the same item
   drafter),
   then through the gateway, block after block, so that a machine that drifts moves both sides alike. Per policy:
   p50 and p99 each way, their ratio (``gateway.<policy>.stack_over_inprocess_p50`` / ``_p99``) and the share of
   users whose list is the same both ways (``gateway.<policy>.lists_equal_inprocess``);
2. **CPU per fused request**: every service's processes' CPU time (user + system, ``/proc``) over the gateway's
   fused blocks, per request (``<service>.fused.cpu_ms_per_request``); the bare front's over blocks of its own
   on the same users (``gateway.bare_front.cpu_ms_per_request``): a plain ``grpc.aio`` server making the same two
   calls, what Python gRPC alone costs here (its latency, interleaved with the others' blocks, over the in-process
   one: ``gateway.bare_front.over_inprocess_p50`` / ``_p99``, the floor of the stack's ratio); and the
   verifier's own work in this process, the same encode and scoring pass of the same candidates
   (``verifier.fused.inprocess_cpu_ms_per_request``);
3. **round trips**: a bare health check against the bare front's server (``gateway.bare_round_trip_p50_ms``), and
   from the fused answers' stage times, each hop's time above its callee's own (``x-server-ms``): the caller to
   the gateway (the client's time less the gateway's total), the gateway to the drafter, the gateway to the
   verifier (``gateway.fused.hop_ms_p50.<hop>``).

The machine's CPU class (AVX2 only, AVX-512, AMX) is named in the results: the same code costs different time on
each. Writes ``request_path.{json,md}`` into ``--out`` and its summary keys.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from bench.cpus import cpu_seconds
from bench.harness import (
    Redis,
    Stack,
    add_common_args,
    command_line,
    fmt,
    machine_line,
    machine_of,
    no_nan,
    publish,
    raise_on_signals,
    request,
    run_line,
    sample_users,
    sayer,
)
from specrec.eval.results import paragraph

say = sayer("path")
#: this benchmark's section of the results README (``<!-- bench.request_path: begin -->`` ... ``end``)
README_OWNER = "bench.request_path"
SERVICES = ("gateway", "drafter", "verifier", "itemset")


def cpu_class(flags: set[str] | None = None) -> str:
    """What the CPU computes in: ``AMX`` (and AVX-512), ``AVX-512``, ``AVX2 only``, or ``no AVX2`` (``flags``: the
    CPU's flags, default this machine's, from ``/proc/cpuinfo``)."""
    if flags is None:
        try:
            with open("/proc/cpuinfo") as fh:
                line = next(x for x in fh if x.startswith("flags"))
            flags = set(line.split(":", 1)[1].split())
        except (OSError, StopIteration):
            flags = set()
    if "amx_tile" in flags:
        return "AMX"
    if "avx512f" in flags:
        return "AVX-512"
    return "AVX2 only" if "avx2" in flags else "no AVX2"


def pct(xs, q: float) -> float:
    return float(np.percentile(np.asarray(xs, dtype=np.float64), q)) if len(xs) else float("nan")


def service_cpu(stack: Stack) -> dict[str, float]:
    """Each service's CPU seconds, every process of it."""
    from specrec_rpc.processes import group_pids

    return {name: sum(cpu_seconds(p) or 0.0 for p in group_pids(stack.procs.procs[name].pid)) for name in SERVICES}


class BareFrontProc:
    """:mod:`bench.bare_front` in a process of its own, on a free port, calling the stack's drafter and verifier."""

    def __init__(self, stack: Stack, ids: list[str], tmp: Path, candidates: int, window: int):
        path = tmp / "ids.json"
        path.write_text(json.dumps(list(ids)))
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "bench.bare_front", "--drafter", stack.addr("drafter"), "--verifier",
             stack.addr("verifier"), "--ids", str(path), "--candidates", str(candidates), "--max-history",
             str(window)], stdout=subprocess.PIPE, text=True, cwd=Path(__file__).resolve().parent.parent)
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        m = re.match(r"port (\d+)", line)
        if not m:
            self.proc.kill()
            raise RuntimeError(f"the bare front did not start: {line!r}")
        self.addr = f"127.0.0.1:{m.group(1)}"

    def cpu(self) -> float:
        return cpu_seconds(self.proc.pid) or 0.0

    def stop(self) -> None:
        self.proc.kill()
        self.proc.wait(10)


def measure(stack: Stack, front: BareFrontProc, bundle, users, policies: list[str], k: int, block: int,
            warmup: int) -> dict:
    import grpc
    import torch
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    from specrec.drafters.base import DraftRequest
    from specrec.policies import RecRequest, make_policy
    from specrec_rpc.v1 import recommender_pb2_grpc

    eng = bundle.engine(drafter=bundle.default_drafter())
    ids = bundle.catalogue.ids
    n = len(users.ids)
    gw = recommender_pb2_grpc.RecommenderStub(grpc.insecure_channel(stack.addr("gateway")))
    bare = recommender_pb2_grpc.RecommenderStub(grpc.insecure_channel(front.addr))

    def through(stub, i: int, policy: str):
        t0 = time.perf_counter()
        resp = stub.Recommend(request(users.ids[i], i, policy, k, 1000.0), timeout=10.0)
        return (time.perf_counter() - t0) * 1000.0, resp

    out: dict = {"policies": {}}
    for policy in policies:
        pol = make_policy(policy, eng)

        def local(i: int, pol=pol):
            t0 = time.perf_counter()
            res = pol.run([RecRequest(users.rows[i], k, eng.clock() + 10.0)])[0]
            return (time.perf_counter() - t0) * 1000.0, res

        for i in range(min(warmup, n)):  # code paths, caches and the first calls, never measured
            local(i)
            through(gw, i, policy)
            if policy == "fused":
                through(bare, i, policy)
        eng.costs.reset()  # a cold first request taught the in-process budget checks nothing true
        loc, st, same, stages = [], [], [], []
        cpu = dict.fromkeys(SERVICES, 0.0)
        bare_ms, bare_cpu = [], 0.0
        for b0 in range(0, n, block):
            idx = range(b0, min(n, b0 + block))
            for i in idx:
                ms, res = local(i)
                loc.append(ms)
                same.append([ids[r] for r in res.items.tolist()])
            c0 = service_cpu(stack)
            for i in idx:
                ms, resp = through(gw, i, policy)
                st.append(ms)
                stages.append((ms, resp.stats.total_ms, dict(resp.stats.stage_ms), resp.stats.served_by))
                j = len(st) - 1
                same[j] = same[j] == [it.item_id for it in resp.items]
            c1 = service_cpu(stack)
            for name in SERVICES:
                cpu[name] += c1[name] - c0[name]
            if policy == "fused":
                f0 = front.cpu()
                for i in idx:
                    bare_ms.append(through(bare, i, policy)[0])
                bare_cpu += front.cpu() - f0
        row = {"n": n, "inprocess_p50_ms": pct(loc, 50), "inprocess_p99_ms": pct(loc, 99),
               "stack_p50_ms": pct(st, 50), "stack_p99_ms": pct(st, 99),
               "lists_equal_inprocess": float(np.mean([s is True for s in same])),
               "served_by": {s: sum(1 for *_, b in stages if b == s) for s in {b for *_, b in stages}},
               "cpu_ms_per_request": {name: 1000.0 * v / n for name, v in cpu.items()}}
        row["stack_over_inprocess_p50"] = row["stack_p50_ms"] / row["inprocess_p50_ms"]
        row["stack_over_inprocess_p99"] = row["stack_p99_ms"] / row["inprocess_p99_ms"]
        hops = {"client_gateway": [ms - total for ms, total, _, _ in stages],
                "gateway_drafter": [s["draft"] - s["server.Draft"] for _, _, s, _ in stages
                                    if "server.Draft" in s and "draft" in s],
                "gateway_verifier": [s["verify"] - s["server.Search"] for _, _, s, _ in stages
                                     if "server.Search" in s and "verify" in s]}
        row["hop_ms_p50"] = {h: pct(v, 50) for h, v in hops.items() if v}
        row["server_ms_p50"] = {m: pct([s[f"server.{m}"] for _, _, s, _ in stages if f"server.{m}" in s], 50)
                                for m in ("Draft", "Search")}
        if policy == "fused":
            row["bare_front"] = {"p50_ms": pct(bare_ms, 50), "p99_ms": pct(bare_ms, 99),
                                 "cpu_ms_per_request": 1000.0 * bare_cpu / n}
            # the floor of stack_over_inprocess: the same two calls from a front that does nothing else
            for q in ("p50", "p99"):
                row["bare_front"][f"over_inprocess_{q}"] = row["bare_front"][f"{q}_ms"] / row[f"inprocess_{q}_ms"]
            row["verifier_inprocess_cpu_ms_per_request"] = _verifier_in_process(eng, users, torch, DraftRequest)
        out["policies"][policy] = row
        say(f"{policy}: in process p50 {row['inprocess_p50_ms']:.2f} ms, stack {row['stack_p50_ms']:.2f} ms "
            f"({row['stack_over_inprocess_p50']:.2f}x; p99 {row['stack_over_inprocess_p99']:.2f}x), same lists "
            f"{row['lists_equal_inprocess']:.3f}")
    health = health_pb2_grpc.HealthStub(grpc.insecure_channel(front.addr))
    for _ in range(50):
        health.Check(health_pb2.HealthCheckRequest(service=""), timeout=5.0)
    rtt = []
    for _ in range(max(300, n)):
        t0 = time.perf_counter()
        health.Check(health_pb2.HealthCheckRequest(service=""), timeout=5.0)
        rtt.append((time.perf_counter() - t0) * 1000.0)
    out["bare_round_trip_p50_ms"], out["bare_round_trip_p99_ms"] = pct(rtt, 50), pct(rtt, 99)
    return out


def _verifier_in_process(eng, users, torch, DraftRequest) -> float:
    """The verifier's share of a fused request in this process: the history's encode and the scoring pass over
    the item drafter's candidates, CPU ms per user (the draft itself not counted)."""
    backend, fusion = eng.verifier.backend, eng.drafter.fusion
    total = 0.0
    for rows in users.rows:
        d = eng.drafter.draft([DraftRequest(rows, fusion.candidates(10))])[0]
        sids = torch.from_numpy(eng.itemset.sids_of(d.items)[None])
        hist = eng.history_sids([rows])
        c0 = time.process_time()
        with torch.inference_mode():
            backend.search("rank", backend.encode(hist), None, (), {"sids": sids})
        total += time.process_time() - c0
    return 1000.0 * total / len(users.rows)


def keys_of(res: dict) -> dict:
    m, out = res["measured"], {}
    for policy, row in m["policies"].items():
        for q in ("p50", "p99"):
            out[f"gateway.{policy}.stack_over_inprocess_{q}"] = row[f"stack_over_inprocess_{q}"]
        out[f"gateway.{policy}.lists_equal_inprocess"] = row["lists_equal_inprocess"]
    fused = m["policies"].get("fused")
    if fused:
        for name in ("gateway", "drafter", "verifier"):
            out[f"{name}.fused.cpu_ms_per_request"] = fused["cpu_ms_per_request"][name]
        out["gateway.bare_front.cpu_ms_per_request"] = fused["bare_front"]["cpu_ms_per_request"]
        for q in ("p50", "p99"):
            out[f"gateway.bare_front.over_inprocess_{q}"] = fused["bare_front"][f"over_inprocess_{q}"]
        out["verifier.fused.inprocess_cpu_ms_per_request"] = fused["verifier_inprocess_cpu_ms_per_request"]
        for hop, v in fused["hop_ms_p50"].items():
            out[f"gateway.fused.hop_ms_p50.{hop}"] = v
    out["gateway.bare_round_trip_p50_ms"] = m["bare_round_trip_p50_ms"]
    return out


def markdown(res: dict) -> str:
    m = res["measured"]
    lines = ["# The request path: in process and through the stack\n",
             f"Produced by `{res['command']}` ({res['run']}; {res['machine']}; CPU class: **{res['cpu_class']}**; "
             f"load average {res['load_before']:.1f} before, {res['load_after']:.1f} after). {res['users']}; K = "
             f"{res['k']}, one request at a time, blocks of {res['block']} users alternating in process and through "
             f"the gateway.\n",
             "| policy | in process p50 / p99 ms | stack p50 / p99 ms | stack / in process p50 | p99 | same lists |"
             " served by |", "|---|---|---|---|---|---|---|"]
    for p, r in m["policies"].items():
        lines.append(f"| {p} | {fmt(r['inprocess_p50_ms'], '.2f')} / {fmt(r['inprocess_p99_ms'], '.2f')} | "
                     f"{fmt(r['stack_p50_ms'], '.2f')} / {fmt(r['stack_p99_ms'], '.2f')} | "
                     f"{fmt(r['stack_over_inprocess_p50'], '.2f')}x | {fmt(r['stack_over_inprocess_p99'], '.2f')}x | "
                     f"{fmt(r['lists_equal_inprocess'], '.3f')} | "
                     f"{', '.join(f'{k} {v}' for k, v in r['served_by'].items())} |")
    f = m["policies"].get("fused")
    if f:
        c, bare = f["cpu_ms_per_request"], f["bare_front"]
        lines += ["", "CPU ms per fused request (every process of each service, user + system, over the gateway's "
                  "blocks), against the same work elsewhere:", "",
                  "| part | CPU ms per request | reference | ratio |", "|---|---|---|---|",
                  f"| gateway | {fmt(c['gateway'], '.2f')} | bare front making the same two calls: "
                  f"{fmt(bare['cpu_ms_per_request'], '.2f')} | "
                  f"{fmt(c['gateway'] / bare['cpu_ms_per_request'], '.2f')}x |",
                  f"| verifier | {fmt(c['verifier'], '.2f')} | the same encode and scoring pass in process: "
                  f"{fmt(f['verifier_inprocess_cpu_ms_per_request'], '.2f')} | "
                  f"{fmt(c['verifier'] / f['verifier_inprocess_cpu_ms_per_request'], '.2f')}x |",
                  f"| drafter | {fmt(c['drafter'], '.2f')} | | |", f"| item set | {fmt(c['itemset'], '.2f')} | | |",
                  "", f"Round trips (p50): a bare health check {fmt(m['bare_round_trip_p50_ms'], '.2f')} ms (p99 "
                  f"{fmt(m['bare_round_trip_p99_ms'], '.2f')}); each hop of a fused request above its callee's own "
                  "time: " + ", ".join(f"{h.replace('_', ' to ')} {fmt(v, '.2f')} ms" for h, v in
                                       f["hop_ms_p50"].items())
                  + f"; the callees' own time: Draft {fmt(f['server_ms_p50']['Draft'], '.2f')}, Search "
                  f"{fmt(f['server_ms_p50']['Search'], '.2f')} ms. The bare front answered in "
                  f"{fmt(bare['p50_ms'], '.2f')} ms p50 ({fmt(bare['p99_ms'], '.2f')} p99): "
                  f"{fmt(bare['over_inprocess_p50'], '.2f')}x / {fmt(bare['over_inprocess_p99'], '.2f')}x the fused "
                  "list in process, the floor of the stack's ratio with these services split this way."]
    return "\n".join(lines) + "\n"


def readme_body(res: dict) -> str:
    """This benchmark's section of the results README: the ratios, the CPU against its references, the round
    trips (every column: ``request_path.md``)."""
    m, k = res["measured"], keys_of(res)
    f = m["policies"].get("fused", {})
    rows = [f"| {p} | {fmt(r['inprocess_p50_ms'], '.2f')} / {fmt(r['inprocess_p99_ms'], '.2f')} | "
            f"{fmt(r['stack_p50_ms'], '.2f')} / {fmt(r['stack_p99_ms'], '.2f')} | "
            f"**{fmt(r['stack_over_inprocess_p50'], '.2f')}** / **{fmt(r['stack_over_inprocess_p99'], '.2f')}** | "
            f"{fmt(r['lists_equal_inprocess'], '.3f')} |" for p, r in m["policies"].items()]
    cpu = ""
    if f:
        c = f["cpu_ms_per_request"]
        cpu = paragraph(
            f"CPU ms per fused request: gateway **{fmt(c['gateway'], '.2f')}** against a bare gRPC front making the "
            f"same two calls {fmt(k['gateway.bare_front.cpu_ms_per_request'], '.2f')} "
            f"({fmt(c['gateway'] / k['gateway.bare_front.cpu_ms_per_request'], '.2f')}x); verifier "
            f"**{fmt(c['verifier'], '.2f')}** against the same encode and scoring pass in process "
            f"{fmt(k['verifier.fused.inprocess_cpu_ms_per_request'], '.2f')} "
            f"({fmt(c['verifier'] / k['verifier.fused.inprocess_cpu_ms_per_request'], '.2f')}x); drafter "
            f"{fmt(c['drafter'], '.2f')}, item set {fmt(c['itemset'], '.2f')}. A bare gRPC front making the same "
            f"two calls answers in {fmt(f['bare_front']['over_inprocess_p50'], '.2f')}x / "
            f"{fmt(f['bare_front']['over_inprocess_p99'], '.2f')}x the in-process time (p50 / p99; "
            "`gateway.bare_front.over_inprocess_*`): the floor of the stack's ratio here. A bare round trip "
            f"{fmt(m['bare_round_trip_p50_ms'], '.2f')} ms; each hop above its callee's own time: "
            + ", ".join(f"{h.replace('_', ' to ')} {fmt(v, '.2f')}" for h, v in f["hop_ms_p50"].items()) + " ms.")
    return "\n".join([
        "## The request path: in process and through the stack (`bench.request_path`, `gateway.*.stack_over_*`)\n",
        paragraph(f"Run: {res['run']}. {machine_of(res)}, CPU class **{res['cpu_class']}**. {res['users']}, K = "
                  f"{res['k']}, one request at a time, blocks of {res['block']} users alternating in process and "
                  "through the gateway. Every column: [`request_path.md`](request_path.md)."),
        f"Command (step `path`): `{res['command']}`", "",
        "| policy | in process p50 / p99 ms | stack p50 / p99 ms | stack / in process, p50 / p99 | same lists |",
        "|---|---|---|---|---|", *rows, "", cpu])


def parse(argv):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    ap.add_argument("--bundle", required=True, help="bundle directory (with a SASRec drafter and a fusion)")
    ap.add_argument("--requests", type=int, default=300, help="test users, each asked once per policy and side")
    ap.add_argument("--policies", default="fused,beam")
    ap.add_argument("--k", type=int, default=10)
    ap.add_argument("--block", type=int, default=25, help="users per block (in process, then through the stack)")
    ap.add_argument("--warmup", type=int, default=10, help="requests per policy and side, not measured")
    add_common_args(ap)
    return ap.parse_args(argv)


def main(argv=None) -> int:
    a = parse(argv)
    command = command_line("bench.request_path", argv)
    raise_on_signals(signal.SIGTERM, signal.SIGHUP)
    import torch

    from specrec.bundle import Bundle

    torch.set_num_threads(a.threads)  # in process as in the services: their intra-op threads (the verifier's)

    bundle_dir = Path(a.bundle).resolve()
    bundle = Bundle.load(bundle_dir)
    users = sample_users(bundle, a.requests, a.seed)
    say(users.source)
    tmp = Path(tempfile.mkdtemp(prefix="specrec-path-"))
    stack = Stack(bundle_dir, Redis(a.redis_url, tmp, a.private_redis), tmp / "logs", "path", threads=a.threads,
                  max_history=bundle.cfg.max_history)
    res: dict = {"command": command, "run": run_line(), "machine": machine_line(), "cpu_class": cpu_class(),
                 "users": users.source, "k": a.k, "block": a.block, "load_before": os.getloadavg()[0]}
    front = None
    try:
        stack.start(a.startup_timeout, say=say)
        fusion = bundle.fusion
        front = BareFrontProc(stack, bundle.catalogue.ids, tmp, fusion.candidates(a.k) if fusion else 2 * a.k,
                              bundle.cfg.max_history)
        res["measured"] = measure(stack, front, bundle, users, a.policies.split(","), a.k, a.block, a.warmup)
    finally:
        if front is not None:
            front.stop()
        stack.stop(say=say)
    res["load_after"] = os.getloadavg()[0]
    keys = keys_of(res)
    publish(Path(a.out), "request_path", res, markdown(res), keys, readme=(README_OWNER, readme_body(res)))
    print(json.dumps(no_nan(keys), indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
