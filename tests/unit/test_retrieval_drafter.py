"""The retrieval drafter's share of unseen items (specrec/drafters/retrieval.py): items no one has
interacted with yet, proposed by text similarity to the history's recent items."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from specrec.drafters.base import DraftRequest
from specrec.drafters.retrieval import RetrievalDrafter
from specrec.itemset import LocalItemSet
from specrec.models.retrieval import RetrievalConfig, RetrievalModel

N, UNSEEN = 60, 12


@pytest.fixture
def drafter_parts():
    rng = np.random.default_rng(0)
    emb = rng.normal(size=(N, 16)).astype(np.float32)
    sids = np.stack([rng.integers(0, 4, N), rng.integers(0, 4, N), np.arange(N) % 8], 1)
    seen = np.ones(N, bool)
    seen[-UNSEEN:] = False
    torch.manual_seed(0)
    model = RetrievalModel(RetrievalConfig(text_dim=16, d_model=16, n_experts=2, n_layers=1, d_ff=32)).eval()
    return model, emb, LocalItemSet(sids, seen, [4, 4, 8])


def by_text(emb: np.ndarray, history, rows) -> list[int]:
    unit = emb / np.linalg.norm(emb, axis=1, keepdims=True)
    q = unit[np.asarray(history)[-3:]].mean(0)
    q /= np.linalg.norm(q)
    return [int(r) for r in np.asarray(rows)[np.argsort(-(unit[rows] @ q), kind="stable")]]


def test_a_share_of_the_drafts_are_the_unseen_items_most_like_the_history(drafter_parts):
    model, emb, itemset = drafter_parts
    d = RetrievalDrafter(model, emb, itemset, unseen_share=0.3)
    history = np.array([3, 7, 11, 20])
    [got] = d.draft([DraftRequest(history, 10, exclude=frozenset({N - 1}))])
    assert len(got.items) == 10 and len(set(got.items.tolist())) == 10
    model_part, new = got.items[:7].tolist(), got.items[7:].tolist()
    unseen = [r for r in range(N - UNSEEN, N - 1) if r not in model_part]  # N - 1 is excluded
    assert new == by_text(emb, history, unseen)[:3]
    assert (got.scores[7:] < got.scores[:7].min()).all()  # below every model draft
    assert N - 1 not in got.items.tolist() and not set(new) & set(history.tolist())


def test_unseen_drafts_keep_to_the_prefixes_asked_for(drafter_parts):
    model, emb, itemset = drafter_parts
    d = RetrievalDrafter(model, emb, itemset, unseen_share=0.5)
    prefix = itemset.sids[N - 2, :1]
    [got] = d.draft([DraftRequest(np.array([1, 2]), 6, prefixes=prefix[None])])
    assert (itemset.sids[got.items, 0] == prefix[0]).all()
    under = [r for r in range(N - UNSEEN, N) if itemset.sids[r, 0] == prefix[0]]
    assert set(got.items[3:].tolist()) <= set(under)


def test_new_rows_join_the_unseen_pool(drafter_parts):
    model, emb, itemset = drafter_parts
    d = RetrievalDrafter(model, emb, itemset, unseen_share=1.0)
    history = np.array([5, 6, 9])
    twin = emb[history].mean(0, keepdims=True)  # a new item whose text is the history's
    grown = itemset.with_items(np.array([[0, 0, 7]]))
    d.add_items(grown, twin)
    [got] = d.draft([DraftRequest(history, 4)])
    assert got.items[0] == N  # the new item first: nearest by text among the unseen
    with pytest.raises(ValueError, match="at most 1 together"):
        RetrievalDrafter(model, emb, itemset, text_share=0.6, unseen_share=0.6)


def test_the_model_fills_what_the_unseen_pool_cannot(drafter_parts):
    """No unseen item in the catalogue (a fresh deployment of the bundle's own), or fewer under the prefixes
    than the share: the drafts still number n, the model's next best filling in."""
    model, emb, itemset = drafter_parts
    all_seen = LocalItemSet(itemset.sids, np.ones(N, bool), itemset.level_sizes)
    history = np.array([3, 7, 11])
    [got] = RetrievalDrafter(model, emb, all_seen, unseen_share=0.4).draft([DraftRequest(history, 10)])
    [plain] = RetrievalDrafter(model, emb, all_seen).draft([DraftRequest(history, 10)])
    assert got.items.tolist() == plain.items.tolist()
    prefix = itemset.sids[N - 2, :1]
    [got] = RetrievalDrafter(model, emb, itemset, unseen_share=0.9).draft(
        [DraftRequest(history, 8, prefixes=prefix[None])])
    under = [r for r in range(N) if itemset.sids[r, 0] == prefix[0]]
    assert len(got.items) == min(8, len(under)) and len(set(got.items.tolist())) == len(got.items)


def test_exact_search_without_faiss_equals_faiss():
    """Where faiss is not installed (a GPU machine's image), the drafters' index is exact search in numpy: the same
    rows, best first, and -1 past the vectors there are."""
    import faiss

    from specrec.drafters.vector import ExactIndex

    rng = np.random.default_rng(0)
    v, q = rng.normal(size=(500, 16)).astype(np.float32), rng.normal(size=(3, 16)).astype(np.float32)
    mine, theirs = ExactIndex(16), faiss.IndexFlatIP(16)
    mine.add(v[:300])
    mine.add(v[300:])
    theirs.add(v)
    for k in (1, 10, 500, 600):
        (s1, r1), (s2, r2) = mine.search(q, k), theirs.search(q, k)
        assert np.array_equal(r1, r2) and np.allclose(s1[r1 >= 0], s2[r2 >= 0], atol=1e-4)
    assert (mine.search(q, 600)[1][:, 500:] == -1).all()
