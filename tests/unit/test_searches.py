"""The registry of whole searches (:mod:`specrec.decoding.searches`): one declaration per search, read by
every layer under one name, above the model maths; the beam search, run in torch from the registry, is the
eager reference's (:func:`specrec.decoding.beam.beam_search`)."""

import ast
from pathlib import Path

import numpy as np
import pytest
import torch

from specrec.backends import Backend
from specrec.backends import onnx as onnx_backend
from specrec.decoding.beam import Beams, beam_search
from specrec.decoding.searches import DRAFTER_KINDS, SEARCHES, search_name
from specrec.ids import SidTrie
from specrec.models.tiger import Tiger

from ..conftest import random_sids, sharpen, tiny_config

TOL = 1e-4
MODELS = Path(__file__).resolve().parents[2] / "specrec" / "models"


def test_one_declaration_per_search_read_by_every_layer():
    assert list(SEARCHES) == ["beam", "head", "draft", "draft_scored", "strict", "resume", "rank"]
    assert all(name == s.name for name, s in SEARCHES.items())
    assert DRAFTER_KINDS == onnx_backend.DRAFTER_KINDS == ("draft", "draft_scored", "strict")
    assert SEARCHES["strict"].outputs[-len(SEARCHES["resume"].inputs):] == SEARCHES["resume"].inputs
    from specrec_rpc.v1 import verifier_pb2

    # one search RPC for every search: adding one adds no method to the backends, the wire or the service
    wire = verifier_pb2.DESCRIPTOR.services_by_name["Verifier"].methods_by_name
    assert [m for m in wire if "Search" in m] == ["Search"]
    for s in SEARCHES.values():
        assert not hasattr(Backend, s.name), s.name
    assert [s.name for s in SEARCHES.values() if s.inside] == ["resume"]


def test_graph_names_stay_the_same():
    """Exported graphs and caches are found by these names."""
    assert search_name("beam", 10) == "beam_w10"
    assert search_name("strict", 10, 20, 8) == "strict_w10_n20_q8"
    assert search_name("draft_scored", 20, None, 8) == "draft_scored_w20_q8"
    assert search_name("resume", 10) == "resume_w10"


def test_the_models_do_not_import_the_searches():
    """The searches import the model maths, never the other way round."""
    for f in MODELS.glob("*.py"):
        for node in ast.walk(ast.parse(f.read_text())):
            if isinstance(node, ast.ImportFrom):
                assert "searches" not in (node.module or ""), f.name
            elif isinstance(node, ast.Import):
                assert not any("searches" in a.name for a in node.names), f.name
    hotpath = ast.parse((MODELS / "hotpath.py").read_text())
    assert not [n for n in ast.walk(hotpath) if isinstance(n, ast.ImportFrom) and "decoding" in (n.module or "")]


def test_the_fingerprint_covers_the_searches(monkeypatch, tmp_path):
    """A change to a search's module is a change of its graphs: exported graphs are fingerprinted with it."""
    torch.manual_seed(0)
    m = Tiger(tiny_config(max_history=8)).eval()
    before = onnx_backend.weights_fingerprint(m)
    src = Path(onnx_backend.searches.__file__).parent / "beam.py"
    real = Path.read_bytes
    monkeypatch.setattr(Path, "read_bytes", lambda p: real(p) + (b"#" if p == src else b""))
    assert onnx_backend.weights_fingerprint(m) != before


@pytest.mark.parametrize("width", [1, 6, 11])
@torch.inference_mode()
def test_the_registrys_beam_search_is_the_eager_reference(width):
    torch.manual_seed(11)
    m = Tiger(tiny_config(max_history=8)).eval()
    sharpen(m, 20)
    sids = random_sids(50, m.cfg.level_sizes, 11)
    be, trie = Backend(m), SidTrie(sids, m.cfg.level_sizes)
    hist = torch.full((3, 8, 4), -1, dtype=torch.int64)
    for i, k in enumerate([7, 3, 1]):
        hist[i, 8 - k :] = torch.from_numpy(sids[i : i + k])
    enc = be.encode(hist)
    want = beam_search(be, enc, trie, width)
    tables = trie.search_tables(be.fused.vmax)
    codes, scores, tlp, nodes = SEARCHES["beam"].fn(be.fused, *be._fused_encoder(enc), tables, width)
    alive = nodes >= 0
    assert torch.equal(alive, want.alive)
    # the nodes it returns are the beams' leaves: the items they name are the trie walk's
    assert torch.equal(Beams.of_search(codes, scores, tlp, nodes).items(trie), want.items(trie))
    assert torch.equal(codes[alive], want.codes[want.alive])
    assert (scores - want.scores).nan_to_num(0, 0, 0).abs().max() < TOL


@pytest.mark.parametrize("backend", ["eager", "onnx"])
@torch.inference_mode()
def test_rank_scores_candidates_as_the_general_tree_pass(backend, tmp_path):
    """The registry's ``rank`` (each prefix node's own level's head, ancestors only) gives every candidate's
    token log-probs as the general tree pass does (every level at every node, a masked T x T attention), for
    candidates sharing prefixes, repeated, and fewer than its width."""
    from specrec.backends import make_backend
    from specrec.decoding.scoring import score_sids
    from specrec.decoding.searches import rank

    torch.manual_seed(5)
    m = Tiger(tiny_config(max_history=8)).eval()
    sharpen(m, 10)
    sids = random_sids(40, m.cfg.level_sizes, 5)
    ref = Backend(m)
    be = ref if backend == "eager" else make_backend("onnx", m, onnx_dir=tmp_path)
    hist = torch.full((2, 8, 4), -1, dtype=torch.int64)
    hist[0, -3:], hist[1, -6:] = torch.from_numpy(sids[:3]), torch.from_numpy(sids[3:9])
    rng = np.random.default_rng(0)
    cand = torch.from_numpy(sids[rng.integers(0, 40, (2, 13))])  # duplicates and shared prefixes
    cand[1, 5] = cand[1, 2]
    want = score_sids(ref, ref.encode(hist), cand).token_logp
    got = be.search("rank", be.encode(hist), None, (), {"sids": cand})
    assert got.shape == (2, 13, 4) and (got - want).abs().max() < TOL
    # the layout: one node per unique prefix (rows padded to the longest), each candidate pointing at its own
    codes, depth, cols, bias, nodes, _ = rank.layout(cand.numpy())
    for r in range(2):
        uniq = [{tuple(c) for c in cand[r, :, : j + 1].tolist()} for j in range(3)]
        assert int((bias[r, :, 1] == 0).sum()) == sum(len(u) for u in uniq)  # real nodes attend past the root
        for j in range(3):
            assert len({int(x) for x in nodes[r, :, j]}) == len(uniq[j])
            assert (depth[r, nodes[r, :, j]] == j + 1).all()
    # codes too wide to pack a prefix into one integer: the same layout, read row-wise
    wide = rank.layout(cand.numpy() * 2**31)
    assert (wide[0] == codes * 2**31).all()
    assert all((a == b).all() for a, b in zip(wide[1:5], (depth, cols, bias, nodes)))
    # one graph for any list: a third request, more candidates
    more = torch.from_numpy(sids[rng.integers(0, 40, (2, 31))])
    got = be.search("rank", be.encode(hist), None, (), {"sids": more})
    assert (got - score_sids(ref, ref.encode(hist), more).token_logp).abs().max() < TOL
