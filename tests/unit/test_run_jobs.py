"""The runner, the verifier's batched path: the jobs of several callers that can share a computation share it
(one encode, one tree pass), each caller gets exactly its own result, in order, and a job whose group failed
gets the exception as its result while the other groups are unaffected."""

import numpy as np
import pytest
import torch

from specrec.decoding.beam import Beams
from specrec.decoding.scoring import Scores
from specrec.verifier import Session
from specrec.verifier.jobs import EncodeJob, ScoreJob, SearchJob

from .policy_fixtures import histories, make_engine


@pytest.fixture(scope="module")
def eng():
    return make_engine(3)


class Calls:
    """Counts the backend calls of one name (the wrapped method still runs)."""

    def __init__(self, monkeypatch, backend, name: str):
        self.n = 0
        fn = getattr(backend, name)

        def counted(*a, **kw):
            self.n += 1
            return fn(*a, **kw)

        monkeypatch.setattr(backend, name, counted)


def hist(eng, n: int, seed: int) -> np.ndarray:
    return eng.history_sids(histories(eng, n, seed)).numpy()  # [n, H, L]


def full_hist(eng, n: int, seed: int) -> np.ndarray:
    """Histories of the full window: sessions encoded apart keep the same history length (the encoder trims
    padding per batch)."""
    rng = np.random.default_rng(seed)
    items = [rng.integers(0, eng.itemset.n_rows, eng.max_history) for _ in range(n)]
    return eng.history_sids(items).numpy()


def sids(eng, r: int, m: int, seed: int) -> torch.Tensor:
    rng = np.random.default_rng(seed)
    return torch.from_numpy(eng.itemset.sids[rng.integers(0, eng.itemset.n_rows, (r, m))])  # [r, m, L]


def alone(eng, h: np.ndarray, s: torch.Tensor) -> Scores:
    """The same score on a session of its own, one job at a time."""
    return eng.verifier.score(eng.verifier.encode(torch.from_numpy(h)), s)


def test_encodes_of_several_callers_are_one_backend_call(eng, monkeypatch):
    hs = [hist(eng, n, seed) for n, seed in ((1, 0), (2, 1), (3, 2))]
    encodes = Calls(monkeypatch, eng.verifier.backend, "encode")
    out = eng.verifier.runner.run([EncodeJob(h) for h in hs])
    assert encodes.n == 1
    assert [type(s) for s in out] == [Session] * 3 and [s.n for s in out] == [1, 2, 3]
    s = sids(eng, 3, 4, 7)
    for h, sess in zip(hs, out):  # each caller's rows of the batch are its own encoding
        got = eng.verifier.score(sess, s[: len(h)]).token_logp
        torch.testing.assert_close(got, alone(eng, h, s[: len(h)]).token_logp, atol=1e-5, rtol=1e-5)


def test_scores_of_several_callers_share_one_tree_pass(eng, monkeypatch):
    h1, h2 = full_hist(eng, 2, 3), full_hist(eng, 1, 4)
    s1, s2 = sids(eng, 2, 5, 5), sids(eng, 1, 3, 6)  # different candidate counts per caller
    want = [alone(eng, h1, s1), alone(eng, h2, s2)]
    sessions = [eng.verifier.encode(torch.from_numpy(h)) for h in (h1, h2)]
    trees = Calls(monkeypatch, eng.verifier.backend, "tree")
    out = eng.verifier.runner.run([ScoreJob(sessions[0], s1), ScoreJob(sessions[1], s2)])
    assert trees.n == 1
    for got, w in zip(out, want):
        assert isinstance(got, Scores)
        torch.testing.assert_close(got.token_logp, w.token_logp, atol=1e-5, rtol=1e-5)


def test_jobs_that_carry_a_history_are_encoded_together_before_their_pass(eng, monkeypatch):
    h1, h2 = hist(eng, 1, 8), hist(eng, 2, 9)
    s1, s2 = sids(eng, 1, 4, 10), sids(eng, 2, 4, 11)
    want = [alone(eng, h1, s1), alone(eng, h2, s2)]
    encodes = Calls(monkeypatch, eng.verifier.backend, "encode")
    trees = Calls(monkeypatch, eng.verifier.backend, "tree")
    out = eng.verifier.runner.run([ScoreJob(EncodeJob(h1), s1), ScoreJob(EncodeJob(h2), s2)])
    assert (encodes.n, trees.n) == (1, 1)
    for got, w in zip(out, want):
        torch.testing.assert_close(got.token_logp, w.token_logp, atol=1e-5, rtol=1e-5)


def test_results_come_back_one_per_job_in_job_order(eng):
    sess = [eng.verifier.encode(torch.from_numpy(full_hist(eng, 1, seed))) for seed in (12, 13, 14)]
    jobs = [
        ScoreJob(sess[0], sids(eng, 1, 3, 15)),
        EncodeJob(hist(eng, 2, 16)),
        SearchJob(sess[1], "head", eng.itemset.trie, (4,)),
        ScoreJob(sess[2], sids(eng, 1, 3, 17)),
    ]
    out = eng.verifier.runner.run(jobs)
    assert [type(x) for x in out] == [Scores, Session, Beams, Scores]
    assert out[1].n == 2 and out[2].codes.shape[:2] == (1, 4)


def test_a_failed_group_gives_its_jobs_the_error_and_leaves_the_others_alone(eng):
    bad = np.full_like(hist(eng, 1, 18), 10**6)  # codes far outside the vocabulary: the encode raises
    good = eng.verifier.encode(torch.from_numpy(hist(eng, 1, 19)))
    s = sids(eng, 1, 3, 20)
    out = eng.verifier.runner.run([ScoreJob(EncodeJob(bad), s), SearchJob(good, "head", eng.itemset.trie, (3,))])
    assert isinstance(out[0], Exception)  # returned, not raised
    assert isinstance(out[1], Beams) and out[1].codes.shape[:2] == (1, 3)


def test_jobs_of_sessions_with_different_history_lengths_share_a_pass_and_equal_each_alone(eng, monkeypatch):
    short, long = full_hist(eng, 1, 21)[:, -1:], full_hist(eng, 1, 22)  # 1 item vs the full window
    short = np.concatenate([np.full_like(long[:, :-1], -1), short], 1)
    sessions = [eng.verifier.encode(torch.from_numpy(h)) for h in (short, long)]
    assert sessions[0].state.enc.cross_k.shape[3] != sessions[1].state.enc.cross_k.shape[3]
    s1, s2 = sids(eng, 1, 3, 23), sids(eng, 1, 3, 24)
    want = [alone(eng, short, s1), alone(eng, long, s2)]
    trees = Calls(monkeypatch, eng.verifier.backend, "tree")
    out = eng.verifier.runner.run([ScoreJob(sessions[0], s1), ScoreJob(sessions[1], s2)])
    assert trees.n == 1
    for got, w in zip(out, want):
        assert isinstance(got, Scores), got
        torch.testing.assert_close(got.token_logp, w.token_logp, atol=1e-5, rtol=1e-5)
    heads = eng.verifier.runner.run([SearchJob(s, "head", eng.itemset.trie, (4,)) for s in sessions])
    for got, s in zip(heads, sessions):
        assert isinstance(got, Beams), got
        w = eng.verifier.runner.run([SearchJob(s, "head", eng.itemset.trie, (4,))])[0]
        assert torch.equal(got.codes, w.codes)
        torch.testing.assert_close(got.scores, w.scores, atol=1e-5, rtol=1e-5)
