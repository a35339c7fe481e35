"""A prefix trie over valid SIDs, for constrained decoding and exact membership.

Stored level by level in CSR form as torch tensors, so beam search can mask
and advance whole batches of prefixes without Python loops:

- ``node`` ids at depth ``d`` number the distinct SID prefixes of length d
  (depth 0 has one node, the root);
- edges from depth d to d+1 are sorted by ``(parent, code)``, with keys
  ``parent * V_d + code`` for ``searchsorted``; an edge's index is the id of
  the child node it leads to; ``ptr[d]`` (int32, [parents + 1]) and
  ``codes[d]`` (int32, [edges]) are each parent's range of edges and each
  edge's code.

Memory is O(number of edges), so it scales to large catalogues. The whole
searches read the same arrays (:meth:`SidTrie.search_tables`, the form
:mod:`.tables` describes), with a dense child table for the levels small
enough to keep one. Where a level's ``nodes x codes`` bool mask is small
(under :data:`DENSE_LIMIT` cells; all of Beauty's levels), the step-by-step
search's allowed-code mask is kept dense too, so masking a batch of beams is
one gather instead of a CSR expansion.

:meth:`SidTrie.excluding` gives one request its own view of the trie without
some items (the request's history, say): the excluded leaves, and every
prefix left without a valid item, are cut, so a constrained search still
returns K valid items. The view shares the trie's arrays and search tables;
it adds only the short lists of what it cuts.
"""

from __future__ import annotations

import numpy as np
import torch

from .tables import Level, edge_parents, empty_cut, level_of

DENSE_LIMIT = 1 << 25  # cells of a dense allowed-code mask per level for step-by-step search (bool: 32 MiB)


#: mixed-radix SID keys (and key * rows + row) are exact in int64 below this
KEY_BOUND = 2.0**62


def sid_space(level_sizes: list[int]) -> float:
    """How many SIDs the level sizes allow: the bound of their mixed-radix keys (:func:`mixed_radix`)."""
    return float(np.prod(np.asarray(level_sizes, dtype=np.float64)))


def key_order(keys: np.ndarray, space: float) -> tuple[np.ndarray, np.ndarray]:
    """The stable order of int64 ``keys`` below ``space`` (ties by position) and the keys in it. Where
    key * len(keys) + position fits int64, one plain sort of those (distinct, so the same order, and numpy's
    vectorised sort: 0.8 s for ten million keys where the stable argsort took 2.2)."""
    n = len(keys)
    if space * max(n, 1) < KEY_BOUND:
        srt = np.sort(keys * n + np.arange(n, dtype=np.int64))
        return srt % max(n, 1), srt // max(n, 1)
    order = np.argsort(keys, kind="stable")
    return order, keys[order]


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
        space = sid_space(self.level_sizes)
        fits = space < KEY_BOUND
        # lexicographic order: the mixed-radix keys' stable order where they fit int64 (key_order; the same order
        # as lexsort's, a fraction of its time: what a follower's every catalogue version pays at millions of items)
        full = mixed_radix(sids, self.level_sizes) if fits else None
        n = len(sids)
        full_sorted = None  # the keys in SID order, where they fit int64
        if full is not None:
            order, full_sorted = key_order(full, space)
        else:
            order = np.lexsort(sids.T[::-1])
        cols = [np.take(sids[:, d], order) for d in range(self.depth)]  # each level's codes in SID order
        self.keys: list[torch.Tensor] = []  # per depth d: sorted edge keys parent*V_d+code
        self.ptr: list[torch.Tensor] = []  # per depth d: CSR pointer over parents, int32
        self.codes: list[torch.Tensor] = []  # per depth d: child code per edge, int32
        parent = np.zeros(n, dtype=np.int64)  # node id of each SID's prefix at depth d
        n_parents = 1
        new = np.ones(n, dtype=bool)
        for d in range(self.depth):
            # prefixes of length d+1 are unique (parent, code) pairs; the rows are in SID order
            pair = parent * self.level_sizes[d]
            pair += cols[d]
            new = np.ones(n, dtype=bool)
            np.not_equal(pair[1:], pair[:-1], out=new[1:])
            at = np.flatnonzero(new)  # each prefix's first row
            edge_keys = pair[at]
            if len(edge_keys) >= 2**31:
                raise ValueError(f"{len(edge_keys)} prefixes at level {d}: more than int32 node ids hold")
            self.keys.append(torch.from_numpy(edge_keys))
            self.codes.append(torch.from_numpy(cols[d][at].astype(np.int32)))
            counts = np.bincount(parent[at], minlength=n_parents)
            ptr = np.zeros(n_parents + 1, dtype=np.int32)
            np.cumsum(counts, out=ptr[1:])
            self.ptr.append(torch.from_numpy(ptr))
            parent = np.cumsum(new) - 1  # each row's node at this depth: the parent of the next
            n_parents = len(edge_keys)
        # leaves (depth L) -> row of the original sids array: of a leaf several items share, the last (the
        # highest row), what :meth:`edited` keeps too
        last = np.ones(n, dtype=bool)
        last[:-1] = new[1:]
        self.leaf_item = torch.from_numpy(order[last])
        self.n_duplicates = n - n_parents
        # every full SID as one mixed-radix key, sorted (leaf ids are numbered in this order), so a complete
        # SID finds its leaf in one searchsorted instead of one per level (None where the keys overflow int64)
        self.full_keys: np.ndarray | None = None
        if full_sorted is not None:
            self.full_keys = full_sorted[new] if n else np.zeros(0, dtype=np.int64)
        self.dense: list[torch.Tensor | None] = [self._dense(d) for d in range(self.depth)]
        self._search_tables: dict[int, list[Level]] = {}

    def _dense(self, level: int) -> torch.Tensor | None:
        """[n_parents + 1, V] bool allowed-code table (its last row, read by node -1, allows nothing)."""
        n, v = len(self.ptr[level]) - 1, self.level_sizes[level]
        if (n + 1) * v > DENSE_LIMIT:
            return None
        table = torch.zeros(n + 1, v, dtype=torch.bool)
        table[edge_parents(self.ptr[level]), self.codes[level].long()] = True
        return table

    def __len__(self) -> int:
        return self.n_sids

    def search_tables(self, vmax: int) -> list[Level]:
        """Per level, the children of its nodes as the whole searches read them (:mod:`.tables`): a dense
        ``[nodes + 1, vmax]`` int32 table where :func:`~.tables.dense_level` keeps one, else the trie's own CSR
        arrays; no cut. Built once per trie (a view's: its catalogue's, with its cut lists)."""
        if vmax not in self._search_tables:
            self._search_tables[vmax] = [level_of(p, c, vmax) for p, c in zip(self.ptr, self.codes)]
        return self._search_tables[vmax]

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
        start = ptr[nodes[rows]].long()
        count = ptr[nodes[rows] + 1].long() - start
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
        node, leaf = self.walk(sids).numpy(), self.leaf_item.numpy()
        if not len(leaf):  # no items: nothing to read (an empty catalogue's version)
            return torch.full(node.shape, -1, dtype=torch.int64)
        return torch.from_numpy(np.where(node >= 0, leaf[np.maximum(node, 0)], -1))

    def edited(self, gone: np.ndarray, come: np.ndarray, keys: np.ndarray, rows: np.ndarray) -> SidTrie:
        """This trie after the items whose full keys (:func:`mixed_radix`) are ``gone`` left it and those whose
        keys are ``come`` joined it (both multisets), bit for bit the trie built from the items left: ``keys``
        is every item's full key after the change, sorted, and ``rows`` each one's row (``leaf_item``; ties
        sorted by row). The nodes on the changed keys' paths are found in the old levels and every level is
        spliced (a memcpy of each array, the node ids after an inserted or removed node shifted in place), so
        a version that changes a few items costs O(items) copies, not a sort: a follower's every catalogue
        version at millions of items. Where no leaf holds two items the leaves' arrays are ``keys`` and
        ``rows`` themselves (shared, not copied). Only a trie whose keys fit int64 (``full_keys``)."""
        if self.full_keys is None:
            raise ValueError("edited: the SIDs' code space does not fit one int64 key: build the trie again")
        cand = np.unique(np.concatenate([np.asarray(gone, np.int64), np.asarray(come, np.int64)]))
        if not len(cand):
            return self
        V, L = self.level_sizes, self.depth
        div = [1] * (L + 1)
        for d in range(L - 1, -1, -1):
            div[d] = div[d + 1] * V[d]
        out = SidTrie.__new__(SidTrie)
        out.level_sizes, out.depth, out.n_sids = list(V), L, len(keys)
        out.keys, out.ptr, out.codes, out._search_tables = [], [], [], {}
        dense: list[torch.Tensor | None] = []
        # the previous depth's candidate prefixes: value, in the old trie (and its old id, else how many old nodes
        # sort before it), new id (-1 if gone); the nodes removed (old ids) and inserted (old rank) at that depth
        uq, ex_old, rank, new_id = np.zeros(1, np.int64), np.ones(1, bool), np.zeros(1, np.int64), np.zeros(1, np.int64)
        D, A_rank = np.zeros(0, np.int64), np.zeros(0, np.int64)
        for d in range(L):
            v = V[d]
            okeys, optr, ocodes = self.keys[d].numpy(), self.ptr[d].numpy(), self.codes[d].numpy()
            q = np.unique(cand // div[d + 1])
            pi = np.searchsorted(uq, q // v)  # each one's parent among the previous depth's candidates
            p_ex, p_rank, code = ex_old[pi], rank[pi], q % v
            ek = p_rank * v + code
            pos = np.searchsorted(okeys, ek)
            q_ex = p_ex & (pos < len(okeys))
            q_ex[q_ex] = okeys[pos[q_ex]] == ek[q_ex]
            q_rank = np.where(p_ex, pos, optr[p_rank].astype(np.int64))
            ex_new = np.searchsorted(keys, (q + 1) * div[d + 1]) > np.searchsorted(keys, q * div[d + 1])
            dele, ins = q_ex & ~ex_new, ~q_ex & ex_new
            qD, qA = q_rank[dele], q_rank[ins]
            q_new = np.full(len(q), -1, np.int64)
            stay = q_ex & ex_new
            q_new[stay] = (q_rank[stay] - np.searchsorted(qD, q_rank[stay])
                           + np.searchsorted(qA, q_rank[stay], side="right"))
            q_new[ins] = qA - np.searchsorted(qD, qA) + np.arange(len(qA))
            a_parent = new_id[pi[ins]]  # the new parent of each inserted edge
            a_code = code[ins]
            # level d's edges (one per node of depth d + 1)
            codes = splice(ocodes, qD, qA, a_code.astype(np.int32))
            ekeys = splice(okeys, qD, qA, np.zeros(len(qA), np.int64))
            b = np.concatenate([optr[D + 1], optr[A_rank]]).astype(np.int64)  # old edges after a parent's change
            add_steps(ekeys, b - np.searchsorted(qD, b) + np.searchsorted(qA, b, side="right"),
                      np.concatenate([np.full(len(D), -v), np.full(len(A_rank), v)]))
            ekeys[q_new[ins]] = a_parent * v + a_code
            if len(ekeys) >= 2**31:
                raise ValueError(f"{len(ekeys)} prefixes at level {d}: more than int32 node ids hold")
            # the CSR pointer over depth d's nodes: entries of removed parents out, of inserted ones in, then the
            # edges removed (by old parent) and inserted (by new parent) counted off and in
            ptr = splice(optr, D, A_rank, optr[A_rank])
            j1 = p_rank[dele] + 1
            add_steps(ptr, np.concatenate([j1 - np.searchsorted(D, j1) + np.searchsorted(A_rank, j1), a_parent + 1]),
                      np.concatenate([np.full(len(j1), -1), np.ones(len(a_parent), np.int64)]))
            out.keys.append(torch.from_numpy(ekeys))
            out.codes.append(torch.from_numpy(codes))
            out.ptr.append(torch.from_numpy(ptr))
            old_dense = self.dense[d]
            if (len(ptr)) * v > DENSE_LIMIT or old_dense is None:
                dense.append(None)
            else:  # rows of removed parents out, empty rows of inserted ones in, the changed parents' rows again
                t = splice(old_dense.numpy(), D, A_rank, np.zeros((len(A_rank), v), bool))
                redo = np.unique(np.concatenate([new_id[pi[dele]], a_parent]))
                for p in redo[redo >= 0].tolist():
                    t[p] = False
                    t[p, codes[ptr[p]:ptr[p + 1]]] = True
                dense.append(torch.from_numpy(t))
            uq, ex_old, rank, new_id, D, A_rank = q, q_ex, q_rank, q_new, qD, qA
        n_leaves = len(out.codes[-1])
        out.n_duplicates = len(keys) - n_leaves
        if not out.n_duplicates:  # one item per leaf: the leaves are the items in key order
            out.full_keys, out.leaf_item = keys, torch.from_numpy(rows)
        else:
            out.full_keys = splice(self.full_keys, D, A_rank, uq[~ex_old & (new_id >= 0)])
            leaf = splice(self.leaf_item.numpy(), D, A_rank, np.zeros(len(A_rank), np.int64))
            live = new_id >= 0  # a changed leaf's item: its last row, as the full build's
            leaf[new_id[live]] = rows[np.searchsorted(keys, uq[live], side="right") - 1]
            out.leaf_item = torch.from_numpy(leaf)
        out.dense = [t if t is not None else out._dense(d) for d, t in enumerate(dense)]
        return out


def mixed_radix(sids: np.ndarray, level_sizes: list[int]) -> np.ndarray:
    """Rows of codes [N, l] (l <= L, leading levels) -> one int64 key each, in the lexicographic order of the
    rows (the caller makes sure the product of the level sizes fits)."""
    key = np.zeros(len(sids), dtype=np.int64)
    for d, v in enumerate(level_sizes[: sids.shape[1]]):
        key = key * v + sids[:, d]
    return key


def splice(a: np.ndarray, drop: np.ndarray, at: np.ndarray, values: np.ndarray) -> np.ndarray:
    """``a`` without its elements (rows) at positions ``drop`` (sorted, distinct) and with ``values`` inserted
    before the elements at positions ``at`` (sorted; ``len(a)``: at the end; several at one position in the
    order given), both in ``a``'s own numbering: a new array, copied piece by piece for a few edits."""
    drop, at = np.asarray(drop, np.int64), np.asarray(at, np.int64)
    values = np.asarray(values, a.dtype)
    if len(drop) + len(at) > 64:
        return np.insert(np.delete(a, drop, axis=0), at - np.searchsorted(drop, at), values, axis=0)
    pieces, start, i, j = [], 0, 0, 0
    at_l, drop_l = at.tolist(), drop.tolist()
    while i < len(at_l) or j < len(drop_l):
        if i < len(at_l) and (j == len(drop_l) or at_l[i] <= drop_l[j]):
            pieces += [a[start:at_l[i]], values[i:i + 1]]
            start, i = at_l[i], i + 1
        else:
            pieces.append(a[start:drop_l[j]])
            start, j = drop_l[j] + 1, j + 1
    pieces.append(a[start:])
    return np.concatenate(pieces)


def add_steps(a: np.ndarray, starts: np.ndarray, deltas: np.ndarray) -> None:
    """In place, ``a[s:] += d`` for each start ``s`` and delta ``d`` (one pass over ``a`` at most)."""
    if not len(starts):
        return
    o = np.argsort(starts, kind="stable")
    s, c = np.asarray(starts)[o].tolist(), np.cumsum(np.asarray(deltas)[o]).tolist()
    if len(s) > 64:
        step = np.zeros(len(a) + 1, dtype=np.int64)
        np.add.at(step, np.minimum(np.asarray(starts), len(a)), deltas)
        a += np.cumsum(step[:-1]).astype(a.dtype)
        return
    for lo, hi, v in zip(s, s[1:] + [len(a)], c):
        if v and hi > lo:
            a[lo:hi] += v


class ExcludingTrie(SidTrie):
    """A :class:`SidTrie` without some of its items, for one request.

    It shares its base's arrays. ``cut[d]`` holds the node ids at depth
    ``d + 1`` that are gone: the excluded leaves, then each prefix all of
    whose children are gone. :meth:`advance` (so ``walk``, ``contains``,
    ``lookup``) and :meth:`allowed_mask` never reach a cut node, and
    :meth:`search_tables` are the base's with the cut (parent, code) pairs
    of each level (:mod:`.tables`): nothing is copied. Nothing is cached on
    the base, so a view lives and dies with its request."""

    def __init__(self, base: SidTrie, sids: np.ndarray):  # noqa: D107 - no SidTrie.__init__: the arrays are shared
        self.base = base
        self.level_sizes, self.depth = base.level_sizes, base.depth
        self.keys, self.ptr, self.codes = base.keys, base.ptr, base.codes
        self.leaf_item, self.n_duplicates, self.dense = base.leaf_item, base.n_duplicates, base.dense
        self.full_keys = base.full_keys
        self._search_tables = {}
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
            parents = _parent_of(base.ptr[d], gone)  # the parent (depth d) of each cut edge
            uniq, n_cut = torch.unique(parents, return_counts=True)
            total = base.ptr[d][uniq + 1].long() - base.ptr[d][uniq].long()
            cut[d - 1] = uniq[n_cut == total]
        self.cut = cut
        # (parent node, code) of each cut edge per level, for masks and tables
        self.cut_parent, self.cut_code = [], []
        for d in range(self.depth):
            gone = cut[d]
            self.cut_parent.append(_parent_of(base.ptr[d], gone))
            self.cut_code.append(base.codes[d][gone].long())

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

    def search_tables(self, vmax: int) -> list[Level]:
        if vmax not in self._search_tables:
            self._search_tables[vmax] = [
                lv if not len(parent) else lv.with_cut(torch.cat([torch.stack([parent, code]), empty_cut()], 1))
                for lv, parent, code in zip(self.base.search_tables(vmax), self.cut_parent, self.cut_code)]
        return self._search_tables[vmax]


def _parent_of(ptr: torch.Tensor, edges: torch.Tensor) -> torch.Tensor:
    """The parent node of each of ``edges`` (int64) by the level's CSR pointer ``ptr`` -> int64."""
    return torch.searchsorted(ptr, edges.to(ptr.dtype), right=True).long() - 1
