"""What only a GPU can show, in one run: ``bench/device_check.sh`` runs it on a lent GPU machine.

    python -m bench.gpu_check --bundle bundles/beauty-loo --out bench/results/gpu     # on a GPU
    python -m bench.gpu_check --cpu --out /tmp/dry                                    # the dry run (CI)

Phases, in this order, each with its own time budget (:data:`BUDGET_S`, 7 minutes together; ``--budgets`` to
change one), each guarded (a phase that fails or runs past its budget is recorded, keeps what it had measured, and
the next one runs), each writing every result file as soon as it ends:

1. ``cuda_tests``: ``tests/unit/test_cuda_backend.py`` in a pytest of its own: on a GPU the captured graphs
   against eager CUDA, CSR tables and a request's view included (Beauty's dense tables exercise neither), and the
   stand-in's tests on this device's torch; every test must pass, and on a GPU none may be skipped.
2. ``inprocess``: every policy (beam, strict, nezha, specgr, fused) at K = 10 and 50, batch 1, in this process,
   on the CUDA backend (the searches captured as CUDA graphs, :mod:`specrec.backends.cuda`) and on eager torch
   on the same device, interleaved on the same seeded random test users; three equality checks, each by
   :func:`compare`: beam's lists against eager CUDA's and against eager float32 on the CPU, strict's against
   beam's (a differing row passes only as a tie: at every rank the two lists' scores within :data:`TIE_NATS`; a
   short or empty list never does); capture time and graph memory after the warm-up, the graphs captured after it
   and the searches that fell back to eager read after the timed runs.
3. ``stack``: the four services on this machine, the verifier on the CUDA backend (its graphs, capture time,
   memory and eager fallbacks from its start log).
4. ``verifier``: the stack's verifier's ``Search`` "rank" (40 candidates: the fused list's pass) and "beam"
   (width 10) RPCs under concurrent callers over real gRPC: requests/s and p99.
5. ``gateway``: the whole stack at a 30 ms budget with that verifier: ``auto`` closed loop (who served each
   answer: ``served_by``), open loop at 300 and 1,000 requests/s, and the capacity: the highest open-loop rate (of
   those tried, rising) whose achieved rate held the target (:func:`rate_held`), with >= 99% of requests answered
   by a list the GR model made or ranked and client p99 <= 30 ms, counted as the rate achieved; then the
   verifier's graphs captured after its start (its metrics, read after the loads); the stack is stopped.
6. ``train``: one timed epoch of the GR model's training on the device (the bundle's config, fresh weights, the
   real training split).

Writes ``gpu_check.json``, ``gpu_check.md`` (its table last), ``gpu_check.png`` and ``gpu_keys.json`` (the
``gpu.*`` summary keys; ``gpu.device`` names the GPU) into ``--out``, which on the GPU machine is ``$OUT``: at the
start, and again as each phase ends. SIGTERM, SIGHUP or SIGINT (``timeout``'s, the device tool's) stops the run:
the phase under way is recorded as interrupted, the files are written with every finished phase's results, the
stack is stopped, and the exit status is 128 + the signal. Back here, ``python -m bench.gpu_check --merge DIR
[DIR ...]`` copies them into ``bench/results/gpu/`` and sets the keys in ``bench/results/summary.json`` (the
``gpu.*`` keys of an earlier run removed); several directories (a run and a rerun of some of its phases) are
merged phase by phase, each phase from the last run that ran it. It refuses a dry run, a phase that failed, ran
past its budget or was interrupted, a phase missing from every run, a search that fell back to eager (in process or
in the verifier), and runs of two different GPUs. ``--cpu`` runs every phase small on the CPU, the CUDA backend as
its stand-in (graphs not captured): it checks the script, never a figure, and what it writes says so.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import traceback
import xml.etree.ElementTree as ET
from collections.abc import Callable
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
    run_line,
    sample_users,
    sayer,
)

say = sayer("gpu_check", clock=True)

POLICIES = ("beam", "strict", "nezha", "specgr", "fused")
#: two lists whose scores agree at every rank within this many nats differ by a tie within float32 rounding
TIE_NATS = 1e-4
BUDGET_MS = 30.0
#: every phase in the order it runs (``stack`` runs when ``verifier`` or ``gateway`` is asked for)
PHASES = ("cuda_tests", "inprocess", "stack", "verifier", "gateway", "train")
#: each phase's time budget on a GPU, seconds: 7 minutes together, so that the whole device run (the carried
#: packages installed first, ~20 s) ends inside 8 (docs/gpu-check.md); ``bench/device_check.sh`` kills the run at
#: their sum plus :data:`RUN_SLACK_S`
BUDGET_S = {"cuda_tests": 60.0, "inprocess": 130.0, "stack": 100.0, "verifier": 30.0, "gateway": 60.0,
            "train": 40.0}
#: what the run may take past its phases' budgets: loading the bundle and sampling users, stopping the stack
RUN_SLACK_S = 30.0
#: the dry run's budgets are the GPU's times this: its phases are small, but a shared CPU can be slow
DRY_RUN_BUDGET_FACTOR = 5.0
CUDA_TESTS = "tests/unit/test_cuda_backend.py"


def parse(argv):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--bundle", default="bundles/beauty-loo")
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "gpu"))
    ap.add_argument("--cpu", action="store_true", help="the dry run: every phase small, on the CPU; nothing "
                    "published")
    ap.add_argument("--device", default="cuda", help="the GPU (ignored with --cpu)")
    ap.add_argument("--phases", default="cuda_tests,inprocess,verifier,gateway,train",
                    help="the phases to run (a rerun: the ones that failed); the stack starts for verifier or gateway")
    ap.add_argument("--budgets", default="", help="phase=seconds,... : budgets other than BUDGET_S's")
    ap.add_argument("--users", type=int, default=200, help="seeded random test users of the in-process phase")
    ap.add_argument("--eager-users", type=int, default=50, help="of them, the ones also run eagerly and on the CPU")
    ap.add_argument("--ks", default="10,50")
    ap.add_argument("--seed", type=int, default=7)
    ap.add_argument("--batch-sizes", default="1,2,4,8,16,32,64", help="the CUDA backend's row buckets")
    ap.add_argument("--callers", type=int, default=64, help="concurrent callers of the verifier phase")
    ap.add_argument("--seconds", type=float, default=5.0, help="each load of the verifier and gateway phases")
    ap.add_argument("--rates", default="300,1000", help="open-loop rates of the gateway phase (requests/s)")
    ap.add_argument("--capacity-rates", default="2000,3000,4000", help="higher rates tried for the capacity")
    ap.add_argument("--drafters", type=int, default=0, help="drafter processes (0: a quarter of the cores, 1-4)")
    ap.add_argument("--redis-url", default=None)
    ap.add_argument("--merge", metavar="DIR", nargs="+", help="publish a GPU run's files (what came back from $OUT); "
                    "a run and a rerun of some of its phases: each phase from the last that ran it")
    a = ap.parse_args(argv)
    if a.cpu:  # the dry run: the same code, small
        a.device, a.users, a.eager_users, a.ks, a.batch_sizes = "cpu", 6, 4, "10", "1,2"
        a.callers, a.seconds, a.rates, a.capacity_rates = 4, 1.5, "5", ""
    return a


# -- 1. the CUDA unit tests --------------------------------------------------------------------------------------
def cuda_tests(a, keys: dict, budget_s: float) -> dict:
    """Phase 1: :data:`CUDA_TESTS` in a pytest of its own (this Python, this environment), inside ``budget_s``;
    raises unless every test passed (and, on a GPU, none was skipped: the CUDA tests skip where torch sees none)."""
    tmp = Path(tempfile.mkdtemp(prefix="specrec-gpu-tests-"))
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--junitxml", str(tmp / "junit.xml"),
           CUDA_TESTS]
    try:
        r = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=max(1.0, budget_s - 5.0))
    except subprocess.TimeoutExpired as e:
        raise RuntimeError(f"{CUDA_TESTS} ran past {budget_s - 5:g} s") from e
    counts = junit_counts(tmp / "junit.xml")
    shutil.rmtree(tmp, ignore_errors=True)
    tail = (r.stdout + r.stderr)[-4000:]
    keys.update({f"gpu.cuda_tests.{n}": counts[n] for n in ("passed", "failed", "skipped")})
    say(f"{CUDA_TESTS}: {counts['passed']} passed, {counts['failed']} failed, {counts['skipped']} skipped")
    if r.returncode != 0 or counts["failed"] or not counts["passed"]:
        raise RuntimeError(f"{CUDA_TESTS} failed (pytest exit {r.returncode}):\n{tail}")
    if counts["skipped"] and not a.cpu:
        raise RuntimeError(f"{counts['skipped']} CUDA tests skipped on the GPU (torch sees no CUDA device?):\n{tail}")
    return {"command": " ".join(cmd[1:]), **counts, "output": tail}


def junit_counts(path: Path) -> dict:
    """A pytest JUnit XML report's passed, failed (failures and errors) and skipped counts (all 0: none written)."""
    out = {"passed": 0, "failed": 0, "skipped": 0}
    if not path.exists():
        return out
    root = ET.parse(path).getroot()
    for suite in [root] if root.tag == "testsuite" else root.iter("testsuite"):
        tests, skipped = int(suite.get("tests", 0)), int(suite.get("skipped", 0))
        failed = int(suite.get("failures", 0)) + int(suite.get("errors", 0))
        out["failed"] += failed
        out["skipped"] += skipped
        out["passed"] += tests - failed - skipped
    return out


# -- 2. in process -------------------------------------------------------------------------------------------
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
    """Two lists that differ, explained by a tie within float32 rounding: both full (a score at every rank) and their
    scores within :data:`TIE_NATS` at every rank. An empty or short list is never a tie: nothing would be compared."""
    a_scores, b_scores = np.asarray(a_scores, float), np.asarray(b_scores, float)
    if a_scores.size == 0 or a_scores.shape != b_scores.shape or np.isnan(a_scores).any() or np.isnan(b_scores).any():
        return False
    return bool(np.all(np.abs(a_scores - b_scores) <= TIE_NATS))


def compare(a: dict, b: dict) -> tuple[float, list[int]]:
    """Two runs' lists over the same users (``items`` [N, K], -1 past a list; ``scores`` [N, K], NaN past it), row
    by row, the one check behind every equality key -> (the share of rows whose lists are identical and full, the
    rows that fail: different without a tie (:func:`tie_explained`), or a list short or empty)."""
    items_a, items_b = np.asarray(a["items"]), np.asarray(b["items"])
    full = (items_a >= 0).all(1) & (items_b >= 0).all(1)
    same = (items_a == items_b).all(1) & full
    failed = [int(i) for i in np.flatnonzero(~same) if not tie_explained(a["scores"][i], b["scores"][i])]
    return float(same.mean()) if len(same) else float("nan"), failed


def rows_of(run: dict, n: int) -> dict:
    """The first ``n`` users' lists of a run (:func:`timed_runs`'s per policy)."""
    return {"items": run["items"][:n], "scores": run["scores"][:n]}


def timed_runs(policies: dict, users, k: int) -> dict:
    """Every policy on every user, interleaved (the order rotating per user), batch 1 -> per policy the lists, their
    scores and milliseconds."""
    from specrec.policies import RecRequest

    out = {n: {"items": np.full((len(users.rows), k), -1, np.int64), "scores": np.full((len(users.rows), k), np.nan),
               "ms": np.zeros(len(users.rows))} for n in policies}
    names = list(policies)
    for i, rows in enumerate(users.rows):
        for n in names[i % len(names):] + names[: i % len(names)]:
            t0 = time.perf_counter()
            res = policies[n].run([RecRequest(rows, k)])[0]
            out[n]["ms"][i] = (time.perf_counter() - t0) * 1000.0
            out[n]["items"][i, : len(res.items)] = res.items[:k]
            out[n]["scores"][i, : len(res.scores)] = res.scores[:k]
    return out


def target_rows(bundle, users) -> np.ndarray:
    index = {iid: r for r, iid in enumerate(bundle.catalogue.ids)}
    return np.asarray([index[t] for t in users.targets])


def recall(items: np.ndarray, users, bundle, at: int = 10) -> float:
    return float((items[:, :at] == target_rows(bundle, users)[:, None]).any(1).mean())


#: the three equality checks of a K: (key, the policy whose lists are checked, against what)
CHECKS = (("beam.equal_to_eager", "beam", "eager"), ("strict.equal_to_beam", "strict", "beam"),
          ("beam.equal_to_cpu", "beam", "cpu"))


def inprocess(bundle, users, a, keys: dict, rows: list) -> dict:
    """Phase 2 (see the module's docstring)."""
    from specrec.backends.cuda import EAGER_FUNCTIONS
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
    d = cuda.describe()  # the warm-up's graphs
    say(f"CUDA backend: {d['graphs']} graphs in {d['capture_s']:.1f} s, {d['graph_memory_mb']:.0f} MB; eager: "
        f"{d['eager']}")
    keys.update({"gpu.cuda.graphs": d["graphs"], "gpu.cuda.capture_s": d["capture_s"],
                 "gpu.cuda.graph_memory_mb": d["graph_memory_mb"]})
    out: dict = {"warm_up": d, "k": {}, "replay_ms": replay_times(cuda, keys, 10 if a.cpu else 100)}
    few = first(users, a.eager_users)
    n_few = len(few.rows)
    failed_rows = 0
    for k in ks:
        pols = {n: make_policy(n, engine) for n in POLICIES}
        warm_until = time.perf_counter() + (0.5 if a.cpu else 3.0)  # the GPU's clocks up, every path run
        while time.perf_counter() < warm_until:
            timed_runs(pols, first(few, 2), k)
        runs = timed_runs(pols, users, k)
        eager = timed_runs({n: make_policy(n, eager_engine) for n in POLICIES}, few, k)
        cpu_items, cpu_scores = lists_of(make_policy("beam", cpu_engine), few, k)
        against = {"eager": eager["beam"], "beam": runs["beam"], "cpu": {"items": cpu_items, "scores": cpu_scores}}
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
        out["k"][k] = {}
        for what, pol, ref in CHECKS:
            n_rows = n_few if ref in ("eager", "cpu") else len(users.rows)
            equal, failed = compare(rows_of(runs[pol], n_rows), rows_of(against[ref], n_rows))
            keys[f"gpu.cuda.{pol}.{kk}.{what.split('.')[1]}"] = equal
            keys[f"gpu.cuda.{pol}.{kk}.{ref}_rows_not_a_tie"] = len(failed)
            out["k"][k][what] = {"rows": n_rows, "equal": equal, "not_a_tie": failed}
            failed_rows += len(failed)
        keys[f"gpu.cuda.beam.{kk}.speedup_vs_eager_cuda"] = (keys[f"gpu.eager_cuda.beam.{kk}.p50_ms"]
                                                            / keys[f"gpu.cuda.beam.{kk}.p50_ms"])
        say(f"K={k}: " + ", ".join(f"{n} {keys[f'gpu.cuda.{n}.{kk}.p50_ms']:.2f} ms" for n in POLICIES) + "; "
            + ", ".join(f"{what} {out['k'][k][what]['equal']:.3f} ({len(out['k'][k][what]['not_a_tie'])} rows not "
                        f"a tie)" for what, _, _ in CHECKS))
    for what, pol, _ in CHECKS:  # the worst K
        keys[f"gpu.cuda.{what}"] = min(keys[f"gpu.cuda.{pol}.k{k}.{what.split('.')[1]}"] for k in ks)
    keys["gpu.cuda.lossless_rows_not_a_tie"] = failed_rows  # 0: beam and strict equal eager and the CPU, ties aside
    keys["gpu.cuda.beam.speedup_vs_eager_cuda"] = keys[f"gpu.cuda.beam.k{ks[0]}.speedup_vs_eager_cuda"]
    after = cuda.describe()  # after the timed runs: a graph captured by one of them counts
    out["after_runs"] = after
    out["eager"] = dict(cuda.runner.eager)  # the searches that fell back to eager, and why
    keys["gpu.cuda.captured_after_start"] = after["captured_after_start"]
    keys["gpu.cuda.searches_eager"] = len(cuda.runner.eager)
    if after["captured_after_start"] or cuda.runner.eager:
        say(f"graphs captured after the warm-up: {after['captured_after_start']}; searches run eagerly: "
            f"{sorted(set(after['eager']) - set(EAGER_FUNCTIONS))}")
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


# -- 4. the verifier's RPCs under concurrent callers ------------------------------------------------------------
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
    """Phase 4: ``Search`` "rank" of 40 catalogue items and "beam" of width 10 per history, ``a.callers`` at once."""
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


# -- 3 and 5. the stack, and the stack at the budget -------------------------------------------------------------------
def rate_held(target: float, achieved: float, seconds: float) -> bool:
    """Whether an open loop held its target rate: the answers per second it achieved (of the measured part) within
    three standard deviations of a Poisson count of ``target`` x ``seconds`` arrivals (2% at least) of the
    target. A load generator that could not send the rate, or a stack that answered fewer, did not hold it."""
    if not (target > 0 and seconds > 0 and math.isfinite(achieved)):
        return False
    return achieved >= target * (1.0 - max(0.02, 3.0 / math.sqrt(target * seconds)))


def gateway_load(stack, bundle, users, a, keys: dict, rows: list) -> dict:
    """Phase 5: ``auto`` at 30 ms through the gateway, closed loop then open loop at rising rates; the capacity is
    the rate achieved at the highest that passed; then the verifier's graphs captured after its start."""
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
    out: dict = {"closed": closed, "open": []}
    rates = [float(x) for x in a.rates.split(",") if x]
    more = [float(x) for x in a.capacity_rates.split(",") if x]
    capacity = None
    for rate in rates + more:
        answers, sent, achieved = asyncio.run(open_loop(target, users, "auto", 10, BUDGET_MS, rate, a.seconds,
                                                        1.0, a.seed + int(rate)))
        row = summarise(answers, hits, sent)
        # GR-ranked among the requests *sent*: one refused or unanswered is not the model's answer
        share = row["gr_ranked_share"] * row["answered"] / max(1, sent) if row["answered"] else 0.0
        held = rate_held(rate, achieved, a.seconds)
        ok = held and share >= 0.99 and row["p99_ms"] <= BUDGET_MS
        lag = pct([r["send_lag_ms"] for r in answers if "send_lag_ms" in r], 99)
        rows.append({"open_rps": rate, "achieved_rps": achieved, "rate_held": held, "send_lag_p99_ms": lag,
                     "gr_ranked_share": share, "p99_ms": row["p99_ms"], "served_by": row["served_by"], "pass": ok})
        out["open"].append(rows[-1])
        if rate in rates:
            keys[f"gpu.gateway.auto.gr_ranked_share_open_{rate:g}rps"] = share
            keys[f"gpu.gateway.client_p99_ms_open_{rate:g}rps"] = row["p99_ms"]
            keys[f"gpu.gateway.achieved_rps_open_{rate:g}rps"] = achieved
        say(f"open loop {rate:g} requests/s: achieved {fmt(achieved)} ({'held' if held else 'not held'}; the "
            f"generator's send lag p99 {fmt(lag)} ms), GR-ranked {share:.3f}, p99 {fmt(row['p99_ms'])} ms -> "
            f"{'pass' if ok else 'fail'}")
        if not ok:
            break
        capacity = achieved  # the rate achieved, never more than was sent and answered
    keys["gpu.gateway.capacity_rps"] = capacity if capacity is not None else 0.0
    after = verifier_graphs_after_start(stack)  # read after every load: a capture during them counts
    if after is not None:
        keys["gpu.verifier.captured_after_start"] = after
    return out


def verifier_graphs_after_start(stack) -> float | None:
    """The stack's verifier's graphs captured after its warm-up (``specrec_verifier_graphs{when="after_start"}`` of
    its metrics); None where they cannot be read."""
    import urllib.request

    try:
        with urllib.request.urlopen(stack.metrics_url("verifier"), timeout=5.0) as r:
            text = r.read().decode()
    except (OSError, ValueError) as e:
        say(f"the verifier's metrics could not be read: {e}")
        return None
    m = re.search(r'^specrec_verifier_graphs\{when="after_start"\} (\S+)$', text, re.MULTILINE)
    return float(m.group(1)) if m else None


def verifier_start_log(logs: Path) -> dict | None:
    """The stack's verifier's "graphs captured" start-log line (its graphs, capture time, memory, eager searches)."""
    path = logs / "verifier.log"
    for line in path.read_text(errors="replace").splitlines() if path.exists() else ():
        try:
            rec = json.loads(line)
        except ValueError:
            continue
        if isinstance(rec, dict) and rec.get("event") == "graphs captured":
            return rec
    return None


def start_stack(bundle_dir: Path, a, tmp: Path, keys: dict):
    """Phase 3: the four services on this machine, the verifier on the CUDA backend with its metrics served, its
    graphs for K = 10 (the loads' only K), the text embedder off (the GPU machine cannot take its model)."""
    from specrec.backends.cuda import EAGER_FUNCTIONS

    n = a.drafters or max(1, min(4, (os.cpu_count() or 4) // 4))
    env = {"SPECREC_VERIFIER_BACKEND": "cuda", "SPECREC_VERIFIER_DEVICE": a.device,
           "SPECREC_VERIFIER_CUDA_GRAPH_BATCH_SIZES": json.dumps([int(x) for x in a.batch_sizes.split(",")]),
           "SPECREC_VERIFIER_WARMUP_K": json.dumps([10]),
           "SPECREC_DRAFTER_TEXT_EMBEDDER": "false", "SPECREC_ITEMSET_WARM_UP": "false"}
    stack = Stack(bundle_dir, Redis(a.redis_url, tmp), tmp / "logs", "gpu", threads=None, env=env,
                  replicas={"drafter": n}, metrics=("verifier",))
    say(f"starting the stack: verifier on {a.device} (CUDA backend), {n} drafter process(es)")
    try:
        stack.start(900.0, say=say)
    except BaseException:  # what started is stopped (a service that never became SERVING raised SystemExit)
        stack.stop(say=say)
        raise
    graphs = verifier_start_log(tmp / "logs")
    if graphs is not None:
        eager = sorted(set(graphs.get("eager", [])) - set(EAGER_FUNCTIONS))
        keys.update({"gpu.verifier.graphs": graphs.get("graphs"), "gpu.verifier.capture_s": graphs.get("capture_s"),
                     "gpu.verifier.graph_memory_mb": graphs.get("graph_memory_mb"),
                     "gpu.verifier.searches_eager": len(eager)})
        say(f"verifier: {graphs.get('graphs')} graphs in {graphs.get('capture_s')} s, "
            f"{graphs.get('graph_memory_mb')} MB; searches run eagerly: {eager or 'none'}")
    return stack


# -- 6. one epoch of training -------------------------------------------------------------------------------------
def train_epoch(bundle, a, keys: dict, out: Path) -> dict:
    """Phase 6: the GR model's training on the device, fresh weights of the bundle's config, its recipe's stride-5
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
    lines += ["", "| open loop requests/s | achieved | held | GR-ranked share | client p99 ms | pass |",
              "|---|---|---|---|---|---|"]
    lines += [f"| {r['open_rps']:g} | {fmt(r['achieved_rps'])} | {r['rate_held']} | {r['gr_ranked_share']:.3f} | "
              f"{fmt(r['p99_ms'])} | {r['pass']} |" for r in rows if "open_rps" in r]
    lines += ["", "| key | value |", "|---|---|"]
    lines += [f"| `{k}` | {v if isinstance(v, str) else fmt(v, '.4g')} |" for k, v in sorted(keys.items())]
    lines += [f"| phase `{p}` failed | {e.strip().splitlines()[-1][:200]} |" for p, e in errors.items()]
    return "\n".join(lines) + "\n"


def device_name(a) -> str:
    if a.cpu:
        return "cpu (dry run)"
    import torch

    return torch.cuda.get_device_name(torch.device(a.device))


# -- publishing a GPU run ---------------------------------------------------------------------------------------------
FILES = ("gpu_check.json", "gpu_check.md", "gpu_check.png", "gpu_keys.json", "gpu_check.log")


def merge(dirs: list[Path]) -> int:
    """Publish a GPU run's files (what came back from ``$OUT``; several: a run and its reruns, each phase from the
    last that ran it) into ``bench/results/gpu/``, its keys into ``bench/results/summary.json``; refused (see the
    module's docstring) unless every phase ran cleanly, on one GPU, with no search run eagerly."""
    from specrec.eval.results import RESULTS_DIR, update_summary

    runs = [(d, json.loads((d / "gpu_check.json").read_text())) for d in dirs]
    for d, res in runs:
        if res.get("dry_run"):
            raise SystemExit(f"{d} holds a dry run on the CPU: not GPU figures")
    source: dict[str, tuple[Path, dict]] = {}
    for d, res in runs:
        for name in res.get("seconds", {}):
            source[name] = (d, res)  # the last run that ran it
    problems = [f"phase {p} ran in none of {', '.join(map(str, dirs))}" for p in PHASES if p not in source]
    for name, (d, res) in source.items():
        err = res.get("errors", {}).get(name)
        if err:
            problems.append(f"phase {name} of {d}: {err.strip().splitlines()[-1][:300]}")
    keys: dict = {}
    for name, (_, res) in source.items():
        keys.update({k: res["keys"][k] for k in res.get("keys_of", {}).get(name, []) if k in res["keys"]})
    for k, where in (("gpu.cuda.searches_eager", "in process"), ("gpu.verifier.searches_eager", "in the verifier")):
        if keys.get(k):
            problems.append(f"{keys[k]} searches fell back to eager {where} ({k}): not captured figures")
    devices = {res["keys"].get("gpu.device") for _, res in source.values()}
    if len(devices) > 1:
        problems.append(f"runs of different GPUs: {sorted(map(str, devices))}")
    if problems:
        raise SystemExit("not published:\n  " + "\n  ".join(problems))
    keys["gpu.device"] = devices.pop()
    dest = RESULTS_DIR / "gpu"
    dest.mkdir(parents=True, exist_ok=True)
    for i, (d, _) in enumerate(runs):
        for name in FILES:
            target = dest / (name if len(runs) == 1 else name.replace(".", f"_run{i + 1}.", 1))
            if (d / name).exists() and (d / name).resolve() != target.resolve():
                shutil.copyfile(d / name, target)
    (dest / "gpu_keys.json").write_text(json.dumps(keys, indent=2, sort_keys=True) + "\n")
    old = json.loads((RESULTS_DIR / "summary.json").read_text()) if (RESULTS_DIR / "summary.json").exists() else {}
    update_summary(keys, RESULTS_DIR / "summary.json", retire=tuple(k for k in old if k.startswith("gpu.")
                                                                     and k not in keys))
    say(f"{len(keys)} gpu.* keys from {keys['gpu.device']} ({len(runs)} run(s)) into {RESULTS_DIR / 'summary.json'}")
    if (ROOT / ".device-aside").is_dir() and any((ROOT / ".device-aside").iterdir()):
        say("what --prepare set aside is still in .device-aside/: bash bench/device_check.sh --restore")
    return 0


# -- the run: phases under budgets, results written as each ends, stopped by a signal ----------------------------
class Halt(SystemExit):
    """What a signal handler raises to end a phase or the run. A SystemExit, not a bare BaseException: no ``except
    Exception`` on the way swallows it, and neither does asyncio, which passes SystemExit and KeyboardInterrupt on but
    logs and drops any other exception raised in one of its callbacks (the verifier phase runs an event loop: a
    SIGTERM landing in a callback was dropped and the dry run's interrupted copy ran to its end, CI 2026-12-07)."""


class PhaseOverrun(Halt):
    """A phase ran past its budget (raised in it by SIGALRM)."""


#: the signals the run was told to stop by, in order (:func:`stop_on_signals`): a phase that ends normally after one
#: (its exception dropped on the way, by a C extension's callback say) raises :class:`Stopped` as it ends
STOPS: list[int] = []


class Stopped(Halt):
    """The run was told to stop (SIGTERM, SIGHUP, SIGINT): what it measured is written and the stack stopped."""

    def __init__(self, signum: int):
        super().__init__(f"signal {signum} ({signal.Signals(signum).name})")
        self.signum = signum


def budgets(a) -> dict[str, float]:
    """:data:`BUDGET_S` (the dry run's: times :data:`DRY_RUN_BUDGET_FACTOR`) with ``--budgets``'s ``phase=seconds``
    in place."""
    out = {p: s * (DRY_RUN_BUDGET_FACTOR if a.cpu else 1.0) for p, s in BUDGET_S.items()}
    for part in filter(None, (x.strip() for x in a.budgets.split(","))):
        name, _, value = part.partition("=")
        if name not in out or not value:
            raise SystemExit(f"--budgets: {part!r} is not phase=seconds for a phase of {', '.join(PHASES)}")
        out[name] = float(value)
    return out


class Run:
    """One run's results and their files: written at the start and again as each phase ends (each file replaced
    whole, so a reader never finds half of one)."""

    def __init__(self, a, argv, out: Path):
        self.a, self.out, self.budgets = a, out, budgets(a)
        self.keys: dict = {"gpu.device": device_name(a)}
        self.rows: list = []
        self.errors: dict = {}
        self.res: dict = {"command": command_line("bench.gpu_check", argv), "run": run_line(),
                          "machine": machine_line(), "dry_run": a.cpu, "budgets_s": self.budgets,
                          "run_limit_s": sum(self.budgets.values()) + RUN_SLACK_S, "phases": {},
                          "seconds": {}, "keys_of": {}, "interrupted": None}
        self.title = ""

    def phase(self, name: str, fn: Callable[[], object]):
        """``fn()`` as phase ``name`` under its budget -> its result (None where it failed); recorded, and the files
        written, however it ends. A :class:`Stopped` is recorded and raised on, also one whose exception was dropped on
        the way (:data:`STOPS`)."""
        if STOPS:  # told to stop between phases, and the signal's exception was dropped on the way
            raise Stopped(STOPS[0])
        budget = self.budgets[name]
        before = dict(self.keys)
        t0 = time.perf_counter()
        out = None

        def overrun(_signum, _frame):
            raise PhaseOverrun()

        signal.signal(signal.SIGALRM, overrun)
        signal.setitimer(signal.ITIMER_REAL, budget)
        try:
            out = fn()
            if STOPS:  # told to stop while it ran, and the signal's exception was dropped on the way
                raise Stopped(STOPS[0])
            self.res["phases"][name] = out
        except PhaseOverrun:
            self.errors[name] = f"ran past its budget of {budget:g} s (what it measured before is kept)"
            say(f"phase {name}: {self.errors[name]}")
        except Stopped as e:
            self.errors[name] = f"interrupted by {e} after {time.perf_counter() - t0:.0f} s"
            self.res["interrupted"] = f"{e} during phase {name}"
            raise
        except (Exception, SystemExit):  # noqa: BLE001 - recorded; the next phase runs
            self.errors[name] = traceback.format_exc()
            say(f"phase {name} failed:\n{self.errors[name]}")
            if STOPS:  # the signal's exception came out as another one: the run stops all the same
                self.res["interrupted"] = f"{Stopped(STOPS[0])} during phase {name}"
                raise Stopped(STOPS[0]) from None
        finally:
            signal.setitimer(signal.ITIMER_REAL, 0)
            self.res["seconds"][name] = round(time.perf_counter() - t0, 1)
            self.res["keys_of"][name] = sorted(k for k, v in self.keys.items() if k not in before or before[k] is not v)
            self.write()
            say(f"phase {name}: {self.res['seconds'][name]:.0f} s of its {budget:g}")
        return out

    def write(self) -> None:
        """Every result file, as the run stands."""
        self.out.mkdir(parents=True, exist_ok=True)
        self.res["keys"], self.res["rows"], self.res["errors"] = self.keys, self.rows, self.errors
        if self.rows:
            plot(self.rows, self.out / "gpu_check.png", self.title)
        md = (f"# What only a GPU can show ({self.keys['gpu.device']})\n\n`{self.res['command']}`\n\n"
              f"{self.res['run']}; {self.res['machine']}; {self.res.get('users', 'users not sampled yet')}.\n\n"
              + ("**Dry run on the CPU: these are not GPU figures.**\n\n" if self.a.cpu else "")
              + (f"**Interrupted ({self.res['interrupted']}): the phases after it did not run.**\n\n"
                 if self.res["interrupted"] else "")
              + table(self.keys, self.rows, self.errors))
        _replace(self.out / "gpu_check.json", json.dumps(no_nan(self.res), indent=2, default=str) + "\n")
        _replace(self.out / "gpu_keys.json", json.dumps(no_nan(self.keys), indent=2) + "\n")
        _replace(self.out / "gpu_check.md", md)


def _replace(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def stop_on_signals() -> None:
    """SIGTERM, SIGHUP and SIGINT raise :class:`Stopped` (once: a second one while the run writes and stops its stack
    is ignored)."""

    def stop(signum, _frame):
        for s in (signal.SIGTERM, signal.SIGHUP, signal.SIGINT):
            signal.signal(s, signal.SIG_IGN)
        STOPS.append(signum)
        raise Stopped(signum)

    for s in (signal.SIGTERM, signal.SIGHUP, signal.SIGINT):
        signal.signal(s, stop)


def main(argv=None) -> int:
    a = parse(argv)
    if a.merge:
        return merge([Path(d) for d in a.merge])
    stop_on_signals()
    phases = [p.strip() for p in a.phases.split(",") if p.strip()]
    unknown = set(phases) - set(PHASES)
    if unknown:
        raise SystemExit(f"--phases: no phase {sorted(unknown)} (the phases: {', '.join(PHASES)})")
    run = Run(a, argv, Path(a.out))
    tmp = Path(tempfile.mkdtemp(prefix="specrec-gpu-"))
    stopped_by = 0
    live: list = []  # the stack from the moment it is up until it is stopped (a signal can end its phase first)

    def stack_up():
        up = start_stack(bundle_dir, a, tmp, run.keys)
        live.append(up)  # (the services run in sessions of their own: a signal to this run misses them)
        run.res["service_pids"] = {n: p.pid for n, p in up.procs.procs.items()}
        return up

    try:
        run.write()  # a run stopped before its first phase ends still leaves its files, saying so
        if "cuda_tests" in phases:
            run.phase("cuda_tests", lambda: cuda_tests(a, run.keys, run.budgets["cuda_tests"]))
        from specrec.bundle import Bundle

        bundle_dir = Path(a.bundle).resolve()
        bundle = Bundle.load(bundle_dir)
        users = sample_users(bundle, a.users, a.seed)
        run.res["users"], run.title = users.source, f"{bundle.name} on {run.keys['gpu.device']}: in process, batch 1"
        if "inprocess" in phases:
            run.phase("inprocess", lambda: inprocess(bundle, users, a, run.keys, run.rows))
        if {"verifier", "gateway"} & set(phases):
            run.phase("stack", stack_up)
        if live and "verifier" in phases:
            run.phase("verifier", lambda: verifier_load(live[0], bundle, users, a, run.keys))
        if live and "gateway" in phases:
            run.phase("gateway", lambda: gateway_load(live[0], bundle, users, a, run.keys, run.rows))
        if live:  # its GPU memory and CPUs back before training
            live.pop().stop(say=say)
            run.res["phases"]["stack"] = "stopped"
        if "train" in phases:
            run.phase("train", lambda: train_epoch(bundle, a, run.keys, tmp / "train"))
    except Stopped as e:
        run.res["interrupted"] = run.res["interrupted"] or f"{e} between phases"
        stopped_by = e.signum
        say(f"stopped by {e}: writing what was measured")
        run.write()
    finally:
        if live:
            live.pop().stop(say=say)
            run.res["phases"]["stack"] = "stopped"
        run.write()
        shutil.rmtree(tmp, ignore_errors=True)
    print((Path(a.out) / "gpu_check.md").read_text())
    if stopped_by:
        return 128 + stopped_by
    return 1 if run.errors else 0


if __name__ == "__main__":
    sys.exit(main())
