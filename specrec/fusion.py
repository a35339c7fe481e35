"""Ranking by both models: the GR model's log-probability of an item's SID fused with an item model's
log-probability of the item (SASRec's, over the catalogue it was trained on). The one definition of the fused
score and of the fused list: the ``fused`` policy (in process and through the gateway) and ``specrec
tune-fusion`` call :meth:`Fusion.rank`, nothing else computes it.

A request's candidates are the item model's best ``drafts`` items (:meth:`Fusion.candidates`); each gets

    fused = weight * norm(gr) + (1 - weight) * norm(item)

where ``norm`` is the identity (``raw``) or a z-score over the request's candidates (``z``: each model's
scores centred and scaled within the request, so the weight does not depend on their ranges), and

- ``gr`` is the GR's log-probability of the candidate's SID, the sum of its L token log-probabilities; for an
  unseen item (no training interactions: its codes mean nothing to the model) the sum of the first L-1 scaled
  to L (:func:`gr_logp`, SpecGR's L-1 rule on the sum's scale);
- ``item`` is the item model's log-probability; an unseen item has none on that scale (the item drafter drafts
  it by text), so it gets the lowest of the request's seen candidates.

The list is the K best by fused score, ties in the item model's order, except that ``reserved`` places go to
the item drafter's unseen candidates where it drafted some (:func:`top_reserved`), in the item drafter's own
order: the drafter chose them by text likeness to the history, which no sequence model can judge for an item
nobody interacted with (ranked by the GR's L-1 score instead, they held fewer of the unseen targets).

Where the bundle has a learned **combiner** (:class:`Combiner`), it replaces the weighted mix: a small MLP over
each candidate's :func:`features` (both models' scores, the GR's per code, within-request z-scores and ranks),
trained by ``tune-fusion`` on half of the validation users and kept only where it beats the mix on the other half
(:mod:`specrec.train.combiner`); the weight stays beside it for a caller that does not know combiners.

The weight, the normalisation and the number of candidates are chosen on validation users (:func:`choose`,
``specrec tune-fusion``) and kept in the bundle (``bundle.json`` ``fusion``) with the validation recall of every
list a policy serves (``valid``: the fused list, the item drafter's own list, the GR's own beam search, ...),
which ``auto`` orders its tiers by; test users only ever judge the choice. :data:`DEFAULTS` holds the defaults
of a fusion entry, the one place they are written.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Literal

import numpy as np

Norm = Literal["raw", "z"]

#: a fusion entry's defaults where ``bundle.json`` (or a caller) leaves a field out
DEFAULTS: dict = {"norm": "z", "drafts": 50}


@dataclass(frozen=True)
class Fusion:
    weight: float  # the GR model's; the item model's is 1 - weight
    norm: Norm = DEFAULTS["norm"]
    drafts: int = DEFAULTS["drafts"]  # the item model's candidates scored per request (at least 2K)
    # validation recall@10 of each list a policy serves, by policy name ("fused", "drafter", "beam", "nezha"),
    # measured by ``tune-fusion``; empty: not told
    valid: Mapping[str, float] = field(default_factory=dict, compare=False, hash=False)
    # the learned score that replaces the weighted mix (None: the mix)
    combiner: Combiner | None = None
    # the list ``auto`` serves by default, "fused" or "drafter", as ``tune-fusion`` decided on validation users
    # (``fusion.default`` in bundle.json: the fused list only where it beat the drafter's own list by more than
    # chance); None: not told (then ``auto`` orders its tiers by ``valid`` alone)
    default: str | None = field(default=None, compare=False, hash=False)

    def __post_init__(self) -> None:
        if not 0.0 <= self.weight <= 1.0:
            raise ValueError(f"fusion weight {self.weight}: must be in [0, 1]")
        if self.norm not in ("raw", "z"):
            raise ValueError(f"fusion norm {self.norm!r}: 'raw' or 'z'")
        if self.drafts < 1:
            raise ValueError(f"fusion drafts {self.drafts}: at least 1")
        if self.default not in (None, *DEFAULT_LISTS):
            raise ValueError(f"fusion default list {self.default!r}: one of {DEFAULT_LISTS}")

    def score(self, gr: np.ndarray, item: np.ndarray) -> np.ndarray:
        """The fused score of one request's candidates from ``gr`` [n] (the GR's log p(SID), :func:`gr_logp`) and
        ``item`` [n] (the item model's log p(item), unseen items' already set: :func:`item_logp`)."""
        return self.weight * _norm(np.asarray(gr, np.float64), self.norm) + (1.0 - self.weight) * _norm(
            np.asarray(item, np.float64), self.norm)

    def rank(self, items: np.ndarray, token_logp: np.ndarray, item_scores: np.ndarray, unseen: np.ndarray, k: int,
             reserved: int = 0) -> tuple[np.ndarray, np.ndarray]:
        """The fused list of one request: ``items`` [n] the item drafter's candidates (its order), ``token_logp``
        [n, L] the GR's log-probability of each code of their SIDs, ``item_scores`` [n] the item model's
        log-probabilities, ``unseen`` [n] bool; ``reserved`` of the ``k`` places kept for unseen candidates
        (the item drafter's own order). -> (items, fused scores), best first."""
        items = np.asarray(items)
        unseen = np.asarray(unseen, dtype=bool)
        fused = self.fused(token_logp, item_scores, unseen)
        pick = top_reserved(fused, k, reserved, unseen)
        return items[pick], fused[pick]

    def fused(self, token_logp: np.ndarray, item_scores: np.ndarray, unseen: np.ndarray) -> np.ndarray:
        """The fused score [n] of one request's candidates (as :meth:`rank` takes them): the combiner's where
        there is one, else the weighted mix (:meth:`score`)."""
        unseen = np.asarray(unseen, dtype=bool)
        if self.combiner is not None:
            return self.combiner.score(features(token_logp, item_scores, unseen))
        return self.score(gr_logp(token_logp, unseen), item_logp(item_scores, unseen))

    def candidates(self, k: int) -> int:
        """Candidates scored for a list of ``k``: the chosen count (chosen at K = 10), and never fewer than 2K,
        so the fused list always has a choice."""
        return max(self.drafts, 2 * k)

    def as_dict(self) -> dict:
        """What ``bundle.json`` keeps of the choice (the validation figures are written beside it)."""
        out: dict = {"weight": self.weight, "norm": self.norm, "drafts": self.drafts}
        if self.combiner is not None:
            out["combiner"] = self.combiner.as_dict()
        return out

    @staticmethod
    def of(meta: dict | None) -> Fusion | None:
        """From a bundle's ``fusion`` entry (None: it has none). Its validation figures are read as labels of the
        lists a policy serves; an entry written before they were named so says ``sasrec`` for the item drafter's
        own list (``gr_alone`` was the GR re-ranking the item model's candidates: no list a policy serves)."""
        if not meta:
            return None
        valid = {LEGACY_LABELS.get(name, name): float(v["recall@10"])
                 for name, v in meta.get("valid", {}).items() if "recall@10" in v and name not in NOT_SERVED}
        default = (meta.get("default") or {}).get("list")
        return Fusion(float(meta["weight"]), meta.get("norm", DEFAULTS["norm"]),
                      int(meta.get("drafts", DEFAULTS["drafts"])), valid, Combiner.of(meta.get("combiner")),
                      default)


#: the lists ``auto`` may serve by default (``Fusion.default``): the fused list, or the item drafter's own
DEFAULT_LISTS = ("fused", "drafter")


#: validation figures of lists no policy serves (kept in bundle.json for the record, never a label)
NOT_SERVED = ("gr_alone", "gr_reranked")
#: older names of served lists in bundle.json's validation figures
LEGACY_LABELS = {"sasrec": "drafter"}


def gr_logp(token_logp: np.ndarray, unseen: np.ndarray) -> np.ndarray:
    """The GR model's log-probability of each candidate's SID from its token log-probabilities [n, L]: their sum;
    an unseen item's (``unseen`` [n] bool) over the first L-1 levels, scaled to L (the L-1 rule)."""
    tl = np.asarray(token_logp, np.float64)
    L = tl.shape[-1]
    full = tl.sum(-1)
    if not np.asarray(unseen).any() or L < 2:
        return full
    return np.where(unseen, tl[..., : L - 1].sum(-1) * L / (L - 1), full)


def item_logp(scores: np.ndarray, unseen: np.ndarray) -> np.ndarray:
    """The item model's log-probabilities [n], an unseen candidate's (drafted by text, not on the model's scale)
    set to the lowest of the request's seen ones (0 when there are none)."""
    s = np.asarray(scores, np.float64).copy()
    unseen = np.asarray(unseen, dtype=bool)
    if unseen.any():
        s[unseen] = s[~unseen].min() if (~unseen).any() else 0.0
    return s


def top_reserved(scores: np.ndarray, k: int, reserved: int = 0, eligible: np.ndarray | None = None) -> np.ndarray:
    """Indices of the best ``k`` of ``scores`` (ties: the given order), of which ``reserved`` (where there are
    that many) go to the ``eligible`` ones in their given order; the list in score order."""
    order = np.argsort(-np.asarray(scores, np.float64), kind="stable")
    if not reserved or eligible is None or not np.asarray(eligible).any():
        return order[:k]
    eligible = np.asarray(eligible, dtype=bool)
    special = np.flatnonzero(eligible)[: min(reserved, k)]  # the drafter's order
    rest = order[~eligible[order]][: k - len(special)]
    chosen = np.zeros(len(order), dtype=bool)
    chosen[special] = chosen[rest] = True
    return order[chosen[order]]


#: the version of :func:`features`; a combiner names the one it was trained on, and one that names another is
#: refused (its weights would read other columns)
FEATURES = "v1"


def features(token_logp: np.ndarray, item_scores: np.ndarray, unseen: np.ndarray) -> np.ndarray:
    """What a combiner reads of each of one request's candidates [n, L + 7]: the GR's log-probability of each
    code of its SID (an unseen item's last one, which means nothing for an item nobody interacted with, set to
    the mean of its others), the GR's :func:`gr_logp` and the item model's :func:`item_logp`, both z-scored
    over the request, both ranks in the request over n (0: the best), and whether it is unseen."""
    tl = np.asarray(token_logp, np.float64)
    unseen = np.asarray(unseen, dtype=bool)
    n, L = tl.shape
    levels = tl.copy()
    if L > 1 and unseen.any():
        levels[unseen, L - 1] = tl[unseen, : L - 1].mean(-1)
    gr, item = gr_logp(tl, unseen), item_logp(item_scores, unseen)
    return np.column_stack([levels, gr, item, _norm(gr, "z"), _norm(item, "z"), _ranks(gr) / max(1, n),
                            _ranks(item) / max(1, n), unseen.astype(np.float64)])


def _ranks(x: np.ndarray) -> np.ndarray:
    """Each entry's place when sorted best (largest) first, ties in the given order."""
    r = np.empty(len(x), np.float64)
    r[np.argsort(-x, kind="stable")] = np.arange(len(x))
    return r


@dataclass(frozen=True, eq=False)
class Combiner:
    """A learned fused score: one hidden ReLU layer over :func:`features` (their standardisation folded into the
    first layer), ``score = relu(x @ w1 + b1) @ w2 + b2``. Trained by :func:`specrec.train.combiner.fit`."""

    w1: np.ndarray  # [F, H]
    b1: np.ndarray  # [H]
    w2: np.ndarray  # [H]
    b2: float
    features: str = FEATURES

    def __post_init__(self) -> None:
        if self.features != FEATURES:
            raise ValueError(f"combiner trained on features {self.features!r}; this code computes {FEATURES!r}")
        F, H = np.shape(self.w1)
        if np.shape(self.b1) != (H,) or np.shape(self.w2) != (H,):
            raise ValueError(f"combiner shapes: w1 {np.shape(self.w1)}, b1 {np.shape(self.b1)}, "
                             f"w2 {np.shape(self.w2)}")

    @property
    def inputs(self) -> int:
        return int(np.shape(self.w1)[0])

    @property
    def hidden(self) -> int:
        return int(np.shape(self.w1)[1])

    def score(self, x: np.ndarray) -> np.ndarray:
        """The fused score [n] of one request's candidates from their :func:`features` [n, F]."""
        x = np.asarray(x, np.float64)
        if x.shape[-1] != self.inputs:
            raise ValueError(f"combiner reads {self.inputs} features, got {x.shape[-1]} (a SID of another length?)")
        return np.maximum(x @ self.w1 + self.b1, 0.0) @ self.w2 + self.b2

    def flat(self) -> list[float]:
        """Its weights in one list: w1 (row-major), b1, w2, b2 (how the drafter service sends it)."""
        return [*np.ravel(self.w1).tolist(), *np.ravel(self.b1).tolist(), *np.ravel(self.w2).tolist(),
                float(self.b2)]

    @staticmethod
    def from_flat(inputs: int, hidden: int, weights: Sequence[float], features: str = FEATURES) -> Combiner:
        w = np.asarray(weights, np.float64)
        F, H = int(inputs), int(hidden)
        if len(w) != F * H + 2 * H + 1:
            raise ValueError(f"combiner of {F} inputs and {H} hidden units has {F * H + 2 * H + 1} weights, "
                             f"got {len(w)}")
        return Combiner(w[: F * H].reshape(F, H), w[F * H: F * H + H], w[F * H + H: F * H + 2 * H],
                        float(w[-1]), features)

    def as_dict(self) -> dict:
        return {"features": self.features, "inputs": self.inputs, "hidden": self.hidden, "weights": self.flat()}

    @staticmethod
    def of(meta: dict | None) -> Combiner | None:
        if not meta:
            return None
        return Combiner.from_flat(meta["inputs"], meta["hidden"], meta["weights"], meta.get("features", FEATURES))


def _norm(x: np.ndarray, norm: Norm) -> np.ndarray:
    if norm == "raw" or len(x) < 2:
        return x
    sd = x.std()
    return (x - x.mean()) / sd if sd > 0 else x - x.mean()


@dataclass
class Scored:
    """One validation user's candidates: the item drafter's items (its order), both models' log-probabilities (the
    GR's per code), which are unseen, and the target."""

    items: np.ndarray  # [n]
    item_scores: np.ndarray  # [n]
    token_logp: np.ndarray  # [n, L]
    unseen: np.ndarray  # [n] bool
    target: int


def served_candidates(u: Scored, drafts: int, unseen_share: float = 0.0) -> np.ndarray:
    """Indices of the candidates of ``u`` that a draft of ``drafts`` gives (the first of its longer draft, the
    drafter's unseen share kept: :func:`top_reserved` in the drafter's order), in the drafter's order."""
    return np.sort(top_reserved(-np.arange(len(u.items), dtype=np.float64), drafts, int(round(unseen_share * drafts)),
                                u.unseen))


def hit_places(users: Sequence[Scored], fusion: Fusion, k: int = 10, unseen_share: float = 0.0) -> np.ndarray:
    """Per user, the place (0: first) of its target in its fused list of ``k`` as served with an item drafter that
    reserves ``unseen_share`` of its drafts (and of the list) for unseen items, -1 where the list misses it: each
    user's candidates are what a draft of ``fusion.drafts`` gives (the first of a longer draft, its unseen share
    kept: :func:`top_reserved` in the drafter's order)."""
    reserved = int(round(unseen_share * k))
    out = np.full(len(users), -1, dtype=np.int64)
    for j, u in enumerate(users):
        c = served_candidates(u, fusion.drafts, unseen_share)
        top, _ = fusion.rank(u.items[c], u.token_logp[c], u.item_scores[c], u.unseen[c], k, reserved)
        hit = np.nonzero(top == u.target)[0]
        if len(hit):
            out[j] = hit[0]
    return out


def recall_ndcg(users: Sequence[Scored], fusion: Fusion, k: int = 10, unseen_share: float = 0.0) -> tuple[float, float]:
    """Recall@k and NDCG@k of the fused lists of ``users`` as served (:func:`hit_places`)."""
    return recall_ndcg_of(hit_places(users, fusion, k, unseen_share))


def recall_ndcg_of(places: np.ndarray) -> tuple[float, float]:
    """Recall and NDCG of lists from their targets' places (:func:`hit_places`; -1: missed)."""
    hit = places >= 0
    n = max(1, len(places))
    return float(hit.sum()) / n, float((1.0 / np.log2(places[hit] + 2.0)).sum()) / n


def choose(users: Sequence[Scored], drafts: Sequence[int] = (50,), k: int = 10,
           weights: Sequence[float] = tuple(np.round(np.arange(0.0, 1.0001, 0.05), 2)),
           norms: Sequence[Norm] = ("raw", "z"), smooth: int = 1, unseen_share: float = 0.0,
           tolerance: float = 0.0) -> tuple[Fusion, list[dict]]:
    """The fusion with the best recall@k on ``users`` (validation users, never test), over a grid of weights,
    normalisations and candidate counts; the recall of each weight is averaged with its ``smooth`` neighbours on
    either side first, so a lone lucky weight of a noisy sample is not the one kept. With ``tolerance``, the
    fewest candidates whose best (smoothed) recall is within that share of the best of all: the scoring pass
    costs in proportion to its prefix nodes, so a few candidates less that lose nothing measurable are taken.
    -> (the choice, the grid)."""
    grid: list[dict] = []
    for n in drafts:
        for norm in norms:
            row = [recall_ndcg(users, Fusion(float(w), norm, int(n)), k, unseen_share) for w in weights]
            rec = np.asarray([r for r, _ in row])
            smoothed = np.asarray([rec[max(0, i - smooth): i + smooth + 1].mean() for i in range(len(rec))])
            for w, (r, nd), s in zip(weights, row, smoothed):
                grid.append({"drafts": int(n), "norm": norm, "weight": float(w), f"recall@{k}": r, f"ndcg@{k}": nd,
                             f"recall@{k}_smoothed": float(s)})

    def key(g: dict) -> tuple:
        return g[f"recall@{k}_smoothed"], g[f"ndcg@{k}"]

    top = max(grid, key=key)[f"recall@{k}_smoothed"]
    fewest = min(g["drafts"] for g in grid if g[f"recall@{k}_smoothed"] >= (1.0 - tolerance) * top)
    best = max((g for g in grid if g["drafts"] == fewest), key=key)
    return Fusion(float(best["weight"]), best["norm"], int(best["drafts"])), grid
