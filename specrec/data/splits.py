"""Evaluation protocols: leave-one-out (TIGER) and temporal (SpecGR).

Both are deterministic functions of the dataset and their parameters.

Leave-one-out
    Per user with items s[0..n-1]: the test target is s[n-1], the validation
    target s[n-2]; every position 1..n-3 is a training target. The history of
    a target at position i is s[max(0, i-H) : i].

Temporal
    One cut-off time T (a quantile of all interaction timestamps by default).
    Training targets are positions with timestamp < T, except each user's last
    such position, which is that user's validation target. The test target is
    the user's first position at or after T (the history is everything before
    it, up to H items). An item is *seen* when it appears anywhere in the
    training examples (as a target or in a history); every other item,
    including every item first interacted with at or after T, is *unseen*.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import numpy as np

from .dataset import Dataset

PAD = -1


@dataclass
class Examples:
    """Next-item examples. ``history`` is left-padded with -1."""

    history: np.ndarray  # [N, H] int64
    target: np.ndarray  # [N] int64
    user: np.ndarray  # [N] int64, index into dataset.sequences
    position: np.ndarray  # [N] int64, target position in the user's sequence

    def __len__(self) -> int:
        return len(self.target)

    def head(self, n: int | None) -> Examples:
        if n is None:
            return self
        return Examples(self.history[:n], self.target[:n], self.user[:n], self.position[:n])

    def take(self, idx: np.ndarray) -> Examples:
        return Examples(self.history[idx], self.target[idx], self.user[idx], self.position[idx])

    def plus(self, other: Examples) -> Examples:
        """These examples and ``other``'s, in that order."""
        return Examples(np.concatenate([self.history, other.history]), np.concatenate([self.target, other.target]),
                        np.concatenate([self.user, other.user]), np.concatenate([self.position, other.position]))

    def histories(self) -> list[np.ndarray]:
        """Unpadded histories, oldest first."""
        return [h[h != PAD] for h in self.history]

    def full_histories(self, sequences) -> list[np.ndarray]:
        """Each example's whole history before its target (not cut to the model's window), oldest first,
        from the dataset's ``sequences`` the examples were made from."""
        return [sequences[u].items[:p] for u, p in zip(self.user.tolist(), self.position.tolist())]


def sample_examples(ex: Examples, n: int | None, seed: int = 0) -> Examples:
    """A seeded random sample of ``n`` examples (in their original order); all when ``n`` is None or too big.
    The first users of a file are not typical, so benchmarks and validation sample instead of taking a head."""
    if n is None or n >= len(ex):
        return ex
    idx = np.sort(np.random.default_rng(seed).choice(len(ex), size=n, replace=False))
    return ex.take(idx)


@dataclass
class Split:
    protocol: str
    train: Examples
    valid: Examples
    test: Examples
    seen: np.ndarray  # [n_items] bool: item appears in training examples
    max_history: int
    cutoff: int | None = None  # temporal only, Unix seconds

    def describe(self) -> dict:
        out = {
            "protocol": self.protocol,
            "train": len(self.train),
            "valid": len(self.valid),
            "test": len(self.test),
            "seen_items": int(self.seen.sum()),
            "unseen_items": int((~self.seen).sum()),
            "test_unseen_targets": int((~self.seen[self.test.target]).sum()),
        }
        if self.cutoff is not None:
            out["cutoff"] = int(self.cutoff)
        return out


class _Builder:
    def __init__(self, max_history: int):
        self.h = max_history
        self.hist: list[np.ndarray] = []
        self.tgt: list[int] = []
        self.usr: list[int] = []
        self.pos: list[int] = []

    def add(self, u: int, items: np.ndarray, i: int) -> None:
        row = np.full(self.h, PAD, dtype=np.int64)
        prev = items[max(0, i - self.h) : i]
        if len(prev):
            row[self.h - len(prev) :] = prev
        self.hist.append(row)
        self.tgt.append(int(items[i]))
        self.usr.append(u)
        self.pos.append(i)

    def build(self) -> Examples:
        if not self.tgt:
            return Examples(np.zeros((0, self.h), np.int64), *(np.zeros(0, np.int64) for _ in range(3)))
        return Examples(
            np.stack(self.hist),
            np.asarray(self.tgt, np.int64),
            np.asarray(self.usr, np.int64),
            np.asarray(self.pos, np.int64),
        )


def _seen(n_items: int, ex: Examples) -> np.ndarray:
    seen = np.zeros(n_items, dtype=bool)
    seen[ex.target] = True
    h = ex.history[ex.history != PAD]
    seen[h] = True
    return seen


def leave_one_out(ds: Dataset, max_history: int = 20) -> Split:
    tr, va, te = _Builder(max_history), _Builder(max_history), _Builder(max_history)
    for u, s in enumerate(ds.sequences):
        n = len(s.items)
        if n < 2:
            continue
        te.add(u, s.items, n - 1)
        if n >= 3:
            va.add(u, s.items, n - 2)
        for i in range(1, n - 2):
            tr.add(u, s.items, i)
    train = tr.build()
    return Split("loo", train, va.build(), te.build(), _seen(ds.n_items, train), max_history)


def temporal_cutoff(ds: Dataset, quantile: float) -> int:
    if not ds.has_timestamps:
        raise ValueError(f"dataset {ds.name!r} has no timestamps: the temporal protocol needs them")
    ts = np.concatenate([s.timestamps for s in ds.sequences])
    return int(np.quantile(ts, quantile, method="lower"))


def temporal(ds: Dataset, max_history: int = 20, quantile: float = 0.8, cutoff: int | None = None) -> Split:
    if cutoff is None:
        cutoff = temporal_cutoff(ds, quantile)
    elif not ds.has_timestamps:
        raise ValueError(f"dataset {ds.name!r} has no timestamps: the temporal protocol needs them")
    tr, va, te = _Builder(max_history), _Builder(max_history), _Builder(max_history)
    for u, s in enumerate(ds.sequences):
        ts = s.timestamps
        assert ts is not None  # has_timestamps, checked above
        before = np.nonzero(ts < cutoff)[0]
        before = before[before >= 1]
        if len(before):
            va.add(u, s.items, int(before[-1]))
            for i in before[:-1]:
                tr.add(u, s.items, int(i))
        after = np.nonzero(ts >= cutoff)[0]
        after = after[after >= 1]
        if len(after):
            te.add(u, s.items, int(after[0]))
    train = tr.build()
    return Split("temporal", train, va.build(), te.build(), _seen(ds.n_items, train), max_history, cutoff)


def refit_split(split: Split) -> Split:
    """The split a model is refit on once every choice was made on validation users: every interaction but the
    test ones trains (the validation targets join the training targets, and so the histories of the chunks and
    sequences made from them), there is no validation left, the test examples are the same. Under leave-one-out
    a test history then ends with an interaction the refit model was trained on, as a validation history ended
    with one the chosen model was trained on: test faces the models as validation did (the production protocol:
    choose on validation, then train on everything up to now)."""
    train = split.train.plus(split.valid)
    empty = split.valid.take(np.zeros(0, dtype=np.int64))
    return Split(split.protocol, train, empty, split.test, _seen(len(split.seen), train), split.max_history,
                 split.cutoff)


Protocol = Literal["loo", "temporal"]


def make_split(ds: Dataset, protocol: str, max_history: int = 20, quantile: float = 0.8) -> Split:
    if protocol == "loo":
        return leave_one_out(ds, max_history)
    if protocol == "temporal":
        return temporal(ds, max_history, quantile)
    raise ValueError(f"unknown protocol {protocol!r} (expected 'loo' or 'temporal')")
