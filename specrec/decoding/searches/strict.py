"""``strict`` in one graph: the distilled drafter's beams (the target's exact top-``width`` at level 0, then
``n`` drafted prefixes per level up to L-2), one tree pass over them, the target's own beam search of
``width`` read from it up to level L-2, then one small pass over the target's own ``width`` beams of length
L-1 (their ancestors are nodes of the first pass) for the last level.

Tree nodes attend to their ancestors only (the root, whose keys/values come from the root pass, and at most
L-1 more), and only their own level's output layer is computed. The last level needs no drafts: drafting it
(N more nodes) cost more than the small pass (measured: ``bench/results/HISTORY.md``). A row whose drafts
missed part of the target's frontier is finished by ``resume`` (:mod:`.resume`) from what this graph leaves
(:data:`LEFT`)."""

from __future__ import annotations

import numpy as np
import torch

from ...ids.tables import Level
from ...models.hotpath import FusedHotPath
from ..beam import Beams
from .common import ancestor_tree, draft, leaf_pass, prefix_keys
from .registry import BEAMS, Search
from .values import Drafted, drafted_reply, drafted_result

#: where the graph leaves a row its drafts missed, for ``resume``: the target's beams after level 1 (codes,
#: scores, token_logp, nodes), their parents among the nodes of depth 1, and the keys|values of the root and
#: those nodes [n_layers, R, 1 + W, 2 * inner] (the row axis of ``kept_kv`` is its second)
LEFT = ("codes1", "scores1", "token_logp1", "nodes1", "parent1", "kept_kv")


def run(fused: FusedHotPath, enc_mask, cross_k, cross_v, tables: list[Level], width: int, n: int):
    """-> the target's beams (codes, scores, token_logp, nodes: exactly ``beam``'s where ``covered``),
    ``covered`` [R] (every beam the target kept at levels 1..L-2 was drafted), ``frontier`` [R, L-1, 2]: per
    level, the target's kept prefixes and how many of them the tree held (at level 0 and the last level, all:
    they are the target's own), then :data:`LEFT`."""
    r, dev = enc_mask.shape[0], enc_mask.device
    L = fused.L
    if L < 3:
        raise ValueError(f"strict's graph needs SIDs of 3 levels or more (these have {L})")
    cross = fused.cross(enc_mask, cross_k, cross_v)
    _, root_kv, states, parents = draft(fused, cross, tables, [width] + [n] * (L - 3))
    chains: list = []
    node_logp, kept = ancestor_tree(fused, states, parents, root_kv, cross, chains)
    target = states[0]
    covered = torch.ones(r, dtype=torch.bool, device=dev)
    held0 = target.nodes.ge(0).sum(1)
    frontier = [torch.stack([held0, held0], -1)]
    col = torch.arange(width, device=dev).view(1, -1).expand(r, -1)[:, : target.codes.shape[1]]
    logp = node_logp[0]
    for j in range(1, L - 1):
        if j > 1:
            d = states[j - 1]
            match = (prefix_keys(fused.sizes, target.codes).unsqueeze(2)
                     == prefix_keys(fused.sizes, d.codes).unsqueeze(1))  # [R, W, n]
            found = match.any(-1)
            alive = target.nodes >= 0
            covered = covered & (found | ~alive).all(1)
            frontier.append(torch.stack([alive.sum(1), (found & alive).sum(1)], -1))
            col = match.float().argmax(-1)
            logp = node_logp[j - 1].gather(1, col.unsqueeze(-1).expand(-1, -1, fused.vmax))
        target, par = target.advance(logp, tables[j], width)
        col = col.gather(1, par)  # each new beam's parent node at depth j
        if j == 1:  # where ``resume`` starts a row whose drafts miss
            at1 = (target.codes, target.scores, target.token_logp, target.nodes, col)
    ch = chains[L - 3]  # the ancestor columns of the first pass's deepest nodes
    anc = torch.cat([torch.zeros_like(col).unsqueeze(-1),
                     ch.gather(1, col.unsqueeze(-1).expand(-1, -1, ch.shape[-1]))], -1)
    last = leaf_pass(fused, target.codes, anc, kept, cross)
    alive = target.nodes >= 0
    frontier.append(torch.stack([alive.sum(1), alive.sum(1)], -1))
    target, _ = target.advance(last, tables[L - 1], width)
    w1 = 1 + states[0].codes.shape[1]  # the root and the nodes of depth 1
    kept_kv = torch.stack([kv[:, :w1] for kv in kept])
    return (*target.beams(), covered, torch.stack(frontier, 1), *at1, kept_kv)


def call(run_graph, enc, trie, widths: tuple[int, ...], args) -> Drafted | None:
    """The graph, then, for the rows it did not cover, ``resume`` (:mod:`.resume`) from what it left
    (:data:`LEFT`, on the device where the backend computes) -> :class:`~.values.Drafted`; None without a
    distilled drafter."""
    out = run_graph("strict", enc, trie, widths, [])
    if out is None:
        return None
    codes, scores, tlp, nodes, covered, frontier, *at1 = out
    beams, covered = Beams.of_search(codes, scores, tlp, nodes), covered.bool()
    miss = torch.nonzero(~covered.cpu()).squeeze(1)
    if len(miss):
        left = [x.index_select(0, miss.to(x.device)) for x in at1[:-1]]
        kept = at1[-1].index_select(1, miss.to(at1[-1].device))  # [n_layers, R, 1 + W, 2 * inner]
        rest = run_graph("resume", enc.select(miss), trie, widths[:1], left + [kept])
        beams = beams.replace_rows(miss, Beams.of_search(*rest))
    return Drafted(beams, np.asarray(covered.cpu(), dtype=bool), np.asarray(frontier.cpu()))


SEARCH = Search("strict", run, (*BEAMS, "covered", "frontier", *LEFT), widths=("width", "n"),
                uses_sid_drafter=True, min_levels=3, left=LEFT, call=call, reply=drafted_reply, result=drafted_result,
                warm=lambda k, drafts: [(k, n) for n in drafts])
