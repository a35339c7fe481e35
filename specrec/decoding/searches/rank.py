"""``rank``: the target's log-probability of every code of given candidate SIDs, in one pass over their prefix
tree: what ranking an item drafter's list by the GR model reads (``specgr`` ranking by both models,
:mod:`specrec.fusion`), and what a ``Score`` call that wants scores only asks.

The caller lays the candidates' unique prefixes out (:func:`layout`, in numpy): T nodes, each a prefix of
length 1 .. L-1 with its last code, its length, and its ancestors' columns (the root, the prefixes of it, itself;
at most L), and, per candidate, its prefix's node at every length. The graph runs the root pass (level 0's
distribution), one decoder pass over the T nodes in which each attends to its ancestors only
(:meth:`~specrec.models.hotpath.FusedHotPath.ancestor_pass`), and reads each node's own level's distribution
(all levels' logits are one product; the node's row is kept) and each candidate's codes off it. Against the
general tree pass (a masked T x T attention, every level's output copied out, [R, T, L, Vmax]): the same
numbers, T x L attention columns, [R, M, L] out. T and the candidate count M are dynamic: one graph serves
every list.
"""

from __future__ import annotations

import numpy as np
import torch

from ...ids.tables import Level
from ...models.hotpath import NEG_INF, FusedHotPath
from .registry import Search
from .values import token_reply, token_result

#: what a rank graph reads after the tables: per node, its last code, its length, its ancestors' columns into
#: [root, nodes] and their mask (0 or -inf) [R, T, L]; per candidate, its node at every length [R, M, L-1] and
#: its codes [R, M, L]
INPUTS = ("node_codes", "node_depth", "node_cols", "node_bias", "cand_nodes", "cand_codes")
AXES = {**{n: {0: "R", 1: "T"} for n in INPUTS[:4]}, **{n: {0: "R", 1: "M"} for n in (*INPUTS[4:], "token_logp")}}


def run(fused: FusedHotPath, enc_mask, cross_k, cross_v, tables: list[Level], node_codes, node_depth,
        node_cols, node_bias, cand_nodes, cand_codes):
    """-> token_logp [R, M, L]: log p(code_j | the candidate's first j codes, history) for every candidate."""
    L, vmax = fused.L, fused.vmax
    cross = fused.cross(enc_mask, cross_k, cross_v)
    h0, root_kv = fused.root(cross)
    level0 = fused.level_logprobs(h0, 0)  # [R, Vmax]
    x = fused.tok[node_codes + fused.offsets[node_depth - 1]] + fused.dec_pos[node_depth]  # [R, T, d]
    hid, _ = fused.ancestor_pass(x, node_cols, root_kv, cross, node_bias.unsqueeze(-1))
    logits = (hid @ fused.head_flat).view(hid.shape[0], -1, L, vmax) + fused.head_b  # [R, T, L, Vmax]
    own = logits.gather(2, node_depth.unsqueeze(-1).unsqueeze(-1).expand(-1, -1, 1, vmax)).squeeze(2)
    logp = torch.log_softmax(own, -1)  # [R, T, Vmax]: a node of length j predicts level j
    token = [level0.gather(1, cand_codes[:, :, 0])]
    for j in range(L - 1):
        at = logp.gather(1, cand_nodes[:, :, j : j + 1].expand(-1, -1, vmax))  # [R, M, Vmax]
        token.append(at.gather(2, cand_codes[:, :, j + 1 : j + 2]).squeeze(-1))
    return (torch.stack(token, -1),)


def layout(sids: np.ndarray) -> tuple[np.ndarray, ...]:
    """Candidates ``sids`` [R, M, L] -> the graph's :data:`INPUTS`: their unique prefixes of length 1 .. L-1 as
    nodes (shortest first; rows with fewer nodes padded with nodes that attend to the root alone and are never
    read), and each candidate's node at every length."""
    sids = np.asarray(sids, dtype=np.int64)
    r, m, L = sids.shape
    base = int(sids.max(initial=0)) + 1  # a prefix as one integer, in the prefixes' lexicographic order
    per = []
    for i in range(r):  # per level, its unique prefixes (sorted), their columns from their parents'
        codes, depth, cols = [], [], []
        cand = np.zeros((m, L - 1), np.int64)
        prev_cols, prev_local, n = np.zeros((1, L), np.int64), np.zeros(m, np.int64), 0  # the root: column 0
        key = np.zeros(m, np.int64)
        for j in range(L - 1):
            if base ** (j + 1) < 2**62:
                key = key * base + sids[i, :, j]
                _, first, local = np.unique(key, return_index=True, return_inverse=True)
            else:  # codes too wide for one integer: rows (the same order, slower)
                _, first, local = np.unique(sids[i, :, : j + 1], axis=0, return_index=True, return_inverse=True)
                local = local.reshape(-1)
            c = prev_cols[prev_local[first]].copy()  # the parent's columns (the root, its ancestors, it) ...
            c[:, j + 1] = n + np.arange(len(first)) + 1  # ... then itself
            codes.append(sids[i, first, j])
            depth.append(np.full(len(first), j + 1))
            cols.append(c)
            cand[:, j] = n + local
            prev_cols, prev_local, n = c, local, n + len(first)
        per.append((np.concatenate(codes), np.concatenate(depth), np.concatenate(cols), cand))
    t = max(len(p[0]) for p in per)
    node_codes = np.zeros((r, t), np.int64)
    node_depth = np.ones((r, t), np.int64)
    node_cols = np.zeros((r, t, L), np.int64)
    node_bias = np.full((r, t, L), NEG_INF, np.float32)
    node_bias[:, :, 0] = 0.0  # padding nodes: the root alone
    cand_nodes = np.zeros((r, m, L - 1), np.int64)
    cols_of_depth = np.arange(L)
    for i, (n_codes, n_depth, n_cols, cand) in enumerate(per):
        n = len(n_codes)
        node_codes[i, :n], node_depth[i, :n], node_cols[i, :n] = n_codes, n_depth, n_cols
        node_bias[i, :n] = np.where(cols_of_depth[None] <= n_depth[:, None], 0.0, NEG_INF)  # depth d: d + 1 columns
        cand_nodes[i] = cand
    return node_codes, node_depth, node_cols, node_bias, cand_nodes, sids


def padded(inputs: tuple[np.ndarray, ...], m: int) -> tuple[np.ndarray, ...]:
    """:func:`layout`'s inputs padded to ``m`` candidates and ``m * (L-1)`` nodes, the most ``m`` candidates can
    have: fixed shapes for a captured graph. Padding nodes attend to the root alone and padding candidates read
    node 0; nothing reads what they give."""
    node_codes, node_depth, node_cols, node_bias, cand_nodes, cand_codes = inputs
    r, have, L = cand_codes.shape
    t_pad, m_pad = m * (L - 1) - node_codes.shape[1], m - have
    if t_pad < 0 or m_pad < 0:
        raise ValueError(f"{have} candidates ({node_codes.shape[1]} nodes) do not fit {m}")
    bias = np.full((r, t_pad, L), NEG_INF, np.float32)
    bias[:, :, 0] = 0.0
    return (np.pad(node_codes, ((0, 0), (0, t_pad))), np.pad(node_depth, ((0, 0), (0, t_pad)), constant_values=1),
            np.pad(node_cols, ((0, 0), (0, t_pad), (0, 0))), np.concatenate([node_bias, bias], 1),
            np.pad(cand_nodes, ((0, 0), (0, m_pad), (0, 0))), np.pad(cand_codes, ((0, 0), (0, m_pad), (0, 0))))


def example(fused: FusedHotPath, enc, tables: list[Level], width: int | None) -> tuple[torch.Tensor, ...]:
    """Example inputs to trace with: a few random candidates per request."""
    r = enc[0].shape[0]
    gen = torch.Generator().manual_seed(0)
    sids = torch.stack([torch.randint(0, v, (r, 7), generator=gen) for v in fused.sizes], -1)
    sids[:, 1, :2] = sids[:, 0, :2]  # prefixes shared
    return tuple(torch.from_numpy(x) for x in layout(sids.numpy()))


def call(run_graph, enc, trie, widths: tuple[int, ...], args: dict[str, torch.Tensor]) -> torch.Tensor | None:
    """Candidates ``args["sids"]`` [R, M, L] -> their token log-probabilities [R, M, L] (laid out here)."""
    out = run_graph("rank", enc, None, (), [torch.from_numpy(x) for x in layout(args["sids"].numpy())])
    return None if out is None else out[0]


SEARCH = Search("rank", run, ("token_logp",), widths=(), inputs=INPUTS, example=example, axes=AXES, tables=False,
                args=("sids",), final=True, lossy="the scoring pass (rank)", call=call, reply=token_reply,
                result=token_result, pad=padded)
