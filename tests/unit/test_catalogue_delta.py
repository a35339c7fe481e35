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


async def test_versions_dropped_from_the_watcher_are_collected(monkeypatch):
    """A version the watcher drops can still sit in a reference cycle (a caught exception's frames hold the
    request's engine and snapshot); the watcher runs a full collection after dropping versions, at most every
    ``collect_every_s``, so dropped versions do not pile up between the collector's rare full passes."""
    import gc
    import weakref
    from unittest import mock

    from specrec_rpc.catalogue import CatalogueWatcher

    passes = []
    real = gc.collect
    monkeypatch.setattr(gc, "collect", lambda *a: passes.append(1) or real(*a))
    w = CatalogueWatcher(mock.MagicMock(), keep=2, collect_every_s=3600.0)
    gc.disable()  # only the watcher's pass may free the cycle (an automatic one would hide what is tested)
    try:
        first = build_snapshot("e1.1", LEVELS, [item("a", 0, (1, 2, 0))])
        gone = weakref.ref(first)

        class Held:  # what a request that failed on this version leaves behind: a cycle through its snapshot
            pass

        held = Held()
        held.snap, held.me = first, held
        del held
        await w._install(first)
        del first
        await w._install(build_snapshot("e1.2", LEVELS, [item("a", 0, (1, 2, 1))]))
        assert passes == [] and gone() is not None  # nothing dropped yet: no pass
        await w._install(build_snapshot("e1.3", LEVELS, [item("a", 0, (1, 2, 2))]))
        assert passes == [1] and gone() is None  # e1.1 dropped, and its cycle freed
        await w._install(build_snapshot("e1.4", LEVELS, [item("a", 0, (1, 2, 3))]))
        assert passes == [1]  # at most one pass per collect_every_s
    finally:
        gc.enable()
        await w.stop()
