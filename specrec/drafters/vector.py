"""Inner-product drafting over the whole catalogue with faiss.

Shared by the retrieval drafter and the self-drafter: each supplies user
vectors for histories and one vector per catalogue row.

- Exact search (``IndexFlatIP``) up to ``exact_limit`` items (200k by
  default); HNSW beyond it (its recall against exact search is measured in
  ``bench/drafter_index.py``). Where faiss is not installed (a GPU machine's
  image, say), exact search in numpy (:class:`ExactIndex`) at any size.
- Guided re-drafting: with ``prefixes``, only items whose SID starts with one
  of the request's prefixes are scored (exactly, by matrix product; prefixes
  map to contiguous ranges of the SID-sorted catalogue, found vectorised).
- A history's user vector is computed once and remembered (LRU), so the
  rounds of one request pay for it once.
- Excluded (already verified) and inactive (deleted) items are never returned.
- ``add_items`` indexes new catalogue rows without a restart.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Sequence
from typing import cast

import numpy as np

from ..itemset import LocalItemSet
from .base import Draft, DraftRequest, topn_excluding

USER_CACHE = 4096  # user vectors remembered (by history)


class ExactIndex:
    """Exact inner-product search in numpy, with faiss's ``add`` / ``search`` (scores and rows, best first; rows
    -1 where fewer than asked exist): where faiss is missing."""

    def __init__(self, d: int):
        self.vectors = np.zeros((0, d), np.float32)

    def add(self, vectors: np.ndarray) -> None:
        self.vectors = np.concatenate([self.vectors, np.asarray(vectors, dtype=np.float32)])

    def search(self, queries: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
        scores = np.asarray(queries, dtype=np.float32) @ self.vectors.T  # [Q, N]
        n = scores.shape[1]
        if 0 < k < n:
            top = np.argpartition(-scores, k - 1, axis=1)[:, :k]
        else:
            top = np.tile(np.arange(n), (len(scores), 1))
        order = np.argsort(-np.take_along_axis(scores, top, 1), axis=1, kind="stable")
        rows = np.take_along_axis(top, order, 1)
        out_s, out_r = np.full((len(scores), k), -np.inf, np.float32), np.full((len(scores), k), -1, np.int64)
        out_s[:, : rows.shape[1]], out_r[:, : rows.shape[1]] = np.take_along_axis(scores, rows, 1), rows
        return out_s, out_r


def build_index(vectors: np.ndarray, exact_limit: int = 200_000, hnsw_m: int = 32, ef_search: int = 512):
    try:
        import faiss
    except ImportError:  # exact search without it
        exact = ExactIndex(vectors.shape[1])
        exact.add(vectors)
        return exact

    d = vectors.shape[1]
    index: faiss.Index
    if len(vectors) <= exact_limit:
        index = faiss.IndexFlatIP(d)
    else:
        hnsw = faiss.IndexHNSWFlat(d, hnsw_m, faiss.METRIC_INNER_PRODUCT)
        hnsw.hnsw.efConstruction = 200
        hnsw.hnsw.efSearch = ef_search
        index = hnsw
    index.add(np.ascontiguousarray(vectors, dtype=np.float32))
    return index


class VectorDrafter:
    name = "vector"

    def __init__(self, item_vectors: np.ndarray, itemset: LocalItemSet, exact_limit: int = 200_000):
        self.vectors = np.ascontiguousarray(item_vectors, dtype=np.float32)
        self.itemset = itemset
        self.exact_limit = exact_limit
        self.index = build_index(self.vectors, exact_limit)
        self._lock = threading.Lock()
        self._users: OrderedDict[bytes, np.ndarray] = OrderedDict()

    @property
    def index_kind(self) -> str:
        return type(self.index).__name__

    def user_vectors(self, histories: Sequence[np.ndarray]) -> np.ndarray:  # pragma: no cover - abstract
        raise NotImplementedError

    def set_itemset(self, itemset: LocalItemSet, new_vectors: np.ndarray | None = None) -> None:
        """Follow a new catalogue version: rows beyond the current ones are
        appended to the index (their vectors given in ``new_vectors``)."""
        with self._lock:
            extra = itemset.n_rows - len(self.vectors)
            if extra > 0:
                if new_vectors is None or len(new_vectors) != extra:
                    raise ValueError(f"{extra} new catalogue rows need {extra} vectors")
                new_vectors = np.ascontiguousarray(new_vectors, dtype=np.float32)
                self.vectors = np.concatenate([self.vectors, new_vectors])
                self.index.add(new_vectors)
            self.itemset = itemset

    def cached_user_vectors(self, histories: Sequence[np.ndarray]) -> np.ndarray:
        """User vectors, remembered per history (guided re-drafting asks again every round)."""
        keys = [np.asarray(h, dtype=np.int64).tobytes() for h in histories]
        with self._lock:
            missing = [i for i, k in enumerate(keys) if k not in self._users]
        if missing:
            vecs = self.user_vectors([histories[i] for i in missing])
            with self._lock:
                for i, v in zip(missing, vecs):
                    self._users[keys[i]] = v
                while len(self._users) > USER_CACHE:
                    self._users.popitem(last=False)
        with self._lock:
            return np.stack([self._users[k] for k in keys])

    def draft(self, requests: Sequence[DraftRequest]) -> list[Draft]:
        if not requests:
            return []
        users = self.cached_user_vectors([r.history for r in requests])
        itemset, vectors = self.itemset, self.vectors
        out: list[Draft | None] = [None] * len(requests)
        free = [i for i, r in enumerate(requests) if r.prefixes is None]
        for i, r in enumerate(requests):
            if r.prefixes is not None:
                rows = itemset.items_with_prefixes(r.prefixes)
                out[i] = topn_excluding(vectors[rows] @ users[i], rows, r.n, r.exclude)
        if free:
            inactive = len(itemset.active) - int(itemset.active.sum())
            want = max(requests[i].n + len(requests[i].exclude) for i in free) + inactive
            want = min(want, len(vectors))
            if max(requests[i].n for i in free) <= 0:  # nothing asked (a drafter whose other shares take all)
                for i in free:
                    out[i] = Draft(np.zeros(0, np.int64), np.zeros(0, np.float32))
                return cast("list[Draft]", out)
            scores, rows = self.index.search(np.ascontiguousarray(users[free]), want)
            for j, i in enumerate(free):
                ok = (rows[j] >= 0) & (rows[j] < len(itemset.active))  # rows past the snapshot's: not in it
                r_rows, r_scores = rows[j][ok], scores[j][ok]
                act = itemset.active[r_rows]
                out[i] = topn_excluding(r_scores[act], r_rows[act], requests[i].n, requests[i].exclude)
        return cast("list[Draft]", out)  # every request is one of the two kinds above
