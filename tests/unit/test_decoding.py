import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from specrec.decoding.beam import BeamSearch, beam_search, expand_prefixes
from specrec.decoding.scoring import score_sids
from specrec.ids import SidTrie
from specrec.models.tiger import Tiger

from ..conftest import random_sids, sharpen, tiny_config


def make(seed=0, n_items=40, **kw):
    torch.manual_seed(seed)
    cfg = tiny_config(**kw)
    model = Tiger(cfg).eval()
    # a random model is nearly uniform; scale the heads so rankings are decisive
    sharpen(model, 40)
    sids = random_sids(n_items, cfg.level_sizes, seed)
    return model, sids, SidTrie(sids, cfg.level_sizes)


def histories(model, sids, n, seed=0):
    rng = np.random.default_rng(seed)
    h = model.cfg.max_history
    out = torch.full((n, h, model.cfg.sid_len), -1, dtype=torch.int64)
    for i in range(n):
        k = int(rng.integers(1, h + 1))
        out[i, h - k :] = torch.from_numpy(sids[rng.integers(0, len(sids), k)])
    return out


@torch.inference_mode()
def test_beam_returns_only_valid_sids():
    model, sids, trie = make(n_items=25)
    enc = model.encode(histories(model, sids, 4))
    for width in (1, 5, 30, 60):  # 30, 60 > catalogue: extra beams must be dead, not invalid
        beams = beam_search(model, enc, trie, width)
        alive = beams.alive()
        flat = beams.codes[alive]
        assert trie.contains(flat).all()
        assert (beams.items(trie)[alive] >= 0).all()
        assert (beams.items(trie)[~alive] == -1).all()
        assert int(alive.sum(1).max()) == min(width, 25)
        # sorted best first, unique per request
        for r in range(4):
            s = beams.scores[r][alive[r]]
            assert torch.all(s[:-1] >= s[1:])
            assert len({tuple(x) for x in beams.codes[r][alive[r]].tolist()}) == int(alive[r].sum())


@torch.inference_mode()
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_wide_beam_equals_exhaustive_search(seed):
    model, sids, trie = make(seed, n_items=30)
    enc = model.encode(histories(model, sids, 3, seed))
    # a beam at least as wide as the catalogue keeps every prefix, so it is exact
    beams = beam_search(model, enc, trie, width=30)
    cand = torch.from_numpy(sids).unsqueeze(0).expand(3, -1, -1)
    total = score_sids(model, enc, cand).total()
    for r in range(3):
        order = torch.argsort(total[r], descending=True, stable=True)
        assert torch.equal(beams.items(trie)[r], order)
        assert torch.allclose(beams.scores[r], total[r][order], atol=1e-5)


@settings(max_examples=15, deadline=None)
@given(seed=st.integers(0, 1000), width=st.integers(1, 12), n_req=st.integers(1, 4))
def test_kv_cache_equals_no_cache(seed, width, n_req):
    model, sids, trie = make(seed % 7, n_items=35)
    with torch.inference_mode():
        enc = model.encode(histories(model, sids, n_req, seed))
        a = beam_search(model, enc, trie, width, use_cache=True)
        b = beam_search(model, enc, trie, width, use_cache=False)
    assert torch.equal(a.codes, b.codes)
    assert torch.allclose(a.scores, b.scores, atol=1e-5, equal_nan=True)


@torch.inference_mode()
def test_batched_scoring_equals_one_by_one():
    model, sids, trie = make(3, n_items=40)
    hist = histories(model, sids, 3, 3)
    enc = model.encode(hist)
    cand = torch.from_numpy(sids[:12]).view(3, 4, -1)
    batched = score_sids(model, enc, cand, full=True)
    for r in range(3):
        enc_r = model.encode(hist[r : r + 1])
        for m in range(4):
            one = score_sids(model, enc_r, cand[r : r + 1, m : m + 1], full=True)
            assert torch.allclose(batched.token_logp[r, m], one.token_logp[0, 0], atol=1e-5)
            for lvl in range(4):
                assert torch.allclose(batched.full[lvl][r, m], one.full[lvl][0, 0], atol=1e-5)
    # full per-token distributions are normalised and agree with the gathered ones
    for lvl in range(4):
        assert torch.allclose(batched.full[lvl].exp().sum(-1), torch.ones(3, 4), atol=1e-5)
        assert torch.allclose(batched.full[lvl].gather(-1, cand[..., lvl : lvl + 1]).squeeze(-1), batched.token_logp[..., lvl])


@torch.inference_mode()
def test_beam_scores_are_teacher_forced_log_likelihoods():
    model, sids, trie = make(4, n_items=40)
    enc = model.encode(histories(model, sids, 2, 4))
    beams = beam_search(model, enc, trie, 6)
    s = score_sids(model, enc, beams.codes).total()
    assert torch.allclose(s, beams.scores, atol=1e-5)
    per_token = score_sids(model, enc, beams.codes).token_logp
    assert torch.allclose(per_token, beams.token_logp, atol=1e-5)


@torch.inference_mode()
def test_one_step_expansion_from_prefixes_matches_beam_step():
    model, sids, trie = make(5, n_items=40)
    enc = model.encode(histories(model, sids, 2, 5))
    bs = BeamSearch(model, enc, trie, width=5)
    bs.step()
    after_two = bs.beams.select(torch.arange(2))
    bs.step()
    expanded = expand_prefixes(model, enc, after_two, trie, width=5)
    assert torch.equal(expanded.codes, bs.beams.codes)
    assert torch.allclose(expanded.scores, bs.beams.scores, atol=1e-5)


@torch.inference_mode()
def test_token_encoder_input_variant_decodes_too():
    model, sids, trie = make(6, n_items=30, encoder_input="tokens")
    enc = model.encode(histories(model, sids, 2, 6))
    a = beam_search(model, enc, trie, 4)
    b = beam_search(model, enc, trie, 4, use_cache=False)
    assert torch.equal(a.codes, b.codes) and trie.contains(a.codes.reshape(-1, 4)).all()
