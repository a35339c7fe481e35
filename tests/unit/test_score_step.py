"""The verify-and-step call (a ``specgr`` round in one verifier call): ``score_step`` scores the drafts and takes
the beam step from the same pass, and equals ``score(with_frontier=True)`` followed by ``beam_step``; the job the
verifier service runs for it (a :class:`ScoreJob` with ``step``) starts the search on a session it encodes, and
several callers' jobs share one tree pass."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from specrec.decoding.beam import Beams
from specrec.decoding.scoring import Scores
from specrec.verifier import SessionStateError
from specrec.verifier.jobs import EncodeJob, ScoreJob, SearchJob, SearchSpec

from .policy_fixtures import histories, make_engine


@pytest.fixture(scope="module")
def eng():
    return make_engine(6)


def hist(eng, seed: int) -> np.ndarray:
    return eng.history_sids(histories(eng, 1, seed)).numpy()  # [1, H, L]


def drafts(eng, m: int, seed: int) -> torch.Tensor:
    rng = np.random.default_rng(seed)
    return torch.from_numpy(eng.itemset.sids[rng.integers(0, eng.itemset.n_rows, (1, m))])  # [1, m, L]


def two_calls(eng, h: np.ndarray, rounds: list[torch.Tensor], width: int) -> list[tuple[Scores, Beams]]:
    """What a round did before: a Score with the frontier, then a BeamStep."""
    v = eng.verifier
    sess = v.encode(torch.from_numpy(h))
    v.beam_start(sess, eng.itemset.trie, width)
    return [(v.score(sess, s, with_frontier=True), v.beam_step(sess)) for s in rounds]


def assert_same(got: tuple[Scores, Beams], want: tuple[Scores, Beams]) -> None:
    torch.testing.assert_close(got[0].token_logp, want[0].token_logp, atol=1e-6, rtol=1e-6)
    assert torch.equal(got[1].codes, want[1].codes) and torch.equal(got[1].alive, want[1].alive)
    torch.testing.assert_close(got[1].scores, want[1].scores, atol=1e-6, rtol=1e-6)


def test_score_step_equals_score_then_step_and_the_step_computes_nothing(eng):
    h, width = hist(eng, 1), 4
    rounds = [drafts(eng, 6, seed) for seed in range(4)]
    want = two_calls(eng, h, rounds, width)
    v = eng.verifier
    sess = v.encode(torch.from_numpy(h))
    v.beam_start(sess, eng.itemset.trie, width)
    for s, w in zip(rounds, want):
        assert_same(v.score_step(sess, s), w)
    assert len(sess.coverage) == 4 and all(c.computed == [0] for c in sess.coverage)  # every step read the pass
    with pytest.raises(SessionStateError, match="complete"):
        v.score_step(sess, rounds[0])


def test_the_services_job_starts_the_search_on_a_session_it_encodes(eng):
    """The gateway's first round: the history travels with the Score, the search starts before the pass."""
    h, width = hist(eng, 2), 3
    rounds = [drafts(eng, 5, seed) for seed in (10, 11)]
    want = two_calls(eng, h, rounds, width)
    job = ScoreJob(EncodeJob(h), rounds[0], with_frontier=True, step=SearchSpec(eng.itemset.trie, width))
    (first,) = eng.verifier.runner.run([job])
    assert_same(first, want[0])
    # later rounds name the session: the search it started is kept (the spec's width is not read again)
    (second,) = eng.verifier.runner.run([ScoreJob(job.session, rounds[1], step=SearchSpec(eng.itemset.trie, 99))])
    assert_same(second, want[1])


def test_callers_share_one_tree_pass_and_a_finished_search_fails_alone(eng, monkeypatch):
    hs = [hist(eng, seed) for seed in (3, 4, 5)]
    s = [drafts(eng, m, seed) for m, seed in ((4, 20), (7, 21), (3, 22))]
    want = [two_calls(eng, h, [x], 5)[0] for h, x in zip(hs, s)]
    v, trie = eng.verifier, eng.itemset.trie
    sessions = [v.encode(torch.from_numpy(h)) for h in hs]
    done = v.encode(torch.from_numpy(hs[0]))
    (beams,) = v.runner.run([SearchJob(done, "beam", trie, (5,))])
    assert beams.level == len(v.level_sizes)
    trees = []
    real = v.backend.tree
    monkeypatch.setattr(v.backend, "tree", lambda *a: (trees.append(1), real(*a))[1])
    jobs = [ScoreJob(x, y, step=SearchSpec(trie, 5)) for x, y in zip(sessions, s)]
    out = v.runner.run([*jobs, ScoreJob(done, s[0], step=SearchSpec(trie, 5))])
    assert len(trees) == 1  # one pass for every caller's drafts and frontiers
    for got, w in zip(out[:3], want):
        assert_same(got, w)
    assert isinstance(out[3], SessionStateError)
