"""Ranking metrics for one held-out target per request.

``ranked`` is ``[N, K]`` item indices, best first (-1 for empty slots);
``target`` is ``[N]``. Recall@k is the hit rate in the top k; NDCG@k with one
relevant item is ``1 / log2(rank + 2)`` for a hit at 0-based ``rank`` (the
ideal DCG is 1), 0 otherwise.
"""

from __future__ import annotations

import numpy as np


def target_ranks(ranked: np.ndarray, target: np.ndarray) -> np.ndarray:
    """0-based position of each target in its list; -1 when absent."""
    ranked = np.asarray(ranked)
    target = np.asarray(target)
    hit = ranked == target[:, None]
    return np.where(hit.any(1), hit.argmax(1), -1)


def recall_at_k(ranks: np.ndarray, k: int) -> float:
    ranks = np.asarray(ranks)
    if len(ranks) == 0:
        return float("nan")
    return float(((ranks >= 0) & (ranks < k)).mean())


def ndcg_at_k(ranks: np.ndarray, k: int) -> float:
    ranks = np.asarray(ranks)
    if len(ranks) == 0:
        return float("nan")
    hit = (ranks >= 0) & (ranks < k)
    gain = np.zeros(len(ranks))
    gain[hit] = 1.0 / np.log2(ranks[hit] + 2.0)
    return float(gain.mean())


def metrics_from_ranks(ranks: np.ndarray, ks=(5, 10, 50)) -> dict[str, float]:
    out = {}
    for k in ks:
        out[f"recall@{k}"] = recall_at_k(ranks, k)
        out[f"ndcg@{k}"] = ndcg_at_k(ranks, k)
    return out


def percentiles_ms(seconds, qs=(50, 99)) -> dict[str, float]:
    arr = np.asarray(seconds, dtype=float) * 1000.0
    if len(arr) == 0:
        return {f"p{q}_ms": float("nan") for q in qs}
    return {f"p{q}_ms": float(np.percentile(arr, q)) for q in qs}


def gains(places: np.ndarray, k: int = 10) -> tuple[np.ndarray, np.ndarray]:
    """Per request, its recall@k (hit: 1.0, else 0.0) and NDCG@k from the target's 0-based place in the list
    (-1: missed): arrays to average, or to compare request by request (:func:`paired_bootstrap`)."""
    places = np.asarray(places)
    hit = (places >= 0) & (places < k)
    ndcg = np.zeros(len(places))
    ndcg[hit] = 1.0 / np.log2(places[hit] + 2.0)
    return hit.astype(np.float64), ndcg


def paired_bootstrap(a: np.ndarray, b: np.ndarray, resamples: int = 1000, seed: int = 0,
                     level: float = 0.95) -> dict[str, float]:
    """How sure the same requests say list A beats list B: ``a`` and ``b`` [n] are each request's figure under A
    and under B (:func:`gains`); the requests are resampled with replacement ``resamples`` times, the same draw
    for both lists (paired), and the mean difference A - B and the ratio mean(A) / mean(B) of each resample
    give percentile intervals at ``level``. -> ``diff`` (the observed mean difference), ``diff_lo``,
    ``diff_hi``, ``ratio``, ``ratio_lo``, ``ratio_hi``, ``n``, ``resamples``."""
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    if a.shape != b.shape or a.ndim != 1:
        raise ValueError(f"paired figures must be two [n] arrays of one length, got {a.shape} and {b.shape}")
    n = len(a)
    rng = np.random.default_rng(seed)
    diffs, ratios = np.empty(resamples), np.empty(resamples)
    chunk = max(1, 2_000_000 // max(1, n))  # resamples drawn together: at most ~2M indices at a time
    for s in range(0, resamples, chunk):
        idx = rng.integers(0, n, size=(min(chunk, resamples - s), n)) if n else np.zeros((0, 0), np.int64)
        ma, mb = a[idx].mean(1), b[idx].mean(1)
        diffs[s:s + len(idx)] = ma - mb
        with np.errstate(divide="ignore", invalid="ignore"):
            ratios[s:s + len(idx)] = np.where(mb > 0, ma / np.where(mb > 0, mb, 1.0), np.nan)
    tail = (1.0 - level) / 2.0 * 100.0
    lo, hi = np.nanpercentile(diffs, [tail, 100.0 - tail]) if n else (np.nan, np.nan)
    rlo, rhi = np.nanpercentile(ratios, [tail, 100.0 - tail]) if n and np.isfinite(ratios).any() else (np.nan, np.nan)
    mean_b = float(b.mean()) if n else float("nan")
    return {"diff": float(a.mean() - b.mean()) if n else float("nan"), "diff_lo": float(lo), "diff_hi": float(hi),
            "ratio": float(a.mean() / mean_b) if n and mean_b > 0 else float("nan"),
            "ratio_lo": float(rlo), "ratio_hi": float(rhi), "n": int(n), "resamples": int(resamples),
            "level": float(level)}
