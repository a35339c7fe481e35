"""The constrained top-k of one beam step, written once for every search.

A beam step extends each of B beams by one code: candidate (beam b, code c)
scores the beam's cumulative log-probability plus ``logp[b, c]``, codes the
item set does not allow after the beam are -inf, and the best ``width``
candidates are kept. Every search runs this function: step-by-step beam
search over a :class:`~specrec.ids.trie.SidTrie`
(:func:`specrec.decoding.beam.select_topk`), the whole-search graphs over
the item set's search tables (:class:`specrec.decoding.searches.SearchState`
with :func:`specrec.ids.tables.children`, traced into ONNX), the NEZHA
head's search and distillation's frontier search. They differ only in how
they find which codes are allowed and the trie node a kept candidate
reaches, which they hand in.

Shapes: ``R`` requests, ``B`` beams in, ``W`` beams out (``min(width, B*V)``),
``V`` codes of the level, ``l`` levels decoded so far.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import torch

NEG_INF = float("-inf")

#: the trie node each kept candidate reaches: (parent [R, W], code [R, W], flat index [R, W] into B*V) -> [R, W]
#: (-1 where the prefix is not in the item set)
ChildNodes = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


class TopK(NamedTuple):
    codes: torch.Tensor  # [R, W, l+1] the kept prefixes
    scores: torch.Tensor  # [R, W] cumulative log-probabilities (-inf = dead)
    token_logp: torch.Tensor  # [R, W, l+1] each code's log-probability
    nodes: torch.Tensor  # [R, W] trie node at the new depth (-1 = dead)
    parent: torch.Tensor  # [R, W] the beam (within its request) each kept prefix extends


def constrained_topk(codes: torch.Tensor, scores: torch.Tensor, token_logp: torch.Tensor, logp: torch.Tensor,
                     allowed: torch.Tensor, width: int, child_nodes: ChildNodes,
                     bias: torch.Tensor | None = None) -> TopK:
    """One constrained beam step.

    ``codes`` [R, B, l], ``scores`` [R, B], ``token_logp`` [R, B, l]: the beams; ``logp`` [R, B, V] their next
    level's log-probs; ``allowed`` [R, B, V] bool: the codes the item set has after each beam. ``bias`` (like
    ``logp``, optional) is added when *choosing* candidates but never kept in their scores (relaxed verification
    prefers drafted codes this way); the kept beams are then ordered by their true scores. A kept candidate
    that is -inf, or whose prefix reaches no node, is dead (score -inf, node -1)."""
    _, b, v = logp.shape
    cand = torch.where(allowed, scores.unsqueeze(-1) + logp, NEG_INF).view(-1, b * v)  # -1: no shape arithmetic
    k = min(width, b * v)
    if bias is None:
        top, idx = cand.topk(k, dim=1)
    else:
        _, idx = (cand + bias.reshape(-1, b * v)).topk(k, dim=1)
        top = cand.gather(1, idx)
        order = torch.argsort(top, dim=1, descending=True, stable=True)
        top, idx = top.gather(1, order), idx.gather(1, order)
    parent = torch.div(idx, v, rounding_mode="trunc")  # idx >= 0: one integer Div in a graph (floor: nine nodes)
    code = idx - parent * v
    nodes = child_nodes(parent, code, idx)
    dead = torch.isinf(top) | (nodes < 0)
    nodes = torch.where(dead, -1, nodes)
    top = torch.where(dead, NEG_INF, top)
    code_logp = logp.reshape(-1, b * v).gather(1, idx).unsqueeze(-1)
    if codes.shape[2] == 0:  # the first level: nothing to carry (a gather of an empty axis breaks static graphs)
        return TopK(code.unsqueeze(-1), top, code_logp, nodes, parent)
    g = parent.unsqueeze(-1).expand(-1, -1, codes.shape[2])
    new_codes = torch.cat([codes.gather(1, g), code.unsqueeze(-1)], dim=2)
    new_tlp = torch.cat([token_logp.gather(1, g), code_logp], dim=2)
    return TopK(new_codes, top, new_tlp, nodes, parent)
