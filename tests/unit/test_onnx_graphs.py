"""The verifier's graphs directory: one shared copy of the weights (specrec/backends/weights.py), no ONNX Runtime
warnings, and the precision of the scoring pass chosen per machine, recorded and read back
(specrec/backends/precision.py), with every other graph still float32 and equal to eager."""

from __future__ import annotations

import json

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch

from specrec.backends import Backend, make_backend
from specrec.backends import precision as prec
from specrec.backends.export import _export
from specrec.backends.onnx import ENC, OrtBackend, graphs_current
from specrec.backends.weights import ALIGN, MIN_BYTES, STORE, share_weights
from specrec.decoding.beam import beam_search
from specrec.decoding.searches import SEARCHES
from specrec.decoding.searches.rank import layout
from specrec.ids import SidTrie
from specrec.models.sid_mlp import SidMlpConfig, SidMlpDrafter
from specrec.models.tiger import Tiger
from specrec.train.precision import choose_kind

from ..conftest import sharpen, tiny_tiger

TOL = 1e-4


@pytest.fixture(scope="module")
def model():
    m, head, sids = tiny_tiger()
    drafter = SidMlpDrafter(m.cfg.level_sizes, m.cfg.d_model, SidMlpConfig(hidden=16, ff=32)).eval()
    return m, head, drafter, sids


def _hist(sids, lengths, h=8):
    out = torch.full((len(lengths), h, 4), -1, dtype=torch.int64)
    for i, k in enumerate(lengths):
        out[i, h - k :] = torch.from_numpy(sids[i : i + k])
    return out


def _external(path) -> list[onnx.TensorProto]:
    return [t for t in onnx.load(str(path), load_external_data=False).graph.initializer
            if t.data_location == onnx.TensorProto.EXTERNAL]


def _inline_big(path) -> list[str]:
    return [t.name for t in onnx.load(str(path), load_external_data=False).graph.initializer
            if t.data_location != onnx.TensorProto.EXTERNAL and len(t.raw_data) >= MIN_BYTES]


class TwoPasses(torch.nn.Module):
    def __init__(self, d_in=32, d_out=64):
        super().__init__()
        self.w = torch.nn.Parameter(torch.randn(d_out, d_in))

    def forward(self, x):
        return torch.tanh(x @ self.w.t()) @ self.w


def test_graphs_read_one_shared_copy_of_their_weights_and_compute_the_same_bit_for_bit(tmp_path):
    torch.manual_seed(0)
    m, x = TwoPasses(), torch.randn(3, 32)
    for name in ("a", "b"):  # two graphs of the same weights
        _export(m, (x,), ["x"], ["y"], {"x": {0: "B"}}, tmp_path / f"{name}.onnx")

    def run(name):
        s = ort.InferenceSession(str(tmp_path / f"{name}.onnx"), providers=["CPUExecutionProvider"])
        return s.run(None, {"x": x.numpy()})[0]

    inline = run("a")
    assert share_weights(tmp_path / "a.onnx") >= 1
    one_copy = (tmp_path / STORE).stat().st_size
    assert share_weights(tmp_path / "b.onnx") >= 1
    assert (tmp_path / STORE).stat().st_size == one_copy  # the second graph added nothing
    assert share_weights(tmp_path / "a.onnx") == 0  # nothing left inline
    for name in ("a", "b"):
        ext = _external(tmp_path / f"{name}.onnx")
        assert ext and not _inline_big(tmp_path / f"{name}.onnx")
        for t in ext:
            info = {e.key: e.value for e in t.external_data}
            assert info["location"] == STORE
            assert int(info["length"]) < ALIGN or int(info["offset"]) % ALIGN == 0  # pages: mapped, not read
        np.testing.assert_array_equal(run(name), inline)
    other = TwoPasses()  # other weights append, aligned
    _export(other, (x,), ["x"], ["y"], {"x": {0: "B"}}, tmp_path / "c.onnx")
    share_weights(tmp_path / "c.onnx")
    assert (tmp_path / STORE).stat().st_size > one_copy
    with torch.no_grad():
        np.testing.assert_allclose(run("c"), other(x).numpy(), rtol=1e-5, atol=1e-5)


@torch.inference_mode()
def test_the_backend_keeps_one_copy_for_all_its_graphs_and_still_equals_eager(model, tmp_path, capfd):
    m, head, drafter, sids = model
    trie = SidTrie(sids, m.cfg.level_sizes)
    ref, be = Backend(m, head, drafter=drafter), OrtBackend(m, head, onnx_dir=tmp_path, drafter=drafter, threads=1)
    hist = _hist(sids, [7, 3, 1])
    enc = be.encode(hist)
    first = be.search("beam", enc, trie, (6,))
    assert first is not None and torch.equal(first.codes, beam_search(ref, ref.encode(hist), trie, 6).codes)
    assert be.search("strict", enc, trie, (4, 8)) is not None and be.search("draft", enc, trie, (4,)) is not None
    graphs = sorted(tmp_path.glob("*.ext.onnx"))
    assert len(graphs) >= 7 and not any(_inline_big(g) for g in graphs)
    referenced = sum(int({e.key: e.value for e in t.external_data}["length"]) for g in graphs for t in _external(g))
    assert (tmp_path / STORE).stat().st_size < referenced / 3  # each distinct tensor once
    # loaded again from the shared file: the same outputs, bit for bit; a width exported later still works
    again = OrtBackend(m, head, onnx_dir=tmp_path, drafter=drafter, threads=1)
    second = again.search("beam", again.encode(hist), trie, (6,))
    assert torch.equal(first.codes, second.codes) and torch.equal(first.scores, second.scores)
    later = again.search("beam", again.encode(hist), trie, (9,))
    assert later is not None and torch.equal(later.codes, beam_search(ref, ref.encode(hist), trie, 9).codes)
    out = capfd.readouterr()
    assert "onnxruntime" not in out.err + out.out and "TracerWarning" not in out.err  # nothing in the terminal


@torch.inference_mode()
def test_a_directory_of_other_weights_is_cleaned_with_its_shared_file(model, tmp_path):
    m, head, _, sids = model
    trie = SidTrie(sids, m.cfg.level_sizes)
    first = make_backend("onnx", m, head, onnx_dir=tmp_path, threads=1)
    assert first.search("beam", first.encode(_hist(sids, [3])), trie, (4,)) is not None
    old = (tmp_path / STORE).stat()
    torch.manual_seed(12)
    other = Tiger(m.cfg).eval()
    sharpen(other, 20)
    be, ref = make_backend("onnx", other, None, onnx_dir=tmp_path, threads=1), Backend(other)
    hist = _hist(sids, [3, 5])
    got, want = be.search("beam", be.encode(hist), trie, (4,)), beam_search(ref, ref.encode(hist), trie, 4)
    assert got is not None and torch.equal(got.codes, want.codes)
    new = (tmp_path / STORE).stat()
    assert (new.st_ino, new.st_size) != (old.st_ino, old.st_size)  # a new file, never rewritten in place
    (tmp_path / STORE).unlink()  # graphs whose weights are gone are not current: built again
    assert not graphs_current(tmp_path, other, None)
    be = make_backend("onnx", other, None, onnx_dir=tmp_path, threads=1)
    assert torch.equal(be.search("beam", be.encode(hist), trie, (4,)).codes, want.codes)


def _rank_feeds(be: OrtBackend, sids: np.ndarray, n: int = 6) -> list[dict]:
    rng = np.random.default_rng(0)
    feeds = []
    for i in range(n):
        enc = be.encode(_hist(sids, [1 + i % 7]))
        cand = sids[rng.choice(len(sids), 12, replace=False)][None]
        names = [*ENC, *SEARCHES["rank"].inputs]
        feeds.append(dict(zip(names, [enc.keep.numpy(), enc.cross_k.numpy(), enc.cross_v.numpy(), *layout(cand)])))
    return feeds


@torch.inference_mode()
def test_the_precision_record_is_written_and_read_back(model, tmp_path, monkeypatch):
    """Candidates forced (the test does not depend on the CPU): each built, timed side by side and judged; the
    choice and its figures recorded in config.json; a backend made on the directory then runs the chosen graph,
    says so, and every other graph stays float32."""
    m, head, drafter, sids = model
    monkeypatch.setenv(prec.ENV, "float32,int8")
    cands, left = prec.candidates(prec.cpu_flags())
    assert cands == ["float32", "int8"] and "bf16" in left
    fp32 = OrtBackend(m, head, onnx_dir=tmp_path, drafter=drafter, threads=1, precision="float32")
    assert prec.read_precision(tmp_path) == {"rank": "float32", "draft": "float32"}  # no record: float32
    asked: list[dict] = []

    def recall_of(graphs: dict[str, str]) -> dict[str, float]:
        asked.append(graphs)
        return dict.fromkeys(graphs, 0.5)

    entry = choose_kind(fp32, "rank", cands, _rank_feeds(fp32, sids), recall_of)
    table = entry["candidates"]
    assert set(table) == {"float32", "int8"} and all(row["ms"] > 0 for row in table.values())
    assert asked[0]["float32"] == "rank" and asked[0].get("int8", "rank_int8") == "rank_int8"
    assert entry["chosen"] == ("int8" if table["int8"]["ms"] * (1 + prec.MARGIN) < table["float32"]["ms"]
                               else "float32")
    prec.write_precision(tmp_path, {"rank": entry})
    meta = json.loads((tmp_path / "config.json").read_text())
    assert meta["precision"]["rank"]["candidates"]["float32"]["recall@10"] == 0.5 and "fingerprint" in meta
    be = OrtBackend(m, head, onnx_dir=tmp_path, drafter=drafter, threads=1)
    assert be.precision == {"rank": entry["chosen"], "draft": "float32"}
    assert be.describe()["precision"]["rank"] == entry["chosen"]

    # int8 recorded: the scoring pass runs its own graph, close to float32's; beam and strict stay exact
    prec.write_precision(tmp_path, {"rank": {"chosen": "int8"}, "draft": {"chosen": "float32"}})
    be = OrtBackend(m, head, onnx_dir=tmp_path, drafter=drafter, threads=1)
    got = be.graph_precisions()
    assert got["rank"] == "int8" and got["beam"] == got["encode"] == "float32"
    assert got["strict"] == got["draft"] == "float32+drafter_w8"
    hist, cand = _hist(sids, [5, 2]), torch.from_numpy(sids[:10]).view(1, 10, 4).expand(2, -1, -1)
    q8 = be.search("rank", be.encode(hist), None, (), {"sids": cand})
    f32 = fp32.search("rank", fp32.encode(hist), None, (), {"sids": cand})
    assert (tmp_path / "rank_int8.ext.onnx").exists() and not torch.equal(q8, f32)
    assert (q8 - f32).abs().max() < 1.0 and (q8.sum(-1).argsort(-1) == f32.sum(-1).argsort(-1)).float().mean() > 0.5
    ref, trie = Backend(m, head, drafter=drafter), SidTrie(sids, m.cfg.level_sizes)
    want = beam_search(ref, ref.encode(hist), trie, 5)
    enc = be.encode(hist)
    assert torch.equal(be.search("beam", enc, trie, (5,)).codes, want.codes)
    strict = be.search("strict", enc, trie, (5, 10))
    assert strict is not None and torch.equal(strict.beams.codes, want.codes)
    # forced float32 ignores the record
    assert OrtBackend(m, head, onnx_dir=tmp_path, drafter=drafter, precision="float32").precision["rank"] == "float32"


def test_candidates_follow_the_cpu(monkeypatch):
    monkeypatch.delenv(prec.ENV, raising=False)
    x86 = {**prec.cpu_flags("model name : Some CPU\nflags : fpu avx2 fma\n"), "machine": "x86_64"}
    assert x86["flags"] == ["avx2", "fma"] and x86["model"] == "Some CPU"
    assert prec.candidates(x86)[0] == ["float32", "int8", "int8_nbits"]
    cands, left = prec.candidates(x86, ["float32", "int8", "int8_nbits", "bf16"])
    assert "bf16" not in cands and "no bf16" in left["bf16"]  # never built, timed or chosen there
    amx = {"machine": "x86_64", "model": "", "flags": ["avx512f", "amx_bf16", "avx512_bf16"]}
    cands, left = prec.candidates(amx, "float32,bf16,int8")
    assert cands == ["float32", "int8"] and "x86" in left["bf16"]
    arm = {"machine": "aarch64", "model": "", "flags": ["asimddp", "bf16"]}
    assert prec.candidates(arm, "bf16")[0] == ["float32", "bf16"]
    assert prec.session_config("rank_bf16") == {prec.BF16_FASTMATH: "1"} and prec.session_config("rank_int8") == {}
    with pytest.raises(ValueError, match="unknown precision"):
        prec.candidates(x86, "fp8")


def test_the_fastest_precision_that_keeps_the_recall_is_chosen():
    ms = {"float32": 10.0, "int8": 7.0, "int8_nbits": 12.0}
    chosen, table = prec.decide(ms, {"float32": 0.100, "int8": 0.0995, "int8_nbits": None})
    assert chosen == "int8" and table["int8"]["verdict"] == "passes" and table["int8"]["ratio"] == 0.995
    assert table["int8_nbits"]["verdict"].startswith("not checked")
    assert prec.decide(ms, {"float32": 0.100, "int8": 0.098})[0] == "float32"  # lost 2%: float32
    assert prec.decide({"float32": 10.0, "int8": 9.9}, {"float32": 0.1, "int8": 0.1})[0] == "float32"  # a tie
    tied = {"float32": 10.0, "int8": 7.0, "int8_nbits": 6.95}
    assert prec.decide(tied, {"float32": 0.1, "int8": 0.101, "int8_nbits": 0.1})[0] == "int8"  # the better recall
    calls: list[str] = []
    got = prec.time_sessions({"a": lambda f: calls.append("a"), "b": lambda f: calls.append("b")}, [0, 1], rounds=2)
    assert set(got) == {"a", "b"} and calls[:4] == ["a", "b", "b", "a"]  # interleaved, the order rotating


@torch.inference_mode()
def test_the_precision_probe_answers_the_scoring_pass_as_the_backend_does(model, tmp_path):
    """The probe that export-onnx's precision choice hands to ``score_users`` in place of the backend (it runs the
    scoring pass in every candidate precision) answers the same entry point the backend does, with float32's
    scores, and keeps each precision's outputs."""
    from specrec.train.precision import FLOAT32, _Scoring

    m, head, drafter, sids = model
    be = OrtBackend(m, head, onnx_dir=tmp_path, drafter=drafter, threads=1, precision="float32")
    session = be._session(be._exported("rank", None, precision=FLOAT32))
    probe = _Scoring(be, {FLOAT32: session}, record=True)
    hist, cand = _hist(sids, [5, 2]), torch.from_numpy(sids[:10]).view(1, 10, 4).expand(2, -1, -1)
    want = be.search("rank", be.encode(hist), None, (), {"sids": cand})
    got = probe.search("rank", probe.encode(hist), None, (), {"sids": cand})
    assert torch.equal(got, want) and len(probe.feeds) == 1 and len(probe.outputs[FLOAT32]) == 1
