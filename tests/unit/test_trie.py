import numpy as np
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from specrec.ids import SidTrie

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
