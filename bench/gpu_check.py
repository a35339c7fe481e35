"""What only a GPU can show, in one run: ``bench/device_check.sh`` runs it on a lent GPU machine.

    python -m bench.gpu_check --bundle bundles/beauty-loo --out bench/results/gpu     # on a GPU
    python -m bench.gpu_check --cpu --out /tmp/dry                                    # the dry run (CI)

Phases, each timed and guarded (a phase that fails is recorded and the next one runs):

1. ``inprocess``: every policy (beam, strict, nezha, specgr, fused) at K = 10 and 50, batch 1, in this process,
   on the CUDA backend (the searches captured as CUDA graphs, :mod:`specrec.backends.cuda`) and on eager torch
   on the same device, interleaved on the same seeded random test users; beam's lists against eager CUDA's and
   against eager float32 on the CPU (each differing row checked for a tie: at every rank the two lists' scores
   within :data:`TIE_NATS`), strict's against beam's; capture time and graph memory.
2. ``verifier``: the stack's verifier on the CUDA backend, its ``Search`` "rank" (40 candidates: the fused list's pass)
   and ``Beam`` (width 10) RPCs under concurrent callers over real gRPC: requests/s and p99.
3. ``gateway``: the whole stack at a 30 ms budget with that verifier: ``auto`` closed loop (who served each
   answer: ``served_by``), open loop at 300 and 1,000 requests/s, and the capacity: the highest open-loop rate
   (of those tried, rising) with >= 99% of requests answered by a list the GR model made or ranked and client
   p99 <= 30 ms.
4. ``train``: one timed epoch of the GR model's training on the device (the bundle's config, fresh weights, the
   real training split).

Writes ``gpu_check.json``, ``gpu_check.md`` (its table last), ``gpu_check.png`` and ``gpu_keys.json`` (the
``gpu.*`` summary keys; ``gpu.device`` names the GPU) into ``--out``, which on the GPU machine is ``$OUT``; back
here, ``python -m bench.gpu_check --merge DIR`` copies them into ``bench/results/gpu/`` and sets the keys in
``bench/results/summary.json`` (the ``gpu.*`` keys of an earlier run removed). ``--cpu`` runs every phase small on
the CPU, the CUDA backend as its stand-in (graphs not captured): it checks the script, never a figure, and what it
writes says so (``--merge`` refuses it).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import sys
import tempfile
import time
import traceback
from pathlib import Path

import numpy as np

from bench.harness import (
    ROOT,
    Redis,
    Stack,
    Users,
    command_line,
    fmt,
    machine_line,
    no_nan,
    pct,
    raise_on_signals,
    run_line,
    sample_users,
    sayer,
)

say = sayer("gpu_check", clock=True)

POLICIES = ("beam", "strict", "nezha", "specgr", "fused")
#: two lists whose scores agree at every rank within this many nats differ by a tie within float32 rounding
TIE_NATS = 1e-4
BUDGET_MS = 30.0


def parse(argv):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--bundle", default="bundles/beauty-loo")
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "gpu"))
    ap.add_argument("--cpu", action="store_true", help="the dry run: every phase small, on the CPU; nothing "
                    "published")
    ap.add_argument("--device", default="cuda", help="the GPU (ignored with --cpu)")
    ap.add_argument("--phases", default="inprocess,verifier,gateway,train")
    ap.add_argument("--users", type=int, default=300, help="seeded random test users of the in-process phase")
    ap.add_argument("--eager-users", type=int, default=100, help="of them, the ones also run eagerly and on the CPU")
    ap.add_argument("--ks", default="10,50")
    ap.add_argument("--seed", type=int, default=7)
    ap.add_argument("--batch-sizes", default="1,2,4,8,16,32,64", help="the CUDA backend's row buckets")
    ap.add_argument("--callers", type=int, default=64, help="concurrent callers of the verifier phase")
    ap.add_argument("--seconds", type=float, default=8.0, help="each load of the verifier and gateway phases")
    ap.add_argument("--rates", default="300,1000", help="open-loop rates of the gateway phase (requests/s)")
    ap.add_argument("--capacity-rates", default="2000,3000,4000", help="higher rates tried for the capacity")
    ap.add_argument("--drafters", type=int, default=0, help="drafter processes (0: a quarter of the cores, 1-4)")
    ap.add_argument("--redis-url", default=None)
    ap.add_argument("--merge", metavar="DIR", help="publish a GPU run's files (what came back from $OUT)")
    a = ap.parse_args(argv)
    if a.cpu:  # the dry run: the same code, small
        a.device, a.users, a.eager_users, a.ks, a.batch_sizes = "cpu", 6, 4, "10", "1,2"
        a.callers, a.seconds, a.rates, a.capacity_rates = 4, 1.5, "5", ""
    return a


# -- 1. in process -------------------------------------------------------------------------------------------
def first(users: Users, n: int) -> Users:
    """The first ``n`` users of a random sample (a random sample of ``n`` of the same users)."""
    return Users(users.ids[:n], users.rows[:n], users.targets[:n], f"{min(n, len(users.ids))} of {users.source}",
                 None if users.unseen is None else users.unseen[:n])


def lists_of(pol, users, k: int) -> tuple[np.ndarray, np.ndarray]:
    """Each user's list and its scores under ``pol`` -> items [N, K], scores [N, K] (-1 / nan past the list)."""
    from specrec.policies import RecRequest

    items = np.full((len(users.rows), k), -1, np.int64)
    scores = np.full((len(users.rows), k), np.nan)
    for i, rows in enumerate(users.rows):
        res = pol.run([RecRequest(rows, k)])[0]
        items[i, : len(res.items)] = res.items[:k]
        scores[i, : len(res.scores)] = res.scores[:k]
    return items, scores


def tie_explained(a_scores: np.ndarray, b_scores: np.ndarray) -> bool:
    """Two lists that differ, explained by a tie within float32 rounding: their scores agree at every rank."""
    both = ~(np.isnan(a_scores) | np.isnan(b_scores))
    return bool(np.all(np.abs(a_scores[both] - b_scores[both]) <= TIE_NATS))


def timed_runs(policies: dict, users, k: int) -> dict:
    """Every policy on every user, interleaved (the order rotating per user), batch 1 -> per policy the lists and
    milliseconds."""
    from specrec.policies import RecRequest

    out = {n: {"items": np.full((len(users.rows), k), -1, np.int64), "ms": np.zeros(len(users.rows))}
           for n in policies}
    names = list(policies)
    for i, rows in enumerate(users.rows):
        for n in names[i % len(names):] + names[: i % len(names)]:
            t0 = time.perf_counter()
            res = policies[n].run([RecRequest(rows, k)])[0]
            out[n]["ms"][i] = (time.perf_counter() - t0) * 1000.0
            out[n]["items"][i, : len(res.items)] = res.items[:k]
    return out


def target_rows(bundle, users) -> np.ndarray:
    index = {iid: r for r, iid in enumerate(bundle.catalogue.ids)}
    return np.asarray([index[t] for t in users.targets])


def recall(items: np.ndarray, users, bundle, at: int = 10) -> float:
    return float((items[:, :at] == target_rows(bundle, users)[:, None]).any(1).mean())


def inprocess(bundle, users, a, keys: dict, rows: list) -> dict:
    """Phase 1 (see the module's docstring)."""
    from specrec.policies import make_policy

    sizes = tuple(int(x) for x in a.batch_sizes.split(","))
    kind = bundle.default_drafter()
    cuda = bundle.backend("cuda", device=a.device, batch_sizes=sizes)
    engine = bundle.engine(drafter=kind, backend=cuda)
    eager_engine = bundle.engine(drafter=kind, backend=bundle.backend("eager", device=a.device))
    cpu_engine = bundle.engine(drafter=None, backend=bundle.backend("eager", device="cpu"))
    ks = [int(x) for x in a.ks.split(",")]
    t0 = time.perf_counter()
    cuda.warmup(engine.itemset.trie, tuple(ks), scored=bundle.scored_counts(tuple(ks)))
    keys["gpu.cuda.warmup_s"] = time.perf_counter() - t0
    d = cuda.describe()
    say(f"CUDA backend: {d['graphs']} graphs in {d['capture_s']:.1f} s, {d['graph_memory_mb']:.0f} MB; eager: "
        f"{d['eager']}")
    keys.update({"gpu.cuda.graphs": d["graphs"], "gpu.cuda.capture_s": d["capture_s"],
                 "gpu.cuda.graph_memory_mb": d["graph_memory_mb"]})
    out: dict = {"backend": d, "k": {}, "replay_ms": replay_times(cuda, keys, 10 if a.cpu else 100)}
    few = first(users, a.eager_users)
    for k in ks:
        pols = {n: make_policy(n, engine) for n in POLICIES}
        warm_until = time.perf_counter() + (0.5 if a.cpu else 3.0)  # the GPU's clocks up, every path run
        while time.perf_counter() < warm_until:
            timed_runs(pols, first(few, 2), k)
        runs = timed_runs(pols, users, k)
        eager = timed_runs({n: make_policy(n, eager_engine) for n in POLICIES}, few, k)
        cpu_items, cpu_scores = lists_of(make_policy("beam", cpu_engine), few, k)
        gpu_items, gpu_scores = lists_of(pols["beam"], few, k)
        differ = np.flatnonzero((gpu_items != cpu_items).any(1))
        unexplained = [int(i) for i in differ if not tie_explained(gpu_scores[i], cpu_scores[i])]
        beam = runs["beam"]["items"]
        kk = f"k{k}"
        for n in POLICIES:
            ms = runs[n]["ms"]
            keys[f"gpu.cuda.{n}.{kk}.p50_ms"], keys[f"gpu.cuda.{n}.{kk}.p99_ms"] = pct(ms, 50), pct(ms, 99)
            keys[f"gpu.eager_cuda.{n}.{kk}.p50_ms"] = pct(eager[n]["ms"], 50)
            keys[f"gpu.cuda.{n}.{kk}.recall@10"] = recall(runs[n]["items"], users, bundle)
            rows.append({"k": k, "policy": n, "cuda_p50_ms": keys[f"gpu.cuda.{n}.{kk}.p50_ms"],
                         "cuda_p99_ms": keys[f"gpu.cuda.{n}.{kk}.p99_ms"],
                         "eager_p50_ms": keys[f"gpu.eager_cuda.{n}.{kk}.p50_ms"],
                         "recall@10": keys[f"gpu.cuda.{n}.{kk}.recall@10"]})
        keys[f"gpu.cuda.beam.{kk}.equal_to_eager"] = float(
            (runs["beam"]["items"][: len(few.rows)] == eager["beam"]["items"]).all(1).mean())
        keys[f"gpu.cuda.strict.{kk}.equal_to_beam"] = float((runs["strict"]["items"] == beam).all(1).mean())
        keys[f"gpu.cuda.beam.{kk}.equal_to_cpu"] = 1.0 - len(differ) / len(few.rows)
        keys[f"gpu.cuda.beam.{kk}.cpu_rows_not_a_tie"] = len(unexplained)
        keys[f"gpu.cuda.beam.{kk}.speedup_vs_eager_cuda"] = (keys[f"gpu.eager_cuda.beam.{kk}.p50_ms"]
                                                            / keys[f"gpu.cuda.beam.{kk}.p50_ms"])
        out["k"][k] = {"differing_cpu_rows": [int(i) for i in differ], "not_a_tie": unexplained}
        say(f"K={k}: " + ", ".join(f"{n} {keys[f'gpu.cuda.{n}.{kk}.p50_ms']:.2f} ms" for n in POLICIES)
            + f"; beam == eager {keys[f'gpu.cuda.beam.{kk}.equal_to_eager']:.3f}, == CPU "
            f"{keys[f'gpu.cuda.beam.{kk}.equal_to_cpu']:.3f} ({len(unexplained)} rows not a tie), strict == beam "
            f"{keys[f'gpu.cuda.strict.{kk}.equal_to_beam']:.3f}")
    for what in ("beam.equal_to_eager", "strict.equal_to_beam", "beam.equal_to_cpu"):  # the worst K
        keys[f"gpu.cuda.{what}"] = min(keys[f"gpu.cuda.{what.split('.')[0]}.k{k}.{what.split('.')[1]}"] for k in ks)
    keys["gpu.cuda.beam.speedup_vs_eager_cuda"] = keys[f"gpu.cuda.beam.k{ks[0]}.speedup_vs_eager_cuda"]
    return out


def replay_times(cuda, keys: dict, n: int) -> dict:
    """Each captured graph's own time at batch 1 (its replay alone, no copies in or out: the floor a request's
    search sits on), timed with CUDA events; the stand-in times its function over the same buffers."""
    import torch

    out = {}
    for key, g in sorted(cuda.runner.graphs.items(), key=lambda kv: str(kv[0])):
        if key[-1] != 1:
            continue
        parts = key[:-1] if key[0] in ("encode", "rank") else key[:-2]  # (kind, widths[, candidates]); no generation
        name = "_".join(str(x) for x in parts)
        ms = []
        for _ in range(n):
            if g.graph is not None:
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                g.graph.replay()
                end.record()
                end.synchronize()
                ms.append(start.elapsed_time(end))
            else:
                t0 = time.perf_counter()
                g.fn(*g.inputs)
                ms.append((time.perf_counter() - t0) * 1000.0)
        out[name] = pct(ms, 50)
    for name in ("encode", "beam_10", "beam_50", "draft_10", "rank_40", "head_10"):
        if name in out:
            keys[f"gpu.cuda.replay.{name}.p50_ms"] = out[name]
    say("graph replay p50 ms at batch 1: " + ", ".join(f"{k} {v:.3f}" for k, v in out.items()))
    return out


# -- 2. the verifier's RPCs under concurrent callers ------------------------------------------------------------
async def _callers(addr: str, make_call, callers: int, seconds: float) -> list[float]:
    """``callers`` concurrent callers each calling ``make_call(stub, i)`` in a loop for ``seconds`` -> latencies ms."""
    import grpc

    from specrec_rpc.v1 import verifier_pb2_grpc

    lat: list[float] = []
    async with grpc.aio.insecure_channel(addr) as ch:
        stub = verifier_pb2_grpc.VerifierStub(ch)
        await ch.channel_ready()
        for i in range(callers):  # one call each first: connections and graphs warm
            await make_call(stub, i)
        stop = time.monotonic() + seconds

        async def loop(c: int) -> None:
            i = c
            while time.monotonic() < stop:
                t0 = time.perf_counter()
                await make_call(stub, i)
                lat.append((time.perf_counter() - t0) * 1000.0)
                i += callers

        await asyncio.gather(*(loop(c) for c in range(callers)))
    return lat


def verifier_load(stack, bundle, users, a, keys: dict) -> dict:
    """Phase 2: ``Search`` "rank" of 40 catalogue items and "beam" of width 10 per history, ``a.callers`` at once."""
    import torch

    from specrec_rpc.tensors import to_msg
    from specrec_rpc.v1 import verifier_pb2

    L = bundle.cfg.sid_len
    sids = bundle.sids
    hists = []
    for rows in users.rows:
        h = np.full((1, bundle.cfg.max_history, L), -1, np.int64)
        rows = np.asarray(rows[-bundle.cfg.max_history :])
        h[0, len(h[0]) - len(rows) :] = sids[rows]
        hists.append(to_msg(torch.from_numpy(h)))
    rng = np.random.default_rng(a.seed)
    cands = [to_msg(torch.from_numpy(sids[rng.choice(len(sids), 40, replace=False)][None])) for _ in range(64)]
    addr = stack.addr("verifier")

    async def rank(stub, i: int):
        ref = verifier_pb2.SessionRef(history_sids=hists[i % len(hists)])
        req = verifier_pb2.SearchRequest(ref=ref, search="rank", tensors={"sids": cands[i % len(cands)]})
        return await stub.Search(req, timeout=5.0)

    async def beam(stub, i: int):
        ref = verifier_pb2.SessionRef(history_sids=hists[i % len(hists)])
        return await stub.Search(verifier_pb2.SearchRequest(ref=ref, search="beam", widths={"width": 10}), timeout=5.0)

    out = {}
    for name, call in (("rank", rank), ("beam", beam)):
        lat = asyncio.run(_callers(addr, call, a.callers, a.seconds))
        keys[f"gpu.verifier.{name}_rps"] = len(lat) / a.seconds
        keys[f"gpu.verifier.{name}_p50_ms"], keys[f"gpu.verifier.{name}_p99_ms"] = pct(lat, 50), pct(lat, 99)
        out[name] = {"calls": len(lat), "callers": a.callers, "seconds": a.seconds}
        say(f"verifier {name}: {keys[f'gpu.verifier.{name}_rps']:.0f} calls/s, p99 "
            f"{keys[f'gpu.verifier.{name}_p99_ms']:.2f} ms ({a.callers} callers)")
    keys["gpu.verifier.callers"] = a.callers
    return out


# -- 3. the stack at the budget -----------------------------------------------------------------------------------
def gateway_load(stack, bundle, users, a, keys: dict, rows: list) -> dict:
    """Phase 3: ``auto`` at 30 ms through the gateway, closed loop then open loop at rising rates."""
    from bench.serving_phases import closed_loop, open_loop, summarise
    from specrec.policies import make_policy

    target = stack.addr("gateway")
    # the offline reference: beam in this process, eagerly on the device (the default backend, ONNX Runtime, would
    # export its graphs first: minutes on the GPU machine)
    beam = make_policy("beam", bundle.engine(drafter=None, backend=bundle.backend("eager", device=a.device)))
    hits = (lists_of(beam, users, 10)[0] == target_rows(bundle, users)[:, None]).any(1).astype(float)
    closed = summarise(asyncio.run(closed_loop(target, users, "auto", 10, BUDGET_MS, len(users.ids))), hits,
                       len(users.ids))
    keys["gpu.gateway.auto.gr_ranked_share_at_30ms"] = closed["gr_ranked_share"]
    keys["gpu.gateway.auto.client_p99_ms_at_30ms"] = closed["p99_ms"]
    keys["gpu.gateway.auto.recall@10_at_30ms"] = closed["recall@10"]
    say(f"closed loop: GR-ranked {closed['gr_ranked_share']:.3f}, p99 {closed['p99_ms']:.1f} ms, served by "
        f"{closed['served_by']}")
    out = {"closed": closed, "open": []}
    rates = [float(x) for x in a.rates.split(",") if x]
    more = [float(x) for x in a.capacity_rates.split(",") if x]
    capacity = None
    for rate in rates + more:
        answers, sent, achieved = asyncio.run(open_loop(target, users, "auto", 10, BUDGET_MS, rate, a.seconds,
                                                        1.0, a.seed + int(rate)))
        row = summarise(answers, hits, sent)
        # GR-ranked among the requests *sent*: one refused or unanswered is not the model's answer
        share = row["gr_ranked_share"] * row["answered"] / max(1, sent) if row["answered"] else 0.0
        ok = share >= 0.99 and row["p99_ms"] <= BUDGET_MS
        rows.append({"open_rps": rate, "achieved_rps": achieved, "gr_ranked_share": share, "p99_ms": row["p99_ms"],
                     "served_by": row["served_by"], "pass": ok})
        out["open"].append(rows[-1])
        if rate in rates:
            keys[f"gpu.gateway.auto.gr_ranked_share_open_{rate:g}rps"] = share
            keys[f"gpu.gateway.client_p99_ms_open_{rate:g}rps"] = row["p99_ms"]
        say(f"open loop {rate:g} requests/s: achieved {fmt(achieved)}, GR-ranked {share:.3f}, p99 "
            f"{fmt(row['p99_ms'])} ms -> {'pass' if ok else 'fail'}")
        if not ok:
            break
        capacity = rate
    keys["gpu.gateway.capacity_rps"] = capacity if capacity is not None else 0.0
    return out


def start_stack(bundle_dir: Path, a, tmp: Path):
    """The four services on this machine, the verifier on the CUDA backend, the text embedder off (the GPU machine
    cannot take its model)."""
    n = a.drafters or max(1, min(4, (os.cpu_count() or 4) // 4))
    env = {"SPECREC_VERIFIER_BACKEND": "cuda", "SPECREC_VERIFIER_DEVICE": a.device,
           "SPECREC_VERIFIER_CUDA_GRAPH_BATCH_SIZES": json.dumps([int(x) for x in a.batch_sizes.split(",")]),
           "SPECREC_VERIFIER_WARMUP_K": json.dumps([10]) if a.cpu else json.dumps([10, 50]),
           "SPECREC_DRAFTER_TEXT_EMBEDDER": "false", "SPECREC_ITEMSET_WARM_UP": "false"}
    stack = Stack(bundle_dir, Redis(a.redis_url, tmp), tmp / "logs", "gpu", threads=None, env=env,
                  replicas={"drafter": n})
    say(f"starting the stack: verifier on {a.device} (CUDA backend), {n} drafter process(es)")
    try:
        return stack.start(900.0, say=say)
    except BaseException:  # what started is stopped (a service that never became SERVING raised SystemExit)
        stack.stop(say=say)
        raise


# -- 4. one epoch of training -------------------------------------------------------------------------------------
def train_epoch(bundle, a, keys: dict) -> dict:
    """Phase 4: the GR model's training on the device, fresh weights of the bundle's config, its recipe's stride-5
    chunks of the real training split at batch 1024 (bf16 autocast on a GPU): two epochs, the second timed (the
    first pays for the device's warm-up)."""
    from specrec.bundle import bundle_split
    from specrec.train.batches import causal_chunks
    from specrec.train.trainer import TrainConfig, Trainer

    _, split = bundle_split(bundle)
    train = split.train
    if a.cpu:  # the dry run: every training example of 100 users
        train = train.take(np.flatnonzero(np.isin(train.user, np.unique(train.user)[:100])))
    cfg = TrainConfig(epochs=2, batch_size=64 if a.cpu else 1024, lr=4e-3, warmup_steps=10, window_stride=5,
                      valid_limit=10 if a.cpu else 200, valid_every=2, device=a.device, bf16=not a.cpu, patience=100)
    out = Path(tempfile.mkdtemp(prefix="specrec-gpu-train-"))
    trainer = Trainer(bundle.cfg, cfg, bundle.sids, train, split.valid, out, log=say)
    trainer.fit(progress=False)
    targets = int((causal_chunks(train, cfg.window_stride)[1] >= 0).sum())
    epoch_s = float(trainer.history[-1]["train_s"])
    keys["gpu.train.epoch_s"], keys["gpu.train.targets_per_s"] = epoch_s, targets / max(epoch_s, 1e-9)
    say(f"training: an epoch of {targets} targets in {epoch_s:.1f} s ({targets / max(epoch_s, 1e-9):.0f} targets/s, "
        f"batch {cfg.batch_size})")
    return {"targets": targets, "history": trainer.history, "config": cfg.model_dump()}


# -- results --------------------------------------------------------------------------------------------------------
def plot(rows: list[dict], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    per = [r for r in rows if "policy" in r]
    if not per:
        return
    ks = sorted({r["k"] for r in per})
    fig, axes = plt.subplots(1, len(ks), figsize=(5 * len(ks), 3.6), squeeze=False)
    for ax, k in zip(axes[0], ks):
        part = [r for r in per if r["k"] == k]
        x = np.arange(len(part))
        ax.bar(x - 0.2, [r["eager_p50_ms"] for r in part], 0.4, label="eager on the device")
        ax.bar(x + 0.2, [r["cuda_p50_ms"] for r in part], 0.4, label="captured CUDA graphs")
        ax.set_xticks(x, [r["policy"] for r in part])
        ax.set_ylabel("p50 ms, batch 1 (in process)")
        ax.set_title(f"K = {k}")
        ax.legend()
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def table(keys: dict, rows: list, errors: dict) -> str:
    lines = ["| K | policy | captured p50 ms | p99 ms | eager p50 ms | R@10 |", "|---|---|---|---|---|---|"]
    lines += [f"| {r['k']} | {r['policy']} | {fmt(r['cuda_p50_ms'], '.2f')} | {fmt(r['cuda_p99_ms'], '.2f')} | "
              f"{fmt(r['eager_p50_ms'], '.2f')} | {fmt(r['recall@10'], '.4f')} |" for r in rows if "policy" in r]
    lines += ["", "| open loop requests/s | achieved | GR-ranked share | client p99 ms | pass |",
              "|---|---|---|---|---|"]
    lines += [f"| {r['open_rps']:g} | {fmt(r['achieved_rps'])} | {r['gr_ranked_share']:.3f} | {fmt(r['p99_ms'])} | "
              f"{r['pass']} |" for r in rows if "open_rps" in r]
    lines += ["", "| key | value |", "|---|---|"]
    lines += [f"| `{k}` | {v if isinstance(v, str) else fmt(v, '.4g')} |" for k, v in sorted(keys.items())]
    lines += [f"| phase `{p}` failed | {e.splitlines()[-1][:200]} |" for p, e in errors.items()]
    return "\n".join(lines) + "\n"


def device_name(a) -> str:
    if a.cpu:
        return "cpu (dry run)"
    import torch

    return torch.cuda.get_device_name(torch.device(a.device))


def merge(src: Path) -> int:
    """Publish a GPU run's files: into ``bench/results/gpu/``, its keys into ``bench/results/summary.json``."""
    import shutil

    from specrec.eval.results import RESULTS_DIR, update_summary

    keys = json.loads((src / "gpu_keys.json").read_text())
    if json.loads((src / "gpu_check.json").read_text()).get("dry_run"):
        raise SystemExit(f"{src} holds a dry run on the CPU: not GPU figures")
    dest = RESULTS_DIR / "gpu"
    dest.mkdir(parents=True, exist_ok=True)
    for name in ("gpu_check.json", "gpu_check.md", "gpu_check.png", "gpu_keys.json"):
        if (src / name).exists() and (src / name).resolve() != (dest / name).resolve():
            shutil.copyfile(src / name, dest / name)
    old = json.loads((RESULTS_DIR / "summary.json").read_text())
    update_summary(keys, RESULTS_DIR / "summary.json", retire=tuple(k for k in old if k.startswith("gpu.")
                                                                     and k not in keys))
    say(f"{len(keys)} gpu.* keys from {keys.get('gpu.device')} into {RESULTS_DIR / 'summary.json'}")
    return 0


def main(argv=None) -> int:
    a = parse(argv)
    if a.merge:
        return merge(Path(a.merge))
    raise_on_signals(signal.SIGTERM, signal.SIGHUP)
    from specrec.bundle import Bundle

    phases = [p.strip() for p in a.phases.split(",") if p.strip()]
    bundle_dir = Path(a.bundle).resolve()
    bundle = Bundle.load(bundle_dir)
    users = sample_users(bundle, a.users, a.seed)
    keys: dict = {"gpu.device": device_name(a)}
    rows: list = []
    res: dict = {"command": command_line("bench.gpu_check", argv), "run": run_line(), "machine": machine_line(),
                 "users": users.source, "dry_run": a.cpu, "phases": {}, "seconds": {}}
    errors: dict = {}
    tmp = Path(tempfile.mkdtemp(prefix="specrec-gpu-"))

    def phase(name: str, fn):
        t0 = time.perf_counter()
        try:
            res["phases"][name] = out = fn()
        except (Exception, SystemExit):  # noqa: BLE001 - recorded; the next phase runs
            errors[name], out = traceback.format_exc(), None
            say(f"phase {name} failed:\n{errors[name]}")
        res["seconds"][name] = round(time.perf_counter() - t0, 1)
        say(f"phase {name}: {res['seconds'][name]:.0f} s")
        return out

    stack = None
    try:
        if "inprocess" in phases:
            phase("inprocess", lambda: inprocess(bundle, users, a, keys, rows))
        if {"verifier", "gateway"} & set(phases):
            stack = phase("stack", lambda: start_stack(bundle_dir, a, tmp))
        if stack is not None and "verifier" in phases:
            phase("verifier", lambda: verifier_load(stack, bundle, users, a, keys))
        if stack is not None and "gateway" in phases:
            phase("gateway", lambda: gateway_load(stack, bundle, users, a, keys, rows))
    except KeyboardInterrupt:
        say("interrupted")
    finally:
        if stack is not None:
            stack.stop(say=say)
            res["phases"]["stack"] = "stopped"
    if "train" in phases:
        phase("train", lambda: train_epoch(bundle, a, keys))
    res["keys"], res["rows"], res["errors"] = keys, rows, errors
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    plot(rows, out / "gpu_check.png", f"{bundle.name} on {keys['gpu.device']}: in process, batch 1")
    md = (f"# What only a GPU can show ({keys['gpu.device']})\n\n`{res['command']}`\n\n{res['run']}; "
          f"{res['machine']}; {users.source}.\n\n" + ("**Dry run on the CPU: these are not GPU figures.**\n\n"
                                                     if a.cpu else "") + table(keys, rows, errors))
    (out / "gpu_check.json").write_text(json.dumps(no_nan(res), indent=2, default=str) + "\n")
    (out / "gpu_keys.json").write_text(json.dumps(no_nan(keys), indent=2) + "\n")
    (out / "gpu_check.md").write_text(md)
    print(md)
    return 1 if errors else 0


if __name__ == "__main__":
    sys.exit(main())
