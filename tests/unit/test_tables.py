"""The item set's search tables (:mod:`specrec.ids.tables`): the one read (:func:`children`) gives every node's
children exactly as the trie's own step does, in the dense form and in CSR, for a catalogue and for a request's
view, and padded as the CUDA backend's static buffers pad them."""

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from specrec.ids import SidTrie
from specrec.ids import tables as tables_mod
from specrec.ids.tables import NO_CUT, Level, children, form_tag, input_names, level_of, levels_of

from ..conftest import random_sids

SIZES = [5, 4, 3, 3]
VMAX = 6  # wider than every level: codes past a level's size lead nowhere


def by_trie(trie: SidTrie, level: int, nodes: torch.Tensor) -> torch.Tensor:
    """The child of every (node, code) by the trie's step (its sorted keys; a view's cuts), [N, VMAX]."""
    n = len(nodes)
    codes = torch.arange(VMAX).repeat(n)
    out = trie.advance(level, nodes.repeat_interleave(VMAX), codes).view(n, VMAX)
    out[:, trie.level_sizes[level] :] = -1
    return out


def both_forms(trie: SidTrie) -> list[list[Level]]:
    """The trie's levels (a view's: with its cut lists) all dense and all CSR."""
    levels = trie.search_tables(VMAX)
    base = getattr(trie, "base", trie)
    return [[level_of(p, c, VMAX, dense).with_cut(lv.cut) for p, c, lv in zip(base.ptr, base.codes, levels)]
            for dense in (True, False)]


def padded(lv: Level, extra: int = 7) -> Level:
    """``lv`` as a device buffer holds it: CSR ``ptr`` repeating its last offset, ``codes`` zeros, ``offs`` longer,
    dense rows -1, the cut list padded with pairs that match nothing."""
    cut = torch.cat([lv.cut, torch.tensor([[NO_CUT[0]], [NO_CUT[1]]]).expand(2, extra)], 1)
    if lv.table is not None:
        return Level(torch.cat([lv.table, torch.full((extra, lv.table.shape[1]), -1, dtype=lv.table.dtype)]), None,
                     None, None, cut)
    assert lv.ptr is not None and lv.codes is not None and lv.offs is not None
    return Level(None, torch.cat([lv.ptr, lv.ptr[-1:].expand(extra)]),
                 torch.cat([lv.codes, torch.zeros(extra, dtype=lv.codes.dtype)]),
                 torch.arange(len(lv.offs) + extra, dtype=torch.int32), cut)


def check(trie: SidTrie) -> None:
    for dense, csr in zip(*both_forms(trie)):
        assert dense.dense and not csr.dense
    for form in both_forms(trie):
        for level, lv in enumerate(form):
            n_nodes = len(trie.ptr[level]) - 1
            nodes = torch.cat([torch.arange(n_nodes), torch.tensor([-1, 0, -1])])  # dead beams read nothing
            want = by_trie(trie, level, nodes)
            assert torch.equal(children(lv, nodes, VMAX), want)
            assert torch.equal(children(padded(lv), nodes, VMAX), want)


@settings(max_examples=40, deadline=None)
@given(n=st.integers(1, 60), n_out=st.integers(0, 30), seed=st.integers(0, 10_000))
def test_children_are_the_tries_step_in_both_forms_views_included(n, n_out, seed):
    sids = random_sids(n, SIZES, seed)
    trie = SidTrie(sids, SIZES)
    check(trie)
    out = sids[np.random.default_rng(seed).choice(n, size=min(n_out, n), replace=False)]
    view = trie.excluding(out)
    check(view)
    if len(out):
        assert view is not trie and any(lv.cut.shape[1] > 1 for lv in view.search_tables(VMAX))


def test_an_empty_catalogue_has_no_children():
    trie = SidTrie(np.zeros((0, 4), dtype=np.int64), SIZES)
    for form in both_forms(trie):
        assert (children(form[0], torch.tensor([0, -1]), VMAX) == -1).all()


def test_the_rule_keeps_small_levels_dense_and_shares_the_tries_arrays(monkeypatch):
    sids = random_sids(50, SIZES, 3)
    monkeypatch.setattr(tables_mod, "DENSE_CELLS", 8 * VMAX)  # the root's and level 1's tables (<= 7 rows) only
    trie = SidTrie(sids, SIZES)
    levels = trie.search_tables(VMAX)
    assert form_tag(levels) == "ddcc"
    assert levels[2].ptr is trie.ptr[2] and levels[2].codes is trie.codes[2]  # CSR: the trie's own int32 arrays
    assert sum(lv.nbytes for lv in levels[2:]) == 4 * sum(len(trie.ptr[j]) + len(trie.codes[j]) + len(levels[j].offs)
                                                          for j in (2, 3))
    fan = [int((trie.ptr[j][1:] - trie.ptr[j][:-1]).max()) for j in (2, 3)]
    assert [len(levels[j].offs) for j in (2, 3)] == [1 << (f - 1).bit_length() for f in fan]  # >= the fan-out
    assert input_names("dc") == ["table0", "cut0", "ptr1", "edge_codes1", "offs1", "cut1"]
    flat = [t for lv in levels for t in lv.tensors()]
    assert all(a is b for lv, back in zip(levels, levels_of("ddcc", flat)) for a, b in zip(lv, back))
    with pytest.raises(ValueError, match="forms"):
        levels_of("ddc", flat)
    nodes = torch.arange(len(trie.ptr[3]) - 1)
    bad = levels[3]._replace(codes=levels[3].codes.roll(1))  # the check bites: codes on the wrong edges
    assert not torch.equal(children(bad, nodes, VMAX), by_trie(trie, 3, nodes))
