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
