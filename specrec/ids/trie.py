"""A prefix trie over valid SIDs, for constrained decoding and exact membership.

Stored level by level in CSR form as torch tensors, so beam search can mask
and advance whole batches of prefixes without Python loops:

- ``node`` ids at depth ``d`` number the distinct SID prefixes of length d
  (depth 0 has one node, the root);
- edges from depth d to d+1 are sorted by ``(parent, code)``, with keys
  ``parent * V_d + code`` for ``searchsorted``; an edge's index is the id of
  the child node it leads to.

Memory is O(number of edges), so it scales to large catalogues. Where a
level's ``nodes x codes`` table is small (under :data:`DENSE_LIMIT` cells; all
of Beauty's levels), its allowed-code mask is also kept dense, so masking a
batch of beams is one gather instead of a CSR expansion.

:meth:`SidTrie.excluding` gives one request its own view of the trie without
some items (the request's history, say): the excluded leaves, and every
prefix left without a valid item, are cut, so a constrained search still
returns K valid items. The view shares the trie's arrays; only its
:meth:`~SidTrie.child_tables` copies the levels it cuts.
"""

from __future__ import annotations

import numpy as np
import torch

DENSE_LIMIT = 1 << 25  # cells of a dense allowed-code table per level (bool: 32 MiB)


class SidTrie:
    def __init__(self, sids: np.ndarray, level_sizes: list[int]):
        sids = np.asarray(sids, dtype=np.int64)
        if sids.ndim != 2 or sids.shape[1] != len(level_sizes):
            raise ValueError(f"sids must be [N, {len(level_sizes)}]")
        if len(sids) and (sids.min() < 0 or np.any(sids.max(0) >= np.asarray(level_sizes))):
            raise ValueError("SID code out of range for level sizes")
        self.level_sizes = list(level_sizes)
        self.depth = len(level_sizes)
        self.n_sids = len(sids)
        order = np.lexsort(sids.T[::-1])
        s = sids[order]
        self.keys: list[torch.Tensor] = []  # per depth d: sorted edge keys parent*V_d+code
        self.ptr: list[torch.Tensor] = []  # per depth d: CSR pointer over parents
        self.codes: list[torch.Tensor] = []  # per depth d: child code per edge
        parent = np.zeros(len(s), dtype=np.int64)  # node id of each SID's prefix at depth d
        n_parents = 1
        for d in range(self.depth):
            # prefixes of length d+1 are unique (parent, code) pairs; s is sorted
            pair = parent * self.level_sizes[d] + s[:, d]
            new = np.ones(len(s), dtype=bool)
            new[1:] = pair[1:] != pair[:-1]
            edge_keys = pair[new]
            child_of_row = np.cumsum(new) - 1
            edge_parent = parent[new]
            self.keys.append(torch.from_numpy(edge_keys.copy()))
            self.codes.append(torch.from_numpy(s[new, d].copy()))
            counts = np.bincount(edge_parent, minlength=n_parents)
            ptr = np.zeros(n_parents + 1, dtype=np.int64)
            np.cumsum(counts, out=ptr[1:])
            self.ptr.append(torch.from_numpy(ptr))
            parent = child_of_row
            n_parents = len(edge_keys)
        # leaves (depth L) -> row of the original sids array
        self.leaf_item = torch.empty(n_parents, dtype=torch.int64)
        if len(s):
            self.leaf_item[torch.from_numpy(parent)] = torch.from_numpy(order)
        self.n_duplicates = len(s) - n_parents
        # every full SID as one mixed-radix key, sorted (leaf ids are numbered in this order), so a complete
        # SID finds its leaf in one searchsorted instead of one per level (None where the keys overflow int64)
        self.full_keys: np.ndarray | None = None
        if float(np.prod(np.asarray(self.level_sizes, dtype=np.float64))) < 2.0**62:
            self.full_keys = mixed_radix(s, self.level_sizes)[new] if len(s) else np.zeros(0, dtype=np.int64)
        self.dense: list[torch.Tensor | None] = [self._dense(d) for d in range(self.depth)]
        self._child_tables: dict[int, list[torch.Tensor] | None] = {}

    def _dense(self, level: int) -> torch.Tensor | None:
        """[n_parents + 1, V] bool allowed-code table (its last row, read by node -1, allows nothing)."""
        ptr = self.ptr[level]
        n, v = len(ptr) - 1, self.level_sizes[level]
        if (n + 1) * v > DENSE_LIMIT:
            return None
        table = torch.zeros(n + 1, v, dtype=torch.bool)
        parent = torch.repeat_interleave(torch.arange(n), ptr[1:] - ptr[:-1])
        table[parent, self.codes[level]] = True
        return table

    def __len__(self) -> int:
        return self.n_sids

    def child_tables(self, vmax: int) -> list[torch.Tensor] | None:
        """Per level, a dense ``[nodes + 1, vmax]`` int32 table of child node ids (-1: no child; the last
        row, read by node -1, is all -1), the form the fused search graphs gather from; None when a level
        is too big for a dense table. Built once per trie."""
        if vmax not in self._child_tables:
            out: list[torch.Tensor] | None = []
            for level in range(self.depth):
                if self.dense[level] is None:
                    out = None
                    break
                ptr = self.ptr[level]
                n = len(ptr) - 1
                table = torch.full((n + 1, vmax), -1, dtype=torch.int32)
                parent = torch.repeat_interleave(torch.arange(n), ptr[1:] - ptr[:-1])
                table[parent, self.codes[level]] = torch.arange(len(self.codes[level]), dtype=torch.int32)
                out.append(table)  # type: ignore[union-attr]
            self._child_tables[vmax] = out
        return self._child_tables[vmax]

    def excluding(self, sids) -> SidTrie:
        """This trie without the items whose SIDs are given (rows of ``sids``; ones not in the trie are
        ignored): a per-request view, see :class:`ExcludingTrie`. Returns ``self`` when nothing is cut."""
        sids = np.asarray(sids, dtype=np.int64).reshape(-1, self.depth)
        if not len(sids):
            return self
        view = ExcludingTrie(self, sids)
        return view if view.n_excluded else self

    def allowed_mask(self, level: int, nodes: torch.Tensor) -> torch.Tensor:
        """Bool ``[len(nodes), V_level]``: which codes may follow each node.
        A node id of -1 (a dead prefix) allows nothing."""
        nodes = nodes.reshape(-1)
        dense = self.dense[level]
        if dense is not None:
            return dense[nodes]  # node -1 reads the last row: nothing allowed
        v = self.level_sizes[level]
        mask = torch.zeros(len(nodes), v, dtype=torch.bool)
        alive = nodes >= 0
        if not bool(alive.any()):
            return mask
        rows = torch.nonzero(alive).squeeze(1)
        ptr = self.ptr[level]
        start = ptr[nodes[rows]]
        count = ptr[nodes[rows] + 1] - start
        total = int(count.sum())
        if total == 0:
            return mask
        row_idx = torch.repeat_interleave(rows, count)
        offs = torch.arange(total) - torch.repeat_interleave(torch.cumsum(count, 0) - count, count)
        edge = torch.repeat_interleave(start, count) + offs
        mask[row_idx, self.codes[level][edge]] = True
        return mask

    def advance(self, level: int, nodes: torch.Tensor, codes: torch.Tensor) -> torch.Tensor:
        """Node ids after appending ``codes`` at ``level``; -1 where invalid."""
        keys = self.keys[level]
        q = nodes * self.level_sizes[level] + codes
        pos = torch.searchsorted(keys, q).clamp(max=max(len(keys) - 1, 0))
        if len(keys) == 0:
            return torch.full_like(nodes, -1)
        ok = (keys[pos] == q) & (nodes >= 0) & (codes >= 0) & (codes < self.level_sizes[level])
        return torch.where(ok, pos, torch.full_like(pos, -1))

    def walk(self, sids: torch.Tensor | np.ndarray) -> torch.Tensor:
        """Node id reached by each (possibly partial) SID row; -1 if off-trie."""
        sids = torch.as_tensor(np.asarray(sids), dtype=torch.int64)
        if sids.shape[1] == self.depth and self.full_keys is not None:
            return self._leaf_of(sids)
        node = torch.zeros(sids.shape[0], dtype=torch.int64)
        for d in range(sids.shape[1]):
            node = self.advance(d, node, sids[:, d])
        return node

    def _leaf_of(self, sids: torch.Tensor) -> torch.Tensor:
        """The leaf of each complete SID row [N, L] (-1 if it is not in the set) by one search of the full keys."""
        keys, s = self.full_keys, sids.numpy()
        assert keys is not None
        if not len(keys) or not len(s):
            return torch.full(sids.shape[:1], -1, dtype=torch.int64)
        valid = ((s >= 0) & (s < np.asarray(self.level_sizes))).all(1)
        q = mixed_radix(np.maximum(s, 0), self.level_sizes)
        pos = np.minimum(np.searchsorted(keys, q), len(keys) - 1)
        return torch.from_numpy(np.where(valid & (keys[pos] == q), pos, -1))

    def contains(self, sids) -> torch.Tensor:
        sids = torch.as_tensor(np.asarray(sids), dtype=torch.int64)
        if sids.shape[1] != self.depth:
            return torch.zeros(sids.shape[0], dtype=torch.bool)
        return self.walk(sids) >= 0

    def lookup(self, sids) -> torch.Tensor:
        """Row index (item) of each full SID; -1 if it is not in the set."""
        node = self.walk(sids).numpy()
        return torch.from_numpy(np.where(node >= 0, self.leaf_item.numpy()[np.maximum(node, 0)], -1))


def mixed_radix(sids: np.ndarray, level_sizes: list[int]) -> np.ndarray:
    """Rows of codes [N, l] (l <= L, leading levels) -> one int64 key each, in the lexicographic order of the
    rows (the caller makes sure the product of the level sizes fits)."""
    key = np.zeros(len(sids), dtype=np.int64)
    for d, v in enumerate(level_sizes[: sids.shape[1]]):
        key = key * v + sids[:, d]
    return key


class ExcludingTrie(SidTrie):
    """A :class:`SidTrie` without some of its items, for one request.

    It shares its base's arrays. ``cut[d]`` holds the node ids at depth
    ``d + 1`` that are gone: the excluded leaves, then each prefix all of
    whose children are gone. :meth:`advance` (so ``walk``, ``contains``,
    ``lookup``) and :meth:`allowed_mask` never reach a cut node, and
    :meth:`child_tables` copies only the levels that have cuts. Nothing is
    cached on the base, so a view lives and dies with its request."""

    def __init__(self, base: SidTrie, sids: np.ndarray):  # noqa: D107 - no SidTrie.__init__: the arrays are shared
        self.base = base
        self.level_sizes, self.depth = base.level_sizes, base.depth
        self.keys, self.ptr, self.codes = base.keys, base.ptr, base.codes
        self.leaf_item, self.n_duplicates, self.dense = base.leaf_item, base.n_duplicates, base.dense
        self.full_keys = base.full_keys
        self._child_tables = {}
        # node ids along each excluded SID's path (depth 1..L)
        path = []
        node = torch.zeros(len(sids), dtype=torch.int64)
        st = torch.from_numpy(sids)
        for d in range(self.depth):
            node = SidTrie.advance(base, d, node, st[:, d])
            path.append(node)
        leaves = torch.unique(path[-1][path[-1] >= 0])
        self.excluded_sids = sids[(path[-1] >= 0).numpy()]  # the excluded SIDs that are items of the base
        self.n_excluded = len(leaves)
        self.n_sids = base.n_sids - self.n_excluded
        cut: list[torch.Tensor] = [torch.zeros(0, dtype=torch.int64) for _ in range(self.depth)]
        cut[-1] = leaves
        for d in range(self.depth - 1, 0, -1):  # a node at depth d whose children (depth d + 1) are all cut
            gone = cut[d]
            if not len(gone):
                break
            parents = torch.searchsorted(base.ptr[d], gone, right=True) - 1  # parent (depth d) of each cut edge
            uniq, n_cut = torch.unique(parents, return_counts=True)
            total = base.ptr[d][uniq + 1] - base.ptr[d][uniq]
            cut[d - 1] = uniq[n_cut == total]
        self.cut = cut
        # (parent node, code) of each cut edge per level, for masks and tables
        self.cut_parent, self.cut_code = [], []
        for d in range(self.depth):
            gone = cut[d]
            self.cut_parent.append(torch.searchsorted(base.ptr[d], gone, right=True) - 1)
            self.cut_code.append(base.codes[d][gone])

    def allowed_mask(self, level: int, nodes: torch.Tensor) -> torch.Tensor:
        mask = SidTrie.allowed_mask(self, level, nodes)
        nodes = nodes.reshape(-1)
        if len(self.cut[level]) and len(nodes):
            dense = self.dense[level]
            if dense is not None and mask.data_ptr() == dense.data_ptr():
                mask = mask.clone()
            hit = nodes.unsqueeze(1) == self.cut_parent[level].unsqueeze(0)  # [n, cuts]
            row, j = hit.nonzero(as_tuple=True)
            mask[row, self.cut_code[level][j]] = False
        return mask

    def _leaf_of(self, sids: torch.Tensor) -> torch.Tensor:
        out = SidTrie._leaf_of(self, sids)  # a leaf under a cut prefix is cut itself
        return torch.where(torch.isin(out, self.cut[-1]), -1, out) if len(self.cut[-1]) else out

    def advance(self, level: int, nodes: torch.Tensor, codes: torch.Tensor) -> torch.Tensor:
        out = SidTrie.advance(self, level, nodes, codes)
        if len(self.cut[level]):
            out = torch.where(torch.isin(out, self.cut[level]), torch.full_like(out, -1), out)
        return out

    def child_tables(self, vmax: int) -> list[torch.Tensor] | None:
        if vmax not in self._child_tables:
            base = self.base.child_tables(vmax)
            if base is None:
                self._child_tables[vmax] = None
            else:
                out = []
                for d, table in enumerate(base):
                    if len(self.cut[d]):
                        table = table.clone()
                        table[self.cut_parent[d], self.cut_code[d]] = -1
                    out.append(table)
                self._child_tables[vmax] = out
        return self._child_tables[vmax]
