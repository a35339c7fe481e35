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


def test_item_and_token_acceptance_are_counted_apart():
    """Items (specgr's candidates) and SID tokens (level-wise policies) are separate counters:
    a request that drafts both keeps two rates, and tokens add up by position."""
    from specrec.policies.metrics import RequestStats, SpecMetrics

    st = RequestStats()
    st.observe_items(drafted=10, accepted=3)
    st.observe_items(drafted=10, accepted=1)
    st.observe_tokens(0, drafted=4, accepted=4)
    st.observe_tokens(2, drafted=4, accepted=0)
    assert (st.draft_items, st.accepted_items) == (20, 4)
    assert st.draft_tokens_by_position == [4, 0, 4] and st.accepted_tokens_by_position == [4, 0, 0]
    m = SpecMetrics()
    m.record("specgr", st)
    m.record("specgr", RequestStats())  # a request that drafted nothing changes neither rate
    snap = m.snapshot()["specgr"]
    assert snap["item_acceptance"] == 0.2 and snap["token_acceptance"] == 0.5


def test_a_copy_of_request_stats_is_equal_and_shares_no_container():
    """``fused`` holds a copy of its stats for the answer a cut may give: what the run adds after must not show
    in it (RequestStats.copy, a cheap deepcopy)."""
    import copy

    from specrec.policies.metrics import RequestStats

    st = RequestStats(rounds=1, exit_reason="fused")
    st.stage_ms["draft"] = 1.5
    st.observe_tokens(1, 3, 2)
    st.observe_frontier(0, 4, 2)
    st.observe_items(5, 1)
    c = st.copy()
    assert c == st == copy.deepcopy(st) and type(c.stage_ms) is type(st.stage_ms)
    c.stage_ms["verify"] += 2.0
    c.observe_tokens(1, 1, 1)
    c.observe_frontier(2, 1, 1)
    c.observe_items(1, 1)
    assert st.stage_ms == {"draft": 1.5} and st.draft_tokens == 3 and st.frontier_drafted_levels == {0}
    assert st.accepted_items_by_round == [1]
