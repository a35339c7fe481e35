"""Self-drafter (SpecGR++): drafts with the GR encoder's own state, through a
small contrastively trained projection; new items are drafted from their SID."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from ..data.histories import history_codes
from ..itemset import LocalItemSet
from ..models.self_draft import SelfDraftHead
from ..models.tiger import Tiger
from .vector import Batch, VectorDrafter


class SelfDrafter(VectorDrafter):
    name = "self"

    def __init__(self, gr: Tiger, head: SelfDraftHead, itemset: LocalItemSet, exact_limit: int = 200_000):
        self.gr, self.head = gr.eval(), head.eval()
        with torch.inference_mode():
            vectors = head.item_vectors(gr, itemset.sids_t).numpy()
        super().__init__(vectors, itemset, exact_limit)

    @torch.inference_mode()
    def user_vectors(self, histories: Sequence[np.ndarray]) -> np.ndarray:
        hist = torch.from_numpy(history_codes(histories, self.gr.cfg.max_history, self.itemset.sids))
        return self.head.user_vectors(self.gr.encode(hist)).numpy()

    def encode(self, itemset: LocalItemSet, stop: int | None = None) -> Batch:
        """The batch of ``itemset``'s rows from the next one to index up to ``stop`` (default: all), from their
        SIDs. Changes nothing (any thread, beside the drafts)."""
        start = self.indexed
        with torch.inference_mode():
            vec = self.head.item_vectors(self.gr, itemset.sids_t[start:stop]).numpy()
        return Batch(start, vec)

    def add_items(self, itemset: LocalItemSet) -> None:
        """Index catalogue rows appended in ``itemset`` (vectors from their SIDs) and follow it."""
        self.extend(self.encode(itemset))
        self.set_itemset(itemset)
