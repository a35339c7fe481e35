"""``bench.generalisation``'s top-10 shares: each model's rank of the target among the candidates."""

from __future__ import annotations

import numpy as np

from bench.generalisation import last_training_examples, top10_by_length
from specrec.data import leave_one_out
from specrec.fusion import Scored


def _user(target_at: int, gr_rank: int, n: int = 20) -> Scored:
    """A user whose target is SASRec's candidate ``target_at`` and the GR's ``gr_rank``-th best."""
    items = np.arange(100, 100 + n)
    gr = -np.arange(n, dtype=np.float64) - 1.0  # the GR's order is the candidates' order ...
    gr[[target_at, gr_rank]] = gr[[gr_rank, target_at]]  # ... but the target swapped to gr_rank
    return Scored(items, -np.arange(n, dtype=np.float64), np.stack([gr, np.zeros(n)], 1), np.zeros(n, bool),
                  int(items[target_at]))


def test_shares_count_each_models_top_ten_among_targets_in_the_candidates():
    users = [_user(2, 15), _user(12, 3), _user(0, 0), _user(19, 19)]
    missing = Scored(np.arange(5), np.zeros(5), np.zeros((5, 2)), np.zeros(5, bool), 999)  # not a candidate
    out = top10_by_length([*users, missing], [3, 6, 6, 25, 3])
    assert out["in_candidates"] == 4
    assert out["sasrec"] == 0.5 and out["gr"] == 0.5  # SASRec: users 0, 2; the GR: users 1, 2
    by = {r["lo"]: r for r in out["by_length"]}
    assert by[0]["users"] == 1 and by[0]["sasrec"] == 1.0 and by[0]["gr"] == 0.0
    assert by[5]["users"] == 2 and by[5]["gr"] == 1.0 and by[5]["sasrec"] == 0.5
    assert by[20]["users"] == 1 and by[20]["gr"] == 0.0 and by[8]["users"] == 0 and by[8]["gr"] is None


def test_the_last_training_example_of_each_user_is_the_one_before_validation(synth):
    split = leave_one_out(synth, max_history=6)
    last = last_training_examples(split)
    assert len(np.unique(last.user)) == len(last)
    valid_pos = dict(zip(split.valid.user.tolist(), split.valid.position.tolist()))
    for u, p in zip(last.user.tolist(), last.position.tolist()):
        assert p == valid_pos[u] - 1


def test_without_last_item_drops_the_most_recent_and_refills_the_window_from_before():
    from bench.generalisation import without_last_item
    from specrec.data.splits import PAD, Examples

    full = [np.arange(10, 18), np.array([7, 8]), np.array([5])]
    hist = np.full((3, 4), PAD)
    for i, h in enumerate(full):
        w = h[-4:]
        hist[i, 4 - len(w):] = w
    ex = Examples(hist, np.array([1, 2, 3]), np.arange(3), np.array([8, 2, 1]))
    short = without_last_item(ex, full, 4)
    assert short.history.tolist() == [[13, 14, 15, 16], [PAD, PAD, PAD, 7], [PAD] * 4]
    assert short.target.tolist() == [1, 2, 3] and ex.history[0].tolist() == [14, 15, 16, 17]
