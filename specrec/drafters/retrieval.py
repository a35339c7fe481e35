"""Retrieval drafter (UniSRec-style): text embeddings -> MoE adaptor ->
SASRec-like encoder -> faiss top-n over the whole catalogue, including items
added after training (their text embedding is all it needs).

Mixed in: ``text_share`` of the drafts are the items whose text is most like
the history's recent items (cosine similarity to the mean of the last
``text_window`` items' text embeddings), and ``unseen_share`` the *unseen*
items (no training interactions: items added after training) most like them.
The sequence model learns from interactions, so it under-proposes items no
one has interacted with yet; text similarity does not know or care. Among all
items it is a weak ranker, so new items rarely make its top list; among the
unseen items alone it finds them (on Beauty's temporal split, 3,000
random test users: the unseen target is among the 10 unseen items most like
the last three items of the history for about 10% of the users whose target
is unseen, and among the 50 most like them for 34%, against 7% for the top 50
of all items: ``python -m bench.unseen_text_reach``).

An item with neither text nor title has nothing for it to read: such rows are looked at but not indexed
(``draftable`` false, :meth:`RetrievalDrafter.encode` with ``has_text``; they hold one byte each), never
drafted, and count for nothing in a history. Rows not looked at yet (pending) are neither drafted nor read in a
history.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from ..itemset import LocalItemSet
from ..models.retrieval import RetrievalModel
from .base import Draft, DraftRequest, topn_excluding
from .vector import Batch, Rows, VectorDrafter, build_index


class RetrievalDrafter(VectorDrafter):
    name = "retrieval"

    def __init__(self, model: RetrievalModel, text_emb: np.ndarray, itemset: LocalItemSet, exact_limit: int = 200_000,
                 text_share: float = 0.0, text_window: int = 3, unseen_share: float = 0.0):
        self.model = model.eval()
        self._text = Rows(np.ascontiguousarray(text_emb, dtype=np.float32))
        with torch.inference_mode():
            vectors = self.model.item_vectors(self.text_emb).numpy()
        super().__init__(vectors, itemset, exact_limit)
        self.text_share, self.text_window = float(text_share), int(text_window)
        if not 0.0 <= text_share + unseen_share <= 1.0 or min(text_share, unseen_share) < 0.0:
            raise ValueError(f"text_share {text_share} and unseen_share {unseen_share}: each >= 0, at most 1 "
                             "together")
        self.unseen_share = float(unseen_share)
        self._unit = Rows(self._normalise(self._text.view))
        self.text_index = build_index(self._text_unit, exact_limit) if text_share > 0 else None

    @property
    def text_emb(self) -> torch.Tensor:
        """[draftable rows indexed, text_dim]: their text embeddings, in row order (as :attr:`vectors`)."""
        return torch.from_numpy(self._text.view)

    @property
    def _text_unit(self) -> np.ndarray:
        return self._unit.view

    def _readable(self, items: np.ndarray) -> np.ndarray:
        """The items of a history the drafter can read: indexed, with text."""
        items = np.asarray(items, dtype=np.int64)
        draftable = self.draftable
        items = items[items < len(draftable)]
        return items[draftable[items]]

    @staticmethod
    def _normalise(x: np.ndarray) -> np.ndarray:
        return np.ascontiguousarray(x / np.linalg.norm(x, axis=1, keepdims=True).clip(min=1e-9), dtype=np.float32)

    @torch.inference_mode()
    def user_vectors(self, histories: Sequence[np.ndarray]) -> np.ndarray:
        h = self.model.cfg.max_history
        t = max(1, min(h, max(len(x) for x in histories)))
        text = self.text_emb
        hist = torch.zeros(len(histories), t, text.shape[1])
        keep = torch.zeros(len(histories), t, dtype=torch.bool)
        for i, items in enumerate(histories):
            items = self._readable(items)[-t:]
            if len(items):
                hist[i, t - len(items) :] = text[torch.from_numpy(self.positions(items))]
                keep[i, t - len(items) :] = True
        return self.model.user_vectors(hist, keep).numpy()

    def _text_queries(self, histories: Sequence[np.ndarray]) -> np.ndarray:
        """The mean unit text embedding of each history's last ``text_window`` readable items (zero where it has
        none: every item scores 0)."""
        unit = self._text_unit
        out = np.zeros((len(histories), unit.shape[1]), np.float32)
        for i, h in enumerate(histories):
            items = self._readable(h)[-self.text_window:]
            if len(items):
                out[i] = unit[self.positions(items)].mean(0)
        return self._normalise(out)

    def _unseen_rows(self, itemset: LocalItemSet) -> np.ndarray:
        """The active unseen rows of ``itemset`` that are indexed and have text (kept per snapshot and rows
        indexed: it changes only with them)."""
        draftable = self.draftable
        got = getattr(self, "_unseen_of", None)
        if got is None or got[0] is not itemset or got[1] != len(draftable):
            n = min(len(draftable), itemset.n_rows)
            rows = np.nonzero(itemset.active[:n] & ~itemset.seen[:n] & draftable[:n])[0]
            got = self._unseen_of = (itemset, len(draftable), rows)
        return got[2]

    def draft(self, requests: Sequence[DraftRequest]) -> list[Draft]:
        if not (self.text_share or self.unseen_share) or not requests:
            return super().draft(requests)
        itemset = self.itemset
        n_text = [int(round(r.n * self.text_share)) for r in requests]
        n_new = [min(int(round(r.n * self.unseen_share)), r.n - m) for r, m in zip(requests, n_text)]
        # the model's whole list: its best n - n_text - n_new lead; the rest fills what the text and unseen parts
        # cannot (no unseen items yet, few under the prefixes asked for, a large exclude set)
        full = super().draft(requests)
        queries = self._text_queries([r.history for r in requests])
        unseen = self._unseen_rows(itemset) if self.unseen_share else None
        out = []
        for i, r in enumerate(requests):
            n_model = r.n - n_text[i] - n_new[i]
            lead = full[i].items[:n_model]
            # the query's own items are its nearest neighbours by text: not proposals
            query_items = np.asarray(r.history, dtype=np.int64)[-self.text_window:].tolist()
            taken = frozenset(r.exclude) | frozenset(lead.tolist()) | frozenset(query_items)
            extra: list[Draft] = []
            if n_text[i]:
                extra.append(self._text_part(r, queries[i], n_text[i], taken))
                taken = taken | frozenset(extra[-1].items.tolist())
            if n_new[i] and unseen is not None and len(unseen):
                extra.append(self._unseen_part(r, queries[i], n_new[i], taken, unseen))
            used = frozenset(x for p in extra for x in p.items.tolist())
            short = r.n - n_model - sum(len(p.items) for p in extra)
            rest = [j for j in range(n_model, len(full[i].items)) if int(full[i].items[j]) not in used][:max(short, 0)]
            keep = np.concatenate([np.arange(min(n_model, len(full[i].items))), np.asarray(rest, dtype=np.int64)])
            parts = [Draft(full[i].items[keep], full[i].scores[keep]), *extra]
            # the model's drafts first, then the text neighbours, then the unseen ones: cosine - 2 (- 4) keeps
            # them below every model score (unit vectors: model scores are in [-1, 1]), each in its own order
            items = np.concatenate([p.items for p in parts])
            scores = np.concatenate([p.scores - 2.0 * j for j, p in enumerate(parts)])
            out.append(Draft(items.astype(np.int64), scores.astype(np.float32)))
        return out

    def _unseen_part(self, r: DraftRequest, query: np.ndarray, n: int, taken: frozenset[int],
                     unseen: np.ndarray) -> Draft:
        """The ``n`` unseen items (rows ``unseen``; under the request's prefixes, if any) whose text is most like
        the query (cosine similarity)."""
        rows = unseen
        if r.prefixes is not None:
            rows = np.intersect1d(rows, self.itemset.items_with_prefixes(r.prefixes), assume_unique=True)
        return topn_excluding(self._text_unit[self.positions(rows)] @ query, rows, n, taken)

    def unseen_drafts(self, requests: Sequence[DraftRequest], counts: list[int],
                      taken: list[frozenset[int]]) -> list[Draft]:
        """For another drafter that mixes them in (the SASRec drafter): per request, ``counts[i]`` unseen items
        most like its recent items by text, none of ``taken[i]`` nor of its own recent items."""
        unseen = self._unseen_rows(self.itemset)
        queries = self._text_queries([r.history for r in requests])
        out = []
        for i, r in enumerate(requests):
            if not counts[i] or not len(unseen):
                out.append(Draft(np.zeros(0, np.int64), np.zeros(0, np.float32)))
                continue
            recent = frozenset(np.asarray(r.history, dtype=np.int64)[-self.text_window:].tolist())
            out.append(self._unseen_part(r, queries[i], counts[i], taken[i] | recent, unseen))
        return out

    def _text_part(self, r: DraftRequest, query: np.ndarray, n: int, taken: frozenset[int]) -> Draft:
        """The ``n`` items (of all, seen or not) whose text is most like the query."""
        itemset, unit, draftable = self.itemset, self._text_unit, self.draftable
        if r.prefixes is not None:
            rows = itemset.items_with_prefixes(r.prefixes)
            rows = rows[rows < len(draftable)]
            rows = rows[itemset.active[rows] & draftable[rows]]
            return topn_excluding(unit[self.positions(rows)] @ query, rows, n, taken)
        want = min(len(unit), n + len(taken) + itemset.n_rows - len(itemset))
        assert self.text_index is not None  # n_text > 0 only with a text share
        scores, rows = self.index_search(self.text_index, query[None], want)
        ok = (rows[0] >= 0) & (rows[0] < len(itemset.active))  # rows past the snapshot's: not in it
        rows, scores = rows[0][ok], scores[0][ok]
        act = itemset.active[rows] & draftable[rows]
        return topn_excluding(scores[act], rows[act], n, taken)

    def encode(self, new_text_emb: np.ndarray, start: int | None = None, has_text: np.ndarray | None = None) -> Batch:
        """The batch of rows ``start`` (default: the next one to index) on, from the text embeddings of those
        with text (all, without ``has_text``; where ``has_text`` is false, no text nor title: never drafted).
        Changes nothing (any thread, beside the drafts)."""
        text = np.ascontiguousarray(new_text_emb, dtype=np.float32)
        draftable = None if has_text is None else np.asarray(has_text, bool)
        if draftable is not None and len(text) != int(draftable.sum()):
            raise ValueError(f"{len(text)} text embeddings for {int(draftable.sum())} rows with text")
        with torch.inference_mode():
            vec = self.model.item_vectors(torch.from_numpy(text)).numpy()
        return Batch(self.indexed if start is None else start, vec, draftable, text)

    def _append(self, batch: Batch) -> None:
        if batch.text is None:
            raise ValueError("the retrieval drafter indexes rows from their text embeddings (encode)")
        unit = self._normalise(batch.text)
        if self.text_index is not None:  # the draftable rows, as the item index (``positions`` maps both)
            self.text_index.add(unit)
        self._text.append(batch.text)
        self._unit.append(unit)
        super()._append(batch)

    def add_items(self, itemset: LocalItemSet, new_text_emb: np.ndarray) -> None:
        """Index catalogue rows appended in ``itemset`` from their text embeddings (those of the rows following
        the indexed ones; rows left without one stay pending) and follow it."""
        self.extend(self.encode(new_text_emb))
        self.set_itemset(itemset)
