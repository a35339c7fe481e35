import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from specrec.policies import POLICIES, RecRequest, make_policy

from .policy_fixtures import histories, make_engine

ALL = ["beam", "specgr", "nezha", "strict", "relaxed", "sample"]


def run(engine, name, hists, k=10, **params):
    return make_policy(name, engine, **params).run([RecRequest(h, k) for h in hists])


def test_registry_names_every_policy():
    assert sorted(POLICIES) == sorted(ALL)
    with pytest.raises(ValueError, match="unknown policy"):
        make_policy("nope", make_engine())
    with pytest.raises(Exception):
        make_policy("specgr", make_engine(), no_such_parameter=1)


@pytest.mark.parametrize("name", ALL)
def test_k_unique_valid_items_and_stats(name):
    eng = make_engine(1)
    hists = histories(eng, 5, 1)
    for k in (1, 10, 60):  # 60 = the whole catalogue
        for res in run(eng, name, hists, k=k, **({"seed": 0} if name == "sample" else {})):
            assert len(res.items) == k
            assert len(set(res.items.tolist())) == k
            assert eng.itemset.contains(eng.itemset.sids_of(res.items)).all()
            assert res.stats.exit_reason
            assert res.stats.encoder_calls == 1
            assert res.stats.verifier_calls >= 1
    snap = eng.metrics.snapshot()[name]
    assert snap["requests"] == 15


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


def test_strict_uses_fewer_verifier_calls_when_drafts_cover():
    eng = make_engine(2)
    hists = histories(eng, 4, 2)
    # drafting the whole catalogue covers every beam: encode + head + one verify pass
    strict = run(eng, "strict", hists, k=5, n_drafts=60)
    beam = run(eng, "beam", hists, k=5)
    for s, b in zip(strict, beam):
        assert s.stats.verifier_calls == 3 < b.stats.verifier_calls == 5
        assert s.stats.accepted_tokens == s.stats.draft_tokens


def test_specgr_delta_zero_is_beam():
    eng = make_engine(3)
    hists = histories(eng, 6, 3)
    for k in (3, 10):
        beam = run(eng, "beam", hists, k=k)
        spec = run(eng, "specgr", hists, k=k, delta=0)
        for a, b in zip(beam, spec):
            assert a.items.tolist() == b.items.tolist()
            assert np.allclose(a.scores / 4.0, b.scores, atol=1e-6)  # V is the mean, beam the sum
            assert b.stats.exit_reason == "beams_complete" and b.stats.drafted == 0


def test_specgr_encodes_once_and_never_verifies_twice():
    eng = make_engine(4)
    calls = {"encode": 0}
    enc = eng.verifier.model.encode

    def counting(*a, **kw):
        calls["encode"] += 1
        return enc(*a, **kw)

    eng.verifier.model.encode = counting
    hists = histories(eng, 4, 4)
    res = run(eng, "specgr", hists, k=10, delta=8, gamma=0.0)  # nothing is accepted: every round runs
    assert calls["encode"] == 1  # one batched encoder call for all four requests
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
        bs = BeamSearch(eng.verifier.model, sess.state.enc, eng.itemset.trie, 3)
        for batch in guided:
            beams = bs.step()
            own = {tuple(c) for c in beams.codes[0][beams.alive()[0]].tolist()}
            assert {tuple(p) for p in batch[i].prefixes.tolist()} == own
    # and the drafter honours them: every guided draft is under one of its request's prefixes
    for batch in guided:
        drafts = eng.drafter.draft(batch)
        for req, d in zip(batch, drafts):
            l = req.prefixes.shape[1]
            pref = {tuple(p) for p in req.prefixes.tolist()}
            assert all(tuple(x[:l]) in pref for x in eng.itemset.sids_of(d.items).tolist())


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
    assert r0.stats.accepted == int((v[0] > float(v[0].max())).sum()) == 0
    res = run(eng, "specgr", hists, k=5, delta=60, gamma=-1e9)
    for i, r in enumerate(res):
        assert r.stats.exit_reason == "accepted"
        # scores are V (L-1 rule for unseen), sorted descending
        assert np.allclose(r.scores, v[i][r.items].numpy(), atol=1e-5)
        assert np.all(np.diff(r.scores) <= 1e-12)
        assert r.items.tolist() == torch.argsort(v[i], descending=True, stable=True)[:5].tolist()


def test_specgr_budget_exit_returns_best_list_so_far():
    eng = make_engine(7)
    hists = histories(eng, 2, 7)
    t = [0.0]
    eng.clock = lambda: t[0]
    pol = make_policy("specgr", eng, delta=5, gamma=0.0)
    pol.budget.estimate["round"] = 1.0  # a round costs 1 s; the deadline is 0.5 s away
    res = pol.run([RecRequest(h, 10, deadline=0.5) for h in hists])
    for r in res:
        assert r.stats.exit_reason == "budget" and len(set(r.items.tolist())) == 10
        assert eng.itemset.contains(eng.itemset.sids_of(r.items)).all()


def test_beam_budget_exit():
    eng = make_engine(8)
    t = [0.0]
    eng.clock = lambda: t[0]
    pol = make_policy("beam", eng)
    pol.budget.estimate["step"] = 1.0
    res = pol.run([RecRequest(h, 7, deadline=0.5) for h in histories(eng, 2, 8)])
    assert all(r.stats.exit_reason == "budget" and len(set(r.items.tolist())) == 7 for r in res)


@pytest.mark.parametrize("seed", range(4))
def test_nezha_never_returns_invalid(seed):
    # a catalogue much sparser than the code space: most head beams would be invalid unmasked
    eng = make_engine(seed, n_items=20, level_sizes=(8, 8, 8, 4))
    for r in run(eng, "nezha", histories(eng, 5, seed), k=20):
        assert eng.itemset.contains(eng.itemset.sids_of(r.items)).all()
        assert r.stats.accepted == 20 and r.stats.verifier_calls == 2


def test_relaxed_is_beam_when_nothing_drafted_is_good_enough():
    eng = make_engine(9)
    hists = histories(eng, 4, 9)
    beam = run(eng, "beam", hists, k=6)
    relaxed = run(eng, "relaxed", hists, k=6, threshold=1.0, top_k=1)  # p >= 1 is (almost) never met
    for a, b in zip(beam, relaxed):
        assert a.items.tolist() == b.items.tolist()
    loose = run(eng, "relaxed", hists, k=6, threshold=0.0, top_k=10_000)
    for r in loose:
        assert np.all(np.diff(r.scores) <= 1e-9)
