"""A load generator in its own process: open-loop Poisson arrivals of ``auto`` requests to a gateway.

Run by ``bench/overload.py`` and ``bench/soak.py`` (never in the process that measures the stack, so
the client's event loop does not compete with the parent's threads for the GIL). Users come from a JSON
file the parent writes (``{"ids": [[item id, ...], ...], "targets": [...]}``); every answer is one JSON
line in ``--out``: scheduled send time (monotonic, seconds), caller-side latency, the gateway's own time
(``stats.total_ms``), the status, who served, whether the list is a model answer (no catalogue fill).

    python bench/loadgen.py --target 127.0.0.1:50050 --users users.json --rate 40 --duration 20 --out rec.jsonl
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from pathlib import Path

import numpy as np


async def run(target: str, users: dict, rate: float, duration: float, budget_ms: float, k: int, seed: int,
              out: Path, progress_every: float = 10.0) -> int:
    import grpc

    from specrec_rpc.v1 import recommender_pb2, recommender_pb2_grpc

    ids = users["ids"]
    rng = np.random.default_rng(seed)
    fh = open(out, "w")
    n_done = 0

    async def one(stub, j: int, sched: float) -> None:
        nonlocal n_done
        i = j % len(ids)
        # how late this process sent it: a caller-side tail the gateway never saw (the generator's own loop)
        rec: dict = {"t": sched, "user": i, "send_lag_ms": (time.monotonic() - sched) * 1000.0}
        req = recommender_pb2.RecommendRequest(history=ids[i], k=k, policy="auto", budget_ms=budget_ms,
                                               user_id=f"load-{i}")
        try:
            resp = await stub.Recommend(req, timeout=5.0)
            sources = [it.source for it in resp.items]
            rec.update(code="OK", served_by=resp.stats.served_by or resp.stats.policy,
                       degraded=bool(resp.stats.degraded), server_ms=resp.stats.total_ms,
                       model=bool(sources) and "fill" not in sources, any_fill="fill" in sources)
        except grpc.aio.AioRpcError as e:
            rec.update(code=e.code().name, served_by="", degraded=True, model=False, any_fill=False)
        rec["latency_ms"] = (time.monotonic() - sched) * 1000.0
        fh.write(json.dumps(rec) + "\n")
        n_done += 1

    async with grpc.aio.insecure_channel(target) as ch:
        stub = recommender_pb2_grpc.RecommenderStub(ch)
        await ch.channel_ready()
        tasks: set[asyncio.Task] = set()
        t0 = t_next = time.monotonic()
        t_print = t0 + progress_every
        j = 0
        while True:
            t_next += rng.exponential(1.0 / rate)
            if t_next - t0 >= duration:
                break
            d = t_next - time.monotonic()
            if d > 0:
                await asyncio.sleep(d)
            task = asyncio.ensure_future(one(stub, j, t_next))
            tasks.add(task)
            task.add_done_callback(tasks.discard)
            j += 1
            if time.monotonic() >= t_print:  # long runs show progress
                print(f"loadgen: {time.monotonic() - t0:.0f}/{duration:.0f} s, {j} sent, {n_done} answered",
                      file=sys.stderr, flush=True)
                t_print += progress_every
        if tasks:
            await asyncio.gather(*tasks, return_exceptions=True)
    fh.close()
    return j


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--target", required=True)
    ap.add_argument("--users", required=True, type=Path)
    ap.add_argument("--rate", required=True, type=float, help="offered requests/s")
    ap.add_argument("--duration", required=True, type=float, help="seconds of arrivals")
    ap.add_argument("--budget-ms", type=float, default=30.0)
    ap.add_argument("--k", type=int, default=10)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", required=True, type=Path)
    a = ap.parse_args(argv)
    sent = asyncio.run(
        run(a.target, json.loads(a.users.read_text()), a.rate, a.duration, a.budget_ms, a.k, a.seed, a.out)
    )
    print(json.dumps({"sent": sent}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
