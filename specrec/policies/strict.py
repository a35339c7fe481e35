"""``strict``: lossless speculative beam search (AtSpeed-S style).

Drafts are verified level by level against the target's exact top-K; a miss
falls back to computing the missing beams only (see :mod:`.levelwise`). The
output equals ``beam`` exactly: same items, same order, scores equal up to
float rounding, for every history."""

from __future__ import annotations

from .base import register
from .levelwise import LevelwisePolicy


@register
class StrictPolicy(LevelwisePolicy):
    name = "strict"
