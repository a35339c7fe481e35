"""Distillation's targets are the serving search's frontier: :func:`specrec.train.distill.target_frontier` (the
registry's ``beam``, :mod:`specrec.decoding.searches.beam`, watched level by level) equals the reference beam
search (:class:`specrec.decoding.beam.BeamSearch`, KV-cached steps on the eager backend) at every level: the same
prefixes kept, the same dead beams, the same next-level log-probs there (float tolerance: the serving pass sums
attention in another order); and its BOS state is the model's own (:meth:`Tiger.decode`).

Before distillation read the serving search it ran a copy of its own (``run_frontier``); this test compared the
two (same prefixes and dead beams, h0 and root log-probs bit for bit, log-probs within 1e-4) on these models
before the copy went."""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch

from specrec.backends import Backend
from specrec.decoding.beam import BeamSearch
from specrec.ids.trie import SidTrie
from specrec.models.hotpath import FusedHotPath
from specrec.models.tiger import BOS_TOKEN, Tiger
from specrec.train.batches import history_batch
from specrec.train.distill import target_frontier

from ..conftest import random_sids, sharpen, tiny_config, tiny_tiger


def _models():
    m, _, sids = tiny_tiger()
    yield m, sids
    torch.manual_seed(3)
    m2 = Tiger(tiny_config(level_sizes=[8, 7, 6])).eval()  # three levels; a wider first level
    sharpen(m2, 5)
    yield m2, random_sids(120, m2.cfg.level_sizes, 3)


def _histories(n_items: int, max_history: int, n: int, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    hist = np.full((n, max_history), -1, dtype=np.int64)
    for i in range(n):
        k = int(rng.integers(1, max_history + 1))
        hist[i, -k:] = rng.integers(0, n_items, k)
    return hist


@torch.inference_mode()
def _reference(model: Tiger, trie: SidTrie, hist: torch.Tensor, width: int):
    """The reference search's frontier: per level, the beams it extends and its next-level log-probs there."""
    backend = Backend(model)
    search = BeamSearch(backend, backend.encode(hist), trie, width)
    levels = []
    while not search.done:
        before = search.beams
        search.step()
        assert search.logp is not None
        levels.append((before.codes, before.alive, search.logp))
    return levels, search.beams


def _assert_same(model: Tiger, frontier, ref, hist: torch.Tensor) -> None:
    h0, root, levels, state = frontier
    ref_levels, beams = ref
    assert len(levels) == len(ref_levels) - 1 == model.cfg.sid_len - 1
    with torch.inference_mode():
        bos = torch.full((len(hist), 1, 1), BOS_TOKEN, dtype=torch.int64)
        assert torch.allclose(h0, model.decode(model.encode(hist), bos)[0][:, 0, 0], atol=1e-4)
    assert torch.allclose(root, ref_levels[0][2][:, 0], atol=1e-4)
    for (codes, alive, logp), (ref_codes, ref_alive, ref_logp) in zip(levels, ref_levels[1:]):
        (codes, alive, logp), (ref_codes, ref_alive, ref_logp) = _same_width((codes, alive, logp),
                                                                              (ref_codes, ref_alive, ref_logp))
        assert torch.equal(alive, ref_alive) and logp.shape == ref_logp.shape
        assert torch.equal(codes[alive], ref_codes[ref_alive])
        fin = torch.isfinite(ref_logp)
        assert torch.equal(torch.isfinite(logp)[alive], fin[ref_alive])
        assert torch.allclose(logp[alive & fin.all(-1)], ref_logp[ref_alive & fin.all(-1)], atol=1e-4)
    (codes, alive, scores), (ref_codes, ref_alive, ref_scores) = _same_width(
        (state.codes, state.nodes >= 0, state.scores), (beams.codes, beams.alive, beams.scores))
    assert torch.equal(alive, ref_alive) and torch.equal(codes[alive], ref_codes[alive])
    assert torch.allclose(scores[alive], ref_scores[alive], atol=1e-4)


def _same_width(ours: tuple, ref: tuple) -> tuple[tuple, tuple]:
    """Both (codes, alive, values) cut to the narrower width: the search keeps up to ``width`` of its candidates
    per row (B x Vmax over dense tables, B x the level's widest fan-out over CSR ones) and the reference of
    B x V_level, so beyond the narrower of the two every beam must be dead."""
    w = min(ours[1].shape[1], ref[1].shape[1])
    assert not ours[1][:, w:].any() and not ref[1][:, w:].any()
    return tuple(x[:, :w] for x in ours), tuple(x[:, :w] for x in ref)


@pytest.mark.parametrize("width", [1, 4, 9, 32])
def test_the_frontier_distillation_reads_is_the_reference_beam_search(width):
    for model, sids in _models():
        trie = SidTrie(sids, model.cfg.level_sizes)
        fused = FusedHotPath(model).eval()
        hist = history_batch(torch.from_numpy(sids), _histories(len(sids), model.cfg.max_history, 40, width))
        frontier = target_frontier(fused, trie.search_tables(fused.vmax), hist, width)
        _assert_same(model, frontier, _reference(model, trie, hist, width), hist)


def test_the_comparison_can_fail():
    """The frontier of a slightly different model (one decoder layer's weights nudged) is not the reference's."""
    model, sids = next(_models())
    trie = SidTrie(sids, model.cfg.level_sizes)
    hist = history_batch(torch.from_numpy(sids), _histories(len(sids), model.cfg.max_history, 40, 0))
    other = copy.deepcopy(model)
    with torch.no_grad():
        other.dec_layers[-1].ff.fc2.weight.mul_(1.5)
    fused = FusedHotPath(other).eval()
    frontier = target_frontier(fused, trie.search_tables(fused.vmax), hist, 4)
    with pytest.raises(AssertionError):
        _assert_same(model, frontier, _reference(model, trie, hist, 4), hist)
