import numpy as np

from specrec.data.histories import history_codes, left_pad


def test_left_pad_keeps_the_last_items_right_aligned():
    rows = left_pad([np.array([5, 6, 7, 8]), np.array([3]), np.array([], dtype=np.int64), np.array([-1, -1, 4, 2])], 3)
    assert rows.tolist() == [[6, 7, 8], [-1, -1, 3], [-1, -1, -1], [-1, 4, 2]]


def test_left_pad_drops_items_a_model_does_not_know():
    assert left_pad([np.array([1, 9, 2, 10])], 4, known=9).tolist() == [[-1, -1, 1, 2]]


def test_history_codes_are_the_padded_rows_sids():
    sids = np.arange(12).reshape(6, 2)
    codes = history_codes([np.array([4, 1]), np.array([0, 2, 5])], 2, sids)
    assert codes.tolist() == [[[8, 9], [2, 3]], [[4, 5], [10, 11]]]
    assert history_codes([np.array([3])], 2, sids).tolist() == [[[-1, -1], [6, 7]]]
