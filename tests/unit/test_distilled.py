"""The distilled drafter: one draft-and-verify call equals the target's beam search wherever it says it
covered the frontier, on both backends; ``strict`` on it equals ``beam`` (falling back where it misses);
and distillation teaches the drafter the target's frontier."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from specrec.data.splits import Examples
from specrec.ids.trie import SidTrie
from specrec.models.hotpath import FusedHotPath
from specrec.models.sid_mlp import SidMlpConfig, SidMlpDrafter
from specrec.policies import RecRequest, make_policy
from specrec.train.distill import (
    distill_loss,
    drafter_beams,
    frontier_coverage,
    target_frontier,
    teacher_frontier,
)

from .policy_fixtures import histories, make_engine


def run(eng, name, hists, k, **params):
    pol = make_policy(name, eng, **params)
    return [pol.run([RecRequest(np.asarray(h), k)])[0] for h in hists]


@pytest.mark.parametrize("backend", ["eager", "onnx"])
def test_draft_verify_equals_beam_search_in_every_row(backend, tmp_path, monkeypatch):
    """Covered rows are read from the tree pass; rows the drafts missed are finished from the verified levels
    (the registry's ``resume``, :mod:`specrec.decoding.searches.resume`) in the same call: both equal the
    target's beam search."""
    monkeypatch.setenv("SPECREC_CACHE", str(tmp_path))
    eng = make_engine(3, n_items=70, distilled=True, backend=backend)
    ver, trie = eng.verifier, eng.itemset.trie
    hists = histories(eng, 6, 3)
    sess = ver.encode(eng.history_sids(hists))
    for k in (1, 4, 7):
        beam = ver.search(ver.encode(eng.history_sids(hists)), "beam", trie, (k,))
        seen_cover = set()
        for n in (1, 2, 3, 6 * 5 * 4):  # 120 drafts: every prefix of the catalogue, so every row is covered
            d = ver.search(sess, "strict", trie, (k, n))
            assert d.covered.shape == (len(hists),) and d.frontier.shape == (len(hists), 3, 2)
            assert (d.frontier[:, 0, 0] == d.frontier[:, 0, 1]).all()  # level 0 is the target's own
            assert (d.frontier[:, -1, 0] == d.frontier[:, -1, 1]).all()  # the last level is the target's own
            assert ((d.frontier[:, :, 1] == d.frontier[:, :, 0]).all(1) == d.covered).all()
            for j in range(len(hists)):
                a = beam.alive[j]
                assert torch.equal(d.beams.alive[j], a)
                assert torch.equal(d.beams.codes[j][a], beam.codes[j][a])
                assert torch.allclose(d.beams.scores[j][a], beam.scores[j][a], atol=1e-5)
            seen_cover.add(bool(d.covered.all()))
            if n == 120:
                assert d.covered.all()
        assert True in seen_cover and (k == 1 or False in seen_cover)


@pytest.mark.parametrize("backend", ["eager", "onnx"])
def test_strict_on_the_distilled_drafter_equals_beam(backend, tmp_path, monkeypatch):
    monkeypatch.setenv("SPECREC_CACHE", str(tmp_path))
    eng = make_engine(4, n_items=60, distilled=True, backend=backend)
    hists = histories(eng, 8, 4)
    for k, n in ((5, 1), (5, 120), (3, 4)):
        beam = run(eng, "beam", hists, k)
        strict = run(eng, "strict", hists, k, n_drafts=n)
        for a, b in zip(beam, strict):
            assert a.items.tolist() == b.items.tolist()
            assert np.allclose(a.scores, b.scores, atol=1e-5)
            assert "draft_verify" in b.stats.stage_ms
            if n == 120:
                assert b.stats.fallback_steps == 0 and set(b.sources) <= {"draft", "fill"}  # every row covered
            if n == 1:  # one draft per level cannot hold a frontier of 5: the target's beam search answers
                assert b.stats.fallback_steps >= 1 and set(b.sources) <= {"beam", "fill"}
    snap = eng.metrics.snapshot()["strict"]
    per, drafted = snap["frontier_coverage_by_level"], snap["drafted_level_coverage_by_level"]
    last = max(per)
    assert per[0] == 1.0 and per[last] == 1.0  # the target's own levels: held by construction
    assert set(drafted) == set(per) - {0, last}  # coverage is reported on the drafted levels alone
    assert 0 < snap["drafted_level_coverage"] < 1 and snap["drafted_level_coverage"] < sum(per.values()) / len(per)
    assert 0 <= snap["whole_frontier_share"] < 1  # n = 1 drafts cannot hold a frontier of 5


def test_nezha_on_the_distilled_drafter_returns_valid_items():
    eng = make_engine(5, n_items=50, distilled=True)
    widths = []
    orig = eng.verifier.search

    def spy(sess, name, trie, w, *a, **kw):
        if name == "draft":
            widths.append(w[0])
        return orig(sess, name, trie, w, *a, **kw)

    eng.verifier.search = spy
    for res in run(eng, "nezha", histories(eng, 5, 5), 6):
        assert len(set(res.items.tolist())) == 6
        assert eng.itemset.contains(eng.itemset.sids_of(res.items)).all()
        assert set(res.sources) <= {"head", "fill"}
    assert widths == [6] * 5  # the distilled drafter's K beams (the default width), one call per request


def test_distillation_teaches_the_target_frontier():
    eng = make_engine(6, n_items=80, distilled=True)
    model = eng.verifier.backend.model
    sids = eng.itemset.sids
    trie = SidTrie(sids, model.cfg.level_sizes)
    rng = np.random.default_rng(6)
    hist = np.full((300, model.cfg.max_history), -1, dtype=np.int64)
    for i in range(len(hist)):
        n = int(rng.integers(1, model.cfg.max_history + 1))
        hist[i, -n:] = rng.integers(0, len(sids), n)
    ex = Examples(hist, np.zeros(len(hist), dtype=np.int64), np.arange(len(hist)), np.ones(len(hist), dtype=np.int64))
    fr = teacher_frontier(model, ex, sids, trie, width=4, progress=False)
    assert fr.logp[0].shape == (300, 4, model.cfg.level_sizes[1])
    drafter = SidMlpDrafter(model.cfg.level_sizes, model.cfg.d_model, SidMlpConfig(hidden=32, ff=64))
    fused = FusedHotPath(model).eval()
    tables = trie.search_tables(fused.vmax)

    def coverage():
        with torch.no_grad():
            from specrec.train.batches import history_batch

            h0, root, levels, _ = target_frontier(fused, tables, history_batch(torch.from_numpy(sids), hist), 4, False)
            beams = drafter_beams(drafter, h0, root, tables, [4, 4, 4])
        return frontier_coverage([b.numpy() for b in beams], [c.numpy() for c, _, _ in levels],
                                 [a.numpy() for _, a, _ in levels], model.cfg.level_sizes)

    def loss():
        return distill_loss(drafter, torch.from_numpy(fr.h0).float(), [torch.from_numpy(c) for c in fr.codes],
                            [torch.from_numpy(a) for a in fr.alive], [torch.from_numpy(p) for p in fr.logp])

    before, loss0 = coverage(), float(loss().detach())
    opt = torch.optim.Adam(drafter.parameters(), lr=3e-3)
    for _ in range(150):
        opt.zero_grad()
        loss().backward()
        opt.step()
    after = coverage()
    assert float(loss().detach()) < 0.5 * loss0
    assert after["levels"][0] == 1.0  # the first level is the target's own
    assert after["mean"] > before["mean"] and after["whole"] >= before["whole"]


def test_specgr_drafts_round_zero_with_the_distilled_drafter():
    eng = make_engine(8, n_items=60, distilled=True)
    hists = histories(eng, 5, 8)
    calls = []
    orig = eng.verifier.search

    def spy(sess, name, trie, w, *a, **kw):
        if name in ("draft", "draft_scored"):
            calls.append(w[0])
        return orig(sess, name, trie, w, *a, **kw)

    eng.verifier.search = spy
    for res in run(eng, "specgr", hists, 4, gamma=-100.0):  # every draft accepted: K of them exit at round 0
        assert res.stats.rounds == 1 and res.stats.exit_reason == "accepted"
        assert len(set(res.items.tolist())) == 4 and set(res.sources) == {"draft"}
        assert eng.itemset.contains(eng.itemset.sids_of(res.items)).all()
    assert calls == [8] * 5  # delta = 2K drafted SIDs, one call per request
    eng.drafter.calls.clear()
    for res in run(eng, "specgr", hists[:2], 4, first_drafter="engine", gamma=-100.0):
        assert res.stats.rounds == 1
    assert len(eng.drafter.calls) == 2 and len(calls) == 5


@pytest.mark.parametrize("backend", ["eager", "onnx"])
def test_draft_beams_with_target_scores_are_the_targets_teacher_forced_logprobs(backend, tmp_path, monkeypatch):
    monkeypatch.setenv("SPECREC_CACHE", str(tmp_path))
    eng = make_engine(5, n_items=70, distilled=True, backend=backend)
    ver, trie = eng.verifier, eng.itemset.trie
    hists = histories(eng, 4, 5)
    for width in (3, 9):
        sess = ver.encode(eng.history_sids(hists))
        drafted = ver.search(sess, "draft", trie, (width,))
        scored = ver.search(sess, "draft_scored", trie, (width,))
        assert torch.equal(scored.codes, drafted.codes) and torch.equal(scored.alive, drafted.alive)
        assert torch.allclose(scored.scores[scored.alive], drafted.scores[drafted.alive], atol=1e-5)
        ref = ver.score(ver.encode(eng.history_sids(hists)), scored.codes).token_logp  # teacher-forced, its own pass
        a = scored.alive
        assert not torch.allclose(drafted.token_logp[a][:, 1:], ref[a][:, 1:], atol=1e-3)  # the drafter's differ
        assert torch.allclose(scored.token_logp[a], ref[a], atol=1e-5)


def test_specgr_round_zero_on_the_distilled_drafter_is_one_call_with_the_targets_values():
    from specrec.policies.batch import length_normalised

    eng = make_engine(8, n_items=60, distilled=True)
    ver = eng.verifier
    hists = histories(eng, 5, 8)
    asked = []
    orig = ver.search

    def spy(sess, name, *a, **kw):
        if name in ("draft", "draft_scored"):
            asked.append(name == "draft_scored")
        return orig(sess, name, *a, **kw)

    ver.search = spy
    for h, res in zip(hists, run(eng, "specgr", hists, 4, gamma=-100.0)):
        assert res.stats.verifier_calls == 1 + res.stats.encoder_calls and res.stats.exit_reason == "accepted"
        assert "verify" not in res.stats.stage_ms and set(res.sources) == {"draft"}
        sids = torch.from_numpy(eng.itemset.sids_of(res.items))[None]
        tl = ver.score(ver.encode(eng.history_sids([h])), sids).token_logp[0]  # teacher-forced, its own pass
        v = length_normalised(tl, eng.itemset.is_unseen(res.items)).numpy()
        assert np.allclose(res.scores, v, atol=1e-5)
    assert asked == [True] * 5


def test_the_drafters_weights_are_8_bit_on_the_cpu_and_the_targets_never(tmp_path, monkeypatch):
    """The ONNX backend on the CPU stores the drafter's products as 8-bit weights (MatMulNBits) in the graphs
    that run it; the target's stay float32, so level 0 (the target's own) scores exactly as with a float32
    drafter, and the drafter's levels stay close (strict equals beam on this backend: tests above)."""
    import onnx

    from specrec.backends.onnx import OrtBackend

    monkeypatch.setenv("SPECREC_CACHE", str(tmp_path))
    eng = make_engine(5, n_items=70, distilled=True, backend="onnx")
    q8 = eng.verifier.backend
    assert q8.drafter_bits == 8
    fp = OrtBackend(q8.model, q8.nezha_head, onnx_dir=tmp_path / "fp32", drafter=q8.drafter, drafter_bits=None)
    trie, hs = eng.itemset.trie, eng.history_sids(histories(eng, 6, 5))
    a, b = q8.search("draft", q8.encode(hs), trie, (6,)), fp.search("draft", fp.encode(hs), trie, (6,))
    tag = q8.table_feed(trie)[0]
    ops = [n.op_type for n in onnx.load(str(q8.graph_path(f"draft_w6_q8_t{tag}"))).graph.node]
    assert ops.count("MatMulNBits") >= 3 and "MatMulNBits" not in [
        n.op_type for n in onnx.load(str(fp.graph_path(f"draft_w6_t{tag}"))).graph.node]
    lvl0 = a.alive & b.alive
    assert torch.allclose(a.token_logp[..., 0][lvl0], b.token_logp[..., 0][lvl0], atol=1e-6)  # the target's
    same = (a.codes == b.codes).all(-1) & lvl0
    assert same.float().mean() > 0.5
    assert torch.allclose(a.token_logp[same], b.token_logp[same], atol=0.05)
    assert not torch.equal(a.token_logp[same], b.token_logp[same])  # the drafter's are 8-bit
