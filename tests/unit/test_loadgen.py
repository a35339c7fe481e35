"""The benchmarks' one load generator (``bench.loadgen``) against a fake gateway: the seeded schedule, what a
record holds, errors, a rate changed while it runs, the closed loop, the process form's file."""

from __future__ import annotations

import asyncio
import json
import os
import threading
import time
from concurrent import futures

import grpc
import numpy as np
import pytest

from bench import loadgen
from specrec_rpc.v1 import recommender_pb2, recommender_pb2_grpc


class FakeGateway(recommender_pb2_grpc.RecommenderServicer):
    """Answers at once: users with an even index get two beam items, odd ones a beam item and a fill item;
    ``refuse`` (a user id) is answered RESOURCE_EXHAUSTED."""

    def __init__(self, refuse: str | None = None):
        self.refuse = refuse
        self.user_ids: list[str] = []
        self.lock = threading.Lock()

    def Recommend(self, request, context):
        with self.lock:
            self.user_ids.append(request.user_id)
        if request.user_id == self.refuse:
            context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, "shed")
        i = int(request.user_id.rsplit("-", 1)[1])
        sources = ["beam", "beam"] if i % 2 == 0 else ["beam", "fill"]
        return recommender_pb2.RecommendResponse(
            items=[recommender_pb2.RecommendedItem(item_id=f"x{j}", source=s) for j, s in enumerate(sources)],
            stats=recommender_pb2.RecommendStats(policy=request.policy, served_by=request.policy, total_ms=1.5))


@pytest.fixture
def gateway():
    servicer = FakeGateway(refuse="load-1")
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=8))
    recommender_pb2_grpc.add_RecommenderServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    yield f"127.0.0.1:{port}", servicer
    server.stop(None)


HISTORIES = [["a", "b"], ["c"], ["d", "e", "f"]]


def test_poisson_follows_its_seeded_clock_and_records_every_answer(gateway):
    target, servicer = gateway
    rate, duration = 400.0, 0.25
    records, sent, t0 = asyncio.run(loadgen.poisson(target, HISTORIES, rate=rate, duration=duration, seed=3,
                                                    start_delay_s=0.05))
    assert sent == len(records) > 20
    recs = sorted(records, key=lambda r: r["t"])
    gaps = np.random.default_rng(3).exponential(1.0 / rate, sent + 1)
    assert np.allclose([r["t"] - t0 for r in recs], np.cumsum(gaps)[:sent])
    assert np.cumsum(gaps)[sent] >= duration  # the next arrival would fall past the duration
    assert [r["user"] for r in recs] == [j % len(HISTORIES) for j in range(sent)]
    for r in recs:
        assert r["latency_ms"] >= r["send_lag_ms"] >= 0 and r["done"] >= r["t"]
        if r["user"] == 1:  # refused
            assert (r["code"], r["served_by"], r["model"], r["degraded"]) == ("RESOURCE_EXHAUSTED", "", False, True)
        else:
            assert r["code"] == "OK" and r["served_by"] == "auto" and r["server_ms"] == 1.5
            assert r["model"] is (r["user"] % 2 == 0) and r["any_fill"] is (r["user"] % 2 == 1)
    assert set(servicer.user_ids) == {"load-0", "load-1", "load-2"}


def test_a_describe_hook_and_a_stop_event_instead_of_a_duration(gateway):
    target, _ = gateway
    stop = threading.Event()
    threading.Timer(0.15, stop.set).start()
    records, sent, _ = asyncio.run(loadgen.poisson(
        target, HISTORIES, rate=200.0, stop=stop, policy="beam", user_prefix="bench",
        describe=lambda i, resp, e: {"i": i, "n": len(resp.items) if resp is not None else -1}))
    assert sent == len(records) > 5
    assert all(set(r) == {"t", "user", "send_lag_ms", "latency_ms", "done", "i", "n"} for r in records)
    assert {r["n"] for r in records} == {2}  # "bench-1" is not refused
    with pytest.raises(ValueError):
        asyncio.run(loadgen.poisson(target, HISTORIES, rate=1.0))


def test_in_a_thread_the_rate_changes_while_it_runs(gateway):
    target, servicer = gateway
    load = loadgen.InThread(target, HISTORIES, 50.0, 30.0, seed=1)
    load.start()
    time.sleep(0.3)
    n_slow = len(load.records)
    load.rate = 1000.0
    time.sleep(0.3)
    load.stop()
    n_fast = len(load.records) - n_slow
    assert n_fast > 3 * max(n_slow, 1)
    assert all(u.startswith("bench-") for u in servicer.user_ids)


def test_closed_loop_capacity_counts_what_it_is_told_to(gateway):
    target, _ = gateway
    every = loadgen.capacity(target, HISTORIES, 2, 0.2, "beam", 1000.0)
    beams = loadgen.capacity(target, HISTORIES, 2, 0.2, "beam", 1000.0,
                             counts=lambda r: r.stats.served_by == "beam")
    none = loadgen.capacity(target, HISTORIES, 2, 0.2, "beam", 1000.0, counts=lambda r: False)
    assert every > 0 and beams > 0 and none == 0


def test_the_process_form_writes_one_json_line_per_answer(gateway, tmp_path, capsys):
    target, _ = gateway
    users = tmp_path / "users.json"
    users.write_text(json.dumps({"ids": HISTORIES, "targets": ["x", "y", "z"]}))
    out = tmp_path / "rec.jsonl"
    assert loadgen.main(["--target", target, "--users", str(users), "--rate", "300", "--duration", "0.2",
                         "--out", str(out)]) == 0
    lines = [json.loads(x) for x in out.read_text().splitlines()]
    said = [json.loads(x) for x in capsys.readouterr().out.splitlines()]
    assert [set(x) for x in said] == [{"t0"}, {"sent"}]  # when its arrivals' clock starts, then how many it sent
    assert said[1]["sent"] == len(lines) > 5
    assert said[0]["t0"] < min(r["t"] for r in lines)
    assert {"t", "user", "send_lag_ms", "code", "served_by", "model", "latency_ms"} <= set(lines[0])


def test_the_process_form_on_a_cpu_calls_back_at_the_offset_from_its_start(gateway, tmp_path):
    target, _ = gateway
    users = tmp_path / "users.json"
    users.write_text(json.dumps({"ids": HISTORIES, "targets": ["x", "y", "z"]}))
    called: list[float] = []
    cpu = sorted(os.sched_getaffinity(0))[-1]
    recs = loadgen.in_process(target, users, 200.0, 0.6, 30.0, 0, tmp_path / "rec.jsonl", cpus={cpu},
                              at=(0.2, lambda: called.append(time.monotonic())))
    assert len(called) == 1 and len(recs) > 20
    first = min(r["t"] for r in recs)  # its clock's start plus one gap (Exp, mean 5 ms)
    assert first + 0.15 <= called[0] <= first + 1.2
    assert called[0] < max(r["done"] for r in recs)


def test_a_model_answer_is_the_verifier_policies_list_without_fill():
    ok = {"code": "OK", "served_by": "nezha", "model": True, "any_fill": False}
    assert loadgen.model_answer(ok)
    assert loadgen.model_answer({**ok, "degraded": True})  # beam's list while the drafter is away is the model's
    assert not loadgen.model_answer({**ok, "served_by": "drafter"})
    assert not loadgen.model_answer({**ok, "served_by": "fill"})
    assert not loadgen.model_answer({**ok, "any_fill": True})
    assert not loadgen.model_answer({**ok, "model": False})
    assert not loadgen.model_answer({**ok, "code": "RESOURCE_EXHAUSTED"})
