import math

import numpy as np

from specrec.eval.metrics import metrics_from_ranks, ndcg_at_k, percentiles_ms, recall_at_k, target_ranks


def test_ranks_recall_ndcg_by_hand():
    ranked = np.array([[5, 3, 1], [2, 4, 6], [9, 8, 7]])
    target = np.array([3, 6, 1])
    ranks = target_ranks(ranked, target)
    assert ranks.tolist() == [1, 2, -1]
    assert recall_at_k(ranks, 1) == 0.0
    assert recall_at_k(ranks, 2) == 1 / 3
    assert recall_at_k(ranks, 3) == 2 / 3
    assert math.isclose(ndcg_at_k(ranks, 3), (1 / math.log2(3) + 1 / math.log2(4)) / 3)
    assert math.isclose(ndcg_at_k(ranks, 2), (1 / math.log2(3)) / 3)
    assert ndcg_at_k(np.array([0]), 1) == 1.0


def test_empty_slots_never_hit():
    ranked = np.array([[-1, -1], [4, -1]])
    ranks = target_ranks(ranked, np.array([4, 4]))
    assert ranks.tolist() == [-1, 0]
    m = metrics_from_ranks(ranks, ks=(1, 2))
    assert m["recall@1"] == 0.5 and m["ndcg@2"] == 0.5


def test_percentiles_in_ms():
    p = percentiles_ms([0.001] * 99 + [0.1])
    assert math.isclose(p["p50_ms"], 1.0)
    assert p["p99_ms"] > 1.0
