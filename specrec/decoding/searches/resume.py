"""``resume``: the target's beam search from level 2 on, for rows whose drafts missed part of the target's
frontier. ``strict``'s graph (:mod:`.strict`) already verified levels 0 and 1 exactly (the root and the
target's own top-``width`` prefixes of length 1 are nodes of its tree), so this starts from its beams of
length 2 and the keys|values of those nodes (:data:`.strict.LEFT`): L-2 passes over ``width`` beams instead
of a whole search's L. It runs inside ``strict``'s call, for the rows that need it."""

from __future__ import annotations

import torch

from ...ids.tables import Level
from ...models.hotpath import FusedHotPath
from . import strict
from .beam import descend
from .common import SearchState
from .registry import BEAMS, Search


def run(fused: FusedHotPath, enc_mask, cross_k, cross_v, tables: list[Level], width: int, codes, scores,
        token_logp, nodes, parent, kept_kv):
    """``codes`` [R, W, 2], ``scores``, ``token_logp``, ``nodes``: the target's beams of length 2; ``parent``
    [R, W] each one's parent among the nodes of depth 1; ``kept_kv`` [n_layers, R, 1 + W, 2 * inner] the
    root's and those nodes' keys|values (the root first). -> codes, scores, token_logp, nodes (exactly
    ``beam``'s)."""
    anc = torch.stack([torch.zeros_like(parent), parent + 1], -1)  # the root, the beam's node of depth 1
    kept = list(kept_kv.unbind(0))
    state = descend(fused, SearchState(codes, scores, token_logp, nodes), anc, kept,
                    fused.cross(enc_mask, cross_k, cross_v), tables, width)
    return state.beams()


def example(fused: FusedHotPath, enc, tables: list[Level], width: int) -> tuple[torch.Tensor, ...]:
    """What ``strict``'s graph leaves, on example inputs (to trace this graph with)."""
    enc_mask, cross_k, cross_v = enc
    out = strict.run(fused, enc_mask, cross_k, cross_v, tables, width, 2 * width)
    return tuple(out[len(out) - len(strict.LEFT):])


SEARCH = Search("resume", run, BEAMS, inputs=strict.LEFT, example=example, inside="strict", min_levels=3,
                warm=lambda k, drafts: [(k,)])
