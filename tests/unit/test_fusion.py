"""Ranking by both models: the SASRec item drafter (specrec/drafters/sasrec.py), the fused score and its choice
on validation (specrec/fusion.py), the ``fused`` policy ranking by it (specrec/policies/fused.py), and ``auto``'s
tiers ordered by the served lists' validation figures (specrec/policies/auto.py)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from specrec.drafters.base import Draft, DraftRequest
from specrec.drafters.retrieval import RetrievalDrafter
from specrec.drafters.sasrec import SasrecDrafter
from specrec.fusion import Fusion, Scored, choose, gr_logp, item_logp, recall_ndcg, top_reserved
from specrec.itemset import LocalItemSet
from specrec.models.retrieval import RetrievalConfig, RetrievalModel
from specrec.models.sasrec import SASRec, SASRecConfig
from specrec.policies import RecRequest, make_policy

from .policy_fixtures import histories, make_engine

N, UNSEEN = 60, 12


@pytest.fixture
def parts():
    rng = np.random.default_rng(0)
    sids = np.stack([rng.integers(0, 4, N), rng.integers(0, 4, N), np.arange(N) % 8], 1)
    seen = np.ones(N, bool)
    seen[-UNSEEN:] = False
    itemset = LocalItemSet(sids, seen, [4, 4, 8])
    torch.manual_seed(0)
    sas = SASRec(SASRecConfig(n_items=N, d_model=16, n_layers=1, n_heads=2, d_ff=32, dropout=0.0, max_history=8))
    emb = rng.normal(size=(N, 16)).astype(np.float32)
    text = RetrievalModel(RetrievalConfig(text_dim=16, d_model=16, n_experts=2, n_layers=1, d_ff=32)).eval()
    return sas.eval(), itemset, RetrievalDrafter(text, emb, itemset, unseen_share=0.25)


def test_sasrec_drafts_its_own_best_seen_items_with_its_log_softmax(parts):
    sas, itemset, _ = parts
    d = SasrecDrafter(sas, itemset)
    history = np.array([3, 7, 11])
    [got] = d.draft([DraftRequest(history, 10, exclude=frozenset({5}))])
    with torch.inference_mode():
        x = torch.full((1, 8), -1, dtype=torch.int64)
        x[0, -3:] = torch.from_numpy(history)
        want = torch.log_softmax(sas.scores(sas.sequence(x)[:, -1])[0], -1).numpy()
    ok = np.flatnonzero(itemset.seen)
    ok = ok[ok != 5]
    best = ok[np.argsort(-want[ok], kind="stable")[:10]]
    assert got.items.tolist() == best.tolist()
    np.testing.assert_allclose(got.scores, want[best], rtol=1e-5, atol=1e-5)
    assert not itemset.is_unseen(got.items).any()  # it proposes no item it never saw trained
    # guided re-drafting: only items under the prefixes, on the same scale
    prefix = itemset.sids[best[0], :2][None]
    [under] = d.draft([DraftRequest(history, 3, prefixes=prefix)])
    assert (itemset.sids[under.items, :2] == prefix).all() and under.items[0] == best[0]
    np.testing.assert_allclose(under.scores, want[under.items], rtol=1e-5, atol=1e-5)


def test_its_graph_drafts_what_the_model_drafts(parts):
    sas, itemset, _ = parts
    graph, eager = SasrecDrafter(sas, itemset), SasrecDrafter(sas, itemset, backend="eager")
    assert graph.warmup() == "onnx" and eager.warmup() == "eager"  # built, and checked against the model
    rng = np.random.default_rng(3)
    hists = [rng.integers(0, N - UNSEEN, size=n) for n in (1, 3, 8, 12)] + [np.array([N - 1])]  # one unseen only
    np.testing.assert_allclose(graph.log_softmax(hists), eager.log_softmax(hists), rtol=0, atol=1e-5)
    reqs = [DraftRequest(h, 10) for h in hists]
    for a, b in zip(graph.draft(reqs), eager.draft(reqs)):
        assert a.items.tolist() == b.items.tolist()
    with pytest.raises(ValueError, match="backend"):
        SasrecDrafter(sas, itemset, backend="tensorrt")


def test_its_unseen_share_comes_from_the_text_drafter_below_every_sasrec_score(parts):
    sas, itemset, text = parts
    d = SasrecDrafter(sas, itemset, text, unseen_share=0.3)
    [got] = d.draft([DraftRequest(np.array([3, 7, 11]), 10)])
    unseen = itemset.is_unseen(got.items)
    assert unseen.sum() == 3 and not unseen[:7].any() and len(set(got.items.tolist())) == 10
    assert got.scores[7:].max() < got.scores[:7].min()
    # new rows (no SASRec embedding) are never its own drafts
    grown = itemset.with_items(itemset.sids[:4], np.ones(4, bool))
    d.set_itemset(grown)
    [again] = d.draft([DraftRequest(np.array([3, 7, 11]), 40)])
    assert (again.items < N).all()


def test_the_fused_score_and_its_choice_on_validation():
    f = Fusion(0.5, "raw", 3)
    np.testing.assert_allclose(f.score(np.array([-1.0, -3.0]), np.array([-2.0, -1.0])), [-1.5, -2.0])
    z = Fusion(0.5, "z", 3).score(np.array([-1.0, -3.0]), np.array([-2.0, -1.0]))
    np.testing.assert_allclose(z, [0.0, 0.0], atol=1e-12)  # each model's scores centred and scaled
    tl = np.array([[-3.0, -1.0, -1.0], [-0.5, -0.25, -0.25], [-1.0, -0.5, -0.5]])  # the GR per code: -5, -1, -2
    items, scores = f.rank(np.array([10, 11, 12]), tl, np.array([-1.0, -3.0, -1.0]), np.zeros(3, bool), 2)
    assert items.tolist() == [12, 11] and scores[0] >= scores[1]  # -1.5 > -2.0 > -3.0
    with pytest.raises(ValueError):
        Fusion(1.5)
    # users whose target the GR ranks first among the item model's candidates: the choice weighs the GR
    rng = np.random.default_rng(0)
    users = []
    for t in range(200):
        items = np.arange(20) + 100 * t
        item = -np.sort(rng.random(20))[::-1].cumsum()  # the item model prefers the first ones
        token = rng.normal(-8, 1, (20, 1))
        target = int(items[15])
        token[15] = -1.0  # the target: the GR is sure, the item model is not
        users.append(Scored(items, item, token, np.zeros(20, bool), target))
    best, grid = choose(users, drafts=(20,), weights=(0.0, 0.5, 1.0), norms=("raw",), smooth=0)
    assert best.weight > 0.0 and recall_ndcg(users, best)[0] > recall_ndcg(users, Fusion(0.0, "raw", 20))[0]
    assert len(grid) == 3 and {g["weight"] for g in grid} == {0.0, 0.5, 1.0}
    assert Fusion.of({"weight": 0.3, "norm": "raw", "drafts": 40}) == Fusion(0.3, "raw", 40) and Fusion.of(None) is None


def test_unseen_candidates_the_l_minus_1_rule_and_their_reserved_places():
    """An unseen item's GR score is its first L-1 codes' scaled to L, its item score the request's lowest seen
    one; the places kept for unseen candidates go to the item drafter's first ones, in its order."""
    tl = np.array([[-1.0, -1.0, -1.0, -9.0], [-1.0, -1.0, -1.0, -9.0]])
    np.testing.assert_allclose(gr_logp(tl, np.array([False, True])), [-12.0, -4.0])
    np.testing.assert_allclose(item_logp(np.array([-1.0, -2.0, 0.0]), np.array([False, False, True])), [-1, -2, -2])
    scores = np.array([5.0, 4.0, 3.0, 9.0, 8.0])  # items 3 and 4 unseen, the drafter drafted 3 before 4
    unseen = np.array([False, False, False, True, True])
    assert top_reserved(scores, 3).tolist() == [3, 4, 0]
    assert top_reserved(-scores, 3, 1, unseen).tolist() == [2, 1, 3]  # one place kept: the drafter's first
    assert top_reserved(scores, 3, 1, np.zeros(5, bool)).tolist() == [3, 4, 0]  # none unseen: nothing kept
    # the fused list keeps them too, and the drafter's own list of a longer draft is what a draft of K would be
    f = Fusion(1.0, "raw")
    items, _ = f.rank(np.arange(5), np.array([[-1.0, -1]] * 3 + [[-5.0, -5]] * 2), np.zeros(5), unseen, 3, 1)
    assert items.tolist() == [0, 1, 3]
    own = Draft(np.arange(10, 15), np.array([-1.0, -2, -3, -9, -9]))
    assert own.top(3, 1, unseen).items.tolist() == [10, 11, 13]


class FixedDrafter:
    """An item drafter with fixed log-probabilities per item, telling a fusion."""

    name = "fixed"

    def __init__(self, logp: np.ndarray, fusion: Fusion | None, unseen: np.ndarray | None = None):
        self.logp, self.fusion, self.unseen, self.unseen_share = logp, fusion, unseen, 0.0

    def draft(self, requests):
        out = []
        for r in requests:
            ok = np.array([i for i in np.argsort(-self.logp, kind="stable") if i not in r.exclude])[: r.n]
            out.append(Draft(ok.astype(np.int64), self.logp[ok].astype(np.float32)))
        return out


def test_fused_ranks_the_drafters_items_by_both_models_as_tune_fusion_scores_them():
    """The served list is the one ``tune-fusion`` chose the weight on: the same candidates give the same list
    through the policy and through :func:`specrec.fusion.recall_ndcg`'s ranking."""
    eng = make_engine(4, n_items=60)
    rng = np.random.default_rng(1)
    logp = np.log(rng.dirichlet(np.ones(60)))
    for weight in (0.0, 1.0, 0.4):
        eng.drafter = FixedDrafter(logp, Fusion(weight, "raw", 20))
        for h in histories(eng, 3, 9):
            res = make_policy("fused", eng).run([RecRequest(h, 5)])[0]
            assert res.stats.exit_reason == "fused" and res.stats.rounds == 1 and len(res.items) == 5
            assert res.served_by == "fused" and not res.degraded
            cand = np.argsort(-logp, kind="stable")[:20]
            sess = eng.verifier.encode(eng.history_sids([h]))
            token = eng.verifier.score(sess, torch.from_numpy(eng.itemset.sids[cand][None])).token_logp[0].numpy()
            want = cand[np.argsort(-(weight * token.sum(-1) + (1 - weight) * logp[cand]), kind="stable")[:5]]
            assert res.items.tolist() == want.tolist()
            scored = Scored(cand, logp[cand], token, np.zeros(20, bool), int(want[0]))
            tuned, _ = eng.drafter.fusion.rank(scored.items, scored.token_logp, scored.item_scores, scored.unseen, 5)
            assert tuned.tolist() == res.items.tolist()
            if weight == 0.0:  # the item model's own order
                assert res.items.tolist() == cand[:5].tolist()
    # specgr keeps the seed's rounds whatever the drafter tells; fused needs a fusion
    eng.drafter = FixedDrafter(logp, Fusion(0.4, "raw", 20))
    h = histories(eng, 1, 10)[0]
    assert make_policy("specgr", eng).run([RecRequest(h, 5)])[0].stats.exit_reason != "fused"
    eng.drafter = FixedDrafter(logp, None)
    assert "fusion" in (make_policy("fused", eng).missing() or "")


def test_a_redraft_under_prefixes_sasrec_cannot_fill_takes_unseen_items_by_text(parts):
    """Under a prefix whose items SASRec never saw (a new item's code), the text-aware source drafts them:
    guided re-drafting still reaches new items, whatever the unseen share."""
    sas, itemset, text = parts
    d = SasrecDrafter(sas, itemset, text, unseen_share=0.0)
    new = np.flatnonzero(~itemset.seen)[0]
    prefix = itemset.sids[new, :2][None]
    under = np.flatnonzero((itemset.sids[:, :2] == prefix).all(1))
    [got] = d.draft([DraftRequest(np.array([3, 7, 11]), len(under), prefixes=prefix)])
    assert sorted(got.items.tolist()) == sorted(under.tolist())  # the seen ones by SASRec, the rest by text
    assert new in got.items.tolist()
    [plain] = d.draft([DraftRequest(np.array([3, 7, 11]), 10)])
    assert not itemset.is_unseen(plain.items).any()  # no share asked: only its own items where it has enough


def test_auto_orders_its_tiers_by_the_validation_figures_of_the_lists_they_serve():
    meta = {"weight": 0.35, "norm": "raw", "drafts": 50,
            "valid": {"fused": {"recall@10": 0.113}, "drafter": {"recall@10": 0.101}, "beam": {"recall@10": 0.09},
                      "nezha": {"recall@10": 0.092}, "gr_reranked": {"recall@10": 0.0999}}}
    f = Fusion.of(meta)
    assert f is not None and f.as_dict() == {"weight": 0.35, "norm": "raw", "drafts": 50}
    assert dict(f.valid) == {"fused": 0.113, "drafter": 0.101, "beam": 0.09, "nezha": 0.092}  # no unserved list
    # an older bundle's names: SASRec's own list is the drafter's; the GR re-ranking SASRec's candidates no label
    old = Fusion.of({"weight": 0.35, "valid": {"sasrec": {"recall@10": 0.101}, "gr_alone": {"recall@10": 0.0999}}})
    assert old is not None and dict(old.valid) == {"drafter": 0.101}
    eng = make_engine(4, n_items=60)
    logp = np.log(np.random.default_rng(1).dirichlet(np.ones(60)))
    eng.drafter = FixedDrafter(logp, f)
    names = [n for tier in make_policy("auto", eng).runnable() for n in tier]
    assert names == ["fused", "drafter", "nezha", "beam", "strict"]  # by the figures, nezha's own included
    eng.drafter = FixedDrafter(logp, Fusion(0.35, "raw", 50, {"fused": 0.11, "drafter": 0.08, "beam": 0.1}))
    assert [n for tier in make_policy("auto", eng).runnable() for n in tier] == ["fused", "beam", "strict", "drafter",
                                                                                "nezha"]  # nezha: no figure, after
    eng.drafter = FixedDrafter(logp, None)  # no fusion: no fused tier, no figures, the drafter last
    names = [n for tier in make_policy("auto", eng).runnable() for n in tier]
    assert "fused" not in names and names == ["beam", "strict", "nezha", "drafter"]
    # configured tiers are kept as given
    assert make_policy("auto", eng, tiers=[["nezha"], ["beam"]]).tiers() == [["nezha"], ["beam"]]


def test_a_request_fused_hands_to_its_drafts_does_not_teach_what_fused_costs():
    """fused answers at once with the item drafter's list when its pass does not fit: that time is not fused's
    cost, and counted as such ``auto`` read fused as cheap and chose it for every request to hand on."""
    from specrec.costs import CostStage
    from specrec.deadline import Deadline

    eng = make_engine(4, n_items=60)
    t = [0.0]
    eng.clock = lambda: t[0]
    logp = np.log(np.random.default_rng(2).dirichlet(np.ones(60)))
    eng.drafter = FixedDrafter(logp, Fusion(0.4, "raw", 20))
    h = histories(eng, 1, 9)[0]
    eng.costs.for_policy("fused", eng.clock).observe(CostStage.ROUND, 0.05)  # a round takes 50 ms here
    res = make_policy("fused", eng).run([RecRequest(h, 5, deadline=Deadline(0.02))])[0]
    assert res.served_by == "drafter" and res.stats.exit_reason == "budget" and len(res.items) == 5
    assert res.degraded and res.items.tolist() == np.argsort(-logp, kind="stable")[:5].tolist()  # the drafter's own
    assert eng.costs.tail("fused", 5) is None  # not learned as a (cheap) fused request
    res = make_policy("fused", eng).run([RecRequest(h, 5, deadline=Deadline(0.2))])[0]  # time for the round
    assert res.stats.exit_reason == "fused" and eng.costs.tail("fused", 5) == 0.0  # this one is fused's time
