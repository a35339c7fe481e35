"""The cost model (specrec.costs): a policy's costs here are learned by running requests on the in-process
engine (a fake clock that the verifier's calls advance), never set by hand; the tail estimator, and the
costs the gateway feeds it (a service's time per request), are given fake streams of known data."""

from __future__ import annotations

import threading
from statistics import NormalDist

import numpy as np
import pytest

from specrec.costs import CostModel, CostStage, Resource, TailEstimate, resource_of
from specrec.deadline import Deadline
from specrec.policies import RecRequest, make_policy

from .policy_fixtures import histories, make_engine, slow_calls


def fake_clock(eng, start: float = 0.0) -> list[float]:
    t = [start]
    eng.clock = lambda: t[0]
    return t


def test_stage_costs_are_kept_per_policy_under_enum_names():
    """beam and specgr time the same verifier call (a beam step) as different stages of their own."""
    eng = make_engine(3)
    t = fake_clock(eng)
    slow_calls(eng, t, {"beam_step": 0.01, "score_step": 0.03})
    h = histories(eng, 1, 3)[0]
    make_policy("beam", eng).run([RecRequest(h, 5)])
    make_policy("specgr", eng, delta=5, gamma=0.0).run([RecRequest(h, 5)])
    costs = eng.costs
    assert costs.stage("beam", CostStage.SEARCH) == pytest.approx(0.04)  # 4 levels of 10 ms, one call
    assert costs.stage("specgr", CostStage.SEARCH) is None and costs.stage("beam", CostStage.ROUND) is None
    assert costs.stage("specgr", CostStage.VERIFY) == pytest.approx(0.03)  # one call: the pass and the step
    # a round is one verify-and-step call (30 ms), or a step alone where drafting found nothing new (10 ms)
    assert 0.01 <= costs.stage_mean("specgr", CostStage.ROUND) <= 0.03 + 1e-9  # (a fake clock: float sums)
    assert CostStage("round") is CostStage.ROUND  # the stage names are one Enum


def test_the_budget_hook_reads_what_running_taught():
    eng = make_engine(4)
    t = fake_clock(eng)
    slow_calls(eng, t, {"score_step": 0.02, "beam_step": 0.02})
    pol = make_policy("specgr", eng, delta=5, gamma=0.0)
    assert pol.costs.fits(Deadline(t[0] + 1e-6), CostStage.ROUND)  # nothing measured yet: costs 0
    pol.run([RecRequest(histories(eng, 1, 4)[0], 5)])
    assert not pol.costs.fits(Deadline(t[0] + 0.019), CostStage.ROUND)
    assert pol.costs.fits(Deadline(t[0] + 0.021), CostStage.ROUND)
    assert pol.costs.fits(None, CostStage.ROUND)


def timed_runs(eng, t):
    """run(seconds, k): one beam request of list length k that takes ``seconds`` on the fake clock (in the encode)."""
    h = histories(eng, 1, 5)[0]
    pol = make_policy("beam", eng)
    real = eng.verifier.encode

    def run(seconds: float, k: int = 5) -> None:
        def slow(*a, **kw):
            t[0] += seconds
            return real(*a, **kw)

        eng.verifier.encode = slow
        try:
            pol.run([RecRequest(h, k)])
        finally:
            eng.verifier.encode = real

    return run


def test_request_costs_are_a_tail_and_a_relearn_replaces_them():
    eng = make_engine(5)
    t = fake_clock(eng)
    run = timed_runs(eng, t)
    run(0.01)
    assert eng.costs.tail("beam", 5) == pytest.approx(0.01)  # one request: its own time
    run(0.10)  # one slow request: few samples read as the largest, not a mean nudged a tenth of the way
    assert eng.costs.tail("beam", 5) == pytest.approx(0.10)
    eng.costs.relearn("beam")  # what auto does before it probes a stale tier
    run(0.05)
    assert eng.costs.tail("beam", 5) == pytest.approx(0.05)  # replaced
    assert eng.costs.tail("strict", 5) is None


def test_a_relearn_drops_the_policys_stage_estimates_so_its_probe_runs_every_stage():
    """A probe of a stale tier must measure its stages again: a stage whose stale mean does not fit would be
    skipped by every probe (fused answering its drafter's list for good) and never measured again."""
    costs = CostModel()
    costs.observe_stage("fused", CostStage.ROUND, 0.5)
    costs.observe_stage("beam", CostStage.ROUND, 0.5)
    fused = costs.for_policy("fused", clock=lambda: 0.0)
    deadline = Deadline(0.1)
    assert not fused.fits(deadline, CostStage.ROUND)  # the stale, slow round does not fit 0.1 s
    costs.relearn("fused")
    assert fused.fits(deadline, CostStage.ROUND) and costs.stage("fused", CostStage.ROUND) is None
    assert costs.stage("beam", CostStage.ROUND) == pytest.approx(0.5)  # another policy's are its own
    fused.observe(CostStage.ROUND, 0.02)
    assert costs.stage_mean("fused", CostStage.ROUND) == pytest.approx(0.02)


def test_request_costs_are_kept_per_list_length_with_the_policy_across_k_until_one_is_measured():
    eng = make_engine(5)
    t = fake_clock(eng)
    run = timed_runs(eng, t)
    for _ in range(5):
        run(0.01, k=5)
    assert eng.costs.tail("beam", 50) == pytest.approx(0.01)  # K = 50 not measured yet: beam across every K
    run(0.04, k=50)
    assert eng.costs.tail("beam", 50) == pytest.approx(0.04)  # its own now
    assert eng.costs.tail("beam", 5) == pytest.approx(0.01)  # K = 50's cost does not leak into K = 5's
    assert eng.costs.tail("beam", 20) == pytest.approx(normal_p99([0.01] * 4 + [0.04]))  # across every K: six so far
    assert eng.costs.tail("beam") == eng.costs.tail("beam", 20)
    eng.costs.relearn("beam")  # a probe replaces every K's estimate: all of them were learned on the old machine
    run(0.02, k=5)
    assert eng.costs.tail("beam", 50) == pytest.approx(0.02) and eng.costs.tail("beam", 5) == pytest.approx(0.02)


def test_a_batch_counts_for_its_largest_list_length():
    costs = CostModel()
    eng = make_engine(5)
    eng.costs = costs
    t = fake_clock(eng)
    slow_calls(eng, t, {"search": 0.03})
    h = histories(eng, 2, 5)
    make_policy("beam", eng).run([RecRequest(h[0], 5), RecRequest(h[1], 9)])
    assert costs.tail("beam", 9) == pytest.approx(0.015)  # 30 ms for two requests
    assert costs.tail("beam", 5) == pytest.approx(0.015)  # K = 5 has none of its own: across every K


def test_a_failed_request_still_teaches_its_cost():
    eng = make_engine(6)
    t = fake_clock(eng)

    def down(*a, **kw):
        t[0] += 0.3
        raise RuntimeError("verifier gone")

    eng.verifier.search = down
    with pytest.raises(RuntimeError):
        make_policy("beam", eng).run([RecRequest(histories(eng, 1, 6)[0], 5)])
    assert eng.costs.tail("beam", 5) == pytest.approx(0.3)


def test_auto_keeps_its_probe_timer_in_the_cost_model():
    eng = make_engine(7)
    t = fake_clock(eng, 50.0)
    auto = make_policy("auto", eng)
    h = histories(eng, 1, 7)[0]
    assert auto.choose(RecRequest(h, 5, deadline=t[0] + 1.0)) in ("beam", "strict")
    name = auto.choose(RecRequest(h, 5, deadline=t[0] + 1.0))
    assert eng.costs.last_tried(name, now=99.0) == 50.0
    assert not any("@" in k or k == "relearn" for o in eng.online.values() for k in o.rates)


def test_resource_costs_and_which_resource_a_policy_uses():
    costs = CostModel(resource_start={Resource.VERIFIER: 0.004, Resource.DRAFTER: 0.002})
    assert resource_of("drafter") is Resource.DRAFTER and resource_of("specgr") is Resource.VERIFIER
    assert costs.resource(Resource.VERIFIER) == 0.004  # the start value until one was measured
    for ms in [5.0] * 150 + [20.0]:
        costs.observe_resource(Resource.VERIFIER, ms / 1000)
    assert costs.resource(Resource.VERIFIER) == pytest.approx(0.005)  # one slow request in 151: not the p99's
    for _ in range(2):
        costs.observe_resource(Resource.VERIFIER, 0.020)
    assert costs.resource(Resource.VERIFIER) == pytest.approx(0.020)  # three in 153 (2%): the p99 is theirs
    assert costs.resource(Resource.DRAFTER) == pytest.approx(0.002)


def test_a_reset_forgets_every_estimate_and_the_next_ones_are_learned_afresh():
    """What the gateway does after its cold warm-up requests: their times (seconds, a first call's) are no policy's
    cost, and must not hold a tier out of the first requests' budgets."""
    costs = CostModel()
    for s in (2.0, 0.020, 0.021):  # a cold first call, then two warm ones
        costs.observe_request("fused", s, 10)
        costs.observe_stage("fused", CostStage.VERIFY, s)
        costs.observe_resource(Resource.VERIFIER, s)
    costs.tried("fused", 1.0)
    assert costs.tail("fused", 10) > 0.021 and costs.stage_mean("fused", CostStage.VERIFY) > 0.6
    costs.reset()
    assert costs.tail("fused", 10) is None and costs.tail("fused") is None
    assert costs.stage("fused", CostStage.VERIFY) is None and costs.stage_mean("fused", CostStage.VERIFY) is None
    assert costs.resource(Resource.VERIFIER) == 0.004 and costs.resource_mean(Resource.VERIFIER) == 0.004
    assert costs.last_tried("fused", now=5.0) == 5.0  # the probe timer starts again
    for s in (0.020, 0.022, 0.021):
        costs.observe_request("fused", s, 10)
    assert 0.021 <= costs.tail("fused", 10) < 0.03  # the warm ones alone


def test_the_budget_hook_reads_a_stages_window_mean_and_its_tail_is_kept_beside_it():
    costs = CostModel()
    for ms in [10.0] * 149 + [30.0] * 3:
        costs.observe_stage("specgr", CostStage.ROUND, ms / 1000)
    pol = costs.for_policy("specgr", clock=lambda: 1.0)
    mean = (149 * 0.010 + 3 * 0.030) / 152
    assert pol.estimate(CostStage.ROUND) == pytest.approx(mean)
    assert costs.stage("specgr", CostStage.ROUND) == pytest.approx(0.030)  # 3 in 152 past 10 ms: the p99 is theirs
    assert pol.fits(Deadline(1.0 + 0.011), CostStage.ROUND)  # one more round fits on its mean (10.4 ms)
    assert not pol.fits(Deadline(1.0 + 0.010), CostStage.ROUND)
    assert pol.estimate(CostStage.DRAFT) == 0.0 and not pol.measured(CostStage.DRAFT)


def test_engines_on_worker_threads_share_one_model():
    """Requests on several threads, each on its own engine, all teach one CostModel (its lock)."""
    shared = CostModel()
    engines = [make_engine(20 + i) for i in range(4)]
    for eng in engines:
        eng.costs = shared
    errors: list[BaseException] = []

    def work(eng):
        try:
            for h in histories(eng, 6, 1):
                make_policy("specgr", eng, delta=5).run([RecRequest(h, 5)])
                make_policy("beam", eng).run([RecRequest(h, 5)])
        except BaseException as e:  # pragma: no cover - reported below
            errors.append(e)

    threads = [threading.Thread(target=work, args=(eng,)) for eng in engines]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    assert not errors
    for policy, stage in (("specgr", CostStage.ROUND), ("specgr", CostStage.VERIFY), ("beam", CostStage.SEARCH)):
        cost = shared.stage(policy, stage)
        assert cost is not None and np.isfinite(cost) and cost > 0
    assert all(shared.tail(p, 5) is not None for p in ("specgr", "beam"))


# -- the tail estimator, on fake streams ----------------------------------------------------------------


def test_the_tail_is_the_exact_quantile_of_known_data():
    est = TailEstimate(q=0.99, window=200)
    rng = np.random.default_rng(0)
    for x in rng.permutation(np.arange(1, 201)):  # 1..200 in any order
        est.observe(float(x))
    # sorted, position 199 * 0.99 = 197.01: a hundredth of the way from the 198th value to the 199th
    assert est.tail() == pytest.approx(198.01) and est.mean() == pytest.approx(100.5) and est.count == 200
    med = TailEstimate(q=0.5, window=4)
    for x in (4.0, 1.0, 3.0, 2.0):
        med.observe(x)
    assert med.tail() == pytest.approx(2.5)
    # random data: numpy's default (linear) quantile, to the last bit
    for q, n in ((0.99, 150), (0.95, 200), (0.9, 37)):
        est = TailEstimate(q=q, window=200)
        data = rng.lognormal(-4.0, 0.5, n)
        for x in data:
            est.observe(x)
        assert est.tail() == pytest.approx(float(np.quantile(data, q)), rel=1e-12)


def normal_p99(xs):
    """What a short sample reads as: the p99 of a normal fitted robustly (median, 1.4826 x median abs. deviation)."""
    med = float(np.median(xs))
    return med + NormalDist().inv_cdf(0.99) * 1.4826 * float(np.median(np.abs(np.asarray(xs) - med)))


def test_few_samples_read_as_a_normal_fitted_to_them():
    est = TailEstimate(q=0.99, window=200)
    assert est.tail() is None and est.mean() is None and est.min_samples == 100
    est.observe(0.010)
    assert est.tail() == 0.010  # one sample: itself
    rng = np.random.default_rng(1)
    data = [0.010] + list(rng.uniform(0.005, 0.015, 98))
    for x in data[1:]:
        est.observe(x)
    assert est.count == 99 and est.tail() == pytest.approx(normal_p99(data[1:]))  # 99 < 1 / (1 - 0.99)
    est.observe(0.006)
    data.append(0.006)
    assert est.tail() == pytest.approx(float(np.quantile(data, 0.99))) and est.tail() < max(data)
    assert TailEstimate(q=0.999, window=200).min_samples == 200  # the window can never resolve a p99.9
    cold = TailEstimate(q=0.99, window=200)
    for x in (2.0, 0.010, 0.012, 0.011):  # a first call that loaded a graph, then the stage's own cost
        cold.observe(x)
    assert cold.tail() == pytest.approx(normal_p99([0.010, 0.012, 0.011])) and cold.tail() < 0.02  # not 2 s
    few = TailEstimate(q=0.99, window=200)
    for x in (0.010, 0.020, 0.021, 0.019, 0.060, 0.020):  # one slow call among a few: counted, not the tail
        few.observe(x)
    assert few.tail() == pytest.approx(normal_p99([0.020, 0.021, 0.019, 0.060, 0.020])) and few.tail() < 0.025
    est.reset()
    assert est.tail() is None and est.count == 0
    est.observe(0.5)
    assert est.tail() == 0.5


def test_the_window_follows_a_machine_that_slows_down_and_forgets_the_old_one():
    """A machine 2x slower from one observation on: the p99 over 200 is one of the slow values from the
    third on (the window's two largest alone do not move it), and after 200 nothing of the old one is left."""
    rng = np.random.default_rng(2)
    est = TailEstimate(q=0.99, window=200)
    fast = rng.uniform(0.010, 0.020, 200)
    for x in fast:
        est.observe(x)
    before = est.tail()
    assert before == pytest.approx(float(np.quantile(fast, 0.99)))
    slow = 2.0 * rng.uniform(0.010, 0.020, 200)  # every value above every old one
    for x in slow[:2]:
        est.observe(x)
    assert est.tail() < min(slow[:2])  # two slow values: still the old machine's tail (nudged)
    est.observe(slow[2])
    assert est.tail() >= min(slow[:3])  # three: the tail is a slow one
    for x in slow[3:]:
        est.observe(x)
    assert est.tail() == pytest.approx(float(np.quantile(slow, 0.99)))  # the window: the new machine only
    assert est.tail() > 1.8 * before
    # a machine that speeds up again is followed as the slow values leave the window: late, on the side of time
    for _ in range(197):
        est.observe(0.010)
    assert est.tail() >= min(slow[-3:])  # three slow values left in the window
    est.observe(0.010)
    assert est.tail() < min(slow[-2:])
