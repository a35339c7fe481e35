"""What ``bench.chaos`` makes of a window of a fault of the machine without a stack (``bench.chaos_machine``): its
figures (undegraded answers of the requests, GR-ranked and fill of the answers, the window's bounds), its keys, and
what a run of those faults alone writes and retires; a scenario's recovery (``bench.chaos_services``)."""

from __future__ import annotations

import argparse
import json
import math
import subprocess
import sys
from dataclasses import dataclass

import pytest

from bench import chaos, chaos_machine, chaos_services, summary_keys
from bench.cpus import Hog, affinity, usable
from bench.harness import Users

from .fake_gateway import fake_gateway


def rec(t: float, served_by: str = "nezha", code: str = "OK", lag: float = 0.5, latency: float = 20.0,
        fill: bool = False) -> dict:
    return {"t": t, "user": 0, "send_lag_ms": lag, "latency_ms": latency, "done": t + latency / 1000.0, "code": code,
            "served_by": served_by if code == "OK" else "", "degraded": served_by == "drafter" or code != "OK",
            "server_ms": latency - 1.0, "model": code == "OK", "any_fill": fill}


def test_a_window_counts_undegraded_answers_of_the_requests_and_gr_ranked_and_fill_of_the_answers():
    inside = ([rec(10.0 + 0.01 * i) for i in range(16)] + [rec(10.2, "drafter"), rec(10.3, fill=True),
              rec(10.4, code="RESOURCE_EXHAUSTED", latency=1.0), rec(10.5, code="INTERNAL", latency=90.0)])
    outside = [rec(9.9, latency=500.0), rec(12.0, latency=500.0)]
    server = {"server_p99_ms": 29.0, "server_count": 20}
    row = chaos_machine.machine_row("cpu-hog", outside + inside, 10.0, 11.0, server, {"cpu": 1})
    assert row["requests"] == 20 and row["seconds"] == pytest.approx(1.0)
    assert row["undegraded_share"] == pytest.approx(16 / 20)  # not degraded, not fill, not shed or failed
    assert row["gr_ranked_share"] == pytest.approx(16 / 18)  # of the answers: not the drafter's, not fill
    budget_exit = dict(rec(10.6), exit="budget")
    assert chaos_machine.machine_row("x", [rec(10.0), budget_exit], 10.0, 11.0, {}, {})["undegraded_share"] == 0.5
    hits = [dict(rec(10.0), hit=True), rec(10.1), rec(10.2, code="RESOURCE_EXHAUSTED")]
    assert chaos_machine.machine_row("x", hits, 10.0, 11.0, {}, {})["recall@10"] == pytest.approx(1 / 3)
    assert row["fill_share"] == pytest.approx(1 / 18) and row["drafter_share"] == pytest.approx(1 / 18)
    assert row["shed_share"] == pytest.approx(1 / 20) and row["internal_errors"] == 1
    assert row["client_p99_ms"] < 100.0  # the 500 ms answers outside the window are not its
    assert row["server_p99_ms"] == 29.0 and row["cpu"] == 1


def test_recovery_is_answers_served_as_with_no_fault_auto_choosing_the_drafter_included():
    fallback = [dict(rec(1.0 + 0.1 * i, "drafter"), degraded=True) for i in range(3)]  # the verifier still down
    chosen = [dict(rec(1.3 + 0.1 * i, "drafter"), degraded=False) for i in range(5)]  # auto's own tier
    assert chaos_services.recovery_s(fallback + chosen, 1.0, 5) == pytest.approx(0.3)
    filled = [rec(1.3 + 0.1 * i, "beam", fill=True) for i in range(5)]
    filled = [dict(r, served_by="fill") for r in filled]
    assert math.isnan(chaos_services.recovery_s(fallback + filled, 1.0, 5))  # the catalogue's fill is no recovery
    assert chaos_services.recovery_s([rec(2.0 + 0.1 * i) for i in range(5)], 1.0, 5) == pytest.approx(1.0)


def test_machine_keys_and_cpu_shares():
    rows = [{"scenario": s, **{f: 0.5 for f in chaos_machine.MACHINE_FIGURES}}
            for s in ("baseline", "cpu-hog", "one-core")]
    keys = chaos_machine.machine_keys(rows)
    assert set(keys) == {f"chaos.{s}.{f}" for s in ("cpu_hog", "one_core") for f in chaos_machine.MACHINE_FIGURES}
    assert summary_keys.keys_without_writer(keys) == []
    shares = chaos_machine.cpu_shares({"hog": 1.0, "verifier": 2.0, "gone": None}, {"hog": 10.5, "verifier": 6.0}, 10.0)
    assert shares == {"hog": 0.95, "verifier": 0.4}


def result(machine_faults: dict) -> dict:
    return {"command": "python -m bench.chaos", "run": "today", "users": "users", "machine": "2 CPUs",
            "budget_ms": 100.0, "rate": 10.0, "flood_x": 2.0, "streak": 5, "scenarios": [],
            "capacity_rps": float("nan"), "machine_faults": machine_faults}


def test_a_fault_of_the_machine_run_alone_writes_its_keys_and_no_other_scenarios(tmp_path):
    (tmp_path / "summary.json").write_text(json.dumps({"chaos.recovery_s_max": 2.2, "chaos.catalogue_items_lost": 0,
                                                       "chaos.cpu_hog.model_answer_share": 0.0}))
    server = {"server_p99_ms": 29.0, "server_p99_bucket_ms": [25.0, 30.0]}
    row = chaos_machine.machine_row("cpu-hog", [rec(10.0 + 0.01 * i) for i in range(50)], 10.0, 11.0, server,
                                    {"cpu": 1, "cpu_share": {}})
    mf = {"names": ["cpu-hog"], "rows": [row], "budget_ms": 30.0, "rate": 20.0, "capacity_rps": 40.0, "cpu": 1}
    summary = chaos.write_results(tmp_path, result(mf))
    written = json.loads((tmp_path / "summary.json").read_text())
    assert written["chaos.cpu_hog.server_p99_ms"] == 29.0 and written["chaos.cpu_hog.undegraded_share"] == 1.0
    assert "chaos.cpu_hog.model_answer_share" not in written  # retired: it could not move with the fault
    assert written["chaos.recovery_s_max"] == 2.2  # the other scenarios did not run: their keys are left alone
    assert "chaos.model_answer_share_during_faults" not in summary and "chaos.internal_errors" not in summary
    assert "| cpu-hog | 1 |" in (tmp_path / "chaos.md").read_text()
    assert "cpu-hog" in (tmp_path / "README.md").read_text()


def test_a_fault_of_the_machine_skipped_retires_its_keys(tmp_path):
    old = {f"chaos.one_core.{f}": 1.0 for f in chaos_machine.MACHINE_FIGURES} | {"chaos.cpu_hog.server_p99_ms": 25.0}
    (tmp_path / "summary.json").write_text(json.dumps(old))
    mf = {"names": ["one-core"], "rows": [], "budget_ms": 30.0, "skipped": "one-core skipped: 1 CPU"}
    chaos.write_results(tmp_path, result(mf))
    written = json.loads((tmp_path / "summary.json").read_text())
    assert not [k for k in written if k.startswith("chaos.one_core.")]
    assert written["chaos.cpu_hog.server_p99_ms"] == 25.0  # not asked for in this run: left alone
    assert "one-core skipped: 1 CPU" in (tmp_path / "chaos.md").read_text()
    assert math.isnan(chaos_machine.machine_row("x", [], 0.0, 1.0, {}, {})["undegraded_share"])


# -- the phase, against a fake gateway ----------------------------------------------------------------
@dataclass
class FakeProcs:
    """What the phase reads of a ServiceProcs: addresses, processes, replica keys, metrics ports."""

    ports: dict[str, int]
    metrics_ports: dict[str, int]
    procs: dict[str, subprocess.Popen]

    def addr(self, name: str) -> str:
        return f"127.0.0.1:{self.ports[name]}"

    def keys(self, name: str) -> list[str]:
        return [name]


@pytest.fixture
def fake_stack():
    with fake_gateway(drafter_every=5) as (port, mport):
        verifier = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
        try:
            yield FakeProcs({"gateway": port}, {"gateway": mport}, {"verifier": verifier})
        finally:
            verifier.kill()
            verifier.wait()


def test_the_machine_phase_measures_each_window_and_puts_the_verifier_back(fake_stack, monkeypatch):
    cpus = usable()
    if len(cpus) < 2:
        pytest.skip("needs two CPUs")
    monkeypatch.setattr(chaos_machine, "measure_capacity", lambda target, users, budget_ms: 40.0)  # no closed loop
    monkeypatch.setattr(chaos_machine, "Hog", lambda cpu: Hog(cpu, code="import time\ntime.sleep(60)\n"))  # no spin
    a = argparse.Namespace(machine_budget_ms=30.0, machine_load=0.5, machine_fault_s=0.6, settle_s=0.2, fault_cpu=None,
                           seed=0)
    users = Users([["a"], ["b"]], [], ["x", "y"], "two users")
    res = chaos_machine.run_machine_phase(a, fake_stack, users, ["cpu-hog", "one-core"])
    rows = {r["scenario"]: r for r in res["rows"]}
    assert list(rows) == ["baseline", "cpu-hog", "one-core"] and res["rate"] == 20.0 and res["cpu"] == cpus[-1]
    for r in rows.values():
        assert r["requests"] > 0 and r["gr_ranked_share"] < 1.0  # the drafter's lists are not the model's
        assert r["server_count"] > 0 and 10.0 < r["server_p99_ms"] <= 15.0  # the fake's 12 ms, in its bucket
        assert r["fill_share"] == 0.0 and "server_error" not in r
    assert {f"hog{c}" for c in cpus} <= set(rows["cpu-hog"]["cpu_share"])  # a hog on every CPU of the path
    assert not [n for n in rows["baseline"]["cpu_share"] if n.startswith("hog")]
    assert rows["one-core"]["path_cpus"] == [cpus[-1]]  # confined while its window lasted
    for name in ("cpu-hog", "one-core"):  # the same users asked again with no fault: the reference
        assert 0.0 <= rows[name]["recall@10_no_fault"] <= 1.0 and "users" not in rows[name]
    assert {frozenset(c) for c in affinity(fake_stack.procs["verifier"].pid).values()} == {frozenset(cpus)}  # back
    assert [w[0] for w in res["windows"]] == ["cpu-hog", "one-core"]
    assert set(chaos_machine.machine_keys(res["rows"])) == {f"chaos.{s}.{f}" for s in ("cpu_hog", "one_core")
                                                            for f in chaos_machine.MACHINE_FIGURES}
