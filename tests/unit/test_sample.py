"""Exactness of speculative sampling: enumeration, frequency tests (and a
test that those tests catch a broken sampler), edge cases, and the policy on
a real (tiny) GR model."""

import itertools
from collections import Counter, defaultdict

import numpy as np
import pytest
import torch
from scipy.stats import chisquare

from specrec.decoding.scoring import score_sids
from specrec.decoding.speculative import accept_prob, residual, speculative_sample, transform
from specrec.policies import RecRequest, make_policy

from .policy_fixtures import make_engine

SIZES = (3, 2, 3)
ALPHA = 1e-3  # significance of the frequency tests


def random_tables(seed, sizes=SIZES, zeros=True):
    """Target and draft distributions for every prefix, with some zeros."""
    rng = np.random.default_rng(seed)
    p, q = {}, {}
    for level in range(len(sizes)):
        for prefix in itertools.product(*[range(s) for s in sizes[:level]]):
            for tab in (p, q):
                w = rng.random(sizes[level]) ** 2
                if zeros and rng.random() < 0.5:
                    w[rng.integers(sizes[level])] = 0.0
                tab[prefix] = torch.tensor(w / w.sum(), dtype=torch.float32)
    return p, q


def target_dist(p, sizes=SIZES):
    out = {}
    for sid in itertools.product(*[range(s) for s in sizes]):
        out[sid] = float(np.prod([float(p[sid[:j]][sid[j]]) for j in range(len(sizes))]))
    return out


def exact_output(p, q, sizes=SIZES, residual_fn=residual):
    """Output distribution of the speculative procedure, by enumeration over
    drafts, accept/reject outcomes and residual draws (the implementation's
    accept_prob and residual)."""
    depth = len(sizes)
    memo = {}

    def from_prefix(c):
        if len(c) == depth:
            return {c: 1.0}
        if c in memo:
            return memo[c]
        out = defaultdict(float)

        def drafts(prefix, prob):
            if len(prefix) == depth:
                verify(prefix, prob)
                return
            qd = q[prefix]
            for v in range(sizes[len(prefix)]):
                if qd[v] > 0:
                    drafts(prefix + (v,), prob * float(qd[v]))

        def verify(draft, prob):
            pr = prob
            for j in range(len(c), depth):
                pd, qd, y = p[draft[:j]], q[draft[:j]], draft[j]
                a = float(accept_prob(pd[y], qd[y]))
                r = residual_fn(pd, qd)
                for z in range(sizes[j]):
                    if r[z] > 0 and a < 1:
                        for sid, pz in from_prefix(draft[:j] + (z,)).items():
                            out[sid] += pr * (1 - a) * float(r[z]) * pz
                pr *= a
            out[draft] += pr

        drafts(c, 1.0)
        memo[c] = dict(out)
        return memo[c]

    return from_prefix(())


def table_fns(p, q):
    def p_fn(seq):
        return [torch.stack([p[tuple(row[:j])] for row in seq.tolist()]) for j in range(seq.shape[1])]

    def q_next(prefix):
        return torch.stack([q[tuple(row)] for row in prefix.tolist()])

    return p_fn, q_next


def frequencies(p, q, n, seed, residual_fn=residual, sizes=SIZES):
    p_fn, q_next = table_fns(p, q)
    g = torch.Generator().manual_seed(seed)
    seq, logp, st = speculative_sample(p_fn, q_next, n, len(sizes), g, residual_fn=residual_fn)
    return Counter(map(tuple, seq.tolist())), logp, st


def chi2_pvalue(counts, dist):
    """Chi-square p-value of the counts against dist; 0.0 when a SID of
    probability zero was sampled (impossible under the target)."""
    sids = [s for s, pr in dist.items() if pr > 0]
    if sum(counts[s] for s in counts if dist.get(s, 0) == 0):
        return 0.0
    n = sum(counts.values())
    total = sum(dist[s] for s in sids)
    return chisquare([counts[s] for s in sids], [dist[s] / total * n for s in sids]).pvalue


@pytest.mark.parametrize("seed", range(5))
def test_enumerated_output_distribution_equals_target(seed):
    p, q = random_tables(seed)
    got, want = exact_output(p, q), target_dist(p)
    for sid in want:
        assert abs(got.get(sid, 0.0) - want[sid]) < 1e-6


def test_enumeration_detects_a_broken_residual():
    p, q = random_tables(1)
    broken = exact_output(p, q, residual_fn=lambda pd, qd: pd)  # resample from p instead of the residual
    want = target_dist(p)
    assert max(abs(broken.get(s, 0.0) - want[s]) for s in want) > 1e-3


@pytest.mark.parametrize("seed", [0, 1])
def test_frequency_test_passes(seed):
    p, q = random_tables(seed)
    p_fn, q_next = table_fns(p, q)
    g = torch.Generator().manual_seed(seed)
    seq, logp, _ = speculative_sample(p_fn, q_next, 40_000, len(SIZES), g)
    want = target_dist(p)
    assert chi2_pvalue(Counter(map(tuple, seq.tolist())), want) > ALPHA
    # the reported log-probabilities are the target's
    for row, lp in zip(seq[:200].tolist(), logp[:200].tolist()):
        assert abs(np.exp(lp) - want[tuple(row)]) < 1e-5


@pytest.mark.parametrize("broken", ["from_p", "from_q"])
def test_frequency_test_fails_without_residual_step(broken):
    """Test the test: the same check must reject a sampler without the
    residual correction (resampling from p, or from q, on rejection)."""
    p, q = random_tables(0)
    fn = (lambda pd, qd: pd) if broken == "from_p" else (lambda pd, qd: qd)
    counts, _, _ = frequencies(p, q, 40_000, 0, residual_fn=fn)
    assert chi2_pvalue(counts, target_dist(p)) < 1e-6


def test_p_equal_q_accepts_everything_in_one_round():
    p, _ = random_tables(3)
    counts, _, st = frequencies(p, p, 5000, 3)
    assert st.rounds == 1 and st.accepted_tokens == st.draft_tokens == 5000 * len(SIZES)
    assert chi2_pvalue(counts, target_dist(p)) > ALPHA


def test_first_token_always_rejected_when_supports_are_disjoint():
    p, q = random_tables(4, zeros=False)
    p[()] = torch.tensor([1.0, 0.0, 0.0])
    q[()] = torch.tensor([0.0, 0.5, 0.5])
    counts, _, st = frequencies(p, q, 3000, 4)
    assert int(st.accepted[:, 0].sum()) == 0 and int(st.drafted[:, 0].sum()) == 3000
    assert all(sid[0] == 0 for sid in counts)  # every first token came from the residual
    assert chi2_pvalue(counts, target_dist(p)) > ALPHA
    got = exact_output(p, q)
    want = target_dist(p)
    assert max(abs(got.get(s, 0) - want[s]) for s in want) < 1e-6


def test_zero_target_probabilities_are_never_sampled():
    p, q = random_tables(5)
    p[()] = torch.tensor([0.0, 0.5, 0.5])
    q[()] = torch.tensor([0.8, 0.1, 0.1])  # the draft loves a token the target forbids
    counts, _, _ = frequencies(p, q, 5000, 5)
    assert all(sid[0] != 0 for sid in counts)


def test_residual_and_accept_edge_values():
    p = torch.tensor([0.5, 0.5, 0.0])
    q = torch.tensor([0.25, 0.25, 0.5])
    assert torch.allclose(residual(p, q), torch.tensor([0.5, 0.5, 0.0]))
    assert torch.allclose(residual(p, p), p)  # empty residual: never used, but well defined
    assert float(accept_prob(torch.tensor(0.0), torch.tensor(0.5))) == 0.0
    assert float(accept_prob(torch.tensor(0.9), torch.tensor(0.1))) == 1.0


def test_transform_is_applied_identically():
    logits = torch.tensor([[2.0, 1.0, 0.5, -1.0]])
    allowed = torch.tensor([[True, True, False, True]])
    t = transform(logits, allowed, temperature=0.5, top_k=2)
    assert t[0, 2] == 0 and t[0, 3] == 0 and torch.isclose(t.sum(), torch.tensor(1.0))
    assert torch.allclose(t[0, :2], torch.softmax(torch.tensor([4.0, 2.0]), 0))
    # log-probs and logits give the same distribution (shift invariance)
    assert torch.allclose(transform(torch.log_softmax(logits, -1), allowed, 0.5, 2), t)


def test_temperature_and_topk_exactness():
    """With temperature and top-k applied to both p and q, the output is
    exactly the processed target."""
    p_raw, q_raw = random_tables(6, zeros=False)

    def proc(tab):
        return {k: transform(torch.log(v).unsqueeze(0), None, 0.7, 2)[0] for k, v in tab.items()}

    p, q = proc(p_raw), proc(q_raw)
    got, want = exact_output(p, q), target_dist(p)
    assert max(abs(got.get(s, 0) - want[s]) for s in want) < 1e-6
    counts, _, _ = frequencies(p, q, 20_000, 6)
    assert chi2_pvalue(counts, want) > ALPHA


@torch.inference_mode()
def test_sample_policy_streams_follow_the_gr_model():
    """On a real tiny GR model with a NEZHA head, with several requests in one
    call: each request's streams are distributed as the model's
    (temperature-processed, item-set-constrained) distribution for *its own*
    history. The requests' targets differ enough that a row mix-up across the
    batch fails the test."""
    eng = make_engine(2, n_items=12, sharp=3.0)
    pol = make_policy("sample", eng, temperature=1.3, seed=0)
    hists = [np.full(6, i) for i in (0, 5, 9)]  # one item repeated: histories as different as they get
    R, M = len(hists), 8_000
    sess = eng.verifier.encode(eng.history_sids(hists))
    p_fn, q_next = pol.distributions(sess, R, M)
    seq, logp, st = speculative_sample(p_fn, q_next, R * M, 4, pol.generator)
    sids = torch.from_numpy(eng.itemset.sids)
    full = score_sids(eng.verifier.backend, sess.state.enc, sids.unsqueeze(0).expand(R, -1, -1), full=True).full
    want = []
    for r in range(R):
        probs = torch.ones(len(sids))
        for j in range(4):
            allowed = pol._allowed(eng.itemset.trie, sids[:, :j], j)
            probs *= transform(full[j][r], allowed, 1.3, 0).gather(1, sids[:, j : j + 1]).squeeze(1)
        assert abs(float(probs.sum()) - 1.0) < 1e-4
        want.append({tuple(s): float(pr) for s, pr in zip(sids.tolist(), probs)})
    for r in range(R):
        counts = Counter(map(tuple, seq[r * M : (r + 1) * M].tolist()))
        assert chi2_pvalue(counts, want[r]) > ALPHA
        other = want[(r + 1) % R]  # the check tells the requests apart
        assert sum(abs(want[r][s] - other[s]) for s in other) > 0.05
        assert chi2_pvalue(counts, other) < 1e-6
    assert st.accepted_tokens < st.draft_tokens  # the untrained head is not the target: rejections happened
    # the policy's lists are distinct valid items, and each request counts only its own streams' tokens
    res = pol.run([RecRequest(h, 5) for h in hists])
    for r in res:
        assert len(set(r.items.tolist())) == 5
        assert 0 < r.stats.draft_tokens <= 4 * pol.config.max_batches * 2 * 5 * 4
    assert sum(r.stats.draft_tokens for r in res) == eng.metrics.snapshot()["sample"]["draft_tokens"]
