"""The summary keys a policy comparison writes: the names the benchmarks README and the issues cite."""

from specrec.eval.compare import summary_keys
from specrec.eval.evaluate import EvalResult


def _res(name: str, overall: dict, groups: dict | None = None, **extra) -> EvalResult:
    r = EvalResult(name=name, n=100, overall=overall, groups=groups or {}, latency={"p50_ms": 1.0, "p99_ms": 2.0})
    r.extra.update(extra)
    return r


def test_temporal_keys_name_their_k_and_every_group():
    groups = {"unseen": {"recall@50": 0.03, "ndcg@50": 0.01}, "in_sample": {"recall@50": 0.2, "ndcg@50": 0.07}}
    table = {"beam": _res("beam", {"recall@50": 0.18, "ndcg@50": 0.06}, groups),
             "specgr": _res("specgr", {"recall@50": 0.19, "ndcg@50": 0.065}, groups, speedup_vs_beam=0.9)}
    keys = summary_keys(table, "beauty", "temporal", 50)
    assert keys["beauty.temporal.specgr.unseen_recall@50"] == 0.03
    assert keys["beauty.temporal.specgr.recall@50"] == 0.19
    assert keys["beauty.temporal.beam.recall@50"] == 0.18
    assert keys["beauty.temporal.beam.in_sample_ndcg@50"] == 0.07
    assert not any(".k50." in k for k in keys)
    # a run with a drafter share of its own keeps apart from the bundle's figures
    tagged = summary_keys(table, "beauty", "temporal", 50, ".unseen0.2")
    assert "beauty.temporal.specgr.unseen0.2.unseen_recall@50" in tagged
    assert "beauty.temporal.specgr.unseen_recall@50" not in tagged


def test_loo_keys_keep_the_k_infix_beyond_ten():
    table = {"beam": _res("beam", {"recall@50": 0.18, "ndcg@50": 0.06}, speedup_vs_eager=1.6),
             "nezha": _res("nezha", {"recall@50": 0.17, "ndcg@50": 0.05}, speedup_vs_beam=2.1,
                           recall_ratio_vs_beam=0.94)}
    keys = summary_keys(table, "beauty", "loo", 50)
    assert keys["beauty.loo.nezha.k50.speedup_vs_beam"] == 2.1
    assert keys["beauty.loo.beam.k50.speedup_vs_eager"] == 1.6
    assert "beauty.loo.beam.k50.recall@50" not in keys  # beam's quality keys come from `specrec eval`


def test_a_pool_keeps_places_for_the_best_unseen_candidates():
    import numpy as np

    from specrec.policies.batch import Candidates

    pool = Candidates()
    pool.add([1, 2, 3, 4, 5, 6], [-1.0, -1.5, -2.0, -2.5, -6.0, -7.0], "beam")  # 5 and 6: unseen, scored low
    unseen = lambda items: np.isin(items, [5, 6])  # noqa: E731
    assert pool.top(4)[0] == [1, 2, 3, 4]  # by score alone no unseen item makes the list
    items, scores, _ = pool.top(4, reserved=1, eligible=unseen)
    assert items == [1, 2, 3, 5] and scores == sorted(scores, reverse=True)  # the best unseen one, in score order
    assert pool.top(4, reserved=3, eligible=unseen)[0] == [1, 2, 5, 6]  # as many as there are
    assert pool.top(4, reserved=1, eligible=lambda items: np.zeros(len(items), bool))[0] == [1, 2, 3, 4]
