"""Prefix trees: verify many SIDs in one decoder pass over their unique prefixes.

Scoring N drafted SIDs of L codes teacher-forced costs N x L decoder tokens
when done flat. Most of those tokens repeat: every draft starts with BOS, and
drafts that share a first code share that position too. A :class:`PrefixTree`
keeps each distinct prefix once per request, as one node:

- the root is the empty prefix (token BOS, decoder position 0);
- a node of depth j (a prefix of j codes, 1 <= j <= L-1) has as token its last
  code and decoder position j;
- a node attends to its ancestors and itself (``mask``), so its hidden state
  is exactly the one a flat teacher-forced pass computes for that prefix.

The pass's output at a node of depth j is the distribution of level j after
the node's prefix. Scoring a full SID reads level j at the node of its first j
codes; a beam step after a prefix reads it at the prefix's node.

Nodes are found by integer keys: a prefix of j codes is the mixed-radix number
of its codes, and ``(request, depth, prefix)`` one sortable key. Building and
looking up are vectorised (numpy), no Python loop per node.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from ..models.tiger import BOS_TOKEN, N_SPECIAL, PAD_TOKEN


def prefix_keys(codes: np.ndarray, level_sizes: Sequence[int]) -> np.ndarray:
    """Mixed-radix key of each prefix ``codes[..., :j]`` (j = codes.shape[-1])."""
    key = np.zeros(codes.shape[:-1], dtype=np.int64)
    for lvl in range(codes.shape[-1]):
        key = key * level_sizes[lvl] + codes[..., lvl]
    return key


@dataclass
class PrefixTree:
    """The unique prefixes of R requests' SID sets, laid out for one pass.

    ``tokens``/``positions`` [R, T], ``mask`` [R, T, T] are the pass's inputs
    (padding nodes hold PAD and attend only to themselves); ``keys`` are the
    sorted node keys and ``cols`` each node's column in its request's row."""

    tokens: torch.Tensor  # [R, T] int64
    positions: torch.Tensor  # [R, T] int64 (node depth)
    mask: torch.Tensor  # [R, T, T] bool
    keys: np.ndarray  # [n_nodes] sorted (request, depth, prefix) keys
    cols: np.ndarray  # [n_nodes] column of each node in its request's row
    n_nodes: np.ndarray  # [R] nodes per request
    level_sizes: list[int]
    space: int  # number of distinct prefix keys per (request, depth)
    drafted: np.ndarray | None = None  # sorted keys of every prefix (lengths 1..L) of the drafted SIDs

    def was_drafted(self, prefixes: np.ndarray, rows: np.ndarray | None = None) -> np.ndarray:
        """[R, B, V] bool: code c after prefix ``prefixes[r, b]`` [R, B, l] extends a drafted SID."""
        prefixes = np.asarray(prefixes, dtype=np.int64)
        r, b, depth = prefixes.shape
        v = self.level_sizes[depth]
        if self.drafted is None or not len(self.drafted):
            return np.zeros((r, b, v), dtype=bool)
        rows = np.arange(r) if rows is None else np.asarray(rows)
        pk = prefix_keys(prefixes, self.level_sizes)[:, :, None] * v + np.arange(v)
        key = _drafted_key(rows[:, None, None], depth + 1, pk, self.level_sizes)
        pos = np.searchsorted(self.drafted, key).clip(max=len(self.drafted) - 1)
        return self.drafted[pos] == key

    @property
    def width(self) -> int:
        return self.tokens.shape[1]

    def _key(self, r: np.ndarray, depth: int, pkey: np.ndarray) -> np.ndarray:
        return (r * len(self.level_sizes) + depth) * self.space + pkey

    def lookup(self, codes: np.ndarray | torch.Tensor, rows: np.ndarray | None = None) -> np.ndarray:
        """Column of the node of each prefix ``codes`` [R, M, l] (l < L); -1
        where that prefix is not in the tree. ``rows`` [R] maps the requests of
        ``codes`` to the tree's (default: the same order)."""
        codes = np.asarray(codes, dtype=np.int64)
        r, m, depth = codes.shape
        rows = np.arange(r) if rows is None else np.asarray(rows)
        key = self._key(rows[:, None], depth, prefix_keys(codes, self.level_sizes))
        pos = np.searchsorted(self.keys, key).clip(max=max(len(self.keys) - 1, 0))
        if not len(self.keys):
            return np.full((r, m), -1, dtype=np.int64)
        return np.where(self.keys[pos] == key, self.cols[pos], -1)


def _drafted_key(r, length: int, pk, level_sizes) -> np.ndarray:
    full = int(np.prod(level_sizes))
    return (r * (len(level_sizes) + 1) + length) * full + pk


def build_tree(groups: Sequence[tuple[np.ndarray, np.ndarray]], level_sizes: Sequence[int], n_requests: int,
               pad_to: int | None = None, drafts: int | None = None) -> PrefixTree:
    """The prefix tree of every prefix of length 0..L-1 of the given codes.

    ``groups``: (codes [R, N, l], ok [R, N]) pairs, e.g. full drafted SIDs and
    the current beam prefixes; rows where ``ok`` is False are ignored. Every
    request gets at least its root. The first ``drafts`` groups (default: all)
    are drafts: :meth:`PrefixTree.was_drafted` answers for them. ``pad_to``
    rounds the node axis up."""
    level_sizes = list(level_sizes)
    L = len(level_sizes)
    space = int(np.prod(level_sizes[: L - 1])) if L > 1 else 1
    R = n_requests
    rows = np.arange(R, dtype=np.int64)
    parts = [(rows * L) * space]  # every request's root
    drafted = []
    for g, (codes, ok) in enumerate(groups):
        codes = np.asarray(codes, dtype=np.int64)
        ok = np.asarray(ok, dtype=bool)
        if codes.size == 0 or not ok.any():
            continue
        rr = np.broadcast_to(rows[:, None], ok.shape)[ok]
        sel = codes[ok]  # [K, l]
        for j in range(1, min(codes.shape[-1], L - 1) + 1):
            parts.append((rr * L + j) * space + prefix_keys(sel[:, :j], level_sizes))
        if drafts is None or g < drafts:
            for j in range(1, codes.shape[-1] + 1):
                drafted.append(_drafted_key(rr, j, prefix_keys(sel[:, :j], level_sizes), level_sizes))
    keys = np.unique(np.concatenate(parts))
    r_of = keys // (L * space)
    depth = (keys // space) % L
    pkey = keys % space
    n_nodes = np.bincount(r_of, minlength=R)
    first = np.cumsum(n_nodes) - n_nodes
    cols = np.arange(len(keys)) - first[r_of]
    T = int(n_nodes.max())
    if pad_to:
        T = max(T, pad_to)
    tokens = np.full((R, T), PAD_TOKEN, dtype=np.int64)
    positions = np.zeros((R, T), dtype=np.int64)
    offsets = np.cumsum([N_SPECIAL, *level_sizes])[:-1]
    sizes = np.asarray(level_sizes, dtype=np.int64)
    last_size = sizes[np.maximum(depth - 1, 0)]
    tok = np.where(depth == 0, BOS_TOKEN, offsets[np.maximum(depth - 1, 0)] + pkey % last_size)
    tokens[r_of, cols] = tok
    positions[r_of, cols] = depth
    mask = np.zeros((R, T, T), dtype=bool)
    mask[:, np.arange(T), np.arange(T)] = True
    for j in range(1, L):  # nodes are sorted by depth within a request: parents' rows are final
        sel = np.nonzero(depth == j)[0]
        if not len(sel):
            continue
        parent_key = (r_of[sel] * L + j - 1) * space + pkey[sel] // last_size[sel]
        pcol = cols[np.searchsorted(keys, parent_key)]
        mask[r_of[sel], cols[sel]] |= mask[r_of[sel], pcol]
    return PrefixTree(torch.from_numpy(tokens), torch.from_numpy(positions), torch.from_numpy(mask), keys, cols,
                      n_nodes, level_sizes, space, np.unique(np.concatenate(drafted)) if drafted else None)


def read_level(out: torch.Tensor, cols: np.ndarray, level: int, level_sizes: Sequence[int],
               rows: np.ndarray | None = None) -> torch.Tensor:
    """Level ``level``'s log-probs at nodes ``cols`` [R, M] of a tree pass's
    output ``out`` [R', T, L, Vmax] -> [R, M, V_level] (columns of -1 read
    column 0). ``rows`` [R] maps requests to the output's rows."""
    r = cols.shape[0]
    rows_t = torch.arange(r) if rows is None else torch.as_tensor(np.asarray(rows), dtype=torch.int64)
    c = torch.from_numpy(np.maximum(cols, 0))
    return out[rows_t.unsqueeze(1), c, level, : level_sizes[level]]


def token_logprobs(out: torch.Tensor, tree: PrefixTree, sids: np.ndarray, full: bool = False):
    """Teacher-forced scores of full SIDs ``sids`` [R, N, L] (all in the tree)
    from a tree pass's output [R, T, L, Vmax]: token log-probs [R, N, L], and with ``full`` each
    level's whole distribution along them (list of [R, N, V_j])."""
    sids = np.asarray(sids, dtype=np.int64)
    L = len(tree.level_sizes)
    per_level, token = [], []
    for j in range(L):
        lp = read_level(out, tree.lookup(sids[:, :, :j]), j, tree.level_sizes)
        token.append(lp.gather(-1, torch.from_numpy(sids[:, :, j : j + 1])).squeeze(-1))
        if full:
            per_level.append(lp)
    return torch.stack(token, dim=-1), (per_level if full else None)
