"""``draft_scored``: ``specgr``'s first round in one graph: the distilled drafter's ``width`` beams (level 0 exact)
and the target's log-probability of every code of each, from one tree pass over the beams' kept prefixes."""

from __future__ import annotations

import torch

from ...ids.tables import Level
from ...models.hotpath import FusedHotPath
from .common import ancestor_tree, draft
from .registry import BEAMS, Search


def run(fused: FusedHotPath, enc_mask, cross_k, cross_v, tables: list[Level], width: int):
    """-> codes [R, W, L], the drafter's scores [R, W], the target's token_logp [R, W, L], nodes [R, W]."""
    L = fused.L
    cross = fused.cross(enc_mask, cross_k, cross_v)
    _, root_kv, states, parents = draft(fused, cross, tables, [width] * L)
    node_logp, _ = ancestor_tree(fused, states, parents, root_kv, cross)
    final = states[-1]
    codes = final.codes.clamp(min=0)
    target = [final.token_logp[:, :, 0]]  # level 0 is the target's own
    levels = []
    at = parents[L - 1]  # [R, W]: each final beam's prefix of length L-1 among states[L-2]
    for j in range(L - 1, 0, -1):  # level j's code, read at the node of the beam's prefix of length j
        lp = node_logp[j - 1].gather(1, at.unsqueeze(-1).expand(-1, -1, fused.vmax))
        levels.append(lp.gather(2, codes[:, :, j : j + 1]).squeeze(-1))
        if j > 1:
            at = parents[j - 1].gather(1, at)
    target += levels[::-1]
    return final.codes, final.scores, torch.stack(target, -1), final.nodes


SEARCH = Search("draft_scored", run, BEAMS, uses_sid_drafter=True, warm=lambda k, drafts: [(2 * k,)])
