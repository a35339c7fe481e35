"""Indexing a drafter's rows in the background (specrec/drafters/vector.py, retrieval.py): a version's new rows
are pending until a batch of their vectors is appended; pending rows, and the retrieval drafter's rows with no
text, are never drafted nor read in a history."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from specrec.drafters.base import DraftRequest
from specrec.drafters.retrieval import RetrievalDrafter
from specrec.drafters.vector import Rows
from specrec.itemset import LocalItemSet
from specrec.models.retrieval import RetrievalConfig, RetrievalModel

N, NEW = 40, 30


@pytest.fixture
def grown():
    """A retrieval drafter over N rows (text share and unseen share on), a catalogue of N + NEW rows (the new
    ones unseen, under SID prefix 3), and the new rows' text embeddings (each a near twin of row 5's)."""
    rng = np.random.default_rng(0)
    emb = rng.normal(size=(N, 16)).astype(np.float32)
    sids = np.stack([rng.integers(0, 3, N), rng.integers(0, 4, N), np.arange(N) % 8], 1)
    torch.manual_seed(0)
    model = RetrievalModel(RetrievalConfig(text_dim=16, d_model=16, n_experts=2, n_layers=1, d_ff=32)).eval()
    itemset = LocalItemSet(sids, np.ones(N, bool), [4, 4, 8])
    d = RetrievalDrafter(model, emb, itemset, text_share=0.3, unseen_share=0.3)
    new_sids = np.stack([np.full(NEW, 3), np.arange(NEW) % 4, np.arange(NEW) // 4], 1)
    new_emb = (emb[5] + 0.01 * rng.normal(size=(NEW, 16))).astype(np.float32)
    return d, itemset.with_items(new_sids), new_emb


def drafted(d: RetrievalDrafter, history, n: int = 20) -> set[int]:
    """Every row any path drafts for ``history``: free, under prefix 3, and as SASRec's unseen source."""
    free, under = d.draft([DraftRequest(np.asarray(history), n),
                           DraftRequest(np.asarray(history), n, prefixes=np.array([[3]]))])
    [unseen] = d.unseen_drafts([DraftRequest(np.asarray(history), n)], [n], [frozenset()])
    return {*free.items.tolist(), *under.items.tolist(), *unseen.items.tolist()}


def test_pending_rows_are_not_drafted_until_indexed(grown):
    d, itemset, new_emb = grown
    d.set_itemset(itemset)  # the version is followed at once; its new rows have no vectors yet
    assert d.indexed == N and d.pending() == NEW
    history = [5, 6]
    assert all(r < N for r in drafted(d, history))
    # a history holding a pending row drafts as if it were not there
    [a] = d.draft([DraftRequest(np.array([5, 6, N + 2]), 10)])
    [b] = d.draft([DraftRequest(np.array([5, 6]), 10)])
    assert a.items.tolist() == b.items.tolist()

    d.extend(d.encode(new_emb[:10]))  # the first chunk
    assert d.indexed == N + 10 and d.pending() == NEW - 10
    got = drafted(d, history)
    assert all(r < N + 10 for r in got) and got & set(range(N, N + 10))  # the indexed new rows are drafted
    d.extend(d.encode(new_emb[10:]))
    assert d.pending() == 0 and drafted(d, history) & set(range(N + 10, N + NEW))


def test_a_batch_must_start_at_the_next_row(grown):
    d, itemset, new_emb = grown
    d.set_itemset(itemset)
    batch = d.encode(new_emb[5:10], start=N + 5)
    with pytest.raises(ValueError, match=f"{N} rows are indexed"):
        d.extend(batch)
    assert d.indexed == N


def test_rows_without_text_are_indexed_but_never_drafted(grown):
    d, itemset, new_emb = grown
    has_text = np.arange(NEW) % 2 == 0  # odd new rows: neither text nor title
    d = d
    d.set_itemset(itemset)
    d.extend(d.encode(new_emb[has_text], has_text=has_text))
    assert d.indexed == N + NEW and len(d.vectors) == len(d.text_emb) == N + NEW // 2  # nothing held for the rest
    assert d.pending() == 0 and d.skipped == NEW // 2
    [free] = d.draft([DraftRequest(np.array([5, 6]), N + NEW)])  # every draftable row, through the item index
    assert sorted(free.items.tolist()) == [*range(N), *(N + i for i in range(NEW) if has_text[i])]
    got = drafted(d, [5, 6], n=N + NEW)
    assert got & {N + i for i in range(NEW) if has_text[i]}
    assert not got & {N + i for i in range(NEW) if not has_text[i]}
    # in a history they count for nothing
    [a] = d.draft([DraftRequest(np.array([5, 6, N + 1]), 10)])
    [b] = d.draft([DraftRequest(np.array([5, 6]), 10)])
    assert a.items.tolist() == b.items.tolist()


def test_rows_grow_without_moving_what_was_read():
    r = Rows(np.arange(6, dtype=np.float32).reshape(3, 2))
    before = r.view
    for i in range(50):
        r.append(np.full((7, 2), i, np.float32))
    assert len(r) == 3 + 50 * 7 and before.tolist() == [[0, 1], [2, 3], [4, 5]]
    assert r.view[:3].tolist() == before.tolist() and (r.view[-7:] == 49).all()
