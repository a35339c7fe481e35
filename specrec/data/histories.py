"""Histories as the models read them: the last ``width`` items, right-aligned, -1 before (left padding), so the
most recent item always sits at the same position. One definition, used by every encoder input (the GR's SID
rows, SASRec's item rows, the self-draft head's) in serving, evaluation and drafting."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from .splits import PAD


def left_pad(histories: Sequence[np.ndarray] | np.ndarray, width: int, known: int | None = None) -> np.ndarray:
    """Item-index histories (ragged lists, or rows already padded with -1) -> [R, width] int64: each row's last
    ``width`` items (those in ``[0, known)`` where ``known`` is given: items a model was trained on), -1 before."""
    out = np.full((len(histories), width), PAD, dtype=np.int64)
    for i, items in enumerate(histories):
        items = np.asarray(items, dtype=np.int64)
        keep = items >= 0 if known is None else (items >= 0) & (items < known)
        items = items[keep][-width:] if width else items[:0]
        if len(items):
            out[i, width - len(items):] = items
    return out


def history_codes(histories: Sequence[np.ndarray] | np.ndarray, width: int, sids: np.ndarray) -> np.ndarray:
    """Histories -> [R, width, L] SID codes of :func:`left_pad`'s rows (``sids`` [N, L]), rows of -1 before."""
    rows = left_pad(histories, width)
    out = np.full((*rows.shape, sids.shape[1]), PAD, dtype=np.int64)
    real = rows >= 0
    out[real] = np.asarray(sids)[rows[real]]
    return out
