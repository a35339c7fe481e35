"""Every whole search reads the item set's tables in either form (:mod:`specrec.ids.tables`: dense child tables,
CSR arrays, or both by level) with the same result, a request's view without some items included: the
registry's functions in torch against the step-by-step references over the trie and against the all-dense form,
and the ONNX graphs against eager. (The CUDA backend's stand-in: ``tests/unit/test_cuda_backend.py``.)"""

import pytest
import torch

from specrec.backends import Backend, make_backend
from specrec.decoding.beam import Beams, beam_search
from specrec.decoding.searches import SEARCHES
from specrec.decoding.searches.head import nezha_beam_search
from specrec.ids import SidTrie
from specrec.ids import tables as tables_mod
from specrec.ids.tables import form_tag, level_of
from specrec.models.sid_mlp import SidMlpConfig, SidMlpDrafter

from ..conftest import tiny_tiger

TOL = 1e-5
#: the rule's one parameter (cells of a dense level) -> the forms the tiny catalogue's levels take
FORMS = {"dddd": 1 << 40, "cccc": 0, "ddcc": 50}


@pytest.fixture(scope="module")
def parts():
    m, head, sids = tiny_tiger()
    torch.manual_seed(0)
    drafter = SidMlpDrafter(m.cfg.level_sizes, m.cfg.d_model, SidMlpConfig(hidden=32, ff=64)).eval()
    return m, head, drafter, sids


def _hist(sids, lengths, h=8):
    out = torch.full((len(lengths), h, sids.shape[1]), -1, dtype=torch.int64)
    for i, k in enumerate(lengths):
        out[i, h - k :] = torch.from_numpy(sids[i : i + k])
    return out


def _tries(sids, sizes, monkeypatch, tag):
    """The catalogue in forms ``tag``, a view without a few items and one without many (whole prefixes cut)."""
    monkeypatch.setattr(tables_mod, "DENSE_CELLS", FORMS[tag])
    trie = SidTrie(sids, sizes)
    out = [trie, trie.excluding(sids[:5]), trie.excluding(sids[20:45])]
    assert all(form_tag(t.search_tables(6)) == tag for t in out)
    return out


def _same(a: Beams, b: Beams):
    assert torch.equal(a.codes[a.alive], b.codes[b.alive]) and torch.equal(a.alive, b.alive)
    assert (a.scores - b.scores).nan_to_num(0, 0, 0).abs().max() < TOL
    assert (a.token_logp - b.token_logp).nan_to_num(0, 0, 0).abs().max() < TOL


def _dense(trie) -> list:
    """The trie's levels all dense, with its cut lists (what the search read before CSR existed)."""
    base = getattr(trie, "base", trie)
    return [level_of(p, c, 6, True).with_cut(lv.cut) for p, c, lv in zip(base.ptr, base.codes, trie.search_tables(6))]


@pytest.mark.parametrize("tag", list(FORMS))
@torch.inference_mode()
def test_every_search_in_every_form_is_the_reference(parts, monkeypatch, tag):
    m, head, drafter, sids = parts
    ref = Backend(m, head, drafter=drafter)
    enc = ref.encode(_hist(sids, [7, 3, 1]))
    fused, encoder = ref.fused, ref._fused_encoder(enc)
    for trie in _tries(sids, m.cfg.level_sizes, monkeypatch, tag):
        levels, dense = trie.search_tables(6), _dense(trie)
        for w in (1, 4):
            got = Beams.of_search(*SEARCHES["beam"].fn(fused, *encoder, levels, w))
            _same(got, beam_search(ref, enc, trie, w))  # the step-by-step search over the trie
            assert torch.equal(got.items(trie), beam_search(ref, enc, trie, w).items(trie))
            codes, _, _, nodes = SEARCHES["head"].fn(fused, *encoder, levels, w)
            want = nezha_beam_search(head, m, ref.head_hidden(enc), trie, w)
            assert torch.equal(codes[nodes >= 0], want.codes[want.alive])
            for kind in ("draft", "draft_scored"):
                _same(Beams.of_search(*SEARCHES[kind].fn(fused, *encoder, levels, w)),
                      Beams.of_search(*SEARCHES[kind].fn(fused, *encoder, dense, w)))
            for n in (1, 2 * w):  # n = 1 misses rows: resume finishes them (on the same tables)
                drafted = ref.search("strict", enc, trie, (w, n))
                _same(drafted.beams, beam_search(ref, enc, trie, w))
                out = SEARCHES["strict"].fn(fused, *encoder, dense, w, n)
                assert torch.equal(torch.from_numpy(drafted.covered), out[4].bool())


@pytest.mark.parametrize("tag", ["ddcc", "cccc"])
@torch.inference_mode()
def test_onnx_graphs_read_either_form(parts, monkeypatch, tmp_path, tag):
    """One graph per form (its name says which), its tables and cut lists as inputs: equal to eager for every
    search, on the catalogue and on views of every size (the cut lists' length is a dynamic axis)."""
    m, head, drafter, sids = parts
    ref = Backend(m, head, drafter=drafter)
    be = make_backend("onnx", m, head, drafter=drafter, onnx_dir=tmp_path, threads=1, drafter_bits=None)
    h = _hist(sids, [7, 3, 1])
    ea, eb = ref.encode(h), be.encode(h)
    w = 4
    for trie in _tries(sids, m.cfg.level_sizes, monkeypatch, tag):
        _same(be.search("beam", eb, trie, (w,)), beam_search(ref, ea, trie, w))
        got, want = be.search("head", eb, trie, (w,)), nezha_beam_search(head, m, ref.head_hidden(ea), trie, w)
        assert torch.equal(got.codes[got.alive], want.codes[want.alive])
        _same(be.search("draft", eb, trie, (w,)), ref.search("draft", ea, trie, (w,)))
        _same(be.search("draft_scored", eb, trie, (w,)), ref.search("draft_scored", ea, trie, (w,)))
        for n in (1, 2 * w):
            a, b = be.search("strict", eb, trie, (w, n)), ref.search("strict", ea, trie, (w, n))
            _same(a.beams, b.beams)
            assert torch.equal(torch.as_tensor(a.covered), torch.as_tensor(b.covered))
    assert {p.name.split("_t")[-1].split(".")[0] for p in tmp_path.glob("beam_w4_t*.onnx")} == {tag}
