"""SASRec drafter: the bundle's SASRec (``specrec train-baseline``), the strongest item model we have, as an
item drafter.

A history's last state scores every item SASRec was trained on (inner product with its item embedding); the
scores are SASRec's log-softmax over that catalogue, the distribution it was trained to give, so a fused
ranking (:mod:`specrec.fusion`) reads them as log-probabilities. Drafts are the top ``n`` of the items it can
score that are active and were seen in training; with ``prefixes`` (guided re-drafting) only items under
them, on the same scale.

SASRec has no embedding worth the name for an item no one interacted with (new items, or items first seen
after a temporal cut-off), so ``unseen_share`` of the drafts comes from the text-aware retrieval drafter
(``unseen_source``: the unseen items whose text is most like the history's recent items), as the retrieval
drafter does for itself; their scores sit below every SASRec score (they are not on its scale).

The matrix product over the catalogue is exact (a 64-dimensional state against 12k items is ~1.6 MFLOP); a
catalogue of millions would want an index, and the log-softmax's normaliser a bound instead.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from ..fusion import Fusion
from ..itemset import LocalItemSet
from ..models.sasrec import SASRec
from .base import Draft, DraftRequest, topn_excluding


class SasrecDrafter:
    name = "sasrec"

    def __init__(self, model: SASRec, itemset: LocalItemSet, unseen_source=None, unseen_share: float = 0.0,
                 fusion: Fusion | None = None):
        """``unseen_source``: a :class:`~specrec.drafters.retrieval.RetrievalDrafter` drafting the unseen share
        (None: no unseen items are drafted); ``fusion``: how a policy ranking by both models weighs these scores
        (the bundle's, chosen on validation users), told to whoever drafts with it."""
        if not 0.0 <= unseen_share <= 1.0:
            raise ValueError(f"unseen_share {unseen_share}: must be in [0, 1]")
        self.model = model.eval()
        # [n_known, d]: the rows it was trained on. Its products stay in torch: a numpy product here runs on
        # OpenBLAS's threads, which spin against torch's OpenMP workers (measured: 1.1 ms a draft with one torch
        # thread, 8 ms p50 and 108 ms p99 with two)
        self.emb = model.item.weight[1:].detach().float().clone()
        self.unseen_source = unseen_source
        self.unseen_share = float(unseen_share) if unseen_source is not None else 0.0
        self.fusion = fusion
        self.set_itemset(itemset)

    @property
    def n_known(self) -> int:
        return len(self.emb)

    @property
    def vectors(self) -> torch.Tensor:
        """The item vectors it scores, one per row it was trained on (as the index-based drafters expose theirs)."""
        return self.emb

    def set_itemset(self, itemset: LocalItemSet) -> None:
        """Follow a catalogue version: rows added since training have no embedding and are not drafted."""
        rows = np.arange(min(self.n_known, itemset.n_rows))
        self.itemset = itemset
        self.eligible = rows[itemset.active[rows] & itemset.seen[rows]]

    def add_items(self, itemset: LocalItemSet, new_text_emb: np.ndarray | None = None) -> None:
        """Follow a catalogue version with rows appended; with their text embeddings, the unseen source indexes
        them too (in-process; a service's shared retrieval drafter follows the catalogue on its own)."""
        if new_text_emb is not None and self.unseen_source is not None:
            self.unseen_source.add_items(itemset, new_text_emb)
        self.set_itemset(itemset)

    @torch.inference_mode()
    def log_softmax(self, histories: Sequence[np.ndarray]) -> np.ndarray:
        """SASRec's log-probability of every item it knows after each history: [R, n_known]."""
        h = self.model.cfg.max_history
        x = torch.full((len(histories), h), -1, dtype=torch.int64)
        for i, items in enumerate(histories):
            items = np.asarray(items, dtype=np.int64)
            items = items[(items >= 0) & (items < self.n_known)][-h:]
            if len(items):
                x[i, h - len(items):] = torch.from_numpy(items)
        return torch.log_softmax(self.model.sequence(x)[:, -1] @ self.emb.T, -1).numpy()

    def draft(self, requests: Sequence[DraftRequest]) -> list[Draft]:
        if not requests:
            return []
        logp = self.log_softmax([r.history for r in requests])
        model = []
        for i, r in enumerate(requests):
            rows = self.eligible
            if r.prefixes is not None:
                rows = np.intersect1d(rows, self.itemset.items_with_prefixes(r.prefixes), assume_unique=True)
            model.append(topn_excluding(logp[i, rows], rows, r.n, r.exclude))  # n: the unseen part may fall short
        if self.unseen_source is None:
            return model
        # the unseen share, and whatever SASRec's list lacks (few known items under a re-draft's prefixes, or
        # only new ones there): the text-aware source drafts unseen items for those places
        n_new = [min(r.n, max(int(round(r.n * self.unseen_share)), r.n - len(d.items)))
                 for r, d in zip(requests, model)]
        if not any(n_new):
            return model
        taken = [frozenset(r.exclude) | frozenset(d.items[: r.n - k].tolist())
                 for r, d, k in zip(requests, model, n_new)]
        unseen = self.unseen_source.unseen_drafts(requests, n_new, taken)
        out = []
        for r, d, u in zip(requests, model, unseen):
            lead = min(r.n - len(u.items), len(d.items))  # what the unseen part did not take goes back to SASRec
            low = float(d.scores[lead - 1]) if lead > 0 else 0.0
            # below every SASRec score of the list, in the text similarity's own order (cosine in [-1, 1])
            u_scores = low - 3.0 + u.scores.astype(np.float32)
            out.append(Draft(np.concatenate([d.items[:lead], u.items]).astype(np.int64),
                             np.concatenate([d.scores[:lead], u_scores]).astype(np.float32)))
        return out
