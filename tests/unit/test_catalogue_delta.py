"""A catalogue delta applied to a follower's snapshot (specrec_rpc/catalogue.py) gives the snapshot the
whole version would."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from specrec_rpc.catalogue import CatalogueMismatch, apply_delta, build_snapshot
from specrec_rpc.v1 import common_pb2

from .test_itemset_edit import assert_same

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


def test_a_snapshot_without_the_index_keeps_rows_ids_and_its_deltas():
    """The verifier's snapshots (index=False): no id index, titles or texts; the same rows, trie and ids, and a
    delta over one checks its fingerprint as the full one does."""
    items = [item("a", 0, (1, 2, 0)), item("b", 1, (1, 3, 0)), item("c", 2, (4, 0, 1), True)]
    full, bare = build_snapshot("e1.1", LEVELS, items), build_snapshot("e1.1", LEVELS, items, index=False)
    assert bare.index == {} and list(bare.titles) == list(bare.texts) == ["", "", ""] and bare.ids == full.ids
    assert bare.fingerprint == full.fingerprint and (bare.itemset.sids == full.itemset.sids).all()
    new = [item("a", 0, (1, 2, 0)), item("b", 1, (5, 5, 0)), item("d", 3, (4, 0, 2), True)]
    want = build_snapshot("e1.2", LEVELS, new, min_rows=4)
    got = apply_delta(bare, "e1.2", [new[1], new[2]], [2], want.fingerprint)
    assert got.fingerprint == want.fingerprint and got.ids == want.ids
    assert got.itemset.contains(want.itemset.sids[want.itemset.active]).all()


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


@settings(max_examples=60, deadline=None)
@given(seed=st.integers(0, 100_000), n=st.integers(1, 30), steps=st.integers(1, 5), small=st.booleans(),
       hashed=st.booleans())
def test_chained_random_deltas_equal_the_full_versions(seed, n, steps, small, hashed):
    """Random deltas (items replaced with new SIDs, moved, added, removed, SIDs shared), one over the other as
    a follower applies them: each snapshot equals the one built from every item of its version, its trie
    and order array for array; with ``small`` the overlays are collapsed into whole copies on the way; with
    ``hashed`` the id index is the one of big catalogues (a HashIndex, merged when collapsed)."""
    from unittest import mock

    import specrec_rpc.rowindex as ri

    with mock.patch.object(ri, "HASHED_INDEX_FROM", 0 if hashed else ri.HASHED_INDEX_FROM):
        chain_random_deltas(seed, n, steps, small, hashed)


def chain_random_deltas(seed, n, steps, small, hashed):
    from unittest import mock

    import specrec_rpc.rowindex as ri

    rng = np.random.default_rng(seed)
    live = {f"i{j}": item(f"i{j}", j, [int(rng.integers(0, v)) for v in LEVELS], bool(rng.random() < 0.3))
            for j in range(n)}
    rows = n
    snap = build_snapshot("e.1", LEVELS, list(live.values()))
    assert isinstance(snap.index, ri.HashIndex) == hashed
    with mock.patch.object(ri, "OVERLAY_MIN", 2 if small else ri.OVERLAY_MIN):
        for step in range(steps):
            changed, removed = [], []
            for _ in range(int(rng.integers(1, 4))):
                kind = rng.integers(0, 4)
                if kind == 0 or not live:  # a new item
                    new_id = f"n{step}-{len(changed)}"
                    live[new_id] = it = item(new_id, rows, [int(rng.integers(0, v)) for v in LEVELS])
                    rows += 1
                elif kind == 1:  # a new SID (sometimes another item's)
                    old = live[str(rng.choice(sorted(live)))]
                    other = live[str(rng.choice(sorted(live)))]
                    codes = list(other.sid.codes) if rng.random() < 0.3 else [int(rng.integers(0, v)) for v in LEVELS]
                    live[old.item_id] = it = item(old.item_id, old.row, codes, old.unseen)
                elif kind == 2:  # moved to a new row
                    old = live[str(rng.choice(sorted(live)))]
                    removed.append(old.row)
                    live[old.item_id] = it = item(old.item_id, rows, old.sid.codes, old.unseen)
                    rows += 1
                else:  # removed (one this delta has not written: the item set sends an item's last state)
                    untouched = sorted(set(live) - {c.item_id for c in changed})
                    if not untouched:
                        continue
                    old = live.pop(str(rng.choice(untouched)))
                    removed.append(old.row)
                    continue
                changed = [c for c in changed if c.item_id != it.item_id] + [it]
            removed = [r for r in removed if r not in {c.row for c in changed}]
            want = build_snapshot(f"e.{step + 2}", LEVELS, sorted(live.values(), key=lambda x: x.row), min_rows=rows)
            snap = apply_delta(snap, f"e.{step + 2}", changed, removed, want.fingerprint)
            assert snap.index == want.index and dict(snap.index) == want.index and len(snap.index) == len(want.index)
            asked = [*want.index, "nope"]
            assert [snap.index.get(i) for i in asked] == ri.rows_of(snap.index, asked) == ri.rows_of(want.index, asked)
            assert snap.ids == want.ids and snap.titles == want.titles and snap.texts == want.texts
            assert [snap.ids[r] for r in range(rows)] == want.ids and snap.ids[-1] == want.ids[-1]
            assert np.array_equal(snap.itemset.active, want.itemset.active)
            act = want.itemset.active
            assert np.array_equal(snap.itemset.sids[act], want.itemset.sids[act])
            assert np.array_equal(snap.itemset.seen[act], want.itemset.seen[act])
            assert_same(snap.itemset, want.itemset)
