"""Ranking by both models: the GR model's log-probability of an item's SID fused with an item model's
log-probability of the item (SASRec's, over the catalogue it was trained on).

A request's candidates are the item model's top ``drafts`` items; each gets

    fused = weight * norm(log p_GR(SID)) + (1 - weight) * norm(log p_item(item))

where ``norm`` is the identity (``raw``) or a z-score over the request's candidates (``z``: each model's
scores centred and scaled within the request, so the weight does not depend on their ranges). The weight,
the normalisation and the number of candidates are chosen on validation users (:func:`choose`, ``specrec
tune-fusion``) and kept in the bundle (``bundle.json`` ``fusion``); test users only ever judge the choice.

Ranked by the GR alone the list falls to the GR's level, by the item model alone it is the item model's;
fused, on Amazon Beauty it is better than either (``bench/results/README.md``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Literal

import numpy as np

Norm = Literal["raw", "z"]


@dataclass(frozen=True)
class Fusion:
    weight: float  # the GR model's; the item model's is 1 - weight
    norm: Norm = "z"
    drafts: int = 50  # the item model's candidates scored per request
    # validation recall@10 of the item model's list and of the GR's alone (``tune-fusion``'s; None: not told):
    # whether the item model's own list is the better of the two, for ``auto``'s order of quality
    item_recall: float | None = None
    gr_recall: float | None = None

    def __post_init__(self) -> None:
        if not 0.0 <= self.weight <= 1.0:
            raise ValueError(f"fusion weight {self.weight}: must be in [0, 1]")
        if self.norm not in ("raw", "z"):
            raise ValueError(f"fusion norm {self.norm!r}: 'raw' or 'z'")
        if self.drafts < 1:
            raise ValueError(f"fusion drafts {self.drafts}: at least 1")

    def score(self, gr: np.ndarray, item: np.ndarray) -> np.ndarray:
        """The fused score of one request's candidates: ``gr`` [n] the GR model's log p(SID), ``item`` [n] the
        item model's log p(item)."""
        return self.weight * _norm(np.asarray(gr, np.float64), self.norm) + (1.0 - self.weight) * _norm(
            np.asarray(item, np.float64), self.norm)

    def candidates(self, k: int) -> int:
        """Candidates scored for a list of ``k``: the chosen count (chosen at K = 10), and never fewer than 2K,
        so the fused list always has a choice."""
        return max(self.drafts, 2 * k)

    @property
    def item_model_leads(self) -> bool:
        """Whether the item model's list alone beat the GR's on validation (both told)."""
        return self.item_recall is not None and self.gr_recall is not None and self.item_recall > self.gr_recall

    def as_dict(self) -> dict:
        return {k: v for k, v in asdict(self).items() if k not in ("item_recall", "gr_recall")}

    @staticmethod
    def of(meta: dict | None) -> Fusion | None:
        """From a bundle's ``fusion`` entry (None: it has none)."""
        if not meta:
            return None
        valid = meta.get("valid", {})

        def told(name: str) -> float | None:
            v = valid.get(name, {}).get("recall@10")
            return None if v is None else float(v)

        return Fusion(float(meta["weight"]), meta.get("norm", "z"), int(meta.get("drafts", 50)),
                      told("sasrec"), told("gr_alone"))


def _norm(x: np.ndarray, norm: Norm) -> np.ndarray:
    if norm == "raw" or len(x) < 2:
        return x
    sd = x.std()
    return (x - x.mean()) / sd if sd > 0 else x - x.mean()


def top_k(fusion: Fusion, items: np.ndarray, gr: np.ndarray, item: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
    """The best ``k`` candidates by fused score (ties: the item model's order) -> (items, fused scores)."""
    f = fusion.score(gr, item)
    order = np.argsort(-f, kind="stable")[:k]
    return np.asarray(items)[order], f[order]


@dataclass
class Scored:
    """One validation user's candidates: the item model's top items, both models' log-probabilities, the
    target."""

    items: np.ndarray  # [n] the item model's best first
    item_logp: np.ndarray  # [n]
    gr_logp: np.ndarray  # [n]
    target: int


def recall_ndcg(users: Sequence[Scored], fusion: Fusion, k: int = 10) -> tuple[float, float]:
    """Recall@k and NDCG@k of the fused lists of ``users`` (their first ``fusion.drafts`` candidates)."""
    rec = ndcg = 0.0
    for u in users:
        n = fusion.drafts
        top, _ = top_k(fusion, u.items[:n], u.gr_logp[:n], u.item_logp[:n], k)
        hit = np.nonzero(top == u.target)[0]
        if len(hit):
            rec += 1.0
            ndcg += 1.0 / np.log2(hit[0] + 2)
    return rec / max(1, len(users)), ndcg / max(1, len(users))


def choose(users: Sequence[Scored], drafts: Sequence[int] = (50,), k: int = 10,
           weights: Sequence[float] = tuple(np.round(np.arange(0.0, 1.0001, 0.05), 2)),
           norms: Sequence[Norm] = ("raw", "z"), smooth: int = 1) -> tuple[Fusion, list[dict]]:
    """The fusion with the best recall@k on ``users`` (validation users, never test), over a grid of weights,
    normalisations and candidate counts; the recall of each weight is averaged with its ``smooth`` neighbours on
    either side first, so a lone lucky weight of a noisy sample is not the one kept. -> (the choice, the grid)."""
    grid: list[dict] = []
    for n in drafts:
        for norm in norms:
            row = [recall_ndcg(users, Fusion(float(w), norm, int(n)), k) for w in weights]
            rec = np.asarray([r for r, _ in row])
            smoothed = np.asarray([rec[max(0, i - smooth): i + smooth + 1].mean() for i in range(len(rec))])
            for w, (r, nd), s in zip(weights, row, smoothed):
                grid.append({"drafts": int(n), "norm": norm, "weight": float(w), f"recall@{k}": r, f"ndcg@{k}": nd,
                             f"recall@{k}_smoothed": float(s)})
    best = max(grid, key=lambda g: (g[f"recall@{k}_smoothed"], g[f"ndcg@{k}"]))
    return Fusion(float(best["weight"]), best["norm"], int(best["drafts"])), grid
