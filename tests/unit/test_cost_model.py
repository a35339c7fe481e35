"""``bench.cost_model`` predicts a policy's time from parts measured apart from it (calls' costs, a pass's cost,
acceptance counts) and compares it with the policy's measured time: a prediction consistent with the parts
agrees, a wrong input gives a mismatch, and the policy's own time never enters its prediction."""

from __future__ import annotations

import copy

import pytest

from bench.cost_model import TOLERANCE, predict

# parts, as bench.drafters and bench.pass_cost write them (L = 4: coverage of prefix lengths 1..3)
DRAFTERS = {
    "cost_ms": {"encode": 1.0, "beam.k10": 5.0, "sid_mlp_search.n10": 2.0, "sid_mlp_search.n20": 2.5,
                "draft_verify.k10.n15": 5.0, "draft_verify.k10.n20": 6.0},
    "coverage": {"sid_mlp.k10.n15": {"levels": [1.0, 0.9, 0.8], "whole": 0.3},
                 "sid_mlp.k10.n20": {"levels": [1.0, 0.95, 0.9], "whole": 0.5}},
}
PASS_COST = {"pass_fixed_ms": 0.5, "pass_node_us": 50.0}  # a pass of 10 nodes: 1 ms; resume: 2 passes
# the policies' run: beam 8 ms; nezha = 8 x (1 + 2) / (1 + 5) = 4 ms; strict drafts 19 a level (-> N = 20), its
# rows covered as often as in bench.drafters: 8 x (1 + 6) / 6
POLICIES = {10: {
    "beam": {"mean_ms": 8.0, "speedup_vs_beam": 1.0},
    "nezha": {"mean_ms": 4.0, "speedup_vs_beam": 2.0, "recall_ratio_vs_beam": 0.95},
    "strict": {"mean_ms": 8.0 * 7 / 6, "speedup_vs_beam": 6 / 7, "n": 100, "drafted_level_coverage": 0.95,
               "whole_frontier_share": 0.5, "draft_tokens_by_position": {"0": 1000, "1": 1900, "2": 1900}},
    "drafter": {"mean_ms": 1.0, "speedup_vs_beam": 8.0},
}}


def rows(policies=POLICIES, drafters=DRAFTERS, pass_cost=PASS_COST) -> dict[str, dict]:
    return {r["policy"]: r for r in predict(policies, drafters, pass_cost)}


def test_a_prediction_from_consistent_parts_agrees():
    got = rows()
    assert set(got) == {"nezha", "strict"}  # beam is the reference; the item drafter is not predicted
    assert got["nezha"]["predicted_ms"] == pytest.approx(4.0) and got["nezha"]["agrees"]
    assert got["strict"]["predicted_ms"] == pytest.approx(8.0 * 7 / 6) and got["strict"]["agrees"]
    assert got["strict"]["inputs"]["n"] == 20


@pytest.mark.parametrize("part, factor", [("sid_mlp_search.n10", 3.0), ("draft_verify.k10.n20", 2.0),
                                          ("beam.k10", 0.4)])
def test_a_wrong_part_gives_a_mismatch(part, factor):
    drafters = copy.deepcopy(DRAFTERS)
    drafters["cost_ms"][part] *= factor
    got = rows(drafters=drafters)
    assert not all(r["agrees"] for r in got.values())
    which = {"sid_mlp_search.n10": ["nezha"], "draft_verify.k10.n20": ["strict"], "beam.k10": ["nezha", "strict"]}
    for p in which[part]:
        r = got[p]
        assert not r["agrees"] and not 1 / (1 + TOLERANCE) <= r["ratio"] <= 1 + TOLERANCE


def test_strict_pays_for_the_rows_its_run_covered_less_often():
    """A run whose drafts covered fewer rows than bench.drafters' resumes more: (0.5 - 0.1) x 2 passes of 1 ms."""
    policies = copy.deepcopy(POLICIES)
    policies[10]["strict"]["whole_frontier_share"] = 0.1
    base, less = rows()["strict"], rows(policies=policies)["strict"]
    assert less["predicted_ms"] == pytest.approx(base["predicted_ms"] * (7 + 0.8) / 7)


def test_a_policys_own_time_never_enters_its_prediction():
    """The old model's rho for nezha was nezha's mean time over beam's: its prediction followed the measurement,
    so the comparison could not fail. Now a measured time twice as long changes the verdict, not the prediction."""
    policies = copy.deepcopy(POLICIES)
    for p in ("nezha", "strict"):
        policies[10][p]["mean_ms"] *= 2
        policies[10][p]["speedup_vs_beam"] /= 2
    base, slower = rows(), rows(policies=policies)
    for p in ("nezha", "strict"):
        assert slower[p]["predicted_ms"] == pytest.approx(base[p]["predicted_ms"])
        assert slower[p]["seed_speedup"] == pytest.approx(base[p]["seed_speedup"])
        assert base[p]["agrees"] and not slower[p]["agrees"]
