import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from pydantic import ValidationError

from specrec.costs import CostStage
from specrec.policies import POLICIES, RecRequest, make_policy

from .policy_fixtures import histories, make_engine, rules, slow_calls

ALL = ["beam", "fused", "specgr", "nezha", "strict", "relaxed", "sample", "drafter", "auto"]


def run(engine, name, hists, k=10, **params):
    return make_policy(name, engine, **params).run([RecRequest(h, k) for h in hists])


def engine_for(name: str, *args, **kw):
    """:func:`make_engine`, its item drafter telling a fusion where the policy ``name`` ranks by it (``fused``)."""
    eng = make_engine(*args, **kw)
    if name == "fused":
        from specrec.fusion import Fusion

        eng.drafter.fusion = Fusion(0.5, "raw", 20)  # type: ignore[union-attr]
    return eng


def test_registry_names_every_policy():
    assert sorted(POLICIES) == sorted(ALL)
    with pytest.raises(ValueError, match="unknown policy"):
        make_policy("nope", make_engine())
    with pytest.raises(ValidationError):
        make_policy("specgr", make_engine(), no_such_parameter=1)


@pytest.mark.parametrize("name", ALL)
def test_k_unique_valid_items_and_stats(name):
    eng = engine_for(name, 1)
    hists = histories(eng, 5, 1)
    for k in (1, 10, 60):  # 60 = the whole catalogue
        for res in run(eng, name, hists, k=k, **({"seed": 0} if name == "sample" else {})):
            assert len(res.items) == k
            assert len(set(res.items.tolist())) == k
            assert eng.itemset.contains(eng.itemset.sids_of(res.items)).all()
            assert res.stats.exit_reason
            uses_verifier = res.served_by != "drafter"
            assert res.stats.encoder_calls == int(uses_verifier)
            assert (res.stats.verifier_calls >= 1) == uses_verifier
            # auto, without a deadline: its most accurate tier (beam, strict: the same list)
            assert res.served_by in ((name,) if name != "auto" else ("beam", "strict"))
    snap = eng.metrics.snapshot()
    assert sum(snap[p]["requests"] for p in (("beam", "strict") if name == "auto" else (name,)) if p in snap) == 15


@settings(max_examples=12, deadline=None)
@given(seed=st.integers(0, 10_000), k=st.integers(1, 12), n_items=st.integers(15, 80))
def test_strict_equals_beam_on_random_models(seed, k, n_items):
    eng = make_engine(seed % 5, n_items=n_items)
    hists = histories(eng, 3, seed)
    beam = run(eng, "beam", hists, k=k)
    for drafter, n in (("head", 2 * k), ("head", 1), ("drafter", 3)):
        strict = run(eng, "strict", hists, k=k, drafter=drafter, n_drafts=n)
        for a, b in zip(beam, strict):
            assert a.items.tolist() == b.items.tolist()
            assert np.allclose(a.scores, b.scores, atol=1e-5)


def count_passes(eng):
    """Count the backend's decoder passes by kind (wraps the eager functions)."""
    be = eng.verifier.backend
    counts = {"encode": 0, "step": 0, "tree": 0, "head": 0}
    for kind, attr in (("encode", "_encode"), ("step", "_step"), ("tree", "_tree"), ("head", "_head_hidden")):
        fn = getattr(be, attr)

        def wrapped(*a, _fn=fn, _kind=kind):
            counts[_kind] += 1
            return _fn(*a)

        setattr(be, attr, wrapped)
    return counts


def test_strict_needs_one_decoder_pass_when_drafts_cover():
    eng = make_engine(2)
    hists = histories(eng, 4, 2)
    counts = count_passes(eng)
    beam = run(eng, "beam", hists, k=5)
    assert counts == {"encode": 1, "step": 4, "tree": 0, "head": 0}
    for key in counts:
        counts[key] = 0
    # drafting the whole catalogue covers every beam: encode + head + one tree pass, no fallback
    strict = run(eng, "strict", hists, k=5, n_drafts=60)
    assert counts == {"encode": 1, "step": 0, "tree": 1, "head": 1}
    for s, b in zip(strict, beam):
        assert s.items.tolist() == b.items.tolist()
        assert s.stats.fallback_steps == 0 and s.stats.accepted_items == 5
        assert s.stats.accepted_tokens_by_position[-1] == 5  # the list's paths, at the last level
    assert eng.metrics.snapshot()["strict"]["no_fallback_share"] == 1.0


def test_strict_with_one_draft_falls_back_and_still_equals_beam():
    eng = make_engine(2)
    hists = histories(eng, 3, 12)
    beam = run(eng, "beam", hists, k=6)
    counts = count_passes(eng)
    strict = run(eng, "strict", hists, k=6, n_drafts=1)
    assert counts["tree"] >= 2  # the draft pass, then fallback passes for the levels it misses
    for s, b in zip(strict, beam):
        assert s.items.tolist() == b.items.tolist()
        assert s.stats.fallback_steps >= 1


def test_specgr_delta_zero_is_beam():
    eng = make_engine(3)
    hists = histories(eng, 6, 3)
    for k in (3, 10):
        beam = run(eng, "beam", hists, k=k)
        spec = run(eng, "specgr", hists, k=k, delta=0)
        for a, b in zip(beam, spec):
            assert a.items.tolist() == b.items.tolist()
            assert np.allclose(a.scores / 4.0, b.scores, atol=1e-6)  # V is the mean, beam the sum
            assert b.stats.exit_reason == "beams_complete" and b.stats.draft_items == 0


def test_specgr_encodes_once_and_never_verifies_twice():
    eng = make_engine(4)
    calls = count_passes(eng)
    hists = histories(eng, 4, 4)
    res = run(eng, "specgr", hists, k=10, delta=8, gamma=0.0)  # nothing is accepted: every round runs
    assert calls["encode"] == 1  # one batched encoder call for all four requests
    # each round's verify pass also evaluates the beam frontier: the beam steps compute nothing more
    assert calls["tree"] == 4 and calls["step"] == 0
    for r in res:
        assert r.stats.rounds == 4 and r.stats.exit_reason == "beams_complete"
    # no item is drafted twice for the same request
    per_request = [[] for _ in hists]
    for batch in eng.drafter.calls:
        for i, req in enumerate(batch):
            per_request[i].append(req)
    for reqs in per_request:
        drafted = set()
        for req in reqs:
            assert drafted <= set(req.exclude)
            drafted |= set(req.exclude)


@torch.inference_mode()
def test_specgr_redrafts_per_request_prefixes():
    from specrec.decoding.beam import BeamSearch

    eng = make_engine(5)
    hists = histories(eng, 3, 5)
    eng.drafter.calls.clear()
    run(eng, "specgr", hists, k=4, delta=5, gamma=0.0, beta=3)
    guided = eng.drafter.calls[1:]
    assert len(guided) == 3, "rounds 2-4 are guided"
    # round r of request i is guided by exactly request i's own beams at level r,
    # as a beam search over that request alone finds them (never a union across the batch)
    for i, h in enumerate(hists):
        sess = eng.verifier.encode(eng.history_sids([h]))
        bs = BeamSearch(eng.verifier.backend, sess.state.enc, eng.itemset.trie, 3)
        for batch in guided:
            beams = bs.step()
            own = {tuple(c) for c in beams.codes[0][beams.alive[0]].tolist()}
            assert {tuple(p) for p in batch[i].prefixes.tolist()} == own
    # and the drafter honours them: every guided draft is under one of its request's prefixes
    for batch in guided:
        drafts = eng.drafter.draft(batch)
        for req, d in zip(batch, drafts):
            depth = req.prefixes.shape[1]
            pref = {tuple(p) for p in req.prefixes.tolist()}
            assert all(tuple(x[:depth]) in pref for x in eng.itemset.sids_of(d.items).tolist())


def test_specgr_accepts_strictly_above_gamma_and_applies_unseen_rule():
    eng = make_engine(6, unseen_frac=0.5)
    hists = histories(eng, 4, 6)
    sess = eng.verifier.encode(eng.history_sids(hists))
    sids = torch.from_numpy(eng.itemset.sids).unsqueeze(0).expand(4, -1, -1)
    tl = eng.verifier.score(sess, sids).token_logp
    unseen = torch.from_numpy(~eng.itemset.seen)
    v = torch.where(unseen, tl[..., :3].mean(-1), tl.mean(-1))
    # put gamma exactly on one candidate's V: that candidate must not be accepted
    res = run(eng, "specgr", hists, k=60, delta=60, gamma=float(v[0].max()), max_rounds=1)
    r0 = res[0]
    assert r0.stats.accepted_items == int((v[0] > float(v[0].max())).sum()) == 0
    res = run(eng, "specgr", hists, k=5, delta=60, gamma=-100.0)
    for i, r in enumerate(res):
        assert r.stats.exit_reason == "accepted"
        # scores are V (L-1 rule for unseen), sorted descending
        assert np.allclose(r.scores, v[i][r.items].numpy(), atol=1e-5)
        assert np.all(np.diff(r.scores) <= 1e-12)
        assert r.items.tolist() == torch.argsort(v[i], descending=True, stable=True)[:5].tolist()


def test_specgr_budget_exit_returns_best_list_so_far():
    eng = make_engine(7)
    hists = histories(eng, 3, 7)
    t = [0.0]
    eng.clock = lambda: t[0]
    slow_calls(eng, t, {"score_step": 1.0, "beam_step": 1.0})  # a round (one verifier call) costs 1 s
    pol = make_policy("specgr", eng, delta=5, gamma=0.0)
    pol.run([RecRequest(hists[2], 10)])  # learns what a round costs
    assert pol.costs.estimate(CostStage.ROUND) == pytest.approx(1.0)
    res = pol.run([RecRequest(h, 10, deadline=t[0] + 0.5) for h in hists[:2]])  # no round fits
    for r in res:
        assert r.stats.exit_reason == "budget" and len(set(r.items.tolist())) == 10
        assert eng.itemset.contains(eng.itemset.sids_of(r.items)).all()


def test_specgr_stops_before_a_round_it_cannot_finish_with_costs_learned_by_running():
    """No cost is set by hand: a fake clock advances 20 ms per verifier call (a round is one: verify and step),
    specgr learns what a round costs from requests without a deadline, then stops before a round that would end
    past its deadline."""
    eng = make_engine(7)
    hists = histories(eng, 4, 7)
    t = [0.0]
    eng.clock = lambda: t[0]
    slow_calls(eng, t, {"score_step": 0.02, "beam_step": 0.02})
    pol = make_policy("specgr", eng, delta=5, gamma=0.0)  # nothing is accepted: every round runs
    for h in hists[:3]:
        assert pol.run([RecRequest(h, 10)])[0].stats.rounds == 4
    assert 0.015 < pol.costs.estimate(CostStage.ROUND) < 0.025
    deadline = t[0] + 0.03  # one 20 ms round fits, a second would end at +40 ms
    res = pol.run([RecRequest(hists[3], 10, deadline=deadline)])[0]
    assert res.stats.exit_reason == "budget" and res.stats.rounds == 1
    assert t[0] <= deadline and len(set(res.items.tolist())) == 10


def test_beam_budget_exit():
    eng = make_engine(8)
    t = [0.0]
    eng.clock = lambda: t[0]
    slow_calls(eng, t, {"beam_step": 1.0})  # the eager backend's whole search is 4 steps (4 levels)
    pol = make_policy("beam", eng)
    hists = histories(eng, 3, 8)
    pol.run([RecRequest(hists[2], 7)])  # learns that a whole search costs 4 s
    assert pol.costs.estimate(CostStage.SEARCH) == 4.0 and not pol.costs.measured(CostStage.STEP)
    # the whole search does not fit: level by level (a step costs 1 s), exiting on the budget after one level
    res = pol.run([RecRequest(h, 7, deadline=t[0] + 0.5) for h in hists[:2]])
    assert all(r.stats.exit_reason == "budget" and len(set(r.items.tolist())) == 7 for r in res)
    assert all(r.stats.rounds == 1 for r in res) and pol.costs.estimate(CostStage.STEP) == 1.0
    assert not any(r.degraded for r in res)  # one level ran: the fill is under the model's own prefixes
    # no time even for a step: nothing is scored, the list is all catalogue fill, and it says so
    res = pol.run([RecRequest(hists[0], 7, deadline=t[0] + 0.1)])[0]
    assert set(res.sources) == {"fill"} and res.degraded.startswith("catalogue fill: beam scored no item")


@pytest.mark.parametrize("seed", range(4))
def test_nezha_never_returns_invalid(seed):
    # a catalogue much sparser than the code space: most head beams would be invalid unmasked
    eng = make_engine(seed, n_items=20, level_sizes=(8, 8, 8, 4))
    for r in run(eng, "nezha", histories(eng, 5, seed), k=20):
        assert eng.itemset.contains(eng.itemset.sids_of(r.items)).all()
        assert r.stats.accepted_items == 20 and r.stats.verifier_calls == 2


def test_relaxed_is_beam_when_nothing_drafted_is_good_enough():
    eng = make_engine(9)
    hists = histories(eng, 4, 9)
    beam = run(eng, "beam", hists, k=6)
    relaxed = run(eng, "relaxed", hists, k=6, threshold=1.0, top_k=1)  # p >= 1 is (almost) never met
    for a, b in zip(beam, relaxed):
        assert a.items.tolist() == b.items.tolist()
    loose = run(eng, "relaxed", hists, k=6, threshold=0.0, top_k=1000)
    for r in loose:
        assert np.all(np.diff(r.scores) <= 1e-9)


@pytest.mark.parametrize("name", ["beam", "specgr", "strict", "nezha", "sample"])
def test_session_released_when_a_call_raises(name):
    eng = make_engine(10)
    released = []
    real_release = eng.verifier.release
    eng.verifier.release = lambda sess: (released.append(sess), real_release(sess))

    def boom(*a, **kw):
        raise RuntimeError("verifier fell over")

    for op in ("search", "beam_step", "score", "score_step"):
        setattr(eng.verifier, op, boom)
    with pytest.raises(RuntimeError, match="fell over"):
        run(eng, name, histories(eng, 2, 10), k=5, **({"seed": 0} if name == "sample" else {}))
    assert len(released) == 1


def test_specgr_skips_drafting_that_does_not_pay():
    """With gamma = 0 nothing is ever accepted: the learned exit rate falls and the
    policy stops drafting (plain beam steps), except on its exploration requests."""
    eng = make_engine(11)
    pol = make_policy("specgr", eng, gamma=0.0)
    hists = histories(eng, 80, 11)
    for h in hists[:60]:
        pol.run([RecRequest(h, 5)])
    eng.drafter.calls.clear()
    res = [pol.run([RecRequest(h, 5)])[0] for h in hists[60:]]
    beam = run(eng, "beam", hists[60:], k=5)
    drafting = [r for r in res if r.stats.draft_items]
    assert len(drafting) <= 2  # exploration only (1 request in 16)
    for r, b in zip(res, beam):
        if not r.stats.draft_items:
            assert r.items.tolist() == b.items.tolist()


def test_drafter_policy_is_the_drafters_list():
    eng = make_engine(12)
    hists = histories(eng, 3, 12)
    res = run(eng, "drafter", hists, k=7)
    from specrec.drafters.base import DraftRequest

    for h, r in zip(hists, res):
        want = eng.drafter.draft([DraftRequest(h, 7)])[0]
        assert r.items.tolist()[: len(want.items)] == want.items.tolist()
        assert r.served_by == "drafter" and r.stats.verifier_calls == 0



def teach_costs(eng, t, seconds: dict[str, float | list[float]], n: int = 50) -> None:
    """Each policy's request cost, learned by running ``n`` requests (K = 5) that take that long on the fake
    clock ``t`` (the time is spent in the encode, or in the drafter for ``drafter``), or one request per time
    in a list; the clock is then put back."""
    start = t[0]
    for name, cost in seconds.items():
        times = cost if isinstance(cost, list) else [cost] * n
        owner, method = (eng.drafter, "draft") if name == "drafter" else (eng.verifier, "encode")
        real = getattr(owner, method)
        each = iter(times)

        def slow(*a, _real=real, _each=each, **kw):
            t[0] += next(_each)
            return _real(*a, **kw)

        setattr(owner, method, slow)
        try:
            pol = make_policy(name, eng)
            for h in histories(eng, len(times), 99):
                pol.run([RecRequest(h, 5)])
        finally:
            setattr(owner, method, real)
        if not isinstance(cost, list):
            assert eng.costs.tail(name, 5) == pytest.approx(cost, rel=0.01)
    t[0] = start


def taught(seconds: dict[str, float | list[float]], n: int = 50):
    """An engine on a fake clock whose policies learned ``seconds`` (:func:`teach_costs`), ``auto`` on it and one
    history -> (engine, clock, auto, history)."""
    eng = make_engine(13)
    t = [0.0]
    eng.clock = lambda: t[0]
    teach_costs(eng, t, seconds, n)
    return eng, t, make_policy("auto", eng), histories(eng, 1, 13)[0]


def test_auto_picks_the_most_accurate_policy_that_fits():
    """With learned costs beam 20 ms, strict 30 ms, nezha 5 ms, drafter 1 ms: a 100 ms
    budget gets beam (strict gives the same list but costs more), 10 ms gets nezha,
    2 ms the drafter, and 0.5 ms (or a queue that eats the budget) is refused."""
    from specrec.policies import Overloaded

    eng, t, auto, h = taught({"beam": 0.02, "strict": 0.03, "nezha": 0.005, "drafter": 0.001})
    for budget, want in ((0.1, "beam"), (0.010, "nezha"), (0.002, "drafter")):
        assert auto.choose(RecRequest(h, 5, deadline=budget)) == want
    with pytest.raises(Overloaded):
        auto.choose(RecRequest(h, 5, deadline=0.0005))
    rules(eng).load = lambda p: 0.0 if p == "drafter" else 0.096  # the verifier's queue: only the drafter fits
    assert auto.choose(RecRequest(h, 5, deadline=0.1)) == "drafter"
    rules(eng).load = lambda p: 0.0
    before = eng.metrics.snapshot()["beam"]["requests"]  # the teaching requests
    res = auto.run([RecRequest(h, 5, deadline=0.1)])[0]
    assert res.served_by == "beam" and len(res.items) == 5
    assert eng.metrics.snapshot()["beam"]["requests"] == before + 1 and "auto" not in eng.metrics.snapshot()


def test_auto_refuses_a_tier_whose_tail_misses_the_budget_though_its_mean_fits():
    """beam and strict answer in 10 ms, but 3 requests in 120 take 40 ms (p99 40 ms, mean 10.75 ms): a
    30 ms budget gets nezha (the mean, or the running mean plus two running mean deviations that auto read
    before, 19.5 ms here, would take beam and answer late 1 time in 40); 45 ms gets beam."""
    spiky = [0.010] * 39 + [0.040]
    eng, t, auto, h = taught({"beam": spiky * 3, "strict": spiky * 3, "nezha": 0.005, "drafter": 0.001})
    assert eng.costs.tail("beam", 5) == pytest.approx(0.040)
    assert auto.choose(RecRequest(h, 5, deadline=0.030)) == "nezha"
    assert auto.choose(RecRequest(h, 5, deadline=0.045)) == "beam"


def test_auto_admits_a_verifier_tier_only_if_it_ends_before_the_reserve_for_the_drafters_answer():
    """beam's tail is 20 ms, nezha's 5 ms, the drafter's 5 ms: with 12 ms of a 30 ms budget kept back for the
    drafter's answer beam does not fit (it would be cut where the reserve starts), nezha does; with nothing
    kept back (the drafter down) beam does. The drafter's own tier keeps nothing back: its fallback is the
    fill."""
    from specrec.policies import Overloaded

    eng, t, auto, h = taught({"beam": 0.02, "strict": 0.03, "nezha": 0.005, "drafter": 0.005})
    asked = []
    rules(eng).reserve = lambda left: asked.append(left) or 0.012
    assert auto.choose(RecRequest(h, 5, deadline=0.030)) == "nezha"
    assert asked and all(left == pytest.approx(0.030) for left in asked)  # out of the time left on arrival
    rules(eng).reserve = lambda left: 0.0
    assert auto.choose(RecRequest(h, 5, deadline=0.030)) == "beam"
    rules(eng).reserve = lambda left: 0.008
    assert auto.choose(RecRequest(h, 5, deadline=0.010)) == "drafter"  # nezha's 5 ms miss the 2 ms before it
    rules(eng).load = lambda p: 0.006 if p == "drafter" else 0.0  # the queue's tail counts for the drafter too
    with pytest.raises(Overloaded, match="kept back for the drafter's answer: 8.0 ms"):
        auto.choose(RecRequest(h, 5, deadline=0.010))


def test_auto_skips_a_tier_whose_dependency_is_down_instead_of_refusing_or_falling_back():
    """beam fits a 100 ms budget; with the verifier down (``Serving.down``) auto chooses the drafter's list as its
    own choice, with the drafter down it keeps beam, and with both down it plans as before (the fallbacks
    answer); a 3 ms budget with the verifier down is the drafter's, not a refusal."""
    eng, t, auto, h = taught({"beam": 0.02, "strict": 0.03, "nezha": 0.005, "drafter": 0.001})
    down: set[str] = set()
    rules(eng).is_down = lambda which: which in down
    assert auto.choose(RecRequest(h, 5, deadline=0.1)) == "beam"
    down.add("verifier")
    assert auto.choose(RecRequest(h, 5, deadline=0.1)) == "drafter"
    assert auto.choose(RecRequest(h, 5, deadline=0.003)) == "drafter"
    res = auto.run([RecRequest(h, 5, deadline=0.1)])[0]
    assert res.served_by == "drafter" and not res.degraded
    down.clear()
    down.add("drafter")
    assert auto.choose(RecRequest(h, 5, deadline=0.1)) == "beam"
    down.add("verifier")
    assert auto.choose(RecRequest(h, 5, deadline=0.1)) == "beam"


def test_auto_plans_every_tier_to_end_before_the_callers_early_cut():
    """beam's tail is 20 ms: it fits 30 ms, but not when the caller's cut fires 12 ms early (the gateway's event loop
    running late): nezha (5 ms) is chosen then."""
    eng, t, auto, h = taught({"beam": 0.02, "strict": 0.03, "nezha": 0.005, "drafter": 0.001})
    assert auto.choose(RecRequest(h, 5, deadline=0.030)) == "beam"
    rules(eng).cut_margin = lambda left: 0.012
    assert auto.choose(RecRequest(h, 5, deadline=0.030)) == "nezha"


def test_a_request_whose_dependency_was_down_does_not_teach_its_policys_cost():
    """A verifier call that fails after 5 s (a connect timeout to a replica gone) raises DependencyDown: beam's
    tail stays what its answered requests taught (20 ms), so beam fits the next 100 ms budget."""
    from specrec.policies.errors import DependencyDown

    eng, t, auto, h = taught({"beam": 0.02, "strict": 0.03, "drafter": 0.001}, n=150)  # past the few-samples estimate
    real = eng.verifier.encode

    def gone(*a, **kw):
        t[0] += 5.0
        raise DependencyDown("verifier", "connect timeout")

    eng.verifier.encode = gone
    for _ in range(3):
        with pytest.raises(DependencyDown):
            make_policy("beam", eng).run([RecRequest(h, 5)])
    eng.verifier.encode = real
    t[0] = 0.0  # (deadlines are absolute on the fake clock)
    assert eng.costs.tail("beam", 5) == pytest.approx(0.02, rel=0.01)
    assert auto.choose(RecRequest(h, 5, deadline=0.1)) == "beam"


def test_auto_probes_a_skipped_tier_and_relearns_its_cost():
    """After a fault, beam's learned cost (200 ms) misses a 150 ms budget: auto answers with the drafter,
    then after probe_s tries beam once; that request's time replaces the stale estimate, and beam is back."""
    eng = make_engine(17)
    t = [100.0]
    eng.clock = lambda: t[0]
    teach_costs(eng, t, {"beam": 0.2, "strict": 0.3, "nezha": 0.2, "drafter": 0.001})
    auto = make_policy("auto", eng, probe_s=0.5)
    h = histories(eng, 1, 17)[0]
    assert auto.choose(RecRequest(h, 5, deadline=t[0] + 0.15)) == "drafter"
    t[0] += 0.2
    assert auto.choose(RecRequest(h, 5, deadline=t[0] + 0.15)) == "drafter"  # not yet probe_s since it was skipped
    t[0] += 0.4
    assert auto.choose(RecRequest(h, 5, deadline=t[0] + 0.15)) == "beam"  # the probe
    make_policy("beam", eng).run([RecRequest(h, 5, deadline=None)])  # the fake clock does not move: 0 s
    assert eng.costs.tail("beam", 5) == 0.0
    assert auto.choose(RecRequest(h, 5, deadline=t[0] + 0.15)) == "beam"


def test_auto_probes_its_last_tier_however_stale_so_one_burst_cannot_refuse_everything_after():
    """A burst taught every tier a cost far above the budget (the drafter 80 ms for a 30 ms budget): auto
    refuses, but once per probe_s it tries the drafter anyway, and a fast answer brings it back."""
    from specrec.policies import Overloaded

    eng = make_engine(19)
    t = [100.0]
    eng.clock = lambda: t[0]
    teach_costs(eng, t, {"beam": 0.5, "strict": 0.5, "nezha": 0.5, "drafter": 0.08})
    auto = make_policy("auto", eng, probe_s=1.0)
    h = histories(eng, 1, 19)[0]
    with pytest.raises(Overloaded):
        auto.choose(RecRequest(h, 5, deadline=t[0] + 0.03))
    t[0] += 1.5
    assert auto.choose(RecRequest(h, 5, deadline=t[0] + 0.03)) == "drafter"  # the probe
    with pytest.raises(Overloaded):  # one probe per probe_s
        auto.choose(RecRequest(h, 5, deadline=t[0] + 0.03))
    make_policy("drafter", eng).run([RecRequest(h, 5, deadline=None)])  # the fake clock does not move: 0 s
    assert auto.choose(RecRequest(h, 5, deadline=t[0] + 0.03)) == "drafter"


def test_draft_sizer_settles_on_the_cheapest_count_and_keeps_trying_its_neighbours():
    from specrec.policies.draft_sizer import DraftSizer

    sizer = DraftSizer(explore_every=4)
    cost = {10: 0.009, 15: 0.006, 20: 0.007, 30: 0.008, 40: 0.010, 60: 0.014}  # seconds per request, misses included
    asked = []
    for _ in range(200):
        n = sizer.size(10)
        asked.append(n)
        sizer.observe_cost(10, n, cost[n])
    tail = asked[-40:]
    assert max(set(tail), key=tail.count) == 15  # the cheapest
    assert set(tail) <= {10, 15, 20} and {10, 20} <= set(tail)  # its neighbours are still tried now and then


def test_specgr_does_not_learn_round_cost_from_a_failed_round():
    """A round that a failing dependency cut short (after waiting on it) must not teach the budget hook."""
    eng = make_engine(7)
    hists = histories(eng, 2, 7)
    t = [0.0]
    eng.clock = lambda: t[0]
    pol = make_policy("specgr", eng, delta=5, gamma=0.0)
    pol.run([RecRequest(hists[0], 10)])
    learned = pol.costs.estimate(CostStage.ROUND)
    real = eng.verifier.score_step

    def down(*a, **kw):
        t[0] += 0.5  # half a second waiting on a verifier that is gone
        raise RuntimeError("verifier unavailable")

    eng.verifier.score_step = down
    with pytest.raises(RuntimeError):
        pol.run([RecRequest(hists[1], 10)])
    eng.verifier.score_step = real
    assert pol.costs.estimate(CostStage.ROUND) == learned


@pytest.mark.parametrize("name", ALL)
def test_exclude_history_returns_k_valid_items_none_from_the_history(name):
    """With exclude_history every policy still answers K unique valid items, and none is in the history;
    a batch mixing requests that exclude and requests that do not is answered request by request."""
    eng = engine_for(name, 2, distilled=name in ("strict", "nezha"))
    hists = [np.concatenate([h, h[::-1]]) for h in histories(eng, 4, 3)]  # repeats too
    params = {"seed": 0} if name == "sample" else {}
    pol = make_policy(name, eng, **params)
    for k in (5, 20):
        reqs = [RecRequest(h, k, exclude_history=(i % 2 == 0)) for i, h in enumerate(hists)]
        for req, res in zip(reqs, pol.run(reqs)):
            assert len(res.items) == k and len(set(res.items.tolist())) == k
            assert eng.itemset.contains(eng.itemset.sids_of(res.items)).all()
            if req.exclude_history:
                assert not set(res.items.tolist()) & set(req.history.tolist()), name


@pytest.mark.parametrize("name,backend", [("beam", "eager"), ("strict", "eager"), ("beam", "onnx"), ("strict", "onnx")])
def test_excluded_beam_is_the_beam_of_a_catalogue_without_the_history(name, backend):
    """Excluding inside the trie constraint is exact: the list is the beam search's over a catalogue
    that never had the history's items (the same model, the same scores)."""
    from specrec.itemset import LocalItemSet
    from specrec.policies import Engine

    eng = make_engine(3, n_items=50, distilled=name == "strict", backend=backend)
    for h in histories(eng, 4, 5):
        got = make_policy(name, eng).run([RecRequest(h, 8, exclude_history=True)])[0]
        keep = np.ones(len(eng.itemset.sids), dtype=bool)
        keep[h] = False
        sub = LocalItemSet(eng.itemset.sids, eng.itemset.seen, eng.itemset.level_sizes, active=keep)  # deleted
        ref = make_policy("beam", Engine(eng.verifier, sub, eng.max_history)).run([RecRequest(h, 8)])[0]
        assert ref.items.tolist() == got.items.tolist()
        assert np.allclose(ref.scores, got.scores, atol=1e-5)


def test_specgr_always_drafts_round_0_when_it_keeps_places_for_unseen_items():
    """The adaptive rule may judge a round's drafting not worth its cost, but with places kept for unseen items
    round 0's drafts are the only way such items reach the list: round 0 drafts even when the estimates say
    skip, and even in the exploration phase that never drafts; later rounds keep the rule."""
    eng = make_engine(unseen_frac=0.3)
    pol = make_policy("specgr", eng, unseen_share=0.2)
    plain = make_policy("specgr", eng)
    assert pol._delta(0, 10, explore=False) == 20 and plain._delta(0, 10, explore=False) == 0
    assert pol._delta(1, 10, explore=False) == 0  # only round 0
