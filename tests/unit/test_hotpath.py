"""The serving path's functions (:mod:`specrec.models.hotpath`: what the eager backend runs and the ONNX
graphs trace) compute what the model itself computes (:class:`~specrec.models.tiger.Tiger`'s teacher-forced
decoder, the NEZHA head's own modules), and the one constrained top-k gives the same beams over a trie and
over its search tables."""

import pytest
import torch

from specrec.decoding.beam import root_beams, select_topk
from specrec.decoding.searches import SEARCHES, SearchState
from specrec.decoding.searches.head import nezha_beam_search
from specrec.decoding.topk import constrained_topk
from specrec.ids import SidTrie
from specrec.models.hotpath import FusedHotPath
from specrec.models.nezha_head import NezhaHead, gru_cell
from specrec.models.tiger import BOS_TOKEN, Tiger

from ..conftest import random_sids, sharpen, tiny_config

TOL = 1e-4


@pytest.fixture(scope="module", params=[False, True], ids=["untied", "tied"])
def model(request):
    torch.manual_seed(5)
    m = Tiger(tiny_config(max_history=8, tie_output=request.param)).eval()
    sharpen(m, 10)
    head = NezhaHead(m).eval()
    with torch.no_grad():  # a head that is not its initial copy of the model's output layers
        for p in head.parameters():
            p.add_(0.05 * torch.randn_like(p))
    sids = torch.from_numpy(random_sids(40, m.cfg.level_sizes, 5))
    return m, head, FusedHotPath(m, head).eval(), sids


def _hist(sids, lengths, h=8):
    out = torch.full((len(lengths), h, sids.shape[1]), -1, dtype=torch.int64)
    for i, k in enumerate(lengths):
        out[i, h - k :] = sids[i : i + k]
    return out


@torch.inference_mode()
def test_step_is_the_models_decoder(model):
    """KV-cached steps along given SIDs give the model's teacher-forced log-probs at every level."""
    m, _, fused, sids = model
    hist = _hist(sids, [8, 3, 1])
    r, b, L = 3, 5, m.cfg.sid_len
    codes = sids[torch.randperm(len(sids))[: r * b]].view(r, b, L)
    want, _ = m.next_logprobs(m.encode(hist), m.decoder_input(codes[..., :-1]))
    keep, ck, cv = fused.encode(hist)
    cache_k, cache_v = fused.empty_cache(r * b)
    tokens, parent = torch.full((r, b), BOS_TOKEN), torch.arange(r * b)
    for level in range(L):
        logp, cache_k, cache_v = fused.step(tokens, torch.tensor(level), parent, keep, ck, cv, cache_k, cache_v)
        got = logp.view(r, b, -1)[..., : m.cfg.level_sizes[level]]
        assert (got - want[level]).abs().max() < TOL
        assert torch.isinf(logp.view(r, b, -1)[..., m.cfg.level_sizes[level] :]).all()
        tokens = codes[:, :, level] + m.cfg.offsets()[level]


@torch.inference_mode()
def test_tree_is_the_models_decoder(model):
    """A tree of b separate chains (BOS and each SID's prefixes) reads, at each node, the model's log-probs."""
    m, _, fused, sids = model
    hist = _hist(sids, [5, 2])
    r, b, L = 2, 4, m.cfg.sid_len
    codes = sids[: r * b].view(r, b, L)
    want, _ = m.next_logprobs(m.encode(hist), m.decoder_input(codes[..., :-1]))
    tokens = m.decoder_input(codes[..., :-1]).reshape(r, b * L)
    positions = torch.arange(L).repeat(b).expand(r, -1)
    chain = torch.arange(b).repeat_interleave(L)
    mask = (chain.view(-1, 1) == chain.view(1, -1)) & (positions[0].view(-1, 1) >= positions[0].view(1, -1))
    out = fused.tree(tokens, positions, mask.expand(r, -1, -1), *fused.encode(hist)).view(r, b, L, L, -1)
    for level in range(L):
        assert (out[:, :, level, level, : m.cfg.level_sizes[level]] - want[level]).abs().max() < TOL


@torch.inference_mode()
def test_nezha_head_on_the_fused_path_is_the_head(model):
    """The head's decoder pass and its whole search (one definition, two sets of weights) agree."""
    m, head, fused, sids = model
    hist = _hist(sids, [7, 3, 1])
    want_h = head.hidden(m, m.encode(hist))
    enc = fused.encode(hist)
    assert (fused.head_hidden(*enc) - want_h).abs().max() < TOL
    trie = SidTrie(sids.numpy(), m.cfg.level_sizes)
    tables = trie.search_tables(fused.vmax)
    for width in (1, 4, 9):
        want = nezha_beam_search(head, m, want_h, trie, width)
        codes, scores, _, nodes = SEARCHES["head"].fn(fused, *enc, tables, width)
        alive = nodes >= 0
        assert torch.equal(codes[alive], want.codes[want.alive])
        assert (scores - want.scores).nan_to_num(0, 0, 0).abs().max() < TOL


def test_gru_cell_is_torchs():
    torch.manual_seed(0)
    cell = torch.nn.GRUCell(7, 5)
    x, s = torch.randn(3, 4, 7), torch.randn(3, 4, 5)
    want = cell(x.reshape(-1, 7), s.reshape(-1, 5)).view(3, 4, 5)
    got = gru_cell(x, s, cell.weight_ih.t(), cell.weight_hh.t(), cell.bias_ih, cell.bias_hh)
    assert (got - want).abs().max() < 1e-6


def test_one_topk_over_a_trie_and_over_tables(model):
    """Beam steps through every level: the trie's step and the tables' step keep the same beams."""
    m, _, _, sids = model
    trie = SidTrie(sids.numpy(), m.cfg.level_sizes)
    tables = trie.search_tables(max(m.cfg.level_sizes))
    g = torch.Generator().manual_seed(1)
    r, width = 3, 6
    beams, state = root_beams(r), SearchState.root(r)
    for level, v in enumerate(m.cfg.level_sizes):
        logp = torch.log_softmax(torch.randn(r, beams.codes.shape[1], v, generator=g), -1)
        beams, _ = select_topk(beams, logp, trie, width)
        pad = torch.nn.functional.pad(logp, (0, max(m.cfg.level_sizes) - v), value=float("-inf"))
        state, _ = state.advance(pad, tables[level], width)
        assert torch.equal(beams.codes[beams.alive], state.codes[state.nodes >= 0])
        assert torch.equal(beams.scores, state.scores)
    assert bool(beams.alive.any())


def test_bias_chooses_but_scores_stay_true():
    scores = torch.zeros(1, 2)
    logp = torch.log(torch.tensor([[[0.6, 0.4], [0.7, 0.3]]]))
    bias = torch.tensor([[[0.0, 5.0], [0.0, 0.0]]])
    out = constrained_topk(torch.zeros(1, 2, 0, dtype=torch.int64), scores, torch.zeros(1, 2, 0), logp,
                           torch.ones(1, 2, 2, dtype=torch.bool), 2, lambda p, c, i: i, bias)
    assert out.codes[0].tolist() == [[0], [1]]  # chosen: (1, 0) on merit and (0, 1) by its bias; ordered by score
    assert out.parent[0].tolist() == [1, 0]
    assert torch.allclose(out.scores[0], logp[0].flatten()[[2, 1]])
