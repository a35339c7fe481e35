"""How the GR model's training examples become batches: bucketed by history length (:func:`bucketed_batches`),
histories as SID rows (:func:`history_batch`), and, for the causal encoder, whole-sequence chunks that teach
every target once (:func:`causal_chunks`)."""

from __future__ import annotations

import numpy as np
import torch

from ..data.splits import PAD, Examples


def bucketed_batches(lengths: np.ndarray, batch_size: int, rng: np.random.Generator, chunk: int) -> list[np.ndarray]:
    """Shuffle, sort within chunks of ``chunk`` batches by length, then shuffle batches."""
    order = rng.permutation(len(lengths))
    span = batch_size * chunk
    batches: list[np.ndarray] = []
    for s in range(0, len(order), span):
        part = order[s : s + span]
        part = part[np.argsort(lengths[part], kind="stable")]
        batches.extend(part[i : i + batch_size] for i in range(0, len(part), batch_size))
    rng.shuffle(batches)
    return batches


def history_batch(sids: torch.Tensor, hist: np.ndarray) -> torch.Tensor:
    """[B, H] item indices (-1 pad, left) -> [B, h, L] codes trimmed to the longest history, on ``sids``' device."""
    n = int((hist != PAD).sum(1).max())
    rows = torch.from_numpy(hist[:, hist.shape[1] - n :]).to(sids.device)
    out = sids[rows.clamp(min=0)]
    return torch.where((rows < 0).unsqueeze(-1), torch.full_like(out, -1), out)


def causal_chunks(ex: Examples, stride: int | None = None) -> tuple[np.ndarray, np.ndarray]:
    """Training examples -> whole-sequence chunks for a causal encoder.

    Per user, the example with the latest target gives a chunk: its history
    as input, and as targets the next item after every input position (the
    history shifted by one, then the example's own target); positions whose
    next item is not a training target are -1. Further chunks end ``stride``
    (default H) targets earlier. Every training target is taught in exactly
    one chunk: the one ending nearest after it, where it has the most context
    (at least H - stride + 1 items, or its whole history when shorter); in
    the others it is -1. With stride H chunks do not overlap, and a target
    early in a chunk sees only the items of that chunk; with stride 1 every
    target sees its full serving context.
    Returns (inputs [C, H], targets [C, H]), left-padded with -1."""
    H = ex.history.shape[1]
    stride = stride or H
    if not 1 <= stride <= H:
        raise ValueError(f"stride must be in 1..{H}, got {stride}")
    order = np.lexsort((ex.position, ex.user))
    users, pos = ex.user[order], ex.position[order]
    inp, tgt = [], []
    starts = np.flatnonzero(np.r_[True, users[1:] != users[:-1]])
    ends = np.r_[starts[1:], len(users)]
    for a, b in zip(starts, ends):
        p_min = int(pos[a])
        by_pos = {int(p): int(order[i]) for i, p in zip(range(a, b), pos[a:b])}
        e = int(pos[b - 1])
        while e >= p_min:
            j = by_pos[e]
            h = ex.history[j]
            row_t = np.full(H, PAD, dtype=np.int64)
            n = int((h != PAD).sum())
            first = e - n  # sequence position of the first history item
            row_t[H - n : H - 1] = h[H - n + 1 :]
            row_t[H - 1] = ex.target[j]
            later = e - stride >= p_min  # an earlier chunk exists: targets at or before e - stride are taught there
            for i in range(H - n, H):  # next item of input i sits at position first + (i - (H - n)) + 1
                p = first + (i - (H - n)) + 1
                if p < p_min or (later and p <= e - stride):
                    row_t[i] = PAD
            inp.append(h)
            tgt.append(row_t)
            e -= stride
    return np.stack(inp), np.stack(tgt)
