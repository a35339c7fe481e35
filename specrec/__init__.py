"""SpecRec's core library: data, semantic IDs, models, decoding, policies, training, evaluation.

``specrec.Recommender`` (:mod:`specrec.recommender`) answers in-process from a
bundle; it is imported on first use, so ``import specrec`` stays light.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .recommender import Recommendation, RecommendedItem, Recommender, RecommendStats

__all__ = ["Recommendation", "RecommendStats", "RecommendedItem", "Recommender"]


def __getattr__(name: str) -> Any:
    if name in __all__:
        from . import recommender

        return getattr(recommender, name)
    raise AttributeError(f"module 'specrec' has no attribute {name!r}")
