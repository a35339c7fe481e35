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
- ``add_items`` indexes new catalogue rows without a restart; at scale in two steps, so that the costly one runs
  beside the drafts: a subclass's ``encode`` computes a :class:`Batch` of the next rows' vectors (no state
  changes, any thread), :meth:`VectorDrafter.extend` appends it (between drafts). Rows of the catalogue past
  the indexed ones are *pending*: never drafted until indexed, and :meth:`VectorDrafter.set_itemset` follows a
  version without waiting for them.
- Rows looked at but not ``draftable`` (the retrieval drafter's items with no text) are never drafted and
  hold nothing but their flag: ``vectors`` and the faiss index hold the draftable rows only, in row order
  (:meth:`VectorDrafter.positions` maps rows to their places once a row was left out).
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
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


class Rows:
    """An array [n, ...] that grows by appending, in amortised O(rows) (capacity doubles): a
    ten-million-row catalogue indexed in chunks copies each row a few times, not once per chunk. ``view`` is the
    filled part; a view taken before an append stays valid (appends write past it, or into a new buffer)."""

    def __init__(self, first: np.ndarray):
        self._buf = np.ascontiguousarray(first)
        self.view = self._buf

    def __len__(self) -> int:
        return len(self.view)

    def append(self, more: np.ndarray) -> None:
        n, k = len(self.view), len(more)
        if n + k > len(self._buf):
            buf = np.empty((max(n + k, 2 * len(self._buf), 1024), *self._buf.shape[1:]), self._buf.dtype)
            buf[:n] = self.view
            self._buf = buf
        self._buf[n : n + k] = more
        self.view = self._buf[: n + k]


@dataclass
class Batch:
    """Catalogue rows ``start`` .. ``start + len(batch) - 1`` encoded (a drafter's ``encode``), for
    :meth:`VectorDrafter.extend`. ``draftable``: per row, whether it may be drafted (None: all); ``vectors``
    (and ``text``, the retrieval drafter's text embeddings): those of the draftable rows only, in order."""

    start: int
    vectors: np.ndarray
    draftable: np.ndarray | None = None
    text: np.ndarray | None = None

    def __len__(self) -> int:
        return len(self.vectors) if self.draftable is None else len(self.draftable)


class VectorDrafter:
    name = "vector"

    def __init__(self, item_vectors: np.ndarray, itemset: LocalItemSet, exact_limit: int = 200_000):
        self._vectors = Rows(np.ascontiguousarray(item_vectors, dtype=np.float32))
        self._draftable = Rows(np.ones(len(item_vectors), bool))
        self.skipped = 0  # rows looked at that are not draftable (the service logs it)
        self._index_rows: Rows | None = None  # the row at each position of ``vectors``; None: position = row
        self.itemset = itemset
        self.exact_limit = exact_limit
        self.index = build_index(self.vectors, exact_limit)
        self._lock = threading.Lock()
        self._users: OrderedDict[bytes, np.ndarray] = OrderedDict()

    @property
    def vectors(self) -> np.ndarray:
        """[draftable rows indexed, d]: their vectors, in row order (row r's at ``positions([r])``), as in the
        faiss index."""
        return self._vectors.view

    @property
    def draftable(self) -> np.ndarray:
        """[indexed] bool: the rows looked at that may be drafted."""
        return self._draftable.view

    @property
    def indexed(self) -> int:
        """Rows looked at (0 .. indexed - 1): each either in the index or never drafted; the rest are pending."""
        return len(self._draftable)

    def positions(self, rows: np.ndarray) -> np.ndarray:
        """The places of ``rows`` (indexed and draftable) in :attr:`vectors` and the index."""
        rows = np.asarray(rows, dtype=np.int64)
        return rows if self._index_rows is None else np.searchsorted(self._index_rows.view, rows)

    def pending(self, itemset: LocalItemSet | None = None) -> int:
        """Rows of ``itemset`` (default: the one followed) not indexed yet: not drafted until they are."""
        return max(0, (itemset or self.itemset).n_rows - self.indexed)

    def index_search(self, index, queries: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
        """``index.search`` (an index of the draftable rows, in order), its positions mapped to rows (-1: none)."""
        scores, pos = index.search(np.ascontiguousarray(queries, dtype=np.float32), k)
        rows = self._index_rows
        if rows is None:
            return scores, pos
        view = rows.view
        return scores, np.where(pos >= 0, view[pos.clip(0, max(len(view) - 1, 0))], -1)

    def user_vectors(self, histories: Sequence[np.ndarray]) -> np.ndarray:  # pragma: no cover - abstract
        raise NotImplementedError

    def set_itemset(self, itemset: LocalItemSet, new_vectors: np.ndarray | None = None) -> None:
        """Follow a new catalogue version; ``new_vectors``: those of the rows following the indexed ones
        (all of the version's new rows, or the first of them). Rows not indexed are pending."""
        if new_vectors is not None:
            self.extend(Batch(self.indexed, np.asarray(new_vectors, dtype=np.float32)))
        self.itemset = itemset

    def extend(self, batch: Batch) -> None:
        """Index the rows of ``batch`` (the next ones: ``batch.start`` must be :attr:`indexed`). Not beside a
        draft: the index is searched without the lock."""
        with self._lock:
            if batch.start != self.indexed:
                raise ValueError(f"batch of rows from {batch.start}: {self.indexed} rows are indexed, the next "
                                 "batch must start there")
            self._append(batch)

    def _append(self, batch: Batch) -> None:
        """Append ``batch`` (under the lock; subclasses add their own arrays, then call this)."""
        vectors = np.ascontiguousarray(batch.vectors, dtype=np.float32)
        draftable = np.ones(len(batch), bool) if batch.draftable is None else np.asarray(batch.draftable, bool)
        if len(vectors) != int(draftable.sum()):
            raise ValueError(f"{len(vectors)} vectors for a batch of {int(draftable.sum())} draftable rows")
        if not draftable.all() and self._index_rows is None:
            self._index_rows = Rows(np.arange(len(self.vectors)))  # positions are rows no more
        if self._index_rows is not None:
            self._index_rows.append(batch.start + np.nonzero(draftable)[0])
        self.index.add(vectors)
        self._vectors.append(vectors)
        self.skipped += int(len(draftable) - draftable.sum())
        self._draftable.append(draftable)  # last: ``indexed`` moves once everything else is in place

    def cached_user_vectors(self, histories: Sequence[np.ndarray]) -> np.ndarray:
        """User vectors, remembered per history and rows indexed (guided re-drafting asks again every round; a
        history with a row pending reads it once it is indexed)."""
        seen = np.int64(self.indexed).tobytes()
        keys = [seen + np.asarray(h, dtype=np.int64).tobytes() for h in histories]
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
        with self._lock:  # one consistent view: the rows indexed so far
            itemset, vectors, draftable = self.itemset, self.vectors, self.draftable
        out: list[Draft | None] = [None] * len(requests)
        free = [i for i, r in enumerate(requests) if r.prefixes is None]
        for i, r in enumerate(requests):
            if r.prefixes is not None:
                rows = itemset.items_with_prefixes(r.prefixes)
                rows = rows[rows < len(draftable)]  # pending rows: not drafted yet
                rows = rows[draftable[rows]]
                out[i] = topn_excluding(vectors[self.positions(rows)] @ users[i], rows, r.n, r.exclude)
        if free:
            inactive = itemset.n_rows - len(itemset)  # (counted once per snapshot)
            want = max(requests[i].n + len(requests[i].exclude) for i in free) + inactive
            want = min(want, len(vectors))
            if max(requests[i].n for i in free) <= 0:  # nothing asked (a drafter whose other shares take all)
                for i in free:
                    out[i] = Draft(np.zeros(0, np.int64), np.zeros(0, np.float32))
                return cast("list[Draft]", out)
            scores, rows = self.index_search(self.index, users[free], want)
            for j, i in enumerate(free):
                ok = (rows[j] >= 0) & (rows[j] < len(itemset.active))  # rows past the snapshot's: not in it
                r_rows, r_scores = rows[j][ok], scores[j][ok]
                act = itemset.active[r_rows] & draftable[r_rows]
                out[i] = topn_excluding(r_scores[act], r_rows[act], requests[i].n, requests[i].exclude)
        return cast("list[Draft]", out)  # every request is one of the two kinds above
