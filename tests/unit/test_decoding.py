import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from specrec.backends import Backend
from specrec.decoding.beam import BeamSearch, beam_search, select_topk
from specrec.decoding.scoring import VerifiedPrefixes, prefix_logprobs, score_sids, tree_pass
from specrec.decoding.tree import build_tree
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
    return Backend(model), sids, SidTrie(sids, cfg.level_sizes)


def histories(backend, sids, n, seed=0):
    rng = np.random.default_rng(seed)
    h = backend.cfg.max_history
    out = torch.full((n, h, backend.cfg.sid_len), -1, dtype=torch.int64)
    for i in range(n):
        k = int(rng.integers(1, h + 1))
        out[i, h - k :] = torch.from_numpy(sids[rng.integers(0, len(sids), k)])
    return out


def flat_scores(model, enc, sids):
    """The reference: N x L flat teacher-forced tokens through Tiger.decode (no tree, no backend)."""
    per_level, _ = model.next_logprobs(enc, model.decoder_input(sids[..., :-1]))
    return torch.stack(
        [lp.gather(-1, sids[..., t : t + 1]).squeeze(-1) for t, lp in enumerate(per_level)], -1
    ), per_level


@torch.inference_mode()
def test_beam_returns_only_valid_sids():
    be, sids, trie = make(n_items=25)
    enc = be.encode(histories(be, sids, 4))
    for width in (1, 5, 30, 60):  # 30, 60 > catalogue: extra beams must be dead, not invalid
        beams = beam_search(be, enc, trie, width)
        alive = beams.alive
        flat = beams.codes[alive]
        assert trie.contains(flat).all()
        assert (beams.items(trie)[alive] >= 0).all()
        assert (beams.items(trie)[~alive] == -1).all()
        assert int(alive.sum(1).max()) == min(width, 25)
        for r in range(4):  # sorted best first, unique per request
            s = beams.scores[r][alive[r]]
            assert torch.all(s[:-1] >= s[1:])
            assert len({tuple(x) for x in beams.codes[r][alive[r]].tolist()}) == int(alive[r].sum())


@torch.inference_mode()
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_wide_beam_equals_exhaustive_search(seed):
    be, sids, trie = make(seed, n_items=30)
    enc = be.encode(histories(be, sids, 3, seed))
    # a beam at least as wide as the catalogue keeps every prefix, so it is exact
    beams = beam_search(be, enc, trie, width=30)
    cand = torch.from_numpy(sids).unsqueeze(0).expand(3, -1, -1)
    total = score_sids(be, enc, cand).total()
    for r in range(3):
        order = torch.argsort(total[r], descending=True, stable=True)
        assert torch.equal(beams.items(trie)[r], order)
        assert torch.allclose(beams.scores[r], total[r][order], atol=1e-5)


@settings(max_examples=20, deadline=None)
@given(seed=st.integers(0, 1000), n_req=st.integers(1, 4), m=st.integers(1, 25))
def test_tree_scores_equal_flat_scores(seed, n_req, m):
    """One pass over unique prefixes gives every token the flat N x L pass gives it."""
    be, sids, _ = make(seed % 5, n_items=40)
    rng = np.random.default_rng(seed)
    with torch.inference_mode():
        hist = histories(be, sids, n_req, seed)
        cand = torch.from_numpy(sids[rng.integers(0, 40, (n_req, m))])  # repeats and shared prefixes on purpose
        tree_s = score_sids(be, be.encode(hist), cand, full=True)
        enc = be.model.encode(hist)
        flat, per_level = flat_scores(be.model, enc, cand)
    assert torch.allclose(tree_s.token_logp, flat, atol=1e-5)
    for a, b in zip(tree_s.full, per_level):
        assert torch.allclose(a, b, atol=1e-5)


def test_tree_holds_each_prefix_once_and_masks_ancestors():
    sizes = [4, 3, 3, 2]
    codes = np.array([[[0, 1, 2, 0], [0, 1, 2, 1], [0, 2, 0, 0], [3, 0, 0, 1]]])  # 4 drafts
    tree = build_tree([(codes, np.ones((1, 4), bool))], sizes, 1)
    # nodes: root; 0, 3; (0,1), (0,2), (3,0); (0,1,2), (0,2,0), (3,0,0) -> 9, where flat needs 16 tokens
    assert tree.n_nodes.tolist() == [9]
    assert tree.positions[0].tolist() == [0, 1, 1, 2, 2, 2, 3, 3, 3]
    col = tree.lookup(np.array([[[0, 2, 0]]]))[0, 0]
    anc = [tree.lookup(np.array([[c]]))[0, 0] if c else 0 for c in ([], [0], [0, 2])]
    anc[0] = tree.lookup(np.zeros((1, 1, 0), dtype=np.int64))[0, 0]
    assert sorted(np.nonzero(tree.mask[0, col].numpy())[0].tolist()) == sorted([*anc, col])
    assert tree.lookup(np.array([[[1, 0]]]))[0, 0] == -1  # not drafted
    drafted = tree.was_drafted(np.array([[[0, 1, 2]]]))[0, 0]
    assert drafted.tolist() == [True, True]
    assert tree.was_drafted(np.array([[[3]]]))[0, 0].tolist() == [True, False, False]


@torch.inference_mode()
def test_beam_scores_are_teacher_forced_log_likelihoods():
    be, sids, trie = make(4, n_items=40)
    enc = be.encode(histories(be, sids, 2, 4))
    beams = beam_search(be, enc, trie, 6)
    sc = score_sids(be, enc, beams.codes)
    assert torch.allclose(sc.total(), beams.scores, atol=1e-5)
    assert torch.allclose(sc.token_logp, beams.token_logp, atol=1e-5)


@torch.inference_mode()
def test_cached_steps_equal_steps_read_from_verified_trees():
    """A beam search that reads every level from tree passes (none cached) equals the KV-cached one."""
    be, sids, trie = make(5, n_items=40)
    enc = be.encode(histories(be, sids, 3, 5))
    ref = beam_search(be, enc, trie, 5)
    verified = VerifiedPrefixes(be.cfg.level_sizes)

    def compute(beams, missing):
        tree, out = tree_pass(be, enc, [(beams.codes, missing)], drafts=0)
        verified.add(tree, out)
        return verified.read(beams.codes)[0]

    bs = BeamSearch(be, enc, trie, 5, known=lambda b: verified.read(b.codes), compute_missing=compute)
    got = bs.run()
    assert torch.equal(got.codes, ref.codes)
    assert torch.allclose(got.scores, ref.scores, atol=1e-5)


@torch.inference_mode()
def test_prefix_expansion_matches_beam_step():
    be, sids, trie = make(5, n_items=40)
    enc = be.encode(histories(be, sids, 2, 5))
    bs = BeamSearch(be, enc, trie, width=5)
    bs.step()
    after_one = bs.beams
    bs.step()
    logp = prefix_logprobs(be, enc, after_one.codes)
    expanded, _ = select_topk(after_one, logp, trie, 5)
    assert torch.equal(expanded.codes, bs.beams.codes)
    assert torch.allclose(expanded.scores, bs.beams.scores, atol=1e-5)


@torch.inference_mode()
def test_select_requests_keeps_the_cache_aligned():
    be, sids, trie = make(7, n_items=40)
    hist = histories(be, sids, 3, 7)
    full = BeamSearch(be, be.encode(hist), trie, 4)
    full.step()
    part = full.select_requests(torch.tensor([2, 0]), be.encode(hist).select(torch.tensor([2, 0])))
    a, b = part.run(), full.run()
    assert torch.equal(a.codes, b.codes[[2, 0]])
    assert torch.allclose(a.scores, b.scores[[2, 0]], atol=1e-5)


@torch.inference_mode()
def test_history_trimming_changes_nothing():
    """Histories shorter than the window are encoded on a trimmed window (a multiple of 4 positions): only
    padding is cut, and the decoder reads the same keys and values, so the beams are the untrimmed ones."""
    be, sids, trie = make(8, n_items=30, max_history=12)
    h = be.cfg.max_history
    hist = torch.full((3, h, be.cfg.sid_len), -1, dtype=torch.int64)
    for i, k in enumerate((1, 3, 5)):  # the longest, 5, keeps 8 of the 12 positions
        hist[i, h - k :] = torch.from_numpy(sids[i : i + k])
    a = be.encode(hist)
    ref = be.model.encode(hist)
    s = a.cross_k.shape[3]
    assert s == 8 < h  # trimmed
    assert not (hist[:, : h - s, 0] >= 0).any()  # what was cut is padding only
    assert torch.allclose(a.cross_k, ref.cross_k[..., -s:, :], atol=1e-5)
    untrimmed = Backend(be.model)
    untrimmed.encode = lambda x: untrimmed.model.encode(x)  # the whole window, the model's own encoder
    got, want = beam_search(be, a, trie, 4), beam_search(untrimmed, untrimmed.encode(hist), trie, 4)
    assert torch.equal(got.codes, want.codes)
    assert torch.allclose(got.scores, want.scores, atol=1e-5)


@torch.inference_mode()
def test_token_encoder_input_variant_decodes_too():
    be, sids, trie = make(6, n_items=30, encoder_input="tokens")
    enc = be.encode(histories(be, sids, 2, 6))
    a = beam_search(be, enc, trie, 4)
    assert trie.contains(a.codes.reshape(-1, 4)).all()
    assert torch.allclose(score_sids(be, enc, a.codes).total(), a.scores, atol=1e-5)
