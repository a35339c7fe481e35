"""Semantic IDs for new items from their text, without retraining: the
bundle's RQ codebooks over all-MiniLM-L6-v2 embeddings (the collision digit is
chosen by the store, per version)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from specrec.bundle import read_meta
from specrec.ids.semantic import SemanticIds


def bundle_semantic_ids(path: str | Path) -> tuple[SemanticIds, list[int]]:
    """The bundle's SID tokenizer and level sizes (without loading the model)."""
    path = Path(path)
    meta = read_meta(path)
    sem = SemanticIds(np.load(path / "codebooks.npy"), int(meta["sid"]["collision_size"]))
    level_sizes = [int(x) for x in meta["model"]["level_sizes"]]
    if level_sizes != sem.level_sizes:
        raise ValueError(f"{path}: model level sizes {level_sizes} do not match the codebooks' {sem.level_sizes}")
    return sem, level_sizes


@dataclass
class SidTokenizer:
    semantic_ids: SemanticIds
    level_sizes: list[int]
    embedder: Callable[[Sequence[str]], np.ndarray] | None = field(default=None, repr=False)

    @classmethod
    def from_bundle(cls, path: str | Path, embedder=None) -> SidTokenizer:
        sem, level_sizes = bundle_semantic_ids(path)
        return cls(sem, level_sizes, embedder)

    def _embed(self, texts: Sequence[str]) -> np.ndarray:
        if self.embedder is None:
            from specrec.ids.embed import TextEmbedder

            # no disk cache: a service would otherwise keep one file per request
            self.embedder = TextEmbedder(cache=False)
        return self.embedder(list(texts))

    def codes(self, texts: Sequence[str]) -> np.ndarray:
        """RQ codes [N, L-1] of texts (blocking; run it off the event loop)."""
        if not texts:
            return np.zeros((0, len(self.level_sizes) - 1), np.int64)
        return self.semantic_ids.encode(self._embed(texts))

    def warm_up(self) -> None:
        self.codes(["warm-up: a lipstick, matte, red"])
