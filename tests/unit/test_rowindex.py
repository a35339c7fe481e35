"""The id -> row index of big catalogues (specrec_rpc/rowindex.py): the sorted hashes answer what a dict does."""

from __future__ import annotations

from contextlib import nullcontext
from unittest import mock

import numpy as np
import pytest

import specrec_rpc.rowindex as ri
from specrec_rpc.rowindex import HashIndex, IdIndex, id_index, rows_of


def _dict(ids: list[str]) -> dict[str, int]:
    return {i: r for r, i in enumerate(ids) if i}


@pytest.mark.parametrize("colliding", [False, True])
def test_hash_index_answers_what_the_dict_does(colliding):
    """Every id, ids not in it, rows left empty; with ``colliding`` every id of a length shares one hash, so each
    lookup walks a run of equal hashes and checks the ids."""
    rng = np.random.default_rng(0)
    ids = [f"it{j}" * int(rng.integers(1, 4)) if rng.random() < 0.8 else "" for j in range(300)]
    ids = [i if i not in ids[:r] else "" for r, i in enumerate(ids)]  # ids are unique
    active = np.asarray([bool(i) for i in ids])
    asked = [*ids[::-1], "nope", "it1it1it1it1", "it"]
    with mock.patch.object(ri, "hash", len, create=True) if colliding else nullcontext():
        idx = HashIndex.build(ids, np.flatnonzero(active))
        want = _dict(ids)
        assert idx == want and len(idx) == len(want) and sorted(idx) == sorted(want)
        assert [idx.get(k, -1) for k in asked] == idx.get_many(asked, -1) == [want.get(k, -1) for k in asked]
        assert all((k in idx) == (k in want) for k in asked)
        assert idx[ids[5] or ids[6]] == want[ids[5] or ids[6]]
        with pytest.raises(KeyError):
            idx["nope"]


@pytest.mark.parametrize("colliding", [False, True])
def test_a_merged_hash_index_is_the_new_versions(colliding):
    """Changes laid in (ids moved, removed, added): the merged index equals the new version's dict; the old
    index is untouched and still answers for the old ids."""
    ids = [f"a{j}" for j in range(50)]
    with mock.patch.object(ri, "hash", len, create=True) if colliding else nullcontext():
        old = HashIndex.build(ids, np.arange(50))
        new_ids = [*ids, "b0", "a7"]
        new_ids[3] = new_ids[7] = ""  # a3 removed, a7 moved to row 51
        changes = {"a3": None, "a7": 51, "b0": 50}
        merged = old.merged(changes, new_ids)
        assert merged == _dict(new_ids) and old == _dict(ids)
        over = IdIndex.over(old, changes, new_ids)  # the same, laid over instead of merged
        assert over == _dict(new_ids) and rows_of(over, ["a7", "a3", "b0", "zz"]) == [51, None, 50, None]


def test_id_index_is_a_dict_below_the_threshold():
    ids = ["x", "", "y"]
    active = np.asarray([True, False, True])
    assert id_index(ids, active) == {"x": 0, "y": 2} and isinstance(id_index(ids, active), dict)
    with mock.patch.object(ri, "HASHED_INDEX_FROM", 3):
        idx = id_index(ids, active)
        assert isinstance(idx, HashIndex) and idx == {"x": 0, "y": 2} and rows_of(idx, ["y", ""]) == [2, None]
    assert rows_of({"x": 0}, ["x", "z"], -1) == [0, -1]
