"""A catalogue version's row-indexed strings and its item id -> row index, as a follower holds them.

A full copy indexes every item once (:func:`id_index`); a version built by delta
(:func:`specrec_rpc.catalogue.apply_delta`) lays its changes over the older
version's list and index (:class:`RowStrings`, :class:`IdIndex`) instead of
copying millions of strings. Past :data:`HASHED_INDEX_FROM` items the index is
not a dict but the ids' hashes sorted (:class:`HashIndex`): at ten million
items a dict took 3.5-7 s and about a GB to build, the sorted hashes 1.2 s and
160 MB. Callers that look up many ids at once use :func:`rows_of` (one batch).
"""

from __future__ import annotations

import operator
from collections.abc import Iterable, Mapping, Sequence

import numpy as np

__all__ = ["HASHED_INDEX_FROM", "HashIndex", "IdIndex", "RowStrings", "id_index", "rows_of"]

#: a version's strings and index lay the changes since the list or dict they share over it, one dict deep, until
#: there are more than OVERLAY_MIN of them and more than 1/OVERLAY_SHARE of the rows: then that version copies them
#: whole (at ten million items, about a second once every 156,000 changed items; each version in between merges
#: the changes' dicts, tens of ms at most)
OVERLAY_MIN, OVERLAY_SHARE = 4096, 64


class RowStrings(Sequence[str]):
    """A catalogue version's strings by row (ids, titles, texts; rows past the shared list read ""): the list of
    an older version, shared, with this version's changed rows laid over it (row -> string). A version built
    by delta (:func:`apply_delta`) copies ten million strings only once in many versions."""

    __slots__ = ("_base", "_changed", "_n")

    def __init__(self, base: list[str], changed: dict[int, str], n: int):
        self._base, self._changed, self._n = base, changed, n

    @staticmethod
    def over(seq: Sequence[str], changes: dict[int, str], n: int) -> RowStrings:
        """``seq`` (a list or a :class:`RowStrings`) with ``changes`` laid over it, ``n`` rows long."""
        if isinstance(seq, RowStrings):
            base, changed = seq._base, {**seq._changed, **changes}
        else:
            base, changed = seq if isinstance(seq, list) else list(seq), changes
        if len(changed) > max(OVERLAY_MIN, len(base) // OVERLAY_SHARE):
            whole = base[:n] + [""] * (n - len(base))
            for r, v in changed.items():
                whole[r] = v
            return RowStrings(whole, {}, n)
        return RowStrings(base, changed, n)

    def __len__(self) -> int:
        return self._n

    def __getitem__(self, r):  # type: ignore[override]
        if isinstance(r, slice):
            return [self[i] for i in range(*r.indices(self._n))]
        r = operator.index(r)
        if r < 0:
            r += self._n
        if not 0 <= r < self._n:
            raise IndexError(f"row {r} out of range (0..{self._n - 1})")
        v = self._changed.get(r)
        if v is not None:
            return v
        return self._base[r] if r < len(self._base) else ""

    def __iter__(self):
        if not self._changed:
            yield from self._base
            yield from [""] * (self._n - len(self._base))
            return
        get = self._changed.get
        for r, v in enumerate(self._base):  # never longer than _n: rows are only appended
            w = get(r)
            yield v if w is None else w
        for r in range(len(self._base), self._n):
            yield get(r, "")

    def __eq__(self, other) -> bool:
        if isinstance(other, (list, RowStrings)):
            return len(self) == len(other) and all(a == b for a, b in zip(self, other))
        return NotImplemented

    __hash__ = None  # type: ignore[assignment]


class IdIndex(Mapping[str, int]):
    """A catalogue version's item id -> row: the index of an older version (a dict or a :class:`HashIndex`),
    shared, with this version's changed ids laid over it (id -> row, None: no longer an item), as
    :class:`RowStrings` lays rows over a list."""

    __slots__ = ("_base", "_changed", "_len")

    def __init__(self, base: dict[str, int] | HashIndex, changed: dict[str, int | None], n: int):
        self._base, self._changed, self._len = base, changed, n

    @staticmethod
    def over(index: Mapping[str, int], changes: dict[str, int | None], ids: Sequence[str]) -> IdIndex:
        """``index`` (a dict, a :class:`HashIndex` or an :class:`IdIndex` over one) with ``changes`` laid over it;
        ``ids``: the new version's ids by row (a :class:`HashIndex` checks what it finds against them)."""
        n = len(index) + sum((v is not None) - (k in index) for k, v in changes.items())
        base: dict[str, int] | HashIndex
        if isinstance(index, IdIndex):
            base, changed = index._base, {**index._changed, **changes}
        else:
            base = index if isinstance(index, (dict, HashIndex)) else dict(index)
            changed = changes
        if len(changed) > max(OVERLAY_MIN, len(base) // OVERLAY_SHARE):
            if isinstance(base, HashIndex):
                return IdIndex(base.merged(changed, ids), {}, n)
            whole = base.copy()
            for k, v in changed.items():
                if v is None:
                    whole.pop(k, None)
                else:
                    whole[k] = v
            return IdIndex(whole, {}, n)
        return IdIndex(base, changed, n)

    def __getitem__(self, key: str) -> int:
        if key in self._changed:
            v = self._changed[key]
            if v is None:
                raise KeyError(key)
            return v
        return self._base[key]

    def get(self, key, default=None):  # type: ignore[override]
        if key in self._changed:
            v = self._changed[key]
            return default if v is None else v
        return self._base.get(key, default)

    def get_many(self, keys: Iterable[str], default=None) -> list:
        keys = list(keys)
        changed = self._changed
        return [(default if changed[k] is None else changed[k]) if k in changed else r
                for k, r in zip(keys, rows_of(self._base, keys, default))]

    def __contains__(self, key) -> bool:
        if key in self._changed:
            return self._changed[key] is not None
        return key in self._base

    def __len__(self) -> int:
        return self._len

    def __iter__(self):
        changed = self._changed
        yield from (k for k in self._base if k not in changed)
        yield from (k for k, v in changed.items() if v is not None)


#: from this many rows a full copy's id -> row index is a :class:`HashIndex`, below it a dict (a lookup in the dict
#: costs ~0.05 us, in the sorted hashes ~2 us alone or ~0.1 us an id in a batch)
HASHED_INDEX_FROM = 1 << 20


class HashIndex(Mapping[str, int]):
    """Item id -> row for millions of items: the ids' hashes (this process's ``hash``) sorted, with their rows.
    A lookup is a binary search, checked against the id at the row it finds (every row of an equal hash is
    tried), so it answers exactly what a dict would for ids that are unique. ``ids`` (by row) is shared, not
    copied."""

    __slots__ = ("_hashes", "_rows", "_ids")

    def __init__(self, hashes: np.ndarray, rows: np.ndarray, ids: Sequence[str]):
        self._hashes, self._rows, self._ids = hashes, rows, ids  # hashes sorted, rows in their order

    @classmethod
    def build(cls, ids: Sequence[str], rows: np.ndarray) -> HashIndex:
        """The index of ``ids[r]`` for each row of ``rows``."""
        every = len(rows) == len(ids)
        hashes = np.fromiter(map(hash, ids), np.int64, len(ids))
        if not every:
            hashes = hashes[rows]
        return cls._sorted(hashes, np.asarray(rows, dtype=np.int64), ids)

    @classmethod
    def _sorted(cls, hashes: np.ndarray, rows: np.ndarray, ids: Sequence[str]) -> HashIndex:
        order = np.argsort(hashes)
        return cls(hashes[order], rows[order], ids)

    def _positions(self, keys: list) -> np.ndarray:
        """Each key's position in the sorted hashes, -1 where it is not an id of the index."""
        hs = self._hashes
        if not keys or not len(hs):
            return np.full(len(keys), -1, dtype=np.int64)
        h = np.fromiter(map(hash, keys), np.int64, len(keys))
        at = np.minimum(hs.searchsorted(h), len(hs) - 1)
        hit = hs[at] == h
        ids, rows = self._ids, self._rows
        found = [x and ids[r] == k for x, r, k in zip(hit.tolist(), rows[at].tolist(), keys)]
        pos = np.where(found, at, -1)
        for j in np.flatnonzero(hit & ~np.asarray(found, dtype=bool)).tolist():  # another id of that hash came first
            p = int(at[j]) + 1
            while p < len(hs) and hs[p] == h[j]:
                if ids[int(rows[p])] == keys[j]:
                    pos[j] = p
                    break
                p += 1
        return pos

    def get_many(self, keys: Iterable[str], default=None) -> list:
        keys = list(keys)
        pos = self._positions(keys)
        rows = self._rows[np.maximum(pos, 0)].tolist() if len(self._rows) else [0] * len(keys)
        return [r if p >= 0 else default for p, r in zip(pos.tolist(), rows)]

    def get(self, key, default=None):  # type: ignore[override]
        return self.get_many([key], default)[0]

    def __getitem__(self, key: str) -> int:
        r = self.get(key)
        if r is None:
            raise KeyError(key)
        return r

    def __contains__(self, key) -> bool:
        return self.get(key) is not None

    def __len__(self) -> int:
        return len(self._rows)

    def __iter__(self):
        ids = self._ids
        return (ids[r] for r in self._rows.tolist())

    def merged(self, changes: Mapping[str, int | None], ids: Sequence[str]) -> HashIndex:
        """This index with ``changes`` (id -> row, None: no longer an item) laid in: a new index over ``ids``
        (the new version's ids by row); this one untouched."""
        keys = list(changes)
        keep = np.ones(len(self._rows), dtype=bool)
        pos = self._positions(keys)
        keep[pos[pos >= 0]] = False
        new = [(k, r) for k, r in changes.items() if r is not None]
        hashes = np.concatenate([self._hashes[keep], np.fromiter((hash(k) for k, _ in new), np.int64, len(new))])
        rows = np.concatenate([self._rows[keep], np.fromiter((r for _, r in new), np.int64, len(new))])
        return HashIndex._sorted(hashes, rows, ids)


def id_index(ids: Sequence[str], active: np.ndarray) -> dict[str, int] | HashIndex:
    """A full copy's item id -> row over the rows of ``active`` (``ids`` by row): a dict, or past
    :data:`HASHED_INDEX_FROM` rows a :class:`HashIndex`."""
    if len(ids) >= HASHED_INDEX_FROM:
        return HashIndex.build(ids, np.flatnonzero(active))
    return {i: r for r, i in enumerate(ids) if i}


def rows_of(index: Mapping[str, int], keys: Iterable[str], default=None) -> list:
    """``index.get(key, default)`` for each key, in one batch where the index has one (:class:`HashIndex`)."""
    if isinstance(index, (HashIndex, IdIndex)):
        return index.get_many(keys, default)
    get = index.get
    return [get(k, default) for k in keys]
