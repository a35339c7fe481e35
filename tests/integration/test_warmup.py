"""What ``auto`` knows of costs at start is measured in the gateway's warm-up, through the real verifier and drafter
(real gRPC servers on loopback, a real Redis), before the gateway says SERVING: so the first ``auto`` request after
start gets the best list that fits its budget (the fused list, where it fits), and not a list that does not fit.

The verifier is slowed on purpose (``fault_delay_ms``: each of its calls waits 60 ms), so that the fused list's cost
is known to be above one budget and below another whatever the machine: the first request is fused at 400 ms, and at
35 ms it is the next tier's list (SASRec's own, as on Beauty, whose validation figures order the tiers here), on
time and not degraded. Without the measured warm-up (``warmup_requests = 0``) the same first request at 35 ms tries
the fused list, unmeasured, and is cut at its deadline."""

from __future__ import annotations

import pytest

from specrec.costs import Resource

from .stack import histories, running

DELAY_MS = 60.0  # every verifier call (the fused list's Score among them)
FITS_MS = 400.0  # well above the fused list's cost on a slow machine
TIGHT_MS = 35.0  # below it (at least DELAY_MS), above the drafter's own list (no verifier call)


@pytest.fixture(scope="module")
def ranked_bundle_dir(fused_bundle_dir, tmp_path_factory):
    """The fused bundle with validation figures as ``specrec tune-fusion`` records them (Beauty's: the fused list,
    then SASRec's own, then beam's, then nezha's), which order auto's tiers."""
    from specrec.bundle import Bundle

    b = Bundle.load(fused_bundle_dir)
    b.meta["fusion"] = {**b.meta["fusion"], "valid": {"fused": {"recall@10": 0.112}, "drafter": {"recall@10": 0.101},
                                                      "beam": {"recall@10": 0.082}, "nezha": {"recall@10": 0.079}}}
    return b.save(tmp_path_factory.mktemp("ranked") / "bundle")


def _stack(redis_url, bundle_dir, **gateway):
    return running(redis_url, "warmup", bundle_dir, verifier_overrides={"fault_delay_ms": DELAY_MS, "warmup_k": [10]},
                   gateway_overrides={"warmup_requests": 4, **gateway})


async def _first(st, budget_ms: float):
    from specrec.bundle import Bundle

    h = histories(Bundle.load(st.bundle), 1, seed=11)[0]
    return await st.recommend(h, k=10, policy="", budget_ms=budget_ms)  # the default policy: auto


@pytest.mark.asyncio(loop_scope="session")
async def test_the_first_auto_request_after_start_is_the_fused_list_where_it_fits(redis_url, ranked_bundle_dir):
    async with _stack(redis_url, ranked_bundle_dir) as st:
        costs = st.runners["gateway"].service.costs
        fused, drafter = costs.tail("fused", 10), costs.tail("drafter", 10)
        # measured before SERVING, through the slowed verifier: not the cold requests' times, not a guess
        assert fused is not None and drafter is not None and DELAY_MS / 1000 <= fused < FITS_MS / 2000, costs
        assert costs.resource(Resource.VERIFIER) >= DELAY_MS / 1000
        r = await _first(st, FITS_MS)
        assert r.stats.policy == "auto" and r.stats.served_by == "fused", r.stats
        assert r.stats.exit_reason == "fused" and not r.stats.degraded and len(r.items) == 10


@pytest.mark.asyncio(loop_scope="session")
async def test_the_first_auto_request_is_the_next_list_where_the_measured_fused_cost_does_not_fit(
        redis_url, ranked_bundle_dir):
    async with _stack(redis_url, ranked_bundle_dir) as st:
        costs = st.runners["gateway"].service.costs
        assert costs.tail("fused", 10) > TIGHT_MS / 1000 > costs.tail("drafter", 10), costs
        r = await _first(st, TIGHT_MS)
        # chosen, not fallen back to: SASRec's own list, complete, on time
        assert r.stats.served_by == "drafter" and r.stats.exit_reason != "budget" and not r.stats.degraded, r.stats
        assert len(r.items) == 10


@pytest.mark.asyncio(loop_scope="session")
async def test_without_the_measured_warm_up_the_first_request_tries_the_fused_list_and_is_cut(
        redis_url, ranked_bundle_dir):
    async with _stack(redis_url, ranked_bundle_dir, warmup_requests=0) as st:
        costs = st.runners["gateway"].service.costs
        assert costs.tail("fused", 10) is None  # the cold requests taught nothing that was kept
        r = await _first(st, TIGHT_MS)
        assert r.stats.exit_reason == "budget" and r.stats.degraded, r.stats  # late: answered by the cut
