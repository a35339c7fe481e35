"""A changed version's trie and order derived from the last one's (SidTrie.edited, LocalItemSet.changed) are
the ones a build from scratch gives, array for array: the SIDs replaced, added, removed, duplicated, levels
crossing the dense limit."""

from __future__ import annotations

from unittest import mock

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from specrec.ids import trie as trie_mod
from specrec.ids.trie import add_steps, splice
from specrec.itemset import LocalItemSet


def assert_same(got: LocalItemSet, want: LocalItemSet) -> None:
    a, b = got.trie, want.trie
    for name in ("keys", "ptr", "codes"):
        for x, y in zip(getattr(a, name), getattr(b, name), strict=True):
            assert x.dtype == y.dtype and torch.equal(x, y), name
    assert torch.equal(a.leaf_item, b.leaf_item)
    assert a.full_keys is not None and b.full_keys is not None and np.array_equal(a.full_keys, b.full_keys)
    assert (a.n_sids, a.n_duplicates) == (b.n_sids, b.n_duplicates)
    for x, y in zip(a.dense, b.dense, strict=True):
        assert (x is None) == (y is None) and (x is None or torch.equal(x, y))
    for x, y in zip(a.search_tables(8), b.search_tables(8), strict=True):
        for u, v in zip(x.tensors(), y.tensors(), strict=True):
            assert torch.equal(u, v)
    for x, y in zip(got.order, want.order, strict=True):
        assert np.array_equal(x, y)


def random_change(rng, s: LocalItemSet, sizes: list[int], k: int, grow: int, dup: float):
    """``s``'s arrays with ``k`` random rows (and ``grow`` new ones) replaced by random SIDs (a share ``dup`` of
    them another active row's SID), or made inactive."""
    n, m = s.n_rows, s.n_rows + grow
    sids = np.concatenate([s.sids, np.zeros((grow, len(sizes)), np.int64)])
    active = np.concatenate([s.active, np.zeros(grow, bool)])
    rows = np.unique(np.concatenate([rng.integers(0, m, k) if m else np.zeros(0, np.int64), np.arange(n, m)]))
    for r in rows.tolist():
        if rng.random() < 0.3 and r < n:
            active[r] = False
        else:
            active[r] = True
            live = np.nonzero(active)[0]
            sids[r] = (sids[rng.choice(live)] if rng.random() < dup and len(live)
                       else [rng.integers(0, v) for v in sizes])
    return sids, np.ones(m, bool), active, rows


@settings(max_examples=150, deadline=None)
@given(seed=st.integers(0, 100_000), n=st.integers(0, 40), steps=st.integers(1, 4), dup=st.sampled_from([0.0, 0.3]),
       dense_limit=st.sampled_from([1 << 25, 12, 40]), trie=st.booleans())
def test_an_edited_itemset_equals_one_built_from_scratch(seed, n, steps, dup, dense_limit, trie):
    """With ``trie`` False only the order was built (a drafter's snapshot): it is spliced, no trie is built."""
    with mock.patch.object(trie_mod, "DENSE_LIMIT", dense_limit):  # small: levels go dense and back as nodes come
        edits_equal_builds(seed, n, steps, dup, trie)


def edits_equal_builds(seed: int, n: int, steps: int, dup: float, trie: bool = True) -> None:
    rng = np.random.default_rng(seed)
    sizes = [int(v) for v in rng.integers(1, 5, size=rng.integers(1, 5))]
    sids = np.stack([rng.integers(0, v, n) for v in sizes], 1) if n else np.zeros((0, len(sizes)), np.int64)
    s = LocalItemSet(sids, np.ones(n, bool), sizes, "1", rng.random(n) < 0.9)
    if trie:
        _ = s.trie
    _ = s.order
    for step in range(steps):  # edits of edits, as a follower's versions chain
        sids, seen, active, rows = random_change(rng, s, sizes, int(rng.integers(0, 6)), int(rng.integers(0, 3)), dup)
        got = s.changed(sids, seen, active, rows, str(step + 2))
        assert ("trie" in got.__dict__) == trie and "order" in got.__dict__  # edited, not left to a build from scratch
        want = LocalItemSet(sids.copy(), seen, sizes, str(step + 2), active.copy())
        if not trie:  # the order spliced equals the one built without a trie, and the one a trie shares
            bare = LocalItemSet(sids.copy(), seen, sizes, str(step + 2), active.copy())
            _ = want.trie
            for x, y, z in zip(got.order, bare.order, want.order, strict=True):
                assert np.array_equal(x, y) and np.array_equal(x, z)
            s = got
            continue
        assert_same(got, want)
        queries = np.concatenate([sids, np.zeros((1, len(sizes)), np.int64)])
        assert np.array_equal(got.lookup(queries), want.lookup(queries))
        s = got


def test_a_change_of_most_rows_is_built_from_scratch():
    sizes = [100, 100]
    s = LocalItemSet(np.array([[i % 100, i // 100] for i in range(5000)]), np.ones(5000, bool), sizes, "1")
    _ = s.trie, s.order
    gone = np.ones(5000, bool)
    gone[:2000] = False
    assert "trie" in s.changed(s.sids, s.seen, gone, np.arange(1000), "2").__dict__
    assert "trie" not in s.changed(s.sids, s.seen, gone, np.arange(2000), "2").__dict__
    wide = LocalItemSet(np.array([[1, 2]]), np.ones(1, bool), [2**40, 2**40], "1")  # keys overflow int64
    assert wide.trie.full_keys is None
    with pytest.raises(ValueError, match="int64"):
        wide.trie.edited(np.zeros(1, np.int64), np.zeros(0, np.int64), np.zeros(0, np.int64), np.zeros(0, np.int64))


@settings(max_examples=60, deadline=None)
@given(n=st.integers(0, 200), drop=st.sets(st.integers(0, 199), max_size=80),
       at=st.lists(st.integers(0, 200), max_size=80))
def test_splice_and_steps_match_numpy(n, drop, at):
    a = np.arange(n) * 10
    d = np.array(sorted(x for x in drop if x < n), dtype=np.int64)
    p = np.array(sorted(x for x in at if x <= n), dtype=np.int64)
    vals = -np.arange(1, len(p) + 1)
    want = np.insert(np.delete(a, d), p - np.searchsorted(d, p), vals)
    assert np.array_equal(splice(a, d, p, vals), want)
    b, c = a.copy(), a.copy()
    add_steps(b, p, vals)
    for s, v in zip(p.tolist(), vals.tolist()):
        c[s:] += v
    assert np.array_equal(b, c)
