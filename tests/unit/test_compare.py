"""``compare_policies`` and ``comparison_table`` (``specrec eval --policies``) on fake policies with known
lists and a fake clock: the ratios are exactly what the lists and the clock say, recall ratios are taken at
the list's K, the order rotates, and warm-up requests are in no counter."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest

from specrec.data.splits import Examples
from specrec.eval.compare import compare_policies, comparison_table, summary_keys
from specrec.policies.metrics import RequestStats, SpecMetrics
from specrec.policies.requests import RecResult

N, K = 12, 50


class FakePolicy:
    """Answers ``hit(i)``-dependent lists: the target first where ``hit`` says so, else K other items;
    each call takes ``ms`` on the fake clock and is recorded in the engine's metrics."""

    def __init__(self, name, engine, clock, ms, hit, calls):
        self.name, self.engine, self.clock, self.ms, self.hit, self.calls = name, engine, clock, ms, hit, calls

    def run(self, reqs):
        (req,) = reqs
        i = int(req.history[0])  # the example's index, as the fake histories carry it
        self.calls.append((i, self.name))
        self.clock.t += self.ms / 1000.0
        target = 1000 + i
        items = ([target] if self.hit(i) else []) + [5000 + j for j in range(K)]
        self.engine.metrics.record(self.name, RequestStats(rounds=1, exit_reason="complete"))
        return [RecResult(np.asarray(items[:req.k]), np.zeros(req.k), ["draft"] * req.k)]


@pytest.fixture
def setup():
    clock = SimpleNamespace(t=0.0)
    eng = SimpleNamespace(metrics=SpecMetrics())
    calls: list = []
    ex = Examples(history=np.array([[i, -1] for i in range(N)]), target=np.array([1000 + i for i in range(N)]),
                  user=np.arange(N), position=np.ones(N, dtype=np.int64))
    split = SimpleNamespace(protocol="loo", seen=None)
    tick = lambda: clock.t  # noqa: E731
    pols = {
        "beam": FakePolicy("beam", eng, clock, 4.0, lambda i: i % 2 == 0, calls),  # half the targets
        "fast": FakePolicy("fast", eng, clock, 1.0, lambda i: i % 4 == 0, calls),  # a quarter
        "slow": FakePolicy("slow", eng, clock, 8.0, lambda i: True, calls),  # every one
    }
    return pols, eng, ex, split, tick, calls


def test_ratios_are_exactly_what_the_lists_and_the_clock_say(setup):
    pols, eng, ex, split, tick, calls = setup
    runs = compare_policies(pols, ex, K, progress=False, warmup=3, clock=tick)
    table, _ = comparison_table(runs, ex, split, [10, 50], eng.metrics.snapshot())
    fast, slow = table["fast"].extra, table["slow"].extra
    assert fast["speedup_vs_beam"] == pytest.approx(4.0) and slow["speedup_vs_beam"] == pytest.approx(0.5)
    assert fast["recall_ratio_vs_beam"] == pytest.approx(0.5) and slow["recall_ratio_vs_beam"] == pytest.approx(2.0)
    assert fast["recall@10_ratio_vs_beam"] == pytest.approx(0.5)
    assert fast["equal_to_beam"] == pytest.approx(0.75)  # the same list where both miss (6) or both hit (3)
    keys = summary_keys(table, "fake", "loo", K)
    assert keys["fake.loo.fast.k50.recall_ratio_vs_beam"] == pytest.approx(0.5)
    assert keys["fake.loo.fast.k50.speedup_vs_beam"] == pytest.approx(4.0)
    assert keys["fake.loo.policies.k50.users"] == len(ex)  # the block says its sample


def test_the_recall_ratio_is_taken_at_the_lists_k(setup):
    """Items past rank 10: recall@50 counts them, recall@10 does not; the K=50 key is recall@50's ratio."""
    pols, eng, ex, split, tick, calls = setup

    class Late(FakePolicy):
        def run(self, reqs):
            res = super().run(reqs)[0]
            res.items = np.roll(res.items, 20)  # the target (when there) moves to rank 21
            return [res]

    pols["late"] = Late("late", eng, pols["beam"].clock, 2.0, lambda i: True, calls)
    runs = compare_policies(pols, ex, K, progress=False, warmup=0, clock=tick)
    late = comparison_table(runs, ex, split, [10, 50], eng.metrics.snapshot())[0]["late"].extra
    assert late["recall_ratio_vs_beam"] == pytest.approx(2.0)  # all of them @50, against beam's half
    assert late["recall@10_ratio_vs_beam"] == pytest.approx(0.0)  # none in the top 10


def test_the_order_rotates_and_warm_up_is_in_no_counter(setup):
    pols, eng, ex, split, tick, calls = setup
    compare_policies(pols, ex, K, progress=False, warmup=3, clock=tick)
    timed = calls[3 * len(pols):]
    firsts = [timed[i * len(pols)][1] for i in range(N)]
    assert set(firsts) == set(pols)  # each policy runs first on some requests
    assert {firsts.count(n) for n in pols} == {N // len(pols)}
    assert dict(eng.metrics.requests) == {n: N for n in pols}  # not N + 3: the warm-up is not counted


def test_every_policy_is_timed_against_the_eager_reference(setup):
    """With ``beam@eager`` in the runs (``--compare-eager``), each policy's speedup over it is a key, and beam's
    lists are compared with the reference's request by request (equal_to_eager)."""
    pols, eng, ex, split, tick, calls = setup
    pols["beam@eager"] = FakePolicy("beam@eager", eng, pols["beam"].clock, 16.0, lambda i: i % 2 == 0, calls)
    runs = compare_policies(pols, ex, K, progress=False, warmup=3, clock=tick)
    table, _ = comparison_table(runs, ex, split, [10, 50], eng.metrics.snapshot())
    keys = summary_keys(table, "fake", "loo", K)
    assert keys["fake.loo.beam.k50.speedup_vs_eager"] == pytest.approx(4.0)
    assert keys["fake.loo.fast.k50.speedup_vs_eager"] == pytest.approx(16.0)
    assert keys["fake.loo.beam.k50.equal_to_eager"] == 1.0
    assert not any(k.startswith("fake.loo.beam@eager") for k in keys)


def test_valid_against_test_takes_both_validation_lists_from_the_same_users():
    """With a learned combiner kept, ``tune-fusion`` judged the fused list on half of the validation users; a
    bundle tuned before the mend has the drafter's ``fusion.valid`` figure from all of them. The validation ratio
    (and the gap to test) comes from the pair the default-list decision compared, on the same users: here 1.046,
    where the mixed figures would say 0.1099 / 0.1024 = 1.073. Without a decision record, ``fusion.valid``."""
    from specrec.eval.compare import valid_against_test

    def lists(fused, drafter):
        return {"fused": SimpleNamespace(overall={"recall@10": fused, "ndcg@10": fused / 2}),
                "drafter": SimpleNamespace(overall={"recall@10": drafter, "ndcg@10": drafter / 2})}

    pair = {"recall@10": {"fused": 0.1099, "drafter": 0.1051}, "ndcg@10": {"fused": 0.0659, "drafter": 0.0635}}
    meta = {"valid": {"fused": {"recall@10": 0.1099, "ndcg@10": 0.0659},
                      "drafter": {"recall@10": 0.1024, "ndcg@10": 0.0624}},
            "default": {"list": "fused", "why": "above 0", **pair}}
    vt = valid_against_test(meta, lists(0.1001, 0.0987), 10)
    assert vt["recall@10"]["valid.drafter"] == 0.1051
    assert vt["recall@10"]["valid.ratio"] == pytest.approx(0.1099 / 0.1051)
    assert vt["recall@10"]["gap"] == pytest.approx(abs(0.1001 / 0.0987 - 0.1099 / 0.1051))
    assert vt["ndcg@10"]["valid.ratio"] == pytest.approx(0.0659 / 0.0635)
    del meta["default"]
    assert valid_against_test(meta, lists(0.1001, 0.0987), 10)["recall@10"]["valid.ratio"] == pytest.approx(
        0.1099 / 0.1024)
