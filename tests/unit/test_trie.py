import numpy as np
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from specrec.ids import SidTrie
from specrec.ids.tables import children

from ..conftest import random_sids


@settings(max_examples=40, deadline=None)
@given(n=st.integers(1, 60), seed=st.integers(0, 10_000))
def test_trie_matches_brute_force(n, seed):
    sizes = [5, 4, 3, 3]
    sids = random_sids(n, sizes, seed)
    trie = SidTrie(sids, sizes)
    queries = np.concatenate([sids, random_sids(30, sizes, seed + 1)])
    valid = {tuple(r) for r in sids.tolist()}
    got = trie.contains(queries).tolist()
    assert got == [tuple(q) in valid for q in queries.tolist()]
    items = trie.lookup(queries).tolist()
    for q, it in zip(queries.tolist(), items):
        if tuple(q) in valid:
            assert sids[it].tolist() == q
        else:
            assert it == -1
    # allowed next codes for random prefixes of every length
    for level in range(len(sizes)):
        prefixes = queries[:, :level]
        nodes = trie.walk(prefixes) if level else torch.zeros(len(prefixes), dtype=torch.int64)
        mask = trie.allowed_mask(level, nodes)
        for p, m in zip(prefixes.tolist(), mask.tolist()):
            expect = [any(tuple(v[:level]) == tuple(p) and v[level] == c for v in valid) for c in range(sizes[level])]
            assert m == expect
    assert trie.allowed_mask(2, torch.tensor([-1])).sum() == 0


def test_codes_out_of_range_are_invalid_not_errors():
    sizes = [4, 4]
    trie = SidTrie(np.array([[1, 2], [3, 0]]), sizes)
    assert trie.contains(np.array([[1, 2], [1, 9], [-1, 0], [3, 0]])).tolist() == [True, False, False, True]


@settings(max_examples=40, deadline=None)
@given(n=st.integers(2, 40), n_out=st.integers(1, 20), seed=st.integers(0, 10_000))
def test_excluding_view_matches_a_trie_built_without_the_items(n, n_out, seed):
    """A request's view without some items behaves exactly as a trie built from the other items: the
    same membership, the same allowed codes after every prefix (prefixes left without items allow
    nothing), the same child tables for the fused graphs; the base trie is untouched."""
    sizes = [3, 3, 2, 3]  # small, so excluded items often empty whole prefixes
    sids = random_sids(n, sizes, seed)
    rng = np.random.default_rng(seed)
    out = sids[rng.choice(n, size=min(n_out, n - 1), replace=False)]
    base = SidTrie(sids, sizes)
    before = [t.clone() for lv in base.search_tables(4) for t in lv.tensors()]
    unknown = np.array([r for r in random_sids(6, sizes, seed + 7).tolist() if r not in sids.tolist()]).reshape(-1, 4)
    view = base.excluding(np.concatenate([out, unknown]))  # unknown SIDs are ignored
    rest = np.array([r for r in sids.tolist() if r not in out.tolist()])
    ref = SidTrie(rest, sizes)
    assert len(view) == len(rest)
    queries = np.concatenate([sids, random_sids(20, sizes, seed + 1)])
    assert view.contains(queries).tolist() == ref.contains(queries).tolist()
    looked = view.lookup(queries)
    assert all((i == -1) == (q not in rest.tolist()) for q, i in zip(queries.tolist(), looked.tolist()))
    assert all(sids[i].tolist() == q for q, i in zip(queries.tolist(), looked.tolist()) if i >= 0)
    for level in range(len(sizes)):
        prefixes = queries[:, :level]
        vn = view.walk(prefixes) if level else torch.zeros(len(prefixes), dtype=torch.int64)
        rn = ref.walk(prefixes) if level else torch.zeros(len(prefixes), dtype=torch.int64)
        assert torch.equal(vn >= 0, rn >= 0)
        assert torch.equal(view.allowed_mask(level, vn), ref.allowed_mask(level, rn))
    # the search tables (the base's, with the view's cut lists): the same reachable structure (node ids are the
    # base's), read as the whole searches read them
    vt, rt = view.search_tables(4), ref.search_tables(4)
    for q in queries.tolist():
        node, rnode = 0, 0
        for level, c in enumerate(q):
            node = int(children(vt[level], torch.tensor([node]), 4)[0, c])
            rnode = int(children(rt[level], torch.tensor([rnode]), 4)[0, c])
            assert (node >= 0) == (rnode >= 0)
    assert all(torch.equal(a, b) for a, b in zip(before, [t for lv in base.search_tables(4) for t in lv.tensors()]))
    assert all(a.table is b.table and a.ptr is b.ptr for a, b in zip(vt, base.search_tables(4)))  # shared
    assert base.excluding(np.zeros((0, 4))) is base


def test_excluding_a_whole_subtree_cuts_its_prefixes():
    """Excluding every item under a prefix cuts the prefix itself, so a constrained search never spends
    a beam on a prefix that leads to no valid item."""
    sizes = [2, 2, 2]
    sids = np.array([[0, 0, 0], [0, 0, 1], [0, 1, 0], [1, 0, 0], [1, 1, 0], [1, 1, 1]])
    trie = SidTrie(sids, sizes)
    view = trie.excluding(sids[:2])  # the whole subtree of prefix (0, 0)
    assert int(view.walk(np.array([[0, 0]]))[0]) == -1 and int(trie.walk(np.array([[0, 0]]))[0]) >= 0
    assert view.allowed_mask(1, view.walk(np.array([[0]]))).tolist() == [[False, True]]
    gone = trie.excluding(sids[:3])  # everything under code 0: the root loses it too
    assert gone.allowed_mask(0, torch.zeros(1, dtype=torch.int64)).tolist() == [[False, True]]
    root = torch.zeros(1, dtype=torch.int64)
    assert children(gone.search_tables(2)[0], root, 2)[0].tolist() == [
        -1, int(children(trie.search_tables(2)[0], root, 2)[0, 1])]
