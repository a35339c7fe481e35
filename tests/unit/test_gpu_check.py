"""What ``bench.gpu_check`` makes of a GPU run without a GPU: the one tie check behind every equality key, the
capacity that counts only a rate achieved, phases under budgets whose results are written as each ends (a signal
included), and ``--merge``, which publishes only clean captured runs (issue 65)."""

from __future__ import annotations

import asyncio
import json
import re
import signal
import time
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

from bench import gpu_check
from bench.harness import Users

ROOT = Path(__file__).resolve().parents[2]
K = 3


def lists(items, scores) -> dict:
    return {"items": np.asarray(items, np.int64), "scores": np.asarray(scores, float)}


# -- the tie check -------------------------------------------------------------------------------------------------
def test_an_empty_or_short_list_is_never_a_tie():
    """Nothing compared is nothing explained: the old check said "tie" for two empty lists."""
    empty = np.full(K, np.nan)
    assert not gpu_check.tie_explained(empty, empty)
    assert not gpu_check.tie_explained(np.array([]), np.array([]))
    assert not gpu_check.tie_explained(np.array([-1.0, -2.0, np.nan]), np.array([-1.0, -2.0, np.nan]))
    assert not gpu_check.tie_explained(np.array([-1.0, -2.0]), np.array([-1.0, -2.0, -3.0]))


def test_a_tie_is_equal_scores_at_every_rank():
    a = np.array([-1.0, -2.0, -2.0])
    assert gpu_check.tie_explained(a, a + 0.5 * gpu_check.TIE_NATS)
    assert not gpu_check.tie_explained(a, a + np.array([0, 0, 10 * gpu_check.TIE_NATS]))


def test_one_comparison_behind_every_equality_key():
    """Rows: identical; swapped at a tie; swapped with scores apart; identical but short; empty in both. Only the
    first two pass: the share equal is 1/5 and three rows fail."""
    a = lists([[1, 2, 3], [1, 2, 3], [1, 2, 3], [1, 2, -1], [-1, -1, -1]],
              [[-1, -2, -3], [-1, -2, -2], [-1, -2, -3], [-1, -2, np.nan], [np.nan] * 3])
    b = lists([[1, 2, 3], [1, 3, 2], [1, 3, 2], [1, 2, -1], [-1, -1, -1]],
              [[-1, -2, -3], [-1, -2, -2], [-1, -2.5, -3], [-1, -2, np.nan], [np.nan] * 3])
    equal, failed = gpu_check.compare(a, b)
    assert equal == pytest.approx(1 / 5) and failed == [2, 3, 4]
    assert gpu_check.rows_of(a, 2)["items"].shape == (2, K)
    # every equality key is made by it: each check names its policy and its reference, with its failed rows' count
    assert [(pol, ref) for _, pol, ref in gpu_check.CHECKS] == [("beam", "eager"), ("strict", "beam"),
                                                               ("beam", "cpu")]


# -- the capacity ----------------------------------------------------------------------------------------------------
def test_a_rate_is_held_only_when_it_was_achieved():
    assert gpu_check.rate_held(1000, 990, 5.0)
    assert not gpu_check.rate_held(1000, 900, 5.0)  # 10% short: 300 arrivals short of 5,000, 7 sigma
    assert gpu_check.rate_held(5, 4.2, 1.5)  # 7.5 arrivals: a Poisson count that short is noise
    assert not gpu_check.rate_held(1000, float("nan"), 5.0) and not gpu_check.rate_held(0, 0, 5.0)


def test_the_capacity_counts_only_the_rate_achieved(monkeypatch):
    """A load generator that sent 4,000 requests/s at 1,900 (answers perfect, fast, by the model): that rate did not
    pass, and the capacity is the rate achieved at the highest that did, not its target."""
    import bench.serving_phases as phases
    import specrec.policies as policies

    achieved = {300.0: 299.0, 1000.0: 1001.0, 2000.0: 1990.0, 4000.0: 1900.0}

    async def closed_loop(*args, **kw):
        return []

    async def open_loop(target, users, policy, k, budget_ms, rate, seconds, warmup, seed):
        return [{"send_lag_ms": 0.1}], int(rate * seconds), achieved[rate]

    def summarise(answers, hits, sent, *a, **kw):
        return {"gr_ranked_share": 1.0, "answered": sent, "p99_ms": 12.0, "recall@10": 0.1, "served_by": {"fused": 1}}

    monkeypatch.setattr(phases, "closed_loop", closed_loop)
    monkeypatch.setattr(phases, "open_loop", open_loop)
    monkeypatch.setattr(phases, "summarise", summarise)
    monkeypatch.setattr(policies, "make_policy", lambda *a, **kw: None)
    monkeypatch.setattr(gpu_check, "lists_of", lambda pol, users, k: (np.zeros((2, k), np.int64), None))
    monkeypatch.setattr(gpu_check, "target_rows", lambda bundle, users: np.ones(2, np.int64))
    stack = SimpleNamespace(addr=lambda name: "127.0.0.1:1", metrics_url=lambda name: "http://127.0.0.1:1/metrics")
    bundle = SimpleNamespace(engine=lambda **kw: None, backend=lambda *a, **kw: None)
    users = Users([["1"], ["2"]], [np.array([1]), np.array([2])], ["3", "4"], "2 users")
    a = SimpleNamespace(device="cpu", rates="300,1000", capacity_rates="2000,4000", seconds=5.0, seed=0)
    keys: dict = {}
    rows: list = []
    gpu_check.gateway_load(stack, bundle, users, a, keys, rows)
    assert [r["pass"] for r in rows] == [True, True, True, False]
    assert keys["gpu.gateway.capacity_rps"] == 1990.0


# -- phases under budgets, results written as each ends -----------------------------------------------------------
def a_run(tmp_path, **budgets) -> gpu_check.Run:
    argv = ["--cpu", "--out", str(tmp_path), "--budgets", ",".join(f"{p}={s}" for p, s in budgets.items())]
    return gpu_check.Run(gpu_check.parse(argv), argv, tmp_path)


def test_a_phase_past_its_budget_keeps_what_it_measured_and_the_next_runs(tmp_path):
    run = a_run(tmp_path, inprocess=0.3)

    def slow():
        run.keys["gpu.cuda.beam.k10.p50_ms"] = 1.5  # measured before the budget ran out
        time.sleep(5)

    t0 = time.perf_counter()
    assert run.phase("inprocess", slow) is None
    assert time.perf_counter() - t0 < 3
    assert run.phase("verifier", lambda: run.keys.update({"gpu.verifier.rank_rps": 9.0}) or "done") == "done"
    res = json.loads((tmp_path / "gpu_check.json").read_text())
    assert "past its budget of 0.3 s" in res["errors"]["inprocess"] and "verifier" not in res["errors"]
    assert res["keys_of"] == {"inprocess": ["gpu.cuda.beam.k10.p50_ms"], "verifier": ["gpu.verifier.rank_rps"]}
    assert json.loads((tmp_path / "gpu_keys.json").read_text())["gpu.cuda.beam.k10.p50_ms"] == 1.5


@pytest.fixture
def stop_on_signals():
    """The run's signal handlers, put back as they were (and the stops they recorded forgotten) afterwards."""
    gpu_check.stop_on_signals()
    yield
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    signal.signal(signal.SIGHUP, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    gpu_check.STOPS.clear()


def test_a_signal_in_a_phase_writes_what_was_measured_and_stops_the_run(tmp_path, stop_on_signals):
    run = a_run(tmp_path)
    run.phase("cuda_tests", lambda: run.keys.update({"gpu.cuda_tests.passed": 20}))

    def stopped():
        run.keys["gpu.train.epoch_s"] = 3.0
        signal.raise_signal(signal.SIGTERM)

    with pytest.raises(gpu_check.Stopped):
        run.phase("train", stopped)
    res = json.loads((tmp_path / "gpu_check.json").read_text())
    assert res["interrupted"] == "signal 15 (SIGTERM) during phase train"
    assert res["keys"]["gpu.cuda_tests.passed"] == 20 and res["keys"]["gpu.train.epoch_s"] == 3.0
    assert "Interrupted" in (tmp_path / "gpu_check.md").read_text()


def test_a_signal_in_an_event_loops_callback_stops_the_phase(tmp_path, stop_on_signals):
    """The verifier phase runs an asyncio loop, which logs and drops any exception raised in a callback but
    SystemExit and KeyboardInterrupt: a SIGTERM landing in one must still stop the phase (CI, 2026-12-07: the dry
    run's interrupted copy ran to its end and exited 0)."""
    run = a_run(tmp_path)
    ran_on = []

    async def loop_with_a_callback():
        loop = asyncio.get_running_loop()
        loop.call_soon(signal.raise_signal, signal.SIGTERM)
        await asyncio.sleep(0.2)
        ran_on.append("the loop went on after the signal")

    with pytest.raises(gpu_check.Stopped):
        run.phase("verifier", lambda: asyncio.run(loop_with_a_callback()))
    assert not ran_on
    res = json.loads((tmp_path / "gpu_check.json").read_text())
    assert res["interrupted"] == "signal 15 (SIGTERM) during phase verifier"


@pytest.mark.parametrize("as_another", [False, True], ids=["dropped", "turned into another exception"])
def test_a_stop_whose_exception_was_lost_stops_the_run_as_the_phase_ends(tmp_path, stop_on_signals, as_another):
    run = a_run(tmp_path)

    def swallows():
        try:
            signal.raise_signal(signal.SIGTERM)
        except BaseException:  # noqa: BLE001 - what a library's callback may do
            if as_another:
                raise RuntimeError("the call failed") from None
        run.keys["gpu.verifier.rank_rps"] = 9.0
        return "done"

    with pytest.raises(gpu_check.Stopped):
        run.phase("verifier", swallows)
    res = json.loads((tmp_path / "gpu_check.json").read_text())
    assert res["interrupted"] == "signal 15 (SIGTERM) during phase verifier" and "verifier" in res["errors"]
    with pytest.raises(gpu_check.Stopped):  # and no later phase starts
        run.phase("train", lambda: pytest.fail("a phase ran after the run was told to stop"))


def test_a_signal_before_the_stacks_phase_returns_still_stops_the_stack(tmp_path, monkeypatch, stop_on_signals):
    """SIGTERM while the stack's phase writes its files (the stack up, the phase not yet returned): the run still
    stops the services it started, says so, and exits 143."""
    stopped = []
    fake = SimpleNamespace(procs=SimpleNamespace(procs={"verifier": SimpleNamespace(pid=123)}),
                           stop=lambda say=None: stopped.append("stack"))
    monkeypatch.setattr(gpu_check, "start_stack", lambda *args: fake)
    monkeypatch.setattr(gpu_check, "verifier_load", lambda *args: pytest.fail("the verifier phase ran"))
    write = gpu_check.Run.write

    def write_then_signal(self):
        write(self)
        if "stack" in self.res["seconds"] and not gpu_check.STOPS:
            signal.raise_signal(signal.SIGTERM)

    monkeypatch.setattr(gpu_check.Run, "write", write_then_signal)
    rc = gpu_check.main(["--cpu", "--phases", "verifier", "--users", "3", "--out", str(tmp_path)])
    res = json.loads((tmp_path / "gpu_check.json").read_text())
    assert rc == 143 and stopped == ["stack"]
    assert res["interrupted"] == "signal 15 (SIGTERM) between phases" and res["phases"]["stack"] == "stopped"
    assert res["service_pids"] == {"verifier": 123}


def test_the_device_scripts_limit_is_the_phases_budgets_and_the_slack():
    script = (ROOT / "bench" / "device_check.sh").read_text()
    limit = float(re.search(r"RUN_LIMIT_S=\$\{RUN_LIMIT_S:-(\d+)\}", script).group(1))
    assert limit == sum(gpu_check.BUDGET_S.values()) + gpu_check.RUN_SLACK_S
    assert limit + 30 <= 8 * 60  # the whole run, the carried packages installed first, inside 8 minutes
    assert list(gpu_check.BUDGET_S) == list(gpu_check.PHASES) and gpu_check.PHASES[0] == "cuda_tests"


# -- publishing ------------------------------------------------------------------------------------------------------
def a_result(path: Path, phases=gpu_check.PHASES, errors=None, device="NVIDIA H100 80GB HBM3", eager=0,
             dry_run=False, value=1.0) -> Path:
    path.mkdir(parents=True)
    keys = {"gpu.device": device, **{f"gpu.{p}.figure": value for p in phases}}
    keys_of = {p: [f"gpu.{p}.figure"] for p in phases}
    if "inprocess" in phases:
        keys["gpu.cuda.searches_eager"] = eager
        keys_of["inprocess"].append("gpu.cuda.searches_eager")
    res = {"dry_run": dry_run, "seconds": {p: 1.0 for p in phases}, "errors": errors or {}, "keys": keys,
           "keys_of": keys_of, "interrupted": None}
    (path / "gpu_check.json").write_text(json.dumps(res))
    (path / "gpu_keys.json").write_text(json.dumps(keys))
    return path


@pytest.fixture()
def results(tmp_path, monkeypatch):
    import specrec.eval.results as results_mod

    monkeypatch.setattr(results_mod, "RESULTS_DIR", tmp_path / "results")
    (tmp_path / "results").mkdir()
    (tmp_path / "results" / "summary.json").write_text(json.dumps({"gpu.stale": 1, "beauty.x": 2}))
    return tmp_path / "results"


@pytest.mark.parametrize("bad, why", [
    (dict(errors={"gateway": "Traceback...\nRuntimeError: the stack died"}), "phase gateway of"),
    (dict(errors={"train": "interrupted by signal 15 (SIGTERM) after 3 s"}), "interrupted by signal 15"),
    (dict(errors={"inprocess": "ran past its budget of 130 s (what it measured before is kept)"}), "past its budget"),
    (dict(eager=2), "2 searches fell back to eager in process"),
    (dict(phases=gpu_check.PHASES[:-1]), "phase train ran in none"),
    (dict(dry_run=True), "dry run"),
])
def test_merge_refuses_what_is_not_a_clean_captured_run(tmp_path, results, bad, why):
    src = a_result(tmp_path / "run", **bad)
    with pytest.raises(SystemExit, match=why):
        gpu_check.merge([src])
    assert json.loads((results / "summary.json").read_text()) == {"gpu.stale": 1, "beauty.x": 2}


def test_merge_takes_each_phase_from_the_last_run_that_ran_it(tmp_path, results):
    first = a_result(tmp_path / "run", errors={"train": "ran past its budget of 40 s"}, value=1.0)
    rerun = a_result(tmp_path / "rerun", phases=("train",), value=2.0)
    assert gpu_check.merge([first, rerun]) == 0
    summary = json.loads((results / "summary.json").read_text())
    assert summary["gpu.train.figure"] == 2.0 and summary["gpu.inprocess.figure"] == 1.0
    assert "gpu.stale" not in summary and summary["beauty.x"] == 2
    assert summary["gpu.device"] == "NVIDIA H100 80GB HBM3"
    assert (results / "gpu" / "gpu_check_run1.json").exists() and (results / "gpu" / "gpu_check_run2.json").exists()
    other = a_result(tmp_path / "h200", phases=("train",), device="NVIDIA H200")
    with pytest.raises(SystemExit, match="different GPUs"):
        gpu_check.merge([first, other])


def test_what_the_device_run_carries_brings_what_it_needs():
    """Every package a carried one requires (on the GPU machine's Python 3.12, Linux; extras aside) is carried too, at
    the version this checkout runs: the carried pydantic needs a typing-extensions newer than the GPU image may have."""
    from importlib.metadata import requires, version

    from packaging.requirements import Requirement
    from packaging.utils import canonicalize_name

    script = (ROOT / "bench" / "device_check.sh").read_text()
    carried = {canonicalize_name(w) for w in re.search(r"^WHEELS=\(([^)]*)\)", script, re.MULTILINE).group(1).split()}
    there = {"python_version": "3.12", "python_full_version": "3.12.3", "sys_platform": "linux",
             "platform_system": "Linux", "platform_machine": "x86_64", "implementation_name": "cpython", "extra": ""}
    for name in sorted(carried):
        for line in requires(name) or []:
            req = Requirement(line)
            if req.marker is None or req.marker.evaluate(there):
                assert canonicalize_name(req.name) in carried, f"{name} needs {req}, which is not carried"
                assert version(req.name) in req.specifier, f"{name} needs {req}; this checkout runs {version(req.name)}"


def test_the_procedure_page_gives_each_phases_budget():
    doc = (ROOT / "docs" / "gpu-check.md").read_text()
    for phase, budget in gpu_check.BUDGET_S.items():
        assert f"| `{phase}` | {budget:g} |" in doc, phase
    assert f"at {sum(gpu_check.BUDGET_S.values()) + gpu_check.RUN_SLACK_S:g} s" in doc
