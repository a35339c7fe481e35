"""``bench.serving``'s measurements, one function per phase, and the figures of a set of answers; ``bench.scaleout``
measures with them too.

1. the offline reference (:func:`offline_beam`, :func:`offline_fused`, :func:`offline_sasrec`: hit@10 per user
   in this process);
2. :func:`overhead` (the gateway's own time on the request path, one request at a time);
3. :func:`closed_loop` and 4. :func:`open_loop` (Poisson arrivals, the generator placed by
   :func:`place_generator`) through the gateway, each answer read by :func:`answer`.

:func:`summarise` gives the figures of a set of answers, :func:`passes` the pass rule of a rate and
:func:`best_rate` the highest rate passing.
"""

from __future__ import annotations

import os
import time
from collections import Counter

import numpy as np

from bench.harness import Users, hit_and_ndcg, pct, request
from bench.loadgen import NOT_THE_MODEL, poisson


def summarise(answers: list[dict], offline_hits: np.ndarray, n_sent: int, k: int = 10,
              unseen: list[bool] | None = None) -> dict:
    """Figures of a set of answers (each: index, items, sources, latency_ms, served_by, exit, error); with a list
    length ``k`` other than 10, recall@k too, and with ``unseen`` (per user, whether the target is an unseen
    item), recall@k of the users with an unseen target and of the others."""
    ok = [a for a in answers if a["error"] is None]
    lat = np.asarray([a["latency_ms"] for a in ok])
    srv = np.asarray([a["server_ms"] for a in ok])  # the gateway's own clock: arrival to answer built
    hits = np.asarray([a["hit"] for a in ok]) if ok else np.zeros(0)
    ref = offline_hits[[a["index"] for a in ok]] if ok else np.zeros(0)
    holds_fill = [any(s == "fill" for s in a["sources"]) for a in ok]
    all_fill = [bool(a["sources"]) and all(s == "fill" for s in a["sources"]) for a in ok]
    errors = Counter(a["error"] for a in answers if a["error"] is not None)
    return {
        "sent": n_sent, "answered": len(ok), "errors": sum(errors.values()), "error_codes": dict(errors),
        "no_answer_share": 1 - len(ok) / n_sent if n_sent else float("nan"),
        "recall@10": float(hits.mean()) if ok else float("nan"),
        "ndcg@10": float(np.mean([a["ndcg"] for a in ok])) if ok else float("nan"),
        "offline_beam_recall@10": float(ref.mean()) if ok else float("nan"),
        "fill_share": float(np.mean(holds_fill)) if ok else float("nan"),
        "all_fill_share": float(np.mean(all_fill)) if ok else float("nan"),
        "budget_exit_share": float(np.mean([a["exit"] == "budget" for a in ok])) if ok else float("nan"),
        "served_by": dict(Counter(a["served_by"] for a in ok)),
        # a list the GR model made or ranked (fused, beam, strict, nezha, ...): not the item drafter's own list, no
        # catalogue fill (loadgen's rule)
        "gr_ranked_share": float(np.mean([a["served_by"] not in NOT_THE_MODEL and not h
                                          for a, h in zip(ok, holds_fill)])) if ok else float("nan"),
        # the fused policy's own list: served by it, ranked by both models, not degraded
        "fused_share": float(np.mean([a["served_by"] == "fused" and a["exit"] == "fused" and not a["degraded"]
                                      for a in ok])) if ok else float("nan"),
        # the gateway's own time on the request path: its total less the callees' own server time
        "overhead_p50_ms": pct([a["server_ms"] - a.get("callees_ms", 0.0) for a in ok], 50),
        "p50_ms": pct(lat, 50), "p95_ms": pct(lat, 95), "p99_ms": pct(lat, 99),
        "max_ms": float(lat.max()) if len(lat) else float("nan"),
        "server_p50_ms": pct(srv, 50), "server_p99_ms": pct(srv, 99),
        **recall_at(ok, k, unseen),
    }


def recall_at(ok: list[dict], k: int, unseen: list[bool] | None) -> dict:
    """recall@k of the answers (when k is not 10), and split by whether the user's target is unseen."""
    out: dict = {}
    if not ok:
        return out
    hit = np.asarray([a["hit_k"] for a in ok])
    if k != 10:
        out[f"recall@{k}"] = float(hit.mean())
    if unseen is not None:
        new = np.asarray([unseen[a["index"]] for a in ok])
        out[f"unseen_recall@{k}"] = float(hit[new].mean()) if new.any() else float("nan")
        out[f"in_sample_recall@{k}"] = float(hit[~new].mean()) if (~new).any() else float("nan")
        out["unseen_users"] = int(new.sum())
    return out


def passes(row: dict, budget_ms: float) -> bool:
    ref = row["offline_beam_recall@10"]
    return (row["answered"] > 0 and row["p99_ms"] <= budget_ms and row["fill_share"] <= 0.01
            and row["no_answer_share"] <= 0.01 and row["recall@10"] >= 0.95 * ref)


def best_rate(rows: list[dict]) -> float | None:
    """The highest offered rate passing before the first that fails (rows in rising order); None: none passes."""
    best = None
    for r in rows:
        if not r["pass"]:
            break
        best = r["offered_rps"]
    return best


# -- phase 1: the offline reference -----------------------------------------------------------
def offline_beam(bundle, users: Users, k: int) -> np.ndarray:
    from specrec.policies import RecRequest, make_policy

    eng = bundle.engine(drafter=None)
    pol = make_policy("beam", eng)
    ids = bundle.catalogue.ids
    hits = []
    for rows, target in zip(users.rows, users.targets):
        res = pol.run([RecRequest(rows, k)])[0]
        hits.append(hit_and_ndcg([ids[r] for r in res.items], target, k)[0])
    return np.asarray(hits)


def offline_fused(bundle, users: Users, k: int) -> np.ndarray | None:
    """The fused policy in this process on the same users (no budget): hit@10 each; None where the bundle has no
    fusion."""
    from specrec.policies import RecRequest, make_policy

    if bundle.fusion is None:
        return None
    pol = make_policy("fused", bundle.engine(drafter="sasrec"))
    ids = bundle.catalogue.ids
    return np.asarray([hit_and_ndcg([ids[r] for r in pol.run([RecRequest(rows, k)])[0].items], target, k)[0]
                       for rows, target in zip(users.rows, users.targets)])


def offline_sasrec(bundle, users: Users, k: int) -> np.ndarray | None:
    """The bundle's SASRec (its own ranker, ``specrec eval --ranker sasrec``'s) on the same users: hit@10 each;
    None without one."""
    if bundle.sasrec is None:
        return None
    from specrec.eval.evaluate import sasrec_ranker

    ranked = sasrec_ranker(bundle)(users.rows, k)
    ids = bundle.catalogue.ids
    return np.asarray([hit_and_ndcg([ids[r] for r in row], target, k)[0] for row, target in zip(ranked, users.targets)])


# -- phase 2: overhead -------------------------------------------------------------------------
def overhead(bundle, target: str, users: Users, policy: str, k: int, n: int, warmup: int = 5) -> dict:
    """One request at a time, generous budget: per request, the gateway's own time on the request path (its total,
    ``stats.total_ms``, less the callees' own server time on the critical path, :func:`callees_ms`), and, for
    comparison, the same policy on the same users in this process (the same code, no transport), in a pass of its
    own before the gateway's: run beside each request, this process's search took the two cores' caches from the
    services and added 0.56 ms to the gateway's own p50 (3.60 against 3.04 ms, fused, the same stack, 300 requests
    each way in alternating blocks, HISTORY.md 2026-12-05)."""
    from specrec.policies import RecRequest, make_policy
    from specrec.terminal import progress_bar
    from specrec_rpc.client import Client

    eng = bundle.engine(drafter=bundle.default_drafter())
    budget_ms = 1000.0
    m = min(n, len(users.ids))

    def local(rows):
        t0 = time.perf_counter()
        make_policy(policy, eng).run([RecRequest(rows, k, eng.clock() + budget_ms / 1000.0)])
        return (time.perf_counter() - t0) * 1000.0

    for i in range(warmup):
        local(users.rows[i])
    loc = [local(users.rows[i]) for i in range(m)]
    gw, srv, own = [], [], []
    with Client(target, timeout_s=10.0) as c:
        for i in range(warmup):
            c.recommend(users.ids[i], k=k, policy=policy, budget_ms=budget_ms)
        for i in progress_bar(range(m), desc=f"overhead {policy}", unit="req", leave=False):
            t0 = time.perf_counter()
            resp = c.recommend(users.ids[i], k=k, policy=policy, budget_ms=budget_ms)
            gw.append((time.perf_counter() - t0) * 1000.0)
            srv.append(resp.stats.total_ms)
            own.append(resp.stats.total_ms - callees_ms(resp.stats.stage_ms))
    return {"policy": policy, "n": len(loc), "inprocess_p50_ms": pct(loc, 50), "gateway_p50_ms": pct(gw, 50),
            "gateway_server_p50_ms": pct(srv, 50), "overhead_p50_ms": pct(own, 50), "overhead_p99_ms": pct(own, 99),
            "gap_vs_inprocess_p50_ms": pct(gw, 50) - pct(loc, 50),
            "inprocess_p99_ms": pct(loc, 99), "gateway_p99_ms": pct(gw, 99)}


# -- phases 3 and 4: through the gateway ---------------------------------------------------------
def answer(i: int, resp, users: Users, error: str | None = None) -> dict:
    """What the figures need of one answer (the caller adds ``latency_ms``)."""
    if error is not None:
        return {"index": i, "error": error}
    items = [it.item_id for it in resp.items]
    hit, ndcg = hit_and_ndcg(items, users.targets[i])
    return {"index": i, "error": None, "items": items, "hit": hit, "ndcg": ndcg,
            "hit_k": hit_and_ndcg(items, users.targets[i], len(items))[0],
            "sources": [it.source for it in resp.items], "served_by": resp.stats.served_by or resp.stats.policy,
            "exit": resp.stats.exit_reason, "server_ms": resp.stats.total_ms, "degraded": resp.stats.degraded,
            "callees_ms": callees_ms(resp.stats.stage_ms)}


def callees_ms(stage_ms) -> float:
    """The callees' own server time on a request's critical path (``stage_ms``'s ``server.<method>``, which the
    gateway reads off each call's ``x-server-ms``): every call but an ``Encode``, which runs beside the draft."""
    return float(sum(v for key, v in stage_ms.items() if key.startswith("server.") and key != "server.Encode"))


async def closed_loop(target: str, users: Users, policy: str, k: int, budget_ms: float, n: int) -> list[dict]:
    import grpc

    from specrec_rpc.v1 import recommender_pb2_grpc

    out = []
    async with grpc.aio.insecure_channel(target) as ch:
        stub = recommender_pb2_grpc.RecommenderStub(ch)
        for i in range(min(5, n)):  # warm-up, not measured
            await stub.Recommend(request(users.ids[i], i, policy, k, budget_ms), timeout=5.0)
        for i in range(n):
            t0 = time.perf_counter()
            try:
                resp = await stub.Recommend(request(users.ids[i], i, policy, k, budget_ms), timeout=5.0)
                out.append({**answer(i, resp, users), "latency_ms": (time.perf_counter() - t0) * 1000.0})
            except grpc.aio.AioRpcError as e:
                out.append({**answer(i, None, users, e.code().name), "latency_ms": (time.perf_counter() - t0) * 1000.0})
    return out


async def open_loop(target: str, users: Users, policy: str, k: int, budget_ms: float, rate: float, duration: float,
                    warmup: float, seed: int) -> tuple[list[dict], int, float]:
    """Poisson arrivals at ``rate`` for warmup + duration seconds (:func:`bench.loadgen.poisson`, in this
    process); answers of the measured part, requests sent in it, and the achieved rate of answers."""
    from specrec.terminal import progress_bar

    bar = progress_bar(total=round(rate * (warmup + duration)), desc=f"{policy} @ {rate:g} rps", unit="req",
                       leave=False)
    results, _, start = await poisson(
        target, users.ids, rate=rate, duration=warmup + duration, policy=policy, k=k, budget_ms=budget_ms, seed=seed,
        timeout_s=2.0, user_prefix="bench", start_delay_s=0.1, on_record=lambda r: bar.update(),
        describe=lambda i, resp, e: answer(i, resp, users, None if e is None else e.code().name))
    bar.close()
    t_measure = start + warmup
    measured = [r for r in results if r["t"] >= t_measure]
    done = [r["done"] for r in measured if r["error"] is None]
    span = (max(done) - t_measure) if done else float("nan")
    return measured, len(measured), len(done) / span if done and span > 0 else float("nan")


def place_generator(stack, cpu: int, services: str) -> tuple[str, dict] | None:
    """The open loop's generator (this process, every thread) on a CPU of its own (``cpu``; -1: the last usable;
    -2: not placed), the services where the stack placed them (``services`` "all": every CPU, unless
    ``SPECREC_STACK_PLACEMENT`` split them) or on the rest ("rest") -> (a line saying
    where, what :func:`bench.cpus.restore` takes), None when not placed or the machine has one CPU."""
    from bench.cpus import confine, split, usable

    if cpu == -2:
        return None
    try:
        gen, rest = split(usable(), None if cpu == -1 else cpu)
    except ValueError:
        return None
    from specrec_rpc.processes import group_pids

    pids = [pid for pr in stack.procs.procs.values() for pid in group_pids(pr.pid)]  # a group's processes too
    before = confine([os.getpid()], gen)
    if services == "rest":
        before.update(confine(pids, rest))
    placed = getattr(stack.procs, "cpus", None)  # the stack's own placement (SPECREC_STACK_PLACEMENT)
    where = (f"CPU {sorted(rest)}" if services == "rest" else "every CPU" if not placed else
             "the stack's placement (" + ", ".join(f"{n} CPU {sorted(c)}" for n, c in placed.items()) + ")")
    return f"open loop: the load generator on CPU {sorted(gen)}, the services on {where}", before
