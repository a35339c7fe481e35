"""A bundle with the GR model and item drafters only (no distilled SID drafter, no NEZHA head: like
``bundles/beauty-temporal``, or any bundle trained without ``train-drafters --which distill``), served by the
whole stack over real gRPC and a real Redis. The verifier says what its bundle offers (Describe); the
gateway plans with it: every policy that can run answers with the model's own list, never the item
drafter's fallback, and the one that cannot (nezha) is FAILED_PRECONDITION naming the missing part. Its item
drafter reserves a share of its drafts for unseen items (as ``bundles/beauty-temporal`` does), says so in its
answers, and ``specgr`` through the gateway keeps that share of its list for them, as in-process."""

from __future__ import annotations

import grpc
import numpy as np
import pytest
import pytest_asyncio

from specrec.policies import RecRequest, make_policy
from specrec_rpc.v1 import verifier_pb2

from .stack import histories, running

UNSEEN_SHARE = 0.3  # the item drafter's share of drafts for unseen items (a temporal bundle's setting)


@pytest_asyncio.fixture(scope="module", loop_scope="session")
async def stack(redis_url, model_only_bundle_dir):
    # the list length the tests ask (5) warmed like the deployment's K: a graph exported at request time takes
    # seconds, past any budget
    async with running(redis_url, "bare", model_only_bundle_dir, verifier_overrides={"warmup_k": [5, 10]},
                       drafter_overrides={"unseen_share": UNSEEN_SHARE}) as st:
        yield st


@pytest.mark.asyncio(loop_scope="session")
async def test_the_verifier_says_what_its_bundle_offers(stack):
    d = await stack.verifier.Describe(verifier_pb2.DescribeRequest(), timeout=10)
    assert not d.distilled_drafter and not d.draft_head and d.sid_space
    # every graph's arithmetic: float32 here (graphs exported on first use hold no precision record)
    assert d.precision["beam"] == "float32" and d.precision["rank"] == "float32" and "draft" not in d.precision


@pytest.mark.asyncio(loop_scope="session")
@pytest.mark.parametrize("policy", ["beam", "strict", "specgr", "auto"])
async def test_every_policy_that_can_run_answers_with_the_model(stack, policy):
    from specrec.bundle import Bundle

    bundle = Bundle.load(stack.bundle)
    for h in histories(bundle, 8, seed=3):
        r = await stack.recommend(h, k=5, policy=policy, budget_ms=1000)
        assert not r.stats.degraded, r.stats.degraded_reason
        assert r.stats.served_by == policy or (policy == "auto" and r.stats.served_by in ("beam", "strict"))
        assert len(r.items) == 5
    if policy == "strict":  # drafted by the item drafter, still the target's own list
        eng = bundle.engine(drafter="retrieval")
        hist = histories(bundle, 1, seed=4)[0]
        r = await stack.recommend(hist, k=5, policy="beam", budget_ms=1000)
        s = await stack.recommend(hist, k=5, policy="strict", budget_ms=1000)
        assert [i.item_id for i in s.items] == [i.item_id for i in r.items]
        idx = np.array([bundle.catalogue.lookup(i) for i in hist])
        local = make_policy("beam", eng).run([RecRequest(idx, 5)])[0]
        assert [bundle.catalogue.ids[i] for i in local.items.tolist()] == [i.item_id for i in r.items]


@pytest.mark.asyncio(loop_scope="session")
async def test_nezha_is_refused_naming_the_missing_part_and_nothing_is_excluded(stack):
    from specrec.bundle import Bundle

    h = histories(Bundle.load(stack.bundle), 1, seed=5)[0]
    for _ in range(5):  # more than the breaker's failures in a row
        with pytest.raises(grpc.aio.AioRpcError) as ei:
            await stack.recommend(h, k=5, policy="nezha", budget_ms=1000)
        assert ei.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        assert "SID drafter" in ei.value.details()
    gw = stack.runners["gateway"].service
    assert not gw.breaker.is_open()
    with pytest.raises(grpc.aio.AioRpcError) as ei:  # relaxed drafts with the NEZHA head unless told otherwise
        await stack.recommend(h, k=5, policy="relaxed", budget_ms=1000)
    assert ei.value.code() == grpc.StatusCode.FAILED_PRECONDITION and "NEZHA draft head" in ei.value.details()
    r = await stack.recommend(h, k=5, policy="relaxed", budget_ms=1000, params={"drafter": "drafter"})
    assert r.stats.served_by == "relaxed" and not r.stats.degraded
    r = await stack.recommend(h, k=5, policy="specgr", budget_ms=1000)  # the verifier was never excluded
    assert r.stats.served_by == "specgr" and not r.stats.degraded


@pytest.mark.asyncio(loop_scope="session")
async def test_specgr_keeps_the_drafters_share_for_unseen_items(stack):
    """The drafter describes what share of its drafts it reserves for unseen items; the gateway's specgr keeps that
    share of the list for them (with no gateway setting of its own), as the in-process engine does from the
    bundle. Without it a temporal bundle's new items never reach the served list."""
    from specrec.bundle import Bundle
    from specrec_rpc.v1 import drafter_pb2

    bundle = Bundle.load(stack.bundle)
    hists = histories(bundle, 4, seed=6)
    d = await stack.drafter.Describe(drafter_pb2.DescribeDrafterRequest())
    assert d.unseen_share == pytest.approx(UNSEEN_SHARE) and not d.HasField("fusion")
    unseen = {bundle.catalogue.ids[r] for r in np.nonzero(~bundle.seen)[0]}
    assert len(unseen) >= 10, "the tiny bundle's temporal split leaves unseen items"
    k = 10
    for h in hists:
        r = await stack.recommend(h, k=k, policy="specgr", budget_ms=1000)
        assert r.stats.served_by == "specgr" and not r.stats.degraded
        assert sum(it.unseen for it in r.items) == round(UNSEEN_SHARE * k)
        assert all((it.item_id in unseen) == it.unseen for it in r.items)
