"""Semantic IDs: residual quantisation (RQ-KMeans) plus a collision digit.

An item's SID is ``L`` residual-quantisation codes (default 3 levels x 256
codes) followed by one collision digit that tells apart items whose codes are
equal. SIDs are int64 arrays ``[N, L + 1]`` of per-level codes (not offset
into a shared vocabulary; the model does that).

- :meth:`SemanticIds.fit` is deterministic given the seed.
- :meth:`SemanticIds.assign` gives new items SIDs from their embeddings
  without refitting (inductive) and reports collisions.
- A collision digit that would reach ``collision_size`` raises
  :class:`CollisionOverflow`; it never wraps or truncates silently.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np


class CollisionOverflow(RuntimeError):
    """More items share one RQ code prefix than the collision digit can tell apart."""


def _kmeans(x: np.ndarray, k: int, seed: int, niter: int) -> np.ndarray:
    import faiss

    k = min(k, len(x))
    km = faiss.Kmeans(
        x.shape[1], k, niter=niter, seed=seed, verbose=False,
        max_points_per_centroid=max(256, (len(x) + k - 1) // k), min_points_per_centroid=1,
    )
    km.train(np.ascontiguousarray(x, dtype=np.float32))
    assert km.centroids is not None  # set by train
    return km.centroids.copy()


def _nearest(x: np.ndarray, centroids: np.ndarray) -> np.ndarray:
    # squared L2 without materialising differences: |x|^2 - 2 x.c + |c|^2
    d = (centroids**2).sum(1)[None, :] - 2.0 * x @ centroids.T
    return d.argmin(1)


@dataclass
class SidReport:
    n_items: int
    levels: list[dict]
    unique_prefixes: int
    items_with_collision: int
    max_collision_digit: int
    collision_size: int

    def as_dict(self) -> dict:
        return self.__dict__.copy()


@dataclass
class Assignment:
    """Result of inductive assignment for new items."""

    sids: np.ndarray  # [M, L+1]
    collided: np.ndarray  # [M] bool: RQ prefix already used by another item
    report: dict = field(default_factory=dict)


class SemanticIds:
    def __init__(self, codebooks: np.ndarray, collision_size: int = 256):
        self.codebooks = np.asarray(codebooks, dtype=np.float32)  # [L, C, D]
        self.collision_size = int(collision_size)

    @property
    def n_levels(self) -> int:
        return self.codebooks.shape[0]

    @property
    def codebook_size(self) -> int:
        return self.codebooks.shape[1]

    @property
    def level_sizes(self) -> list[int]:
        return [self.codebook_size] * self.n_levels + [self.collision_size]

    # -- fitting ---------------------------------------------------------
    @classmethod
    def fit(
        cls,
        emb: np.ndarray,
        n_levels: int = 3,
        codebook_size: int = 256,
        collision_size: int = 256,
        seed: int = 0,
        niter: int = 30,
    ) -> SemanticIds:
        emb = np.asarray(emb, dtype=np.float32)
        residual = emb.copy()
        books = np.zeros((n_levels, codebook_size, emb.shape[1]), dtype=np.float32)
        for lvl in range(n_levels):
            cents = _kmeans(residual, codebook_size, seed + lvl, niter)
            # unused slots (catalogue smaller than the codebook) sit far away
            books[lvl, : len(cents)] = cents
            if len(cents) < codebook_size:
                books[lvl, len(cents) :] = 1e6
            codes = _nearest(residual, books[lvl])
            residual = residual - books[lvl][codes]
        return cls(books, collision_size)

    # -- encoding --------------------------------------------------------
    def encode(self, emb: np.ndarray) -> np.ndarray:
        """RQ codes ``[N, L]`` (no collision digit)."""
        residual = np.asarray(emb, dtype=np.float32).copy()
        codes = np.zeros((len(residual), self.n_levels), dtype=np.int64)
        for lvl in range(self.n_levels):
            codes[:, lvl] = _nearest(residual, self.codebooks[lvl])
            residual = residual - self.codebooks[lvl][codes[:, lvl]]
        return codes

    def with_collision_digits(
        self, codes: np.ndarray, existing: np.ndarray | None = None
    ) -> tuple[np.ndarray, np.ndarray]:
        """Append collision digits. Items take the lowest digit not used by
        ``existing`` SIDs or by earlier rows with the same codes.
        Returns (sids, collided)."""
        used: dict[tuple, set[int]] = {}
        if existing is not None:
            for row in np.asarray(existing):
                used.setdefault(tuple(int(c) for c in row[:-1]), set()).add(int(row[-1]))
        sids = np.zeros((len(codes), self.n_levels + 1), dtype=np.int64)
        collided = np.zeros(len(codes), dtype=bool)
        for i, row in enumerate(codes):
            key = tuple(int(c) for c in row)
            taken = used.setdefault(key, set())
            collided[i] = bool(taken)
            digit = 0
            while digit in taken:
                digit += 1
            if digit >= self.collision_size:
                raise CollisionOverflow(
                    f"{len(taken) + 1} items share RQ codes {key}; collision digit would be {digit} "
                    f">= collision_size {self.collision_size}"
                )
            taken.add(digit)
            sids[i, :-1] = row
            sids[i, -1] = digit
        return sids, collided

    def assign_all(self, emb: np.ndarray) -> np.ndarray:
        sids, _ = self.with_collision_digits(self.encode(emb))
        return sids

    def assign(self, emb: np.ndarray, existing: np.ndarray) -> Assignment:
        """Inductive SIDs for new items, given the catalogue's current SIDs."""
        sids, collided = self.with_collision_digits(self.encode(emb), existing)
        report = {
            "new_items": int(len(sids)),
            "collided": int(collided.sum()),
            "max_digit": int(sids[:, -1].max(initial=0)),
        }
        return Assignment(sids, collided, report)

    # -- reporting -------------------------------------------------------
    def report(self, sids: np.ndarray) -> SidReport:
        levels = []
        for lvl in range(self.n_levels):
            counts = np.bincount(sids[:, lvl], minlength=self.codebook_size)
            p = counts[counts > 0] / counts.sum()
            levels.append({
                "level": lvl,
                "used": int((counts > 0).sum()),
                "size": self.codebook_size,
                "usage": float((counts > 0).mean()),
                "perplexity": float(np.exp(-(p * np.log(p)).sum())),
            })
        prefixes = np.unique(sids[:, :-1], axis=0)
        return SidReport(
            n_items=int(len(sids)),
            levels=levels,
            unique_prefixes=int(len(prefixes)),
            items_with_collision=int((sids[:, -1] > 0).sum()),
            max_collision_digit=int(sids[:, -1].max(initial=0)),
            collision_size=self.collision_size,
        )
