import numpy as np
import pytest
import torch

from specrec.decoding.beam import beam_search
from specrec.decoding.scoring import score_sids
from specrec.export.onnx import OrtTiger, export_onnx
from specrec.ids import SidTrie
from specrec.models.tiger import Tiger

from ..conftest import random_sids, tiny_config

TOL = 1e-4


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    torch.manual_seed(11)
    cfg = tiny_config(max_history=8)
    model = Tiger(cfg).eval()
    out = export_onnx(model, tmp_path_factory.mktemp("onnx"))
    return model, OrtTiger(out, threads=1), random_sids(50, cfg.level_sizes, 11)


def _hist(sids, lengths, h=8):
    out = torch.full((len(lengths), h, 4), -1, dtype=torch.int64)
    for i, k in enumerate(lengths):
        out[i, h - k :] = torch.from_numpy(sids[i : i + k])
    return out


@torch.inference_mode()
def test_encoder_matches(pair):
    model, ort_model, sids = pair
    for lengths in ([8, 3, 1], [5]):
        hist = _hist(sids, lengths)
        a, b = model.encode(hist), ort_model.encode(hist)
        assert torch.equal(a.mask, b.mask)
        for (k1, v1), (k2, v2) in zip(a.cross_kv, b.cross_kv):
            assert (k1 - k2).abs().max() < TOL and (v1 - v2).abs().max() < TOL
    # shorter history window than at export time
    hist = _hist(sids, [2, 4], h=4)
    a, b = model.encode(hist), ort_model.encode(hist)
    assert (a.cross_kv[0][0] - b.cross_kv[0][0]).abs().max() < TOL


@torch.inference_mode()
def test_scoring_and_cached_steps_match(pair):
    model, ort_model, sids = pair
    hist = _hist(sids, [6, 2])
    ea, eb = model.encode(hist), ort_model.encode(hist)
    cand = torch.from_numpy(sids[:10]).view(2, 5, 4)
    sa, sb = score_sids(model, ea, cand, full=True), score_sids(ort_model, eb, cand, full=True)
    assert (sa.token_logp - sb.token_logp).abs().max() < TOL
    for x, y in zip(sa.full, sb.full):
        assert (x - y).abs().max() < TOL
    # incremental decoding with a cache, one token at a time
    tok = model.decoder_input(cand[..., :-1])
    pa = pb = None
    for t in range(4):
        la, pa = model.next_logprobs(ea, tok[..., t : t + 1], pa, start=t)
        lb, pb = ort_model.next_logprobs(eb, tok[..., t : t + 1], pb, start=t)
        assert (la[0] - lb[0]).abs().max() < TOL


@torch.inference_mode()
def test_beam_search_on_ort_equals_torch(pair):
    model, ort_model, sids = pair
    trie = SidTrie(sids, model.cfg.level_sizes)
    hist = _hist(sids, [7, 3, 1])
    a = beam_search(model, model.encode(hist), trie, 6)
    b = beam_search(ort_model, ort_model.encode(hist), trie, 6)
    assert torch.equal(a.codes, b.codes)
    assert (a.scores - b.scores).abs().max() < TOL
