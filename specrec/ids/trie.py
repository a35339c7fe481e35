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
        self.dense: list[torch.Tensor | None] = [self._dense(d) for d in range(self.depth)]

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

    def allowed_mask(self, level: int, nodes: torch.Tensor) -> torch.Tensor:
        """Bool ``[len(nodes), V_level]``: which codes may follow each node.
        A node id of -1 (a dead prefix) allows nothing."""
        nodes = nodes.reshape(-1)
        if self.dense[level] is not None:
            return self.dense[level][nodes]  # node -1 reads the last row: nothing allowed
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
        node = torch.zeros(sids.shape[0], dtype=torch.int64)
        for d in range(sids.shape[1]):
            node = self.advance(d, node, sids[:, d])
        return node

    def contains(self, sids) -> torch.Tensor:
        sids = torch.as_tensor(np.asarray(sids), dtype=torch.int64)
        if sids.shape[1] != self.depth:
            return torch.zeros(sids.shape[0], dtype=torch.bool)
        return self.walk(sids) >= 0

    def lookup(self, sids) -> torch.Tensor:
        """Row index (item) of each full SID; -1 if it is not in the set."""
        node = self.walk(sids)
        out = torch.full_like(node, -1)
        ok = node >= 0
        out[ok] = self.leaf_item[node[ok]]
        return out
