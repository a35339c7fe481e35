"""Which list ``auto`` serves by default (``tune-fusion``'s ``fusion.default``): the fused list only where validation
users show it beating the item drafter's own list by more than chance (a paired bootstrap over the users, each
judging a fusion chosen on the other half of them), else the drafter's own list; ``auto`` orders its tiers by that
decision in process (:func:`specrec.policies.auto.ordered_tiers`)."""

from __future__ import annotations

import numpy as np
import pytest

from specrec.eval.metrics import gains, paired_bootstrap
from specrec.fusion import Fusion, Scored
from specrec.policies import make_policy
from specrec.train.fusion import _halves, cross_fitted_places, default_list, drafter_places

from .policy_fixtures import make_engine
from .test_fusion import FixedDrafter

N_CAND, L = 40, 3


def scored_users(n: int, gr_signal: float, seed: int = 0) -> list[Scored]:
    """``n`` validation users whose 40 candidates come in the item drafter's order (its log-probabilities falling),
    the target among them at a place drawn to give the drafter's own top 10 about a third of the targets; the
    GR's per-code log-probabilities are noise, plus ``gr_signal`` on each code of the target's SID (0: the GR
    knows nothing the drafter does not)."""
    rng = np.random.default_rng(seed)
    users = []
    for _ in range(n):
        items = rng.permutation(1000)[:N_CAND]
        item_scores = np.sort(rng.normal(size=N_CAND))[::-1] - 3.0
        place = min(N_CAND - 1, int(rng.exponential(14.0)))
        tl = rng.normal(-2.0, 1.0, size=(N_CAND, L))
        tl[place] += gr_signal
        users.append(Scored(items, item_scores, tl, np.zeros(N_CAND, bool), int(items[place])))
    return users


def decide(users: list[Scored]) -> dict:
    places = cross_fitted_places(users, _halves(len(users), 0), (N_CAND,), 0.0, 0.0)
    return default_list(places, drafter_places(users, 0), "test users", seed=0)


def test_the_fused_list_is_the_default_where_it_beats_the_drafters_list_clearly():
    d = decide(scored_users(1200, gr_signal=1.5))
    assert d["list"] == "fused", d["why"]
    r = d["recall@10"]
    assert r["fused"] > r["drafter"] + 0.05 and r["diff_lo"] > 0 and r["n"] == 1200
    assert "above 0, so the fused list" in d["why"]


def test_the_drafters_own_list_is_the_default_where_the_gr_adds_nothing_but_luck():
    """A GR of noise: the grid finds some weight that scores a little higher on the users it was chosen on, but
    judged by users that took no part in the choice the fused list does not beat the drafter's own by more than
    chance: the drafter's list is served."""
    users = scored_users(1200, gr_signal=0.0, seed=3)
    d = decide(users)
    assert d["list"] == "drafter", d["why"]
    assert d["recall@10"]["diff_lo"] <= 0 and "not above 0" in d["why"]


def test_a_paired_bootstrap_sees_a_small_steady_gain_an_unpaired_look_would_call_noise():
    """The same users under both lists: where the fused list holds every target the drafter's holds and a few
    more, the interval is above 0 even though the gain is a fraction of either figure's own sampling spread."""
    rng = np.random.default_rng(5)
    drafter = (rng.random(3000) < 0.08).astype(float)
    fused = drafter.copy()
    fused[rng.choice(np.flatnonzero(drafter == 0), 25, replace=False)] = 1.0  # +0.8 points, never a loss
    b = paired_bootstrap(fused, drafter, seed=0)
    assert 0 < b["diff_lo"] <= b["diff"] <= b["diff_hi"] and b["ratio_lo"] > 1.0
    lost = fused.copy()
    lost[rng.choice(np.flatnonzero(fused == 1), 25, replace=False)] = 0.0  # as many lost as won: no gain
    assert paired_bootstrap(lost, drafter, seed=0)["diff_lo"] < 0


def test_gains_read_places_as_recall_and_ndcg():
    r, n = gains(np.array([0, 3, -1, 12]), 10)
    assert r.tolist() == [1.0, 1.0, 0.0, 0.0]
    assert n[0] == pytest.approx(1.0) and n[1] == pytest.approx(1 / np.log2(5)) and n[2] == n[3] == 0.0


def test_auto_serves_the_decided_list_first_whatever_the_validation_figures_say():
    """A fusion whose fused list scored higher on validation but did not beat the drafter's by more than chance:
    ``auto`` tries the drafter's own list first (in process, without a deadline: the list it serves)."""
    from specrec.policies import RecRequest

    from .policy_fixtures import histories

    eng = make_engine(4, n_items=60)
    logp = np.log(np.random.default_rng(1).dirichlet(np.ones(60)))
    valid = {"fused": 0.113, "drafter": 0.110, "beam": 0.09}
    eng.drafter = FixedDrafter(logp, Fusion(0.35, "raw", 50, valid, default="drafter"))
    auto = make_policy("auto", eng)
    assert [n for tier in auto.runnable() for n in tier] == ["drafter", "fused", "beam", "strict", "nezha"]
    h = histories(eng, 1, 9)[0]
    res = auto.run([RecRequest(h, 5)])[0]
    assert res.served_by == "drafter"
    own = make_policy("drafter", eng).run([RecRequest(h, 5)])[0]
    assert res.items.tolist() == own.items.tolist()
    # decided the other way (or not decided: the figures alone), fused first
    eng.drafter = FixedDrafter(logp, Fusion(0.35, "raw", 50, valid, default="fused"))
    assert make_policy("auto", eng).run([RecRequest(h, 5)])[0].served_by == "fused"
    eng.drafter = FixedDrafter(logp, Fusion(0.35, "raw", 50, valid))
    assert make_policy("auto", eng).runnable()[0] == ["fused"]


def test_a_bundles_fusion_entry_carries_the_decision_and_refuses_an_unknown_list():
    meta = {"weight": 0.3, "norm": "z", "drafts": 40, "valid": {"fused": {"recall@10": 0.1}},
            "default": {"list": "drafter", "why": "..."}}
    f = Fusion.of(meta)
    assert f is not None and f.default == "drafter"
    assert Fusion.of({"weight": 0.3}).default is None  # an older bundle: not decided
    with pytest.raises(ValueError, match="default list"):
        Fusion(0.3, default="beam")
