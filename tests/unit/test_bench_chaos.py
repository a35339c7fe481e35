"""What ``bench.chaos`` makes of a window of a fault of the machine without a stack: its figures (model answers
of the requests, fill of the answers, the window's bounds), its keys, and what a run of those faults alone
writes and retires."""

from __future__ import annotations

import json
import math

import pytest

from bench import chaos, summary_keys


def rec(t: float, served_by: str = "nezha", code: str = "OK", lag: float = 0.5, latency: float = 20.0,
        fill: bool = False) -> dict:
    return {"t": t, "user": 0, "send_lag_ms": lag, "latency_ms": latency, "done": t + latency / 1000.0, "code": code,
            "served_by": served_by if code == "OK" else "", "degraded": served_by == "drafter" or code != "OK",
            "server_ms": latency - 1.0, "model": code == "OK", "any_fill": fill}


def test_a_window_counts_model_answers_of_the_requests_and_fill_of_the_answers():
    inside = ([rec(10.0 + 0.01 * i) for i in range(16)] + [rec(10.2, "drafter"), rec(10.3, fill=True),
              rec(10.4, code="RESOURCE_EXHAUSTED", latency=1.0), rec(10.5, code="INTERNAL", latency=90.0)])
    outside = [rec(9.9, latency=500.0), rec(12.0, latency=500.0)]
    server = {"server_p99_ms": 29.0, "server_count": 20}
    row = chaos.machine_row("cpu-hog", outside + inside, 10.0, 11.0, server, {"cpu": 1})
    assert row["requests"] == 20 and row["seconds"] == pytest.approx(1.0)
    assert row["model_answer_share"] == pytest.approx(16 / 20)  # not the drafter's, not fill, not shed or failed
    assert row["fill_share"] == pytest.approx(1 / 18) and row["drafter_share"] == pytest.approx(1 / 18)
    assert row["shed_share"] == pytest.approx(1 / 20) and row["internal_errors"] == 1
    assert row["client_p99_ms"] < 100.0  # the 500 ms answers outside the window are not its
    assert row["server_p99_ms"] == 29.0 and row["cpu"] == 1


def test_machine_keys_and_cpu_shares():
    rows = [{"scenario": s, **{f: 0.5 for f in chaos.MACHINE_FIGURES}} for s in ("baseline", "cpu-hog", "one-core")]
    keys = chaos.machine_keys(rows)
    assert set(keys) == {f"chaos.{s}.{f}" for s in ("cpu_hog", "one_core") for f in chaos.MACHINE_FIGURES}
    assert summary_keys.keys_without_writer(keys) == []
    assert chaos.cpu_shares({"hog": 1.0, "verifier": 2.0, "gone": None}, {"hog": 10.5, "verifier": 6.0}, 10.0) == {
        "hog": 0.95, "verifier": 0.4}


def result(machine_faults: dict) -> dict:
    return {"command": "python -m bench.chaos", "run": "today", "users": "users", "machine": "2 CPUs",
            "budget_ms": 100.0, "rate": 10.0, "flood_x": 2.0, "streak": 5, "scenarios": [],
            "capacity_rps": float("nan"), "machine_faults": machine_faults}


def test_a_fault_of_the_machine_run_alone_writes_its_keys_and_no_other_scenarios(tmp_path):
    (tmp_path / "summary.json").write_text(json.dumps({"chaos.recovery_s_max": 2.2, "chaos.catalogue_items_lost": 0}))
    row = chaos.machine_row("cpu-hog", [rec(10.0 + 0.01 * i) for i in range(50)], 10.0, 11.0,
                            {"server_p99_ms": 29.0, "server_p99_bucket_ms": [25.0, 30.0]}, {"cpu": 1, "cpu_share": {}})
    mf = {"names": ["cpu-hog"], "rows": [row], "budget_ms": 30.0, "rate": 20.0, "capacity_rps": 40.0, "cpu": 1}
    summary = chaos.write_results(tmp_path, result(mf))
    written = json.loads((tmp_path / "summary.json").read_text())
    assert written["chaos.cpu_hog.server_p99_ms"] == 29.0 and written["chaos.cpu_hog.model_answer_share"] == 1.0
    assert written["chaos.recovery_s_max"] == 2.2  # the other scenarios did not run: their keys are left alone
    assert "chaos.model_answer_share_during_faults" not in summary and summary["chaos.internal_errors"] == 0
    assert "| cpu-hog | 1 |" in (tmp_path / "chaos.md").read_text()
    assert "cpu-hog" in (tmp_path / "README.md").read_text()


def test_a_fault_of_the_machine_skipped_retires_its_keys(tmp_path):
    old = {f"chaos.one_core.{f}": 1.0 for f in chaos.MACHINE_FIGURES} | {"chaos.cpu_hog.server_p99_ms": 25.0}
    (tmp_path / "summary.json").write_text(json.dumps(old))
    mf = {"names": ["one-core"], "rows": [], "budget_ms": 30.0, "skipped": "one-core skipped: 1 CPU"}
    chaos.write_results(tmp_path, result(mf))
    written = json.loads((tmp_path / "summary.json").read_text())
    assert not [k for k in written if k.startswith("chaos.one_core.")]
    assert written["chaos.cpu_hog.server_p99_ms"] == 25.0  # not asked for in this run: left alone
    assert "one-core skipped: 1 CPU" in (tmp_path / "chaos.md").read_text()
    assert math.isnan(chaos.machine_row("x", [], 0.0, 1.0, {}, {})["model_answer_share"])
