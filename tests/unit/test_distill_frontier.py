"""Distillation's targets: the target's frontier that :func:`specrec.train.distill.target_frontier` reads off the
serving search (:mod:`specrec.decoding.searches.beam`) equals the one distillation computed before with its own
beam search (``run_frontier``), on the tiny synthetic models: the same prefixes kept at every level, the same
dead beams, the same log-probabilities (float tolerance: the serving pass sums attention in another order)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from specrec.ids.trie import SidTrie
from specrec.models.hotpath import FusedHotPath, child_tables
from specrec.train.batches import history_batch
from specrec.train.distill import run_frontier, target_frontier

from ..conftest import random_sids, sharpen, tiny_config, tiny_tiger


def _models():
    m, _, sids = tiny_tiger()
    yield "tiny_tiger", m, sids
    from specrec.models.tiger import Tiger

    torch.manual_seed(3)
    m2 = Tiger(tiny_config(level_sizes=[8, 7, 6])).eval()  # three levels; a wider first level
    sharpen(m2, 5)
    yield "three_levels", m2, random_sids(120, m2.cfg.level_sizes, 3)


def _histories(n_items: int, max_history: int, n: int, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    hist = np.full((n, max_history), -1, dtype=np.int64)
    for i in range(n):
        k = int(rng.integers(1, max_history + 1))
        hist[i, -k:] = rng.integers(0, n_items, k)
    return hist


@pytest.mark.parametrize("width", [1, 4, 9, 32])
def test_the_frontier_is_the_one_distillation_computed_before(width):
    for _, model, sids in _models():
        fused = FusedHotPath(model).eval()
        tables = child_tables(SidTrie(sids, model.cfg.level_sizes), fused.vmax)
        hist = history_batch(torch.from_numpy(sids), _histories(len(sids), model.cfg.max_history, 40, width))
        h0a, roota, la, sa = run_frontier(fused, tables, hist, width)
        h0b, rootb, lb, sb = target_frontier(fused, tables, hist, width)
        assert torch.allclose(h0a, h0b, atol=1e-5) and torch.allclose(roota, rootb, atol=1e-5)
        assert len(la) == len(lb) == model.cfg.sid_len - 1
        for (ca, aa, pa), (cb, ab, pb) in zip(la, lb):
            assert torch.equal(ca, cb) and torch.equal(aa, ab)
            assert pa.shape == pb.shape
            fin = torch.isfinite(pa)
            assert torch.equal(fin, torch.isfinite(pb)) and torch.allclose(pa[fin], pb[fin], atol=1e-4)
        assert torch.equal(sa.codes, sb.codes) and torch.equal(sa.nodes, sb.nodes)
        assert torch.allclose(sa.scores[sa.nodes >= 0], sb.scores[sb.nodes >= 0], atol=1e-4)
