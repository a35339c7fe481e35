"""The fallback ladder (specrec.policies.fallback) on the in-process engine: dependencies made to fail the
way the gateway's adapters fail (core DependencyDown / BudgetExceeded), never a hand-set state."""

from __future__ import annotations

import pytest

from specrec.costs import Resource
from specrec.deadline import Deadline
from specrec.policies import RecRequest, make_policy
from specrec.policies.breaker import Breaker, Cooldown
from specrec.policies.errors import BudgetExceeded, DependencyDown
from specrec.policies.fallback import Ladder

from .policy_fixtures import histories, make_engine, rules, slow_calls


def setup(seed=30, failures=2):
    eng = make_engine(seed)
    t = [0.0]
    eng.clock = lambda: t[0]
    breaker, drafter = Breaker(failures, 1.0, clock=eng.clock), Cooldown(1.0, clock=eng.clock)
    downs: list[DependencyDown] = []
    ladder = Ladder(breaker, drafter, eng.costs, grace_s=0.002, on_down=downs.append)
    return eng, t, ladder, downs, histories(eng, 2, seed)


def fail(owner, *methods, exc):
    def boom(*a, **kw):
        raise exc

    for m in methods:
        setattr(owner, m, boom)


def test_the_asked_policy_answers_when_all_is_well():
    eng, t, ladder, downs, hists = setup()
    res = ladder.answer("beam", {}, eng, RecRequest(hists[0], 5, Deadline(1.0)))
    assert res.served_by == "beam" and not res.degraded and not downs
    assert res.items.tolist() == make_policy("beam", eng).run([RecRequest(hists[0], 5)])[0].items.tolist()


def test_the_verifier_down_gets_the_drafters_list_and_opens_the_breaker():
    eng, t, ladder, downs, hists = setup(failures=2)
    fail(eng.verifier, "beam_search", "beam_step", exc=DependencyDown("verifier", "UNAVAILABLE: gone"))
    slow_calls(eng, t, {"draft": 0.01})
    start = eng.costs.resource(Resource.DRAFTER)
    for _ in range(2):
        res = ladder.answer("beam", {}, eng, RecRequest(hists[0], 5, Deadline(t[0] + 1.0)))
        assert res.served_by == "drafter" and res.degraded.startswith("verifier unavailable: drafter answered")
        assert len(set(res.items.tolist())) == 5
    assert [d.which for d in downs] == ["verifier", "verifier"] and ladder.breaker.is_open()
    # the drafter's own time in a fallback is what the next requests keep back for it
    assert eng.costs.resource(Resource.DRAFTER) > start
    res = ladder.answer("beam", {}, eng, RecRequest(hists[0], 5, Deadline(t[0] + 1.0)))
    assert "breaker open" in res.degraded and len(downs) == 2  # the verifier was not asked


def test_the_drafter_down_gets_beam_with_the_reserve_given_to_the_verifier():
    eng, t, ladder, downs, hists = setup()
    fail(eng.drafter, "draft", exc=DependencyDown("drafter", "UNAVAILABLE: gone"))
    deadline = Deadline(1.0, reserve=0.3)
    encode, sessions = eng.verifier.encode, []
    eng.verifier.encode = lambda sids, dl=None: sessions.append(dl) or encode(sids, dl)
    res = ladder.answer("specgr", {"delta": 5, "first_drafter": "engine"}, eng, RecRequest(hists[0], 5, deadline))
    assert res.served_by == "beam" and res.degraded.startswith("drafter unavailable: beam answered")
    assert ladder.drafter.is_down() and not ladder.breaker.is_open()
    # beam's session had the whole deadline (the asked policy's kept 0.3 s back), and the request's is unchanged
    assert [d.reserve for d in sessions] == [0.3, 0.0] and deadline.reserve == 0.3
    # the drafter known down: a verifier failure now has nothing left but the catalogue
    fail(eng.verifier, "beam_search", "beam_step", exc=DependencyDown("verifier", "UNAVAILABLE: gone"))
    res = ladder.answer("beam", {}, eng, RecRequest(hists[1], 5, Deadline(1.0)))
    assert res.served_by == "fill" and "drafter down (recent failure)" in res.degraded
    assert len(set(res.items.tolist())) == 5


def test_a_drafter_that_refused_is_not_counted_as_down():
    eng, t, ladder, downs, hists = setup()
    fail(eng.drafter, "draft", exc=DependencyDown("drafter", "INVALID_ARGUMENT: one version behind", unreachable=False))
    res = ladder.answer("drafter", {}, eng, RecRequest(hists[0], 5, Deadline(1.0)))
    assert res.served_by == "beam" and not ladder.drafter.is_down()


def test_a_drafter_out_of_time_answers_fill_and_leaves_the_breaker_as_it_was():
    eng, t, ladder, downs, hists = setup(failures=1)
    fail(eng.drafter, "draft", exc=BudgetExceeded("drafter", "deadline exceeded"))
    res = ladder.answer("drafter", {}, eng, RecRequest(hists[0], 5, Deadline(1.0)))
    assert res.served_by == "fill" and "drafter did not answer in time" in res.degraded
    assert not ladder.breaker.is_open() and not ladder.drafter.is_down()


def test_less_time_than_one_calls_grace_answers_fill_at_once():
    eng, t, ladder, downs, hists = setup()
    fail(eng.verifier, "encode", exc=AssertionError("no call may be made"))
    res = ladder.answer("beam", {}, eng, RecRequest(hists[0], 5, Deadline(0.001)))
    assert res.served_by == "fill" and "no time left" in res.degraded and len(res.items) == 5


def test_an_unexpected_error_is_not_swallowed():
    eng, t, ladder, downs, hists = setup()
    fail(eng.verifier, "beam_search", "beam_step", exc=RuntimeError("a bug"))
    with pytest.raises(RuntimeError, match="a bug"):
        ladder.answer("beam", {}, eng, RecRequest(hists[0], 5, Deadline(1.0)))



def test_fused_answers_with_its_drafts_when_the_verifier_runs_out_of_time():
    """The fused policy holds the item drafter's list before the verifier's pass: when the pass runs out of
    time (BudgetExceeded, as the gateway's adapter raises at the deadline), or its mean cost does not fit what
    is left, the answer is that list at once (served_by drafter, flagged), not a second drafter call nor fill."""
    import numpy as np

    from specrec.costs import CostStage
    from specrec.fusion import Fusion

    from .test_fusion import FixedDrafter

    eng, t, ladder, downs, hists = setup()
    logp = np.log(np.random.default_rng(1).dirichlet(np.ones(len(eng.itemset.sids))))
    eng.drafter = FixedDrafter(logp, Fusion(0.4, "raw", 20))
    asked = []
    real_draft = eng.drafter.draft
    eng.drafter.draft = lambda reqs: asked.append(len(reqs)) or real_draft(reqs)
    own = np.argsort(-logp, kind="stable")
    fail(eng.verifier, "search", exc=BudgetExceeded("verifier", "DEADLINE_EXCEEDED"))
    res = ladder.answer("fused", {}, eng, RecRequest(hists[0], 5, Deadline(t[0] + 1.0)))
    want = [i for i in own if i not in set(hists[0].tolist())][:5]
    assert res.served_by == "drafter" and "unranked by the model" in res.degraded and res.stats.exit_reason == "budget"
    assert res.items.tolist() == want and asked == [1] and not downs  # one draft call, no verdict on the verifier
    # its round's mean cost does not fit what is left: no verifier call at all, the drafts answer
    eng2, t2, ladder2, _, _ = setup()
    eng2.drafter = FixedDrafter(logp, Fusion(0.4, "raw", 20))
    fail(eng2.verifier, "search", exc=AssertionError("the verifier must not be called"))
    make_policy("fused", eng2).costs.observe(CostStage.ROUND, 0.5)
    res = ladder2.answer("fused", {}, eng2, RecRequest(hists[0], 5, Deadline(t2[0] + 0.1)))
    assert res.served_by == "drafter" and res.degraded.startswith("budget") and res.items.tolist() == want
    # the verifier down: the drafts in hand answer too (no second drafter call), and the breaker hears of it
    eng3, t3, ladder3, downs3, _ = setup(failures=1)
    eng3.drafter = FixedDrafter(logp, Fusion(0.4, "raw", 20))
    asked3: list[int] = []
    real3 = eng3.drafter.draft
    eng3.drafter.draft = lambda reqs: asked3.append(len(reqs)) or real3(reqs)
    fail(eng3.verifier, "search", exc=DependencyDown("verifier", "UNAVAILABLE: gone"))
    res = ladder3.answer("fused", {}, eng3, RecRequest(hists[0], 5, Deadline(t3[0] + 1.0)))
    assert res.served_by == "drafter" and res.stats.exit_reason == "degraded" and res.items.tolist() == want
    assert "verifier unavailable" in res.degraded and asked3 == [1] and ladder3.breaker.is_open() and downs3


def test_auto_keeps_back_for_fused_only_the_time_to_answer_with_its_drafts():
    """A policy whose fallback is in hand (fused) is admitted against the budget less ``reserve_held``, not less
    the drafter's reserve: its verifier call may run until then, since the drafts answer if it misses."""
    import numpy as np

    from specrec.fusion import Fusion

    from .test_fusion import FixedDrafter

    eng, t, _, _, hists = setup()
    logp = np.log(np.random.default_rng(1).dirichlet(np.ones(len(eng.itemset.sids))))
    eng.drafter = FixedDrafter(logp, Fusion(0.4, "raw", 20, {"fused": 0.2, "drafter": 0.1, "beam": 0.05}))
    rules(eng).reserve = lambda left: 0.010  # 10 ms kept back for the drafter's answer by a verifier policy
    rules(eng).reserve_held = 0.001
    for name, cost in (("fused", 0.025), ("drafter", 0.002), ("beam", 0.025), ("strict", 0.025), ("nezha", 0.02)):
        for _ in range(5):
            eng.costs.for_policy(name, eng.clock).observe_request(cost, 5)
    auto = make_policy("auto", eng)
    assert auto.choose(RecRequest(hists[0], 5, Deadline(t[0] + 0.030))) == "fused"  # 25 + 1 <= 30
    eng.drafter = FixedDrafter(logp, Fusion(0.4, "raw", 20, {"beam": 0.2, "drafter": 0.1, "fused": 0.05}))
    auto = make_policy("auto", eng)  # beam first now: 25 + 10 > 30, so the drafter's list
    assert auto.choose(RecRequest(hists[0], 5, Deadline(t[0] + 0.030))) == "drafter"
