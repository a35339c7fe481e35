"""``draft``: the distilled SID drafter's constrained beam search (level 0 exact: the target's) in one graph,
``nezha``'s drafts. Only the root pass of the target runs, and only its value projection (no later pass
attends to it)."""

from __future__ import annotations

from ...ids.tables import Level
from ...models.hotpath import FusedHotPath
from .common import draft
from .registry import BEAMS, Search


def run(fused: FusedHotPath, enc_mask, cross_k, cross_v, tables: list[Level], width: int):
    """-> codes [R, W, L], scores [R, W] (level 0's target log-prob plus the drafter's), token_logp [R, W, L],
    nodes [R, W] (-1 = dead)."""
    _, _, states, _ = draft(fused, fused.cross(enc_mask, cross_k, cross_v), tables, [width] * fused.L, keys=False)
    return states[-1].beams()


SEARCH = Search("draft", run, BEAMS, uses_sid_drafter=True, lossy="nezha's graphs (draft)",
                warm=lambda k, drafts: [(k,), (2 * k,)])
