"""What ``bench.overload`` makes of its records without a stack: the figures of a run (the item drafter's lists
are not model answers; the generator's own send lag), the void rule, and the keys a run writes and retires."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from types import SimpleNamespace

import pytest

from bench import overload, summary_keys
from bench.cpus import confine, usable

from .fake_gateway import fake_gateway


def rec(t: float, served_by: str = "nezha", code: str = "OK", lag: float = 0.5, latency: float = 20.0,
        fill: bool = False) -> dict:
    return {"t": t, "user": 0, "send_lag_ms": lag, "latency_ms": latency, "done": t + latency / 1000.0, "code": code,
            "served_by": served_by if code == "OK" else "", "degraded": served_by == "drafter" or code != "OK",
            "server_ms": latency - 1.0, "model": code == "OK", "any_fill": fill}


def test_a_run_is_void_when_the_generator_lags_or_shares_the_cpus_or_the_histogram_is_unread():
    assert overload.void_reason(1.99, 2.0) is None
    assert "2.01 ms > 2 ms" in overload.void_reason(2.01, 2.0)
    assert "no send lag" in overload.void_reason(float("nan"), 2.0)
    assert "1 CPU" in overload.void_reason(0.5, 2.0, placement="1 CPU(s): the load generator cannot ...")
    why = overload.void_reason(3.0, 2.0, server_error="connection refused")
    assert "send lag" in why and "connection refused" in why


def test_summarise_counts_the_drafter_out_of_the_model_answers_and_reads_the_generator_lag():
    recs = ([rec(0.01 * i, lag=0.5) for i in range(90)] + [rec(0.9 + 0.01 * i, "drafter", lag=5.0) for i in range(5)]
            + [rec(0.95 + 0.01 * i, code="RESOURCE_EXHAUSTED") for i in range(5)] + [rec(5.0, lag=99.0)])
    row = overload.summarise(recs, 0.0, 1.0)  # the last record is past the window
    assert row["sent"] == 100 and row["answered"] == 95
    assert row["model_answer_share"] == pytest.approx(90 / 95)
    assert row["no_fill_share"] == pytest.approx(1.0)  # what model_share counted: the drafter's lists too
    assert row["shed_share"] == pytest.approx(0.05)
    assert row["generator_lag_p99_ms"] == pytest.approx(5.0)
    assert overload.void_reason(row["generator_lag_p99_ms"], 2.0) is not None


def test_only_a_run_that_is_not_void_writes_figures_and_a_void_one_retires_its_multiples():
    figures = {f: 1.0 for f in overload.FIGURES}
    rows = [{"multiple": 1.0, "void": False, "generator_lag_p99_ms": 0.8, **figures},
            {"multiple": 3.0, "void": True, "void_reason": "lag", "generator_lag_p99_ms": 7.0, **figures}]
    keys, retire = overload.summary_keys(rows, 80.0)
    assert keys["serving.capacity_rps"] == 80.0
    assert keys["serving.overload_1x.void"] == 0 and keys["serving.overload_1x.server_p99_ms"] == 1.0
    assert keys["serving.overload_3x.void"] == 1 and keys["serving.overload_3x.generator_lag_p99_ms"] == 7.0
    assert not [k for k in keys if k.startswith("serving.overload_3x.") and k.rsplit(".", 1)[1] in overload.FIGURES]
    assert {f"serving.overload_3x.{f}" for f in overload.FIGURES} <= set(retire)
    assert not [k for k in retire if k.startswith("serving.overload_1x.") and k.rsplit(".", 1)[1] in keys]
    assert {"serving.overload_1x.model_share", "serving.overload_3x.model_share"} <= set(retire)
    assert summary_keys.keys_without_writer(keys) == []  # bench/summary_keys.py knows every key it writes
    assert summary_keys.keys_without_writer({"serving.overload_1x.model_share": 1}) != []  # replaced: no writer


# -- against a fake gateway ---------------------------------------------------------------------------
@pytest.fixture
def gateway():
    with fake_gateway() as (port, mport):
        yield f"127.0.0.1:{port}", f"http://127.0.0.1:{mport}/metrics"


def test_a_run_reads_the_histogram_over_its_measured_part_and_applies_the_void_rule(gateway, tmp_path):
    target, metrics = gateway
    users = tmp_path / "users.json"
    users.write_text(json.dumps({"ids": [["a"], ["b"]], "targets": ["x", "y"]}))
    a = argparse.Namespace(warmup=0.4, duration=0.8, budget_ms=30.0, seed=0, max_lag_ms=2.0)
    row = overload.load_run(target, metrics, users, 1.0, 60.0, a, tmp_path, {usable()[-1]}, None)
    assert row["sent"] > 10 and row["answered"] == row["sent"] and row["model_answer_share"] == 1.0
    # the histogram counts what the gateway answered from the first reading on: the measured part's requests
    # and the few of the warm-up still in flight then (none here: it answers at once)
    assert row["server_count"] == pytest.approx(row["sent"], abs=3)
    assert 10.0 < row["server_p99_ms"] <= 15.0 and row["server_over_budget_share"] == 0.0
    assert row["void"] == (row["generator_lag_p99_ms"] > 2.0)  # whatever this machine's load gives it
    placed = overload.load_run(target, metrics, users, 1.0, 60.0, a, tmp_path, None, "1 CPU(s): no CPU of its own")
    assert placed["void"] and "no CPU of its own" in placed["void_reason"]


def test_placement_confines_the_services_and_this_process_apart():
    cpus = usable()
    if len(cpus) < 2:
        pytest.skip("needs two CPUs")
    gen, svc = {cpus[-1]}, set(cpus[:-1])
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
    stack = SimpleNamespace(procs=SimpleNamespace(procs={"verifier": child}), redis=None,
                            redis_url="redis://127.0.0.1:6379/0")
    try:
        placed = overload.place(stack, gen, svc)
        assert usable() == sorted(gen)
    finally:
        confine([os.getpid()], set(cpus))
        child.kill()
        child.wait()
    assert placed["processes"] == {"verifier": sorted(svc), "bench": sorted(gen)}
    assert placed["generator_cpus"] == sorted(gen) and "not started here" in placed["redis"]
