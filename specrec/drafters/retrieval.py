"""Retrieval drafter (UniSRec-style): text embeddings -> MoE adaptor ->
SASRec-like encoder -> faiss top-n over the whole catalogue, including items
added after training (their text embedding is all it needs)."""

from __future__ import annotations

from typing import Sequence

import numpy as np
import torch

from ..itemset import LocalItemSet
from ..models.retrieval import RetrievalModel
from .vector import VectorDrafter


class RetrievalDrafter(VectorDrafter):
    name = "retrieval"

    def __init__(self, model: RetrievalModel, text_emb: np.ndarray, itemset: LocalItemSet, exact_limit: int = 200_000):
        self.model = model.eval()
        self.text_emb = torch.from_numpy(np.ascontiguousarray(text_emb, dtype=np.float32))
        with torch.inference_mode():
            vectors = self.model.item_vectors(self.text_emb).numpy()
        super().__init__(vectors, itemset, exact_limit)

    @torch.inference_mode()
    def user_vectors(self, histories: Sequence[np.ndarray]) -> np.ndarray:
        h = self.model.cfg.max_history
        t = max(1, min(h, max(len(x) for x in histories)))
        hist = torch.zeros(len(histories), t, self.text_emb.shape[1])
        keep = torch.zeros(len(histories), t, dtype=torch.bool)
        for i, items in enumerate(histories):
            items = np.asarray(items, dtype=np.int64)[-t:]
            if len(items):
                hist[i, t - len(items) :] = self.text_emb[torch.from_numpy(items)]
                keep[i, t - len(items) :] = True
        return self.model.user_vectors(hist, keep).numpy()

    def add_items(self, itemset: LocalItemSet, new_text_emb: np.ndarray) -> None:
        """Index catalogue rows appended in ``itemset`` from their text embeddings."""
        new = torch.from_numpy(np.ascontiguousarray(new_text_emb, dtype=np.float32))
        with torch.inference_mode():
            vec = self.model.item_vectors(new).numpy()
        self.text_emb = torch.cat([self.text_emb, new])
        self.set_itemset(itemset, vec)
