"""A catalogue delta applied to a follower's snapshot (specrec_rpc/catalogue.py) gives the snapshot the
whole version would."""

from __future__ import annotations

import pytest

from specrec_rpc.catalogue import CatalogueMismatch, apply_delta, build_snapshot
from specrec_rpc.v1 import common_pb2

LEVELS = [8, 8, 4]


def item(item_id: str, row: int, codes, unseen: bool = False) -> common_pb2.Item:
    return common_pb2.Item(item_id=item_id, row=row, sid=common_pb2.Sid(codes=list(codes)), title=item_id.upper(),
                           text=f"text of {item_id}", unseen=unseen)


def test_a_delta_equals_the_full_version():
    base = build_snapshot("e1.1", LEVELS, [item("a", 0, (1, 2, 0)), item("b", 1, (1, 3, 0)),
                                           item("c", 2, (4, 0, 1), True)])
    # b replaced (new SID, same row), c deleted, d added
    new = [item("a", 0, (1, 2, 0)), item("b", 1, (5, 5, 0)), item("d", 3, (4, 0, 2), True)]
    want = build_snapshot("e1.2", LEVELS, new, min_rows=4)
    got = apply_delta(base, "e1.2", [new[1], new[2]], [2], want.fingerprint)
    assert got.index == want.index == {"a": 0, "b": 1, "d": 3} and got.fingerprint == want.fingerprint
    assert got.ids == want.ids and got.texts == want.texts and got.titles == want.titles
    assert (got.itemset.active == want.itemset.active).all()
    act = want.itemset.active
    assert (got.itemset.sids[act] == want.itemset.sids[act]).all() and (got.itemset.seen == want.itemset.seen).all()
    assert got.itemset.contains(want.itemset.sids[act]).all() and not got.itemset.contains([[4, 0, 1]])[0]
    assert base.index == {"a": 0, "b": 1, "c": 2} and base.itemset.active.all()  # the base is untouched


def test_an_item_moved_in_the_same_delta_stays_indexed():
    """b moves to row 2 and c takes b's old row: b keeps its new row in the index."""
    base = build_snapshot("e1.1", LEVELS, [item("a", 0, (1, 2, 0)), item("b", 1, (1, 3, 0))])
    new = [item("a", 0, (1, 2, 0)), item("c", 1, (2, 2, 0)), item("b", 2, (1, 3, 0))]
    want = build_snapshot("e1.2", LEVELS, new)
    got = apply_delta(base, "e1.2", [new[2], new[1]], [], want.fingerprint)
    assert got.index == {"a": 0, "b": 2, "c": 1} and got.fingerprint == want.fingerprint


def test_a_delta_over_other_content_is_refused():
    base = build_snapshot("e1.1", LEVELS, [item("a", 0, (1, 2, 0))])
    want = build_snapshot("e1.2", LEVELS, [item("a", 0, (1, 2, 1)), item("b", 1, (3, 3, 0))])
    with pytest.raises(CatalogueMismatch, match="as a delta over e1.1"):
        apply_delta(base, "e1.2", [item("b", 1, (3, 3, 0))], [], want.fingerprint)
