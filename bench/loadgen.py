"""The load generator of every benchmark: open-loop Poisson arrivals of requests to a gateway, and closed-loop
callers that measure a capacity.

:func:`poisson` is the one open-loop implementation (grpc.aio, one channel), run three ways:

- in the measuring process, ``asyncio.run(poisson(...))`` (``bench.serving``, ``bench.scaleout``);
- in a thread with its event loop, until stopped, its rate changeable while it runs: :class:`InThread`
  (``bench.chaos``);
- in a process of its own, so that its event loop never competes with the measuring process's threads for
  the GIL: :func:`in_process`, which runs this module (``bench.overload``, ``bench.soak``), optionally on
  CPUs of its own (``--cpus``: every thread of it confined to them, :func:`bench.cpus.confine`):

    python -m bench.loadgen --target 127.0.0.1:50050 --users users.json --rate 40 --duration 20 --out rec.jsonl

Arrival times come from a seeded exponential clock (``time.monotonic()``, seconds). Latency runs from the
*scheduled* send time, so queueing in the client counts, and each record says how late this process sent
the request (``send_lag_ms``: a caller-side tail the gateway never saw). Every answer is one record: ``t``
(the scheduled send), ``user`` (its index in the sample), ``send_lag_ms``, ``latency_ms``, ``done`` (when it
came back) and what ``describe`` makes of the answer, by default :func:`answer_fields`: the status, who
served, the gateway's own time (``server_ms``, ``stats.total_ms``), whether the list is a model answer (no
catalogue fill). :func:`model_answer` says whether a record is the GR model's answer (not the item drafter's,
not holding catalogue fill). The process form writes the records as JSON lines in ``--out``; its users come
from a JSON file (``{"ids": [[item id, ...], ...], "targets": [...]}``, :func:`bench.harness.write_users`); on
its stdout, a line ``{"t0": ...}`` when its arrivals' clock starts (the monotonic clock every process of the
machine shares: the measuring process times its own readings by it), and ``{"sent": n}`` at the end.

:func:`capacity` is the closed loop: ``clients`` callers, each sending its next request when the last is
answered; :func:`measured_capacity` is the GR model's own answers/s that ``bench.overload`` and ``bench.soak``
load as multiples of.
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
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from bench.cpus import confine
from bench.harness import ROOT, add_common_args, request

#: what a record holds of one answer: (user index, the response or None, the gRPC error or None) -> fields
Describe = Callable[[int, Any, Any], dict]

#: the capacity phase: this policy, with a budget that never acts
CAPACITY_POLICY, CAPACITY_BUDGET_MS = "beam", 1000.0
#: who served a list that is not the GR model's: the item drafter (auto's cheapest tier, or the fallback when the
#: verifier is away) and the catalogue's fill
NOT_THE_MODEL = ("drafter", "fill")


def answer_fields(i: int, resp, error) -> dict:
    """The status, who served, whether degraded, the gateway's own time, and whether the list is a model
    answer (``model``: items and none of them catalogue fill; ``any_fill``: some are)."""
    if error is not None:
        return {"code": error.code().name, "served_by": "", "degraded": True, "model": False, "any_fill": False}
    sources = [it.source for it in resp.items]
    return {"code": "OK", "served_by": resp.stats.served_by or resp.stats.policy, "degraded": bool(resp.stats.degraded),
            "server_ms": resp.stats.total_ms, "model": bool(sources) and "fill" not in sources,
            "any_fill": "fill" in sources}


def model_answer(rec: dict) -> bool:
    """A record of an answer the GR model made: answered, served by a policy of the verifier (not the item
    drafter, not the catalogue fill: :data:`NOT_THE_MODEL`), with items, none of them fill. Degraded or not:
    a verifier policy's list when the item drafter is away is still the model's."""
    return (rec.get("code") == "OK" and rec.get("served_by") not in NOT_THE_MODEL and not rec.get("any_fill", False)
            and bool(rec.get("model", False)))


async def poisson(target: str, histories: list[list[str]], *, rate: float | Callable[[], float],
                  duration: float | None = None, stop: threading.Event | None = None, policy: str = "auto",
                  k: int = 10, budget_ms: float = 30.0, seed: int = 0, timeout_s: float = 5.0,
                  user_prefix: str = "load", start_delay_s: float = 0.0, describe: Describe = answer_fields,
                  records: list[dict] | None = None, on_record: Callable[[dict], object] | None = None,
                  on_start: Callable[[float], object] | None = None,
                  progress_every: float | None = None) -> tuple[list[dict], int, float]:
    """Poisson arrivals at ``rate`` requests/s (a callable: read at every arrival) of ``policy`` requests,
    user ``j % len(histories)`` for the j-th, from ``start_delay_s`` after the channel is ready until
    ``duration`` seconds of arrivals or ``stop`` is set; then waits for every answer. -> (the records, in
    the order they came back (appended to ``records`` if given, as they come), requests sent, the monotonic
    time the arrivals count from; ``on_start`` is told that time as soon as it is set)."""
    import grpc

    from specrec_rpc.v1 import recommender_pb2_grpc

    if duration is None and stop is None:
        raise ValueError("poisson() needs a duration or a stop event")
    rate_of = rate if callable(rate) else (lambda: rate)
    rng = np.random.default_rng(seed)
    out: list[dict] = [] if records is None else records
    n_users = len(histories)
    n_done = 0

    async def one(stub, j: int, sched: float) -> None:
        nonlocal n_done
        i = j % n_users
        rec: dict = {"t": sched, "user": i, "send_lag_ms": (time.monotonic() - sched) * 1000.0}
        try:
            resp = await stub.Recommend(request(histories[i], i, policy, k, budget_ms, user_prefix), timeout=timeout_s)
            rec.update(describe(i, resp, None))
        except grpc.aio.AioRpcError as e:
            rec.update(describe(i, None, e))
        done = time.monotonic()
        rec["latency_ms"] = (done - sched) * 1000.0
        rec["done"] = done
        out.append(rec)
        n_done += 1
        if on_record is not None:
            on_record(rec)

    async with grpc.aio.insecure_channel(target) as ch:
        stub = recommender_pb2_grpc.RecommenderStub(ch)
        await ch.channel_ready()
        tasks: set[asyncio.Task] = set()
        t0 = t_next = time.monotonic() + start_delay_s
        if on_start is not None:
            on_start(t0)
        t_print = time.monotonic() + progress_every if progress_every else float("inf")
        j = 0
        while stop is None or not stop.is_set():
            t_next += rng.exponential(1.0 / rate_of())
            if duration is not None and t_next - t0 >= duration:
                break
            d = t_next - time.monotonic()
            if d > 0:
                await asyncio.sleep(d)
            task = asyncio.ensure_future(one(stub, j, t_next))
            tasks.add(task)
            task.add_done_callback(tasks.discard)
            j += 1
            if progress_every and time.monotonic() >= t_print:  # long runs show progress
                print(f"loadgen: {time.monotonic() - t0:.0f}/{duration or 0:.0f} s, {j} sent, {n_done} answered",
                      file=sys.stderr, flush=True)
                t_print += progress_every
        if tasks:
            await asyncio.gather(*tasks, return_exceptions=True)
    return out, j, t0


class InThread:
    """:func:`poisson` in a thread of its own (its own event loop) from :meth:`start` until :meth:`stop`;
    ``rate`` may be changed while it runs (the next arrival reads it); ``records`` fill as answers come."""

    def __init__(self, target: str, histories: list[list[str]], rate: float, budget_ms: float, *,
                 policy: str = "auto", k: int = 10, seed: int = 0, timeout_s: float = 5.0, user_prefix: str = "bench",
                 describe: Describe = answer_fields):
        self.rate = rate
        self.records: list[dict] = []
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._run = lambda: asyncio.run(poisson(
            target, histories, rate=lambda: self.rate, stop=self._stop, policy=policy, k=k, budget_ms=budget_ms,
            seed=seed, timeout_s=timeout_s, user_prefix=user_prefix, describe=describe, records=self.records))

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="load", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(30)


def in_process(target: str, users_file: Path, rate: float, seconds: float, budget_ms: float, seed: int, out: Path,
               profile: dict[str, int] | None = None, profile_dir: Path | None = None,
               say: Callable[[str], None] = print, cpus: set[int] | None = None,
               at: tuple[float, Callable[[], object]] | None = None) -> list[dict]:
    """This module in its own process (``auto``, K = 10, for ``seconds`` of arrivals); its records. ``cpus``:
    the CPUs it runs on (it confines itself at its start, and is confined again by its pid here). ``at`` =
    (offset s, fn): ``fn()`` is called here once, ``offset`` seconds after its arrivals' clock starts (a
    reading of the server at the start of the measured part). With ``profile`` (name -> pid), py-spy samples
    those processes and the load generator for the whole run into ``profile_dir`` (``<name>.txt``, collapsed
    stacks; each sampler's messages in ``<name>.err``)."""
    cmd = [sys.executable, "-m", "bench.loadgen", "--target", target, "--users", str(users_file),
           "--rate", f"{rate:.3f}", "--duration", f"{seconds:.1f}", "--budget-ms", str(budget_ms),
           "--seed", str(seed), "--out", str(out)]
    if cpus:
        cmd += ["--cpus", ",".join(str(c) for c in sorted(cpus))]
    gen = subprocess.Popen(cmd, cwd=ROOT, env={**os.environ, "OMP_NUM_THREADS": "1"}, stdout=subprocess.PIPE,
                           text=True)
    if cpus:
        confine([gen.pid], cpus)
    spies: list[tuple[str, subprocess.Popen]] = []
    try:
        if profile and profile_dir is not None:
            profile_dir.mkdir(parents=True, exist_ok=True)
            for name, pid in {**profile, "loadgen": gen.pid}.items():
                with open(profile_dir / f"{name}.err", "w") as err:
                    spies.append((name, subprocess.Popen(
                        [py_spy(), "record", "--pid", str(pid), "--rate", "250", "--format", "raw", "--nonblocking",
                         "--threads", "-o", str(profile_dir / f"{name}.txt")],
                        stdout=subprocess.DEVNULL, stderr=err)))
        assert gen.stdout is not None
        first = gen.stdout.readline()  # {"t0": ...} when its arrivals' clock starts ("" if it failed first)
        if at is not None and first.strip():
            t0 = json.loads(first).get("t0")
            if t0 is not None:
                time.sleep(max(0.0, t0 + at[0] - time.monotonic()))
                at[1]()
        gen.stdout.read()  # {"sent": n}
        if gen.wait() != 0:
            raise subprocess.CalledProcessError(gen.returncode, cmd)
    finally:
        if gen.poll() is None:
            gen.terminate()
            gen.wait(timeout=10)
        gen.stdout.close()
        for name, sp in spies:  # py-spy writes its file when interrupted
            if sp.poll() is None:
                sp.send_signal(signal.SIGINT)
            try:
                sp.wait(timeout=30)
            except subprocess.TimeoutExpired:
                sp.kill()
            assert profile_dir is not None
            if sp.returncode not in (0, -signal.SIGINT) or not (profile_dir / f"{name}.txt").exists():
                say(f"py-spy of {name} gave nothing (exit {sp.returncode}): see {profile_dir / f'{name}.err'}")
    return [json.loads(line) for line in out.read_text().splitlines() if line.strip()]


def py_spy() -> str:
    exe = Path(sys.executable).with_name("py-spy")
    found = str(exe) if exe.exists() else shutil.which("py-spy")
    if not found:
        raise SystemExit("--profile needs py-spy (pip install py-spy)")
    return found


# -- closed loop -------------------------------------------------------------------------------------
def capacity(target: str, histories: list[list[str]], clients: int, seconds: float, policy: str, budget_ms: float,
             k: int = 10, counts: Callable[[object], bool] | None = None) -> float:
    """Answers/s of ``clients`` closed-loop callers (threads, one channel each; caller c asks users c,
    c + clients, ...) over ``seconds``, counting the answers ``counts`` accepts (default: every answer;
    errors never)."""
    import grpc

    from specrec_rpc.v1 import recommender_pb2_grpc

    n = [0] * clients
    stop = time.monotonic() + seconds

    def caller(c: int) -> None:
        with grpc.insecure_channel(target) as ch:
            stub = recommender_pb2_grpc.RecommenderStub(ch)
            i = c
            while time.monotonic() < stop:
                u = i % len(histories)
                try:
                    resp = stub.Recommend(request(histories[u], u, policy, k, budget_ms), timeout=5)
                    n[c] += int(counts is None or counts(resp))
                except grpc.RpcError:
                    pass
                i += clients

    t0 = time.monotonic()
    threads = [threading.Thread(target=caller, args=(c,)) for c in range(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return sum(n) / (time.monotonic() - t0)


def measured_capacity(target: str, histories: list[list[str]], a) -> float:
    """The GR model's answers/s: ``a.clients`` closed-loop callers asking ``beam`` with a budget that never
    acts, over ``a.capacity_seconds`` after a 2-second warm-up of the same loop, counting the answers beam
    served, not degraded: what the stack serves at full quality when saturated. (Under ``auto`` at the budget
    the stack also answers from the drafter when the verifier is busy, cheaply, and how much depends on what
    auto has learned: that would measure the drafter, or the moment.)"""

    def beams(resp) -> bool:
        return resp.stats.served_by == CAPACITY_POLICY and not resp.stats.degraded

    capacity(target, histories, a.clients, 2.0, CAPACITY_POLICY, CAPACITY_BUDGET_MS, counts=beams)
    return capacity(target, histories, a.clients, a.capacity_seconds, CAPACITY_POLICY, CAPACITY_BUDGET_MS,
                    counts=beams)


def add_load_args(ap: argparse.ArgumentParser) -> None:
    """The options of a benchmark loading the stack at multiples of its measured capacity (``bench.overload``,
    ``bench.soak``)."""
    ap.add_argument("--bundle", required=True)
    ap.add_argument("--clients", type=int, default=4, help="closed-loop callers of the capacity phase")
    ap.add_argument("--capacity-seconds", type=float, default=8.0)
    ap.add_argument("--budget-ms", type=float, default=30.0)
    ap.add_argument("--requests", type=int, default=1000, help="test users sampled")
    add_common_args(ap)


# -- the process form --------------------------------------------------------------------------------
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
    ap.add_argument("--cpus", help="run on these CPUs only (comma-separated): every thread of this process, and "
                    "so every thread it starts")
    a = ap.parse_args(argv)
    if a.cpus:
        confine([os.getpid()], {int(c) for c in a.cpus.split(",")})
    users = json.loads(a.users.read_text())
    with open(a.out, "w") as fh:
        _, sent, _ = asyncio.run(poisson(a.target, users["ids"], rate=a.rate, duration=a.duration,
                                         budget_ms=a.budget_ms, k=a.k, seed=a.seed, progress_every=10.0,
                                         on_record=lambda r: fh.write(json.dumps(r) + "\n"),
                                         on_start=lambda t0: print(json.dumps({"t0": t0}), flush=True)))
    print(json.dumps({"sent": sent}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
