"""specrec.Recommender: the in-process API (doctests of its module and of docs/api.md's section), its answers
against the policies' own, upserts, and input errors."""

from __future__ import annotations

import doctest
import re
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[2]
BUNDLE = ROOT / "bundles" / "beauty-loo"

pytestmark = pytest.mark.skipif(not (BUNDLE / "bundle.json").exists(), reason="needs the committed bundles/beauty-loo")


@pytest.fixture(scope="module")
def rec():
    from specrec import Recommender

    return Recommender.load(BUNDLE)


def test_import_specrec_stays_light():
    import subprocess
    import sys

    code = (
        "import sys, specrec; assert 'torch' not in sys.modules, 'import specrec pulled in torch'; specrec.Recommender"
    )
    subprocess.run([sys.executable, "-c", code], check=True, cwd=ROOT)


def test_module_doctest(monkeypatch):
    import specrec.recommender

    monkeypatch.chdir(ROOT)  # the examples name the bundle as a user in a clone would: bundles/beauty-loo
    res = doctest.testmod(specrec.recommender, optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE)
    assert res.attempted >= 8 and res.failed == 0, res


def test_docs_python_api_doctest(monkeypatch):
    text = (ROOT / "docs" / "api.md").read_text()
    m = re.search(r"\n## In-process, from Python\n(.*?)\n## ", text, re.S)
    assert m, "docs/api.md lost its 'In-process, from Python' section"
    monkeypatch.chdir(ROOT)
    parser = doctest.DocTestParser()
    test = parser.get_doctest(m.group(1), {}, "docs/api.md", str(ROOT / "docs" / "api.md"), 0)
    assert len(test.examples) >= 4
    runner = doctest.DocTestRunner(optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE)
    runner.run(test)
    assert runner.failures == 0


def test_same_answer_as_the_policy_on_the_bundles_engine(rec):
    """The Recommender adds no logic of its own: beam through it is beam on the bundle's engine."""
    from specrec.policies import RecRequest, make_policy

    hist = ["1258", "1259", "1260", "1127"]
    rows = np.asarray([rec.bundle.catalogue.index[h] for h in hist])
    want = make_policy("beam", rec.engine).run([RecRequest(rows, 10, None)])[0]
    got = rec.recommend(hist, k=10, policy="beam", budget_ms=None)
    assert [it.id for it in got.items] == [rec.bundle.catalogue.ids[r] for r in want.items.tolist()]
    np.testing.assert_allclose([it.score for it in got.items], want.scores, rtol=1e-5)
    assert got.stats.served_by == "beam" and got.stats.encoder_calls == 1 and not got.stats.ignored_history
    assert got.stats.catalogue_version == rec.itemset.version
    for it in got.items:
        r = rec.bundle.catalogue.index[it.id]
        assert it.sid == tuple(rec.bundle.sids[r].tolist()) and it.unseen == (not rec.bundle.seen[r])


@pytest.mark.parametrize("policy", ["auto", "specgr", "nezha", "strict", "drafter"])
def test_every_policy_answers_k_unique_valid_items(rec, policy):
    a = rec.recommend(["1258", "1259", "1260"], k=10, policy=policy, budget_ms=500)
    ids = [it.id for it in a.items]
    assert len(ids) == 10 == len(set(ids)) and all(i in rec for i in ids)
    assert rec.itemset.contains(np.asarray([it.sid for it in a.items])).all()
    assert a.stats.policy == policy and a.stats.served_by


def test_ignored_history_ids_are_listed(rec):
    a = rec.recommend(["abc", "1258", "99999999"], k=3, policy="beam", budget_ms=None)
    assert a.stats.ignored_history == ["abc", "99999999"]


@pytest.mark.parametrize("kw, field", [
    (dict(history=[]), "history"),
    (dict(history=["nope"]), "history"),
    (dict(history="1258"), "history"),
    (dict(history=["1258"], k=0), "k"),
    (dict(history=["1258"], budget_ms=-1), "budget_ms"),
    (dict(history=["1258"], policy="magic"), "policy"),
    (dict(history=["1258"], policy="specgr", gamma="high"), "params.gamma"),
    (dict(history=["1258"], policy="beam", no_such_param=1), "params.no_such_param"),
])
def test_bad_input_names_the_field(rec, kw, field):
    with pytest.raises(ValueError, match=rf"^{re.escape(field)}:"):
        rec.recommend(**kw)


def test_recommend_batch_in_order_with_a_progress_bar(rec, capsys):
    hists = [["1258", "1259"], ["1"], ["2", "3"]]
    got = rec.recommend_batch(hists, k=5, policy="beam", budget_ms=None)
    assert [a.ids for a in got] == [rec.recommend(h, k=5, policy="beam", budget_ms=None).ids for h in hists]
    assert "3/3" in capsys.readouterr().err  # tqdm's bar


def test_upsert_new_item_is_valid_draftable_and_replaceable():
    """An upserted item gets a valid SID from its text, the drafter reaches it, histories may name it;
    upserting the same id again replaces it (the old row leaves the item set)."""
    from specrec import Recommender
    from specrec.drafters.base import DraftRequest

    rec = Recommender.load(BUNDLE)
    n0, v0 = len(rec), rec.itemset.version
    it = rec.upsert(item_id="new-1", title="Rose hand cream 50 ml", categories=["Beauty", "Skin"])
    assert it.unseen and it.id == "new-1" and len(rec) == n0 + 1 and rec.itemset.version != v0
    sid = np.asarray([it.sid])
    assert rec.itemset.contains(sid).all() and rec.itemset.lookup(sid)[0] == rec.itemset.n_rows - 1
    row = rec.itemset.n_rows - 1
    # the drafter indexed it: prefix-restricted drafting under its RQ code reaches it
    d = rec.engine.drafter.draft([DraftRequest(np.asarray([0, 1]), 50, np.asarray([it.sid[:-1]]))])[0]
    assert row in d.items.tolist()
    assert not rec.recommend(["new-1"], k=5, policy="beam", budget_ms=None).stats.ignored_history
    again = rec.upsert({"item_id": "new-1", "text": "Rose hand cream, travel size 15 ml"})
    assert len(rec) == n0 + 1 and not rec.itemset.active[row] and rec.itemset.active[rec.itemset.n_rows - 1]
    assert rec.itemset.contains(np.asarray([again.sid])).all()
    with pytest.raises(ValueError, match="^item_id:"):
        rec.upsert(title="no id")


def test_load_warms_every_policy_auto_may_choose_with_warm_costs():
    """``Recommender.load`` runs every tier ``auto`` may choose before the first call: each has a cost learned from
    warm calls only (the cold first call, which loads graphs, is forgotten), and no metric counts the warm-up."""
    from specrec import Recommender
    from specrec.policies.auto import AutoPolicy

    rec = Recommender.load(BUNDLE, warmup=False)
    names = [n for tier in AutoPolicy(rec.engine).runnable() for n in tier]
    assert "fused" in names and all(rec.engine.costs.tail(n, 10) is None for n in names)
    took = rec.warmup(requests=2)
    assert set(took) == set(names)
    assert all(rec.engine.costs.tail(n, 10) is not None for n in names)
    assert not rec.engine.metrics.snapshot()
    assert Recommender.load(BUNDLE).engine.costs.tail("fused", 10) is not None  # the default
