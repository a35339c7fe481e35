"""The learned combiner of the fused list: its features and weights (specrec/fusion.py), how ``Fusion.rank`` uses
it, and its training and choice against the weighted mix on validation halves (specrec/train/combiner.py)."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

from specrec.fusion import FEATURES, Combiner, Fusion, Scored, choose, features, recall_ndcg
from specrec.train.combiner import compare, fit

L = 3


def test_features_read_both_models_per_request_and_set_an_unseen_items_last_code():
    tl = np.array([[-1.0, -2.0, -3.0], [-0.5, -0.5, -9.0], [-2.0, -1.0, -1.0]])
    item = np.array([-3.0, -1.0, -2.0])
    unseen = np.array([False, True, False])
    x = features(tl, item, unseen)
    assert x.shape == (3, L + 7)
    assert x[1, L - 1] == pytest.approx(-0.5)  # the unseen item's last code: the mean of its others
    np.testing.assert_allclose(x[[0, 2], :L], tl[[0, 2]])
    np.testing.assert_allclose(x[:, L], [-6.0, -1.5, -4.0])  # gr_logp: the L-1 rule for the unseen one
    np.testing.assert_allclose(x[:, L + 1], [-3.0, -3.0, -2.0])  # item_logp: unseen at the lowest seen
    assert abs(x[:, L + 2].mean()) < 1e-12 and abs(x[:, L + 3].mean()) < 1e-12  # z-scored within the request
    np.testing.assert_allclose(x[:, L + 4] * 3, [2, 0, 1])  # ranks by gr, best first
    np.testing.assert_allclose(x[:, L + 6], [0, 1, 0])


def test_a_combiner_travels_as_a_flat_list_and_through_bundle_json():
    rng = np.random.default_rng(0)
    c = Combiner(rng.normal(size=(L + 7, 4)), rng.normal(size=4), rng.normal(size=4), 0.3)
    back = Combiner.from_flat(c.inputs, c.hidden, c.flat())
    x = rng.normal(size=(5, L + 7))
    np.testing.assert_array_equal(back.score(x), c.score(x))
    f = Fusion.of({**Fusion(0.4, "z", 20, combiner=c).as_dict(), "valid": {}})
    assert f is not None and f.combiner is not None and f.weight == pytest.approx(0.4)
    np.testing.assert_array_equal(f.combiner.score(x), c.score(x))
    with pytest.raises(ValueError, match="weights"):
        Combiner.from_flat(c.inputs, c.hidden, c.flat()[:-1])
    with pytest.raises(ValueError, match="features"):
        Combiner.from_flat(c.inputs, c.hidden, c.flat(), features="v0")
    with pytest.raises(ValueError, match="reads"):
        c.score(rng.normal(size=(5, L + 6)))
    assert c.features == FEATURES


def test_the_fused_list_ranks_by_the_combiner_where_there_is_one():
    """A combiner that scores by the item model's rank gives the item model's order, where the mix weighted all
    to the GR gives the GR's."""
    w1 = np.zeros((L + 7, 1))
    w1[L + 5, 0] = -1.0  # the item model's rank
    only_item = Combiner(w1, np.array([100.0]), np.array([1.0]), 0.0)
    rng = np.random.default_rng(1)
    items = np.arange(10, 30)
    tl, item = rng.normal(size=(20, L)), rng.normal(size=20)
    unseen = np.zeros(20, bool)
    gr_first = Fusion(1.0, "raw", 20)
    by_gr, _ = gr_first.rank(items, tl, item, unseen, 5)
    by_item, _ = replace(gr_first, combiner=only_item).rank(items, tl, item, unseen, 5)
    np.testing.assert_array_equal(by_item, items[np.argsort(-item, kind="stable")[:5]])
    np.testing.assert_array_equal(by_gr, items[np.argsort(-tl.sum(1), kind="stable")[:5]])
    assert not np.array_equal(by_gr, by_item)


def _users(n: int, seed: int, rule) -> list[Scored]:
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(n):
        items = rng.permutation(1000)[:40]
        item = np.sort(rng.normal(size=40))[::-1].copy()  # the drafter's order: its best first
        tl = rng.normal(size=(40, L)) - 2.0
        out.append(Scored(items, item, tl, np.zeros(40, bool), int(items[rule(tl, item)])))
    return out


def test_a_combiner_learns_what_the_mix_cannot_and_is_kept():
    """The target is the item model's *worst* among the candidates whose first code the GR likes: no weight of
    the two sums in [0, 1] finds it, the combiner (which reads each code) does; ``compare`` keeps it, judged on
    the half it was not trained on."""
    def rule(tl, item):
        ok = tl[:, 0] > -1.0
        return int(np.argmin(np.where(ok, item, np.inf))) if ok.any() else len(item) - 1

    users = _users(1200, 0, rule)
    comb, record = compare(users, 40, hidden=16, epochs=40)
    assert record["kept"] and comb is not None
    assert record["b.combiner.recall@10"] > record["b.mix.recall@10"] + 0.1
    assert record["b.only_combiner_hits"] > record["b.only_mix_hits"]
    assert [r["chosen"] for r in record["curve"]].count(True) == 1


def test_compare_keeps_the_mix_where_the_combiner_does_not_beat_it():
    """The target is always the item model's best: the mix (all weight on it) has them all; a combiner can at
    best tie, and a tie keeps the mix."""
    users = _users(400, 1, lambda tl, item: 0)
    comb, record = compare(users, 40, hidden=8, epochs=3)
    mix, _ = choose(users, (40,))
    assert recall_ndcg(users, mix)[0] == 1.0
    assert comb is None and not record["kept"] and record["b.mix.recall@10"] == 1.0


def test_fit_refuses_users_whose_targets_it_never_sees():
    users = [replace(u, target=-1) for u in _users(20, 2, lambda tl, item: 0)]
    with pytest.raises(ValueError, match="nothing to train"):
        fit(users, 40, epochs=1)
