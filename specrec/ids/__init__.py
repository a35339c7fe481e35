"""Semantic IDs: text embeddings, residual quantisation with a collision digit, the SID trie."""

from .semantic import Assignment, CollisionOverflow, SemanticIds, SidReport
from .trie import SidTrie

__all__ = ["Assignment", "CollisionOverflow", "SemanticIds", "SidReport", "SidTrie"]
