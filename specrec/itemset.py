"""The item set: which SIDs are valid items, in one catalogue version.

The policy loop and the verifier see the catalogue only through
:class:`ItemSet`. :class:`LocalItemSet` keeps it in memory (a
:class:`~specrec.ids.trie.SidTrie` plus arrays); the item-set service keeps the
same data in Redis and hands out local snapshots per version.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
from typing import Protocol

import numpy as np
import torch

from .ids.trie import KEY_BOUND, SidTrie, key_order, mixed_radix, sid_space, splice


class ItemSet(Protocol):
    version: str
    level_sizes: list[int]

    @property
    def trie(self) -> SidTrie: ...

    def __len__(self) -> int: ...

    def contains(self, sids: np.ndarray) -> np.ndarray: ...

    def lookup(self, sids: np.ndarray) -> np.ndarray: ...

    def sids_of(self, items: np.ndarray) -> np.ndarray: ...

    def is_unseen(self, items: np.ndarray) -> np.ndarray: ...


@dataclass
class LocalItemSet:
    """An immutable in-memory catalogue snapshot.

    ``sids[i]`` is item i's SID; ``seen[i]`` says whether item i had training
    interactions (unseen items are scored with the SpecGR L-1 rule). Items
    whose row in ``active`` is False (deleted) are not valid.
    """

    sids: np.ndarray  # [N, L] int64
    seen: np.ndarray  # [N] bool
    level_sizes: list[int]
    version: str = "0"
    # [N] bool; None = all active (the default, which __post_init__ replaces by an array)
    active: np.ndarray = None  # type: ignore[assignment]

    def __post_init__(self) -> None:
        self.sids = np.ascontiguousarray(self.sids, dtype=np.int64)
        self.seen = np.asarray(self.seen, dtype=bool)
        if self.active is None:
            self.active = np.ones(len(self.sids), dtype=bool)
        self.sids_t = torch.from_numpy(self.sids)

    @cached_property
    def trie(self) -> SidTrie:
        rows = np.nonzero(self.active)[0]
        trie = SidTrie(self.sids[rows], self.level_sizes)
        # map trie rows back to catalogue item indices
        trie.leaf_item = torch.from_numpy(rows)[trie.leaf_item]
        return trie

    @cached_property
    def order(self) -> tuple[np.ndarray, np.ndarray]:
        """Active items sorted by SID, and their SIDs as sortable int keys:
        every SID prefix is one contiguous range (for prefix-restricted drafting)."""
        trie = self.__dict__.get("trie")
        if trie is not None and trie.full_keys is not None and not trie.n_duplicates:
            return trie.leaf_item.numpy(), trie.full_keys  # the trie's leaves are these, in this order: shared
        rows = np.nonzero(self.active)[0]
        o, keys = key_order(self.sid_keys(self.sids[rows]), sid_space(self.level_sizes))
        return rows[o], keys

    def sid_keys(self, sids: np.ndarray) -> np.ndarray:
        return mixed_radix(np.asarray(sids, dtype=np.int64), self.level_sizes)

    def prefix_range(self, prefix) -> tuple[int, int]:
        """[lo, hi) positions in :attr:`order` of items whose SID starts with ``prefix``."""
        rows, keys = self.order
        lo = hi = 0
        for lvl, v in enumerate(self.level_sizes):
            c = int(prefix[lvl]) if lvl < len(prefix) else None
            lo = lo * v + (c if c is not None else 0)
            hi = hi * v + (c if c is not None else v - 1)
        return int(np.searchsorted(keys, lo, "left")), int(np.searchsorted(keys, hi, "right"))

    def items_with_prefix(self, prefix) -> np.ndarray:
        lo, hi = self.prefix_range(prefix)
        return self.order[0][lo:hi]

    def items_with_prefixes(self, prefixes: np.ndarray) -> np.ndarray:
        """Items under any of ``prefixes`` [P, l] (all the same length), vectorised."""
        prefixes = np.asarray(prefixes, dtype=np.int64)
        rows, keys = self.order
        if not len(prefixes):
            return np.zeros(0, dtype=np.int64)
        depth = prefixes.shape[1]
        lo = hi = np.zeros(len(prefixes), dtype=np.int64)
        for lvl, v in enumerate(self.level_sizes):
            lo = lo * v + (prefixes[:, lvl] if lvl < depth else 0)
            hi = hi * v + (prefixes[:, lvl] if lvl < depth else v - 1)
        a, b = np.searchsorted(keys, lo, "left"), np.searchsorted(keys, hi, "right")
        spans = [rows[x:y] for x, y in zip(a.tolist(), b.tolist()) if y > x]
        return np.unique(np.concatenate(spans)) if spans else np.zeros(0, dtype=np.int64)

    @cached_property
    def n_items(self) -> int:
        """How many items are active, counted once: a snapshot's arrays do not change (a request asks, and at ten
        million rows the count is ~4 ms)."""
        return int(self.active.sum())

    def __len__(self) -> int:
        return self.n_items

    @property
    def n_rows(self) -> int:
        return len(self.sids)

    def contains(self, sids: np.ndarray) -> np.ndarray:
        return self.trie.contains(np.asarray(sids)).numpy()

    def lookup(self, sids: np.ndarray) -> np.ndarray:
        return self.trie.lookup(np.asarray(sids)).numpy()

    def sids_of(self, items: np.ndarray) -> np.ndarray:
        return self.sids[np.asarray(items, dtype=np.int64)]

    def is_unseen(self, items: np.ndarray) -> np.ndarray:
        return ~self.seen[np.asarray(items, dtype=np.int64)]

    def changed(self, sids: np.ndarray, seen: np.ndarray, active: np.ndarray, rows: np.ndarray,
                version: str) -> LocalItemSet:
        """A new snapshot of the arrays given, this one's with ``rows`` changed (a new SID, added, or made
        inactive; every other row as here, rows only ever appended). Where this one has built its
        :attr:`order`, the new one's is derived from it (the sorted keys spliced), and so is its :attr:`trie`
        where this one has built one (:meth:`SidTrie.edited`), the same as built from scratch at the cost of a
        few copies: what a follower pays for a catalogue version that changes a few of millions of items.
        Otherwise (no order built here, a code space wider than int64, more than 1,024 rows changed and a
        quarter of the items) they are built when first used; a trie not built here is not built for the new
        one either until first used (a drafter reads the order alone)."""
        new = LocalItemSet(sids, seen, self.level_sizes, version, active)
        rows = np.unique(np.asarray(rows, dtype=np.int64))
        trie = self.__dict__.get("trie")
        if ("order" not in self.__dict__ or sid_space(self.level_sizes) >= KEY_BOUND
                or (trie is not None and trie.full_keys is None) or len(rows) > max(1024, len(self) // 4)):
            return new
        was = rows[rows < self.n_rows]
        was = was[self.active[was]]
        now = rows[new.active[rows]]
        gk, ck = self.sid_keys(self.sids[was]), self.sid_keys(new.sids[now])
        same = np.isin(was, now)  # a row with the same SID before and after is no change
        if same.any():
            kept = set(zip(was[same].tolist(), gk[same].tolist())) & set(zip(now.tolist(), ck.tolist()))
            g = np.array([(r, k) not in kept for r, k in zip(was.tolist(), gk.tolist())], dtype=bool)
            c = np.array([(r, k) not in kept for r, k in zip(now.tolist(), ck.tolist())], dtype=bool)
            was, gk, now, ck = was[g], gk[g], now[c], ck[c]
        o = np.lexsort((now, ck))
        now, ck = now[o], ck[o]
        R, K = self.order
        drop = np.sort(_position(R, K, gk, was))
        at = _position(R, K, ck, now)
        K2 = splice(K, drop, at, ck)
        R2 = splice(R, drop, at, now)
        if trie is not None:
            new.__dict__["trie"] = trie.edited(gk, ck, K2, R2)
        new.__dict__["order"] = (R2, K2)  # with no duplicated SIDs, the trie's leaf arrays themselves
        return new

    def with_items(
        self, new_sids: np.ndarray, new_seen: np.ndarray | None = None, version: str | None = None
    ) -> LocalItemSet:
        """A new snapshot with items appended (new items are unseen by default)."""
        new_sids = np.asarray(new_sids, dtype=np.int64).reshape(-1, len(self.level_sizes))
        seen = np.zeros(len(new_sids), bool) if new_seen is None else np.asarray(new_seen, bool)
        return LocalItemSet(
            np.concatenate([self.sids, new_sids]), np.concatenate([self.seen, seen]), self.level_sizes,
            version or str(int(self.version) + 1 if self.version.isdigit() else self.version + "+"),
            np.concatenate([self.active, np.ones(len(new_sids), bool)]),
        )


def _position(rows: np.ndarray, keys: np.ndarray, k: np.ndarray, r: np.ndarray) -> np.ndarray:
    """Where each (key ``k``, row ``r``) stands in ``keys``, ``rows`` sorted by key then row (an item's own
    position when it is there, else where it would go)."""
    lo = np.searchsorted(keys, k, side="left")
    hi = np.searchsorted(keys, k, side="right")
    if not len(rows):
        return lo
    pos = lo + ((hi - lo == 1) & (rows[np.minimum(lo, len(rows) - 1)] < r))
    for i in np.nonzero(hi - lo > 1)[0].tolist():  # rows of one key (a SID several items share): by row
        pos[i] = lo[i] + np.searchsorted(rows[lo[i]:hi[i]], r[i])
    return pos
