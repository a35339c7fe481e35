"""``relaxed``: accept a drafted token when the target finds it good enough
(LASER / AtSpeed-R family). A documented approximation of ``beam``.

Level by level (see :mod:`.levelwise`), a drafted code c after a beam prefix
is *accepted* when the target's probability of c is at least ``threshold``
and c is within the target's ``top_k`` valid codes there. Accepted drafted
extensions take the beam slots first, so the search stays on the drafts,
whose distributions are already computed; the remaining slots go to the
target's own best extensions. Scores are the target's summed
log-probabilities; the list is sorted by them.
"""

from __future__ import annotations

from pydantic import Field

from ..verifier import SelectRule
from .base import register
from .levelwise import LevelwiseConfig, LevelwisePolicy


class RelaxedConfig(LevelwiseConfig):
    threshold: float = Field(0.02, ge=0.0, le=1.0, description="minimum target probability of an accepted drafted code")
    top_k: int = Field(
        10, ge=1, le=1000, description="an accepted drafted code is within the target's top-k valid codes"
    )


@register
class RelaxedPolicy(LevelwisePolicy):
    name = "relaxed"
    Config = RelaxedConfig
    config: RelaxedConfig

    def rule(self) -> SelectRule:
        return SelectRule("relaxed", self.config.threshold, self.config.top_k)
