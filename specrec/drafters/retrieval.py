"""Retrieval drafter (UniSRec-style): text embeddings -> MoE adaptor ->
SASRec-like encoder -> faiss top-n over the whole catalogue, including items
added after training (their text embedding is all it needs).

Mixed in: ``text_share`` of the drafts are the items whose text is most like
the history's recent items (cosine similarity to the mean of the last
``text_window`` items' text embeddings). The sequence model learns from
interactions, so it under-proposes items no one has interacted with yet;
text similarity does not know or care, so new items reach the verifier
(measured in ``bench/results``: unseen items drafted at their share of the
targets).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from ..itemset import LocalItemSet
from ..models.retrieval import RetrievalModel
from .base import Draft, DraftRequest, topn_excluding
from .vector import VectorDrafter, build_index


class RetrievalDrafter(VectorDrafter):
    name = "retrieval"

    def __init__(self, model: RetrievalModel, text_emb: np.ndarray, itemset: LocalItemSet, exact_limit: int = 200_000,
                 text_share: float = 0.0, text_window: int = 3):
        self.model = model.eval()
        self.text_emb = torch.from_numpy(np.ascontiguousarray(text_emb, dtype=np.float32))
        with torch.inference_mode():
            vectors = self.model.item_vectors(self.text_emb).numpy()
        super().__init__(vectors, itemset, exact_limit)
        self.text_share, self.text_window = float(text_share), int(text_window)
        self._text_unit = self._normalise(self.text_emb.numpy())
        self.text_index = build_index(self._text_unit, exact_limit) if text_share > 0 else None

    @staticmethod
    def _normalise(x: np.ndarray) -> np.ndarray:
        return np.ascontiguousarray(x / np.linalg.norm(x, axis=1, keepdims=True).clip(min=1e-9), dtype=np.float32)

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

    def _text_queries(self, histories: Sequence[np.ndarray]) -> np.ndarray:
        return self._normalise(np.stack([self._text_unit[np.asarray(h, dtype=np.int64)[-self.text_window:]].mean(0)
                                         for h in histories]))

    def draft(self, requests: Sequence[DraftRequest]) -> list[Draft]:
        if not self.text_share or not requests:
            return super().draft(requests)
        n_text = [int(round(r.n * self.text_share)) for r in requests]
        model_part = super().draft([DraftRequest(r.history, r.n - m, r.prefixes, r.exclude)
                                    for r, m in zip(requests, n_text)])
        queries = self._text_queries([r.history for r in requests])
        itemset = self.itemset
        out = []
        for i, r in enumerate(requests):
            # the query's own items are its nearest neighbours by text: not proposals
            query_items = np.asarray(r.history, dtype=np.int64)[-self.text_window:].tolist()
            taken = frozenset(r.exclude) | frozenset(model_part[i].items.tolist()) | frozenset(query_items)
            if r.prefixes is not None:
                rows = itemset.items_with_prefixes(r.prefixes)
                rows = rows[itemset.active[rows]]
                text = topn_excluding(self._text_unit[rows] @ queries[i], rows, n_text[i], taken)
            else:
                want = min(
                    len(self._text_unit), n_text[i] + len(taken) + len(itemset.active) - int(itemset.active.sum())
                )
                assert self.text_index is not None  # n_text > 0 only with a text share
                scores, rows = self.text_index.search(queries[i : i + 1], want)
                ok = (rows[0] >= 0) & (rows[0] < len(itemset.active))  # rows past the snapshot's: not in it
                rows, scores = rows[0][ok], scores[0][ok]
                act = itemset.active[rows]
                text = topn_excluding(scores[act], rows[act], n_text[i], taken)
            # the model's drafts first, then the text neighbours: cosine - 2 keeps them below every model score
            # (unit vectors: model scores are in [-1, 1]) and in their own order
            items = np.concatenate([model_part[i].items, text.items])
            scores = np.concatenate([model_part[i].scores, text.scores - 2.0])
            out.append(Draft(items.astype(np.int64), scores.astype(np.float32)))
        return out

    def add_items(self, itemset: LocalItemSet, new_text_emb: np.ndarray) -> None:
        """Index catalogue rows appended in ``itemset`` from their text embeddings."""
        new = torch.from_numpy(np.ascontiguousarray(new_text_emb, dtype=np.float32))
        with torch.inference_mode():
            vec = self.model.item_vectors(new).numpy()
        self.text_emb = torch.cat([self.text_emb, new])
        unit = self._normalise(new.numpy())
        with self._lock:
            self._text_unit = np.concatenate([self._text_unit, unit])
            if self.text_index is not None:
                self.text_index.add(unit)
        self.set_itemset(itemset, vec)
