"""Every backend computes what eager PyTorch computes (within 1e-4), and
``strict`` still equals ``beam`` exactly when both run on it. ``cuda`` runs here as its CPU stand-in (the
same buckets, padding and static buffers, the graphs' functions run eagerly: ``tests/unit/test_cuda_backend.py``
has the rest), with small row buckets so that calls pad and chunk."""

import numpy as np
import pytest
import torch

from specrec.backends import Backend, make_backend
from specrec.decoding.beam import beam_search
from specrec.decoding.scoring import score_sids
from specrec.decoding.searches.head import nezha_beam_search
from specrec.ids import SidTrie
from specrec.itemset import LocalItemSet
from specrec.models.tiger import Tiger
from specrec.policies import Engine, RecRequest, make_policy
from specrec.verifier import LocalVerifier

from ..conftest import sharpen, tiny_tiger

TOL = 1e-4


@pytest.fixture(scope="module")
def model():
    return tiny_tiger()


@pytest.fixture(scope="module", params=["onnx", "cuda"])
def pair(request, model, tmp_path_factory):
    m, head, sids = model
    if request.param == "onnx":
        kw = {"onnx_dir": tmp_path_factory.mktemp("onnx"), "threads": 1}
    else:
        kw = {"device": "cpu", "batch_sizes": (1, 2)}
    return Backend(m, head), make_backend(request.param, m, head, **kw), sids


def _hist(sids, lengths, h=8):
    out = torch.full((len(lengths), h, 4), -1, dtype=torch.int64)
    for i, k in enumerate(lengths):
        out[i, h - k :] = torch.from_numpy(sids[i : i + k])
    return out


@torch.inference_mode()
def test_encoder_matches(pair):
    """Encoder states are each backend's own layout: compare what the decoder reads from them."""
    ref, be, sids = pair
    cand = torch.from_numpy(sids[:12]).view(1, 12, 4)
    for lengths in ([8, 3, 1], [5], [2, 2]):
        a, b = ref.encode(_hist(sids, lengths)), be.encode(_hist(sids, lengths))
        s = a.mask.shape[-1]  # a backend of fixed shapes pads every history to the window: more masked positions
        assert torch.equal(a.mask, b.mask[..., -s:]) and not b.mask[..., :-s].any()
        c = cand.expand(len(lengths), -1, -1)
        assert (score_sids(ref, a, c).token_logp - score_sids(be, b, c).token_logp).abs().max() < TOL


@torch.inference_mode()
def test_tree_scoring_matches(pair):
    ref, be, sids = pair
    hist = _hist(sids, [6, 2])
    for m in (3, 10, 23):
        cand = torch.from_numpy(sids[np.random.default_rng(m).integers(0, 50, 2 * m)]).view(2, m, 4)
        sa, sb = score_sids(ref, ref.encode(hist), cand, full=True), score_sids(be, be.encode(hist), cand, full=True)
        assert (sa.token_logp - sb.token_logp).abs().max() < TOL
        for x, y in zip(sa.full, sb.full):
            assert (x - y).abs().max() < TOL


@torch.inference_mode()
def test_beam_search_and_head_match(pair):
    ref, be, sids = pair
    trie = SidTrie(sids, ref.cfg.level_sizes)
    hist = _hist(sids, [7, 3, 1])
    for width in (1, 6, 11):
        a = beam_search(ref, ref.encode(hist), trie, width)
        b = beam_search(be, be.encode(hist), trie, width)
        assert torch.equal(a.codes, b.codes)
        assert (a.scores - b.scores).nan_to_num(0, 0, 0).abs().max() < TOL
    assert (ref.head_hidden(ref.encode(hist)) - be.head_hidden(be.encode(hist))).abs().max() < TOL
    # the NEZHA head's whole search (decoder pass, transitions, trie) in one call equals its eager search
    hb = be.search("head", be.encode(hist), trie, (6,))
    if hb is not None:
        want = nezha_beam_search(ref.nezha_head, ref.model, ref.head_hidden(ref.encode(hist)), trie, 6)
        assert torch.equal(hb.codes[hb.alive], want.codes[want.alive])
        assert (hb.scores - want.scores).nan_to_num(0, 0, 0).abs().max() < TOL


def test_strict_equals_beam_on_the_backend(pair, model):
    m, head, sids = model
    _, be, _ = pair
    itemset = LocalItemSet(sids, np.ones(len(sids), bool), m.cfg.level_sizes)
    eng = Engine(LocalVerifier(be, head, m), itemset, m.cfg.max_history)
    rng = np.random.default_rng(3)
    hists = [rng.integers(0, 50, int(rng.integers(1, 9))) for _ in range(4)]
    for k in (3, 8):
        beam = make_policy("beam", eng).run([RecRequest(h, k) for h in hists])
        for n in (1, 2 * k):
            strict = make_policy("strict", eng, n_drafts=n).run([RecRequest(h, k) for h in hists])
            for a, b in zip(beam, strict):
                assert a.items.tolist() == b.items.tolist()
                assert np.allclose(a.scores, b.scores, atol=TOL)


def test_exported_graphs_store_each_weight_once(tmp_path):
    """A weight used by several passes is traced into one constant per use; the export keeps one copy of each
    distinct tensor (as an initializer) and the graph computes the same."""
    import onnxruntime as ort

    from specrec.backends.onnx import _export

    class TwoPasses(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.w = torch.nn.Parameter(torch.randn(64, 32))

        def forward(self, x):
            for _ in range(3):  # the transpose is folded into a new constant at each use
                x = torch.tanh(x @ self.w.t()) @ self.w
            return x

    torch.manual_seed(0)
    m, x = TwoPasses(), torch.randn(2, 32)
    path = tmp_path / "two.onnx"
    _export(m, (x,), ["x"], ["y"], {"x": {0: "B"}}, path)
    import onnx

    g = onnx.load(str(path)).graph
    big = [t for t in g.initializer if len(t.raw_data) >= 1024]
    big += [n for n in g.node if n.op_type == "Constant" and len(n.attribute[0].t.raw_data) >= 1024]
    assert len(big) <= 2  # w and its transpose, however many passes read them
    y = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"]).run(None, {"x": x.numpy()})[0]
    with torch.no_grad():
        np.testing.assert_allclose(y, m(x).numpy(), rtol=1e-5, atol=1e-5)


def test_sizes_known_to_shape_inference_are_folded_into_constants(tmp_path):
    """``x.shape[1]`` of a tensor whose first axis is dynamic is a fixed number: the export stores it as a
    constant (no Shape -> Gather chain left for it), and the graph computes the same."""
    import onnx
    import onnxruntime as ort

    from specrec.backends.onnx import _export, fold_static_dims

    class Views(torch.nn.Module):
        def forward(self, x):  # x [B, 6, 4]
            b, t, d = x.shape
            return (x.reshape(b, t * d) * 2).view(b, t, d)[:, : t // 2]

    x = torch.randn(3, 6, 4)
    raw, lean = tmp_path / "raw.onnx", tmp_path / "lean.onnx"
    torch.onnx.export(Views(), (x,), str(raw), dynamo=False, input_names=["x"], output_names=["y"],
                      dynamic_axes={"x": {0: "B"}})
    lean.write_bytes(raw.read_bytes())
    assert fold_static_dims(lean) >= 2  # t and d
    shapes = [sum(n.op_type == "Shape" for n in onnx.load(str(p)).graph.node) for p in (raw, lean)]
    assert shapes[1] < shapes[0]
    x2 = torch.randn(5, 6, 4)  # another batch size: the dynamic axis stays dynamic
    for p in (raw, lean):
        y = ort.InferenceSession(str(p), providers=["CPUExecutionProvider"]).run(None, {"x": x2.numpy()})[0]
        np.testing.assert_array_equal(y, Views()(x2).numpy())
    assert fold_static_dims(lean) == 0  # nothing left to fold
    _export(Views(), (x,), ["x"], ["y"], {"x": {0: "B"}}, tmp_path / "exported.onnx")  # the export folds them
    assert sum(n.op_type == "Shape" for n in onnx.load(str(tmp_path / "exported.onnx")).graph.node) == shapes[1]


@torch.inference_mode()
def test_graphs_of_other_weights_are_replaced(model, tmp_path):
    """A directory holding optimised graphs of other weights (a bundle retrained, or the code changed) is
    rebuilt for these, not a crash at start: an optimised whole-search graph is one of the files to remove
    under two patterns."""
    m, head, sids = model
    trie = SidTrie(sids, m.cfg.level_sizes)
    first = make_backend("onnx", m, head, onnx_dir=tmp_path, threads=1)
    hist = _hist(sids, [3, 5])
    assert first.search("beam", first.encode(hist), trie, (4,)) is not None
    assert list(tmp_path.glob("beam_w4_t*.ext.onnx"))
    torch.manual_seed(12)
    other = Tiger(m.cfg).eval()
    sharpen(other, 20)
    be, ref = make_backend("onnx", other, None, onnx_dir=tmp_path, threads=1), Backend(other)
    got, want = be.search("beam", be.encode(hist), trie, (4,)), beam_search(ref, ref.encode(hist), trie, 4)
    assert got is not None and torch.equal(got.codes, want.codes)
