"""The whole system over real gRPC on loopback with a real Redis: gateway
answers equal the in-process policies, budgets, degradation, catalogue
updates, and a clear status for every kind of bad input."""

from __future__ import annotations

import asyncio
import time

import grpc
import numpy as np
import pytest
import pytest_asyncio
from grpc_health.v1 import health_pb2, health_pb2_grpc

from specrec.policies import RecRequest, make_policy
from specrec_rpc.v1 import common_pb2, drafter_pb2, itemset_pb2, recommender_pb2

from .stack import AUTH, histories, running

POLICIES = ["beam", "specgr", "nezha", "strict", "relaxed", "sample", "drafter"]
# specgr drafts in every round (adaptive skipping reads what each process learned, so it could differ)
PARAMS = {"specgr": {"delta": 12, "gamma": -3.0, "adaptive": False}, "sample": {"seed": 5},
          "strict": {"n_drafts": 15}, "relaxed": {"n_drafts": 15}}


@pytest_asyncio.fixture(scope="module", loop_scope="session")
async def stack(redis_url, serving_bundle_dir):
    async with running(redis_url, "gw", serving_bundle_dir) as st:
        yield st


async def expect(aw, code, *fragments):
    with pytest.raises(grpc.aio.AioRpcError) as ei:
        await aw
    assert ei.value.code() == code, (ei.value.code(), ei.value.details())
    for f in fragments:
        assert f in ei.value.details(), ei.value.details()
    return ei.value.details()


@pytest.mark.asyncio(loop_scope="session")
async def test_all_services_serving(stack):
    for name in ("itemset", "verifier", "drafter", "gateway"):
        r = await health_pb2_grpc.HealthStub(stack.channel(name)).Check(health_pb2.HealthCheckRequest(service=""))
        assert r.status == health_pb2.HealthCheckResponse.SERVING, name


@pytest.mark.asyncio(loop_scope="session")
@pytest.mark.parametrize("policy", POLICIES)
async def test_gateway_equals_in_process_policy(stack, serving_bundle, policy):
    engine = serving_bundle.engine(drafter="retrieval")
    params = PARAMS.get(policy, {})
    local = make_policy(policy, engine, **params)
    ids = serving_bundle.catalogue.ids
    index = {i: n for n, i in enumerate(ids)}
    for hist in histories(serving_bundle, 4, seed=3):
        rows = np.array([index[h] for h in hist])
        if policy == "sample":  # same seed, same stream of draws
            local = make_policy(policy, engine, **params)
        want = local.run([RecRequest(rows[-8:], 10)])[0]
        got = await stack.recommend(hist, k=10, policy=policy, params=params)
        assert [it.item_id for it in got.items] == [ids[r] for r in want.items], policy
        assert np.allclose([it.score for it in got.items], want.scores, atol=1e-4)
        st = got.stats
        assert st.policy == policy and st.exit_reason == want.stats.exit_reason and not st.degraded
        assert st.served_by == policy and st.request_id
        assert st.encoder_calls == int(policy != "drafter") and st.catalogue_version
        # every item is valid in the catalogue version named in the response, no duplicates
        r = await stack.itemset.Lookup(
            itemset_pb2.LookupRequest(sids=[it.sid for it in got.items], version=st.catalogue_version)
        )
        assert all(r.valid) and list(r.item_ids) == [it.item_id for it in got.items]
        assert len({it.item_id for it in got.items}) == 10


@pytest.mark.asyncio(loop_scope="session")
async def test_small_budget_answers_in_time_with_budget_exit(stack, serving_bundle):
    hist = histories(serving_bundle, 1, seed=4)[0]
    await stack.recommend(hist, k=10, policy="specgr")  # warm
    for _ in range(2):  # and warm the paths a 5 ms budget takes (the drafter's fallback, fill)
        await stack.recommend(hist, k=10, policy="specgr", budget_ms=5, params={"gamma": 0.0, "delta": 12})
    lat, totals, reasons, stages, details = [], [], [], [], []
    for i in range(30):  # at least 7; more (up to 30) while none was a model's answer (a busy machine)
        t0 = time.perf_counter()
        r = await stack.recommend(hist, k=10, policy="specgr", budget_ms=5, params={"gamma": 0.0, "delta": 12})
        lat.append((time.perf_counter() - t0) * 1000)
        totals.append(r.stats.total_ms)
        reasons.append(r.stats.exit_reason)
        details.append((r.stats.served_by, r.stats.degraded_reason[:80], r.stats.rounds))
        stages.append(dict(r.stats.stage_ms))
        assert len(r.items) == 10
        if i >= 6 and any(r == "budget" or d[0] == "drafter" for r, d in zip(reasons, details)):
            break
    # 5 ms leave the verifier little after the drafter's reserve: answers are the policy's own, cut short by
    # the budget, or the drafter's (flagged), or fill (flagged) when even the drafter cannot make it; never late
    assert any(r == "budget" or d[0] == "drafter" for r, d in zip(reasons, details)), details
    assert np.median(totals) < 15.0, (totals, stages)  # the gateway's own time: 5 ms budget + a fallback
    assert np.median(lat) < 50.0, (lat, stages)  # plus transport, on 2 shared cores


@pytest.mark.asyncio(loop_scope="session")
async def test_bad_inputs_get_clear_statuses(stack, serving_bundle):
    ok = serving_bundle.catalogue.ids[:3]
    IA = grpc.StatusCode.INVALID_ARGUMENT
    await expect(stack.recommend([], k=10), IA, "history", "empty")
    await expect(stack.recommend(["no-such-item", "nor-this"], k=10), IA, "history", "none of the 2")
    await expect(stack.recommend(ok, k=0), IA, "k:")
    await expect(stack.recommend(ok, k=-3), IA, "k:")
    await expect(stack.recommend(ok, k=10**6), IA, "k:")
    await expect(stack.recommend(ok, k=10, budget_ms=-1), IA, "budget_ms")
    await expect(stack.recommend(ok, k=10, policy="greedy"), IA, "policy", "unknown")
    await expect(stack.recommend(ok, k=10, policy="specgr", params={"gamma": "high"}), IA, "params.gamma")
    await expect(stack.recommend(ok, k=10, policy="specgr", params={"nope": 1}), IA, "params.nope")
    await expect(stack.recommend(ok * 400, k=10), IA, "history", "at most")
    await expect(stack.recommend(ok, k=10, budget_ms=5000), IA, "budget_ms", "at most")
    await expect(stack.recommend(["x" * 300], k=10), IA, "history", "characters")
    # oversized request: larger than the gateway's 1 MiB receive limit
    big = recommender_pb2.RecommendRequest(history=ok, k=10, user_id="x" * (2 * 1024 * 1024))
    await expect(stack.gateway.Recommend(big, timeout=30), grpc.StatusCode.RESOURCE_EXHAUSTED)
    # writes: malformed SIDs or text, missing or wrong token
    up = stack.itemset.Upsert
    bad_sid = itemset_pb2.UpsertItem(item_id="n1", text="x", sid=common_pb2.Sid(codes=[1, 2]))
    await expect(up(itemset_pb2.UpsertRequest(items=[bad_sid]), metadata=AUTH), IA, "items[0].sid")
    no_text = itemset_pb2.UpsertItem(item_id="n2")
    await expect(up(itemset_pb2.UpsertRequest(items=[no_text]), metadata=AUTH), IA, "items[0].text")
    good = itemset_pb2.UpsertRequest(items=[itemset_pb2.UpsertItem(item_id="n3", text="red lipstick")])
    await expect(up(good), grpc.StatusCode.UNAUTHENTICATED)
    await expect(up(good, metadata=(("authorization", "Bearer wrong"),)), grpc.StatusCode.PERMISSION_DENIED)
    # a batch answers per request
    batch = recommender_pb2.RecommendBatchRequest(requests=[
        recommender_pb2.RecommendRequest(history=ok, k=5, budget_ms=1000),
        recommender_pb2.RecommendRequest(history=ok, k=0),
    ])
    r = await stack.gateway.RecommendBatch(batch, timeout=30)
    assert r.results[0].error_code == 0 and len(r.results[0].response.items) == 5
    assert r.results[1].error_code == IA.value[0] and "requests[1].k" in r.results[1].error_message


@pytest.mark.asyncio(loop_scope="session")
async def test_upserted_item_becomes_recommendable(stack, serving_bundle):
    text = "Aurel velvet lipstick, long-wear matte red, 0.5 oz"
    r = await stack.itemset.Upsert(
        itemset_pb2.UpsertRequest(items=[itemset_pb2.UpsertItem(item_id="new-1", text=text, title=text)]), metadata=AUTH
    )
    version, sid = r.version, list(r.items[0].sid.codes)
    t0 = time.monotonic()
    while True:  # gateway, drafter and verifier follow the new version
        resp = await stack.recommend(serving_bundle.catalogue.ids[:2], k=3, policy="beam")
        if resp.stats.catalogue_version == version:
            break
        assert time.monotonic() - t0 < 10.0, "new version not picked up within 10 s"
        await asyncio.sleep(0.05)
    # the drafter indexes it (it follows the catalogue on its own, within the same 10 s of the upsert):
    # prefix-restricted drafting under its SID prefix finds it
    while True:
        d = await stack.drafter.Draft(drafter_pb2.DraftRequest(queries=[drafter_pb2.DraftQuery(
            history=serving_bundle.catalogue.ids[:3], n=50, prefixes=[common_pb2.Sid(codes=sid[:3])])]))
        if "new-1" in d.drafts[0].item_ids:
            break
        assert time.monotonic() - t0 < 10.0, "the drafter did not index the new item within 10 s"
        await asyncio.sleep(0.05)
    # and the gateway recommends it: with K = the whole catalogue every valid item is listed, flagged unseen
    n = len(serving_bundle.catalogue) + 1
    both = {"first_drafter": "both"}  # round 0 from the text-aware drafter too: it reaches items no one bought yet
    resp = await stack.recommend(["new-1", *serving_bundle.catalogue.ids[:2]], k=n, policy="specgr",
                                 params={"delta": n, "gamma": -100.0, **both})
    new = [it for it in resp.items if it.item_id == "new-1"]
    assert new and new[0].unseen and list(new[0].sid.codes) == sid and new[0].source == "draft", (
        f"new-1: {new[0].source if new else 'missing'}; stats: {resp.stats}")  # (once "fill" in a full run)
    # a history of near-identical new items: the drafter proposes new-1 (text similarity reaches items no one
    # has bought yet) and specgr accepts and returns it at K = 10, without any retraining
    near = [f"Aurel velvet lipstick, long-wear matte red, shade {i}" for i in range(3)]
    r = await stack.itemset.Upsert(itemset_pb2.UpsertRequest(items=[itemset_pb2.UpsertItem(item_id=f"near-{i}", text=t)
                                                                    for i, t in enumerate(near)]), metadata=AUTH)
    t0 = time.monotonic()
    while (
        await stack.recommend(serving_bundle.catalogue.ids[:2], k=3, policy="beam")
    ).stats.catalogue_version != r.version:
        assert time.monotonic() - t0 < 10.0, "new version not picked up within 10 s"
        await asyncio.sleep(0.05)
    near_ids = [f"near-{i}" for i in range(3)]
    while True:  # the drafter follows on its own poll (and embeds the texts): wait until it knows them
        try:
            d = await stack.drafter.Draft(
                drafter_pb2.DraftRequest(queries=[drafter_pb2.DraftQuery(history=near_ids, n=10)])
            )
            if d.version == r.version:
                break
        except grpc.aio.AioRpcError as e:
            assert e.code() == grpc.StatusCode.INVALID_ARGUMENT, e  # "no item of the history is in the catalogue"
        assert time.monotonic() - t0 < 10.0, "the drafter did not follow the new version within 10 s"
        await asyncio.sleep(0.05)
    while True:
        resp = await stack.recommend(near_ids, k=10, policy="specgr", params={"delta": 10, "gamma": -100.0, **both})
        got = [it for it in resp.items if it.item_id == "new-1"]
        if resp.stats.catalogue_version == r.version and got and not resp.stats.degraded:
            break
        assert time.monotonic() - t0 < 10.0, [(it.item_id, it.source) for it in resp.items]
        await asyncio.sleep(0.1)
    assert got[0].source == "draft" and got[0].unseen and resp.stats.accepted >= 1


@pytest.mark.asyncio(loop_scope="session")
async def test_degrades_when_verifier_or_drafter_stops(stack, serving_bundle):
    hist = histories(serving_bundle, 1, seed=9)[0]
    svc = stack.runners["gateway"].service
    t0 = time.monotonic()
    while svc.drafter.is_down():  # an earlier test may have seen the drafter fail; its window is breaker_open_s
        assert time.monotonic() - t0 < 5.0, "the drafter still counts as down after 5 s"
        await asyncio.sleep(0.05)
    assert svc.queue.reserve(0.030) > 0.0  # time kept back for the drafter's answer
    try:
        await stack.stop_one("verifier")
        t0 = time.perf_counter()
        r = await stack.recommend(hist, k=10, policy="specgr", budget_ms=500)
        assert r.stats.total_ms <= 500 + 50 and (time.perf_counter() - t0) < 5.0
        assert r.stats.degraded and "verifier" in r.stats.degraded_reason and len(r.items) == 10
        assert all(it.source == "draft" for it in r.items), [(it.source, it.item_id) for it in r.items]
    finally:
        await stack.start_one("verifier")
    t0 = time.monotonic()
    while (await stack.recommend(hist, k=10, policy="beam")).stats.degraded:  # the channel reconnects
        assert time.monotonic() - t0 < 10.0, "the gateway did not reach the restarted verifier within 10 s"
        await asyncio.sleep(0.1)
    try:
        await stack.stop_one("drafter")
        t0 = time.perf_counter()
        t_r = time.monotonic()
        # delta set: specgr drafts every round (left to itself it may skip drafting that does not pay)
        r = await stack.recommend(hist, k=10, policy="specgr", budget_ms=1000, params={"delta": 20})
        assert r.stats.total_ms <= 1000 + 50 and (time.perf_counter() - t0) < 5.0
        assert r.stats.degraded and "drafter" in r.stats.degraded_reason and len(r.items) == 10
        beam = await stack.recommend(hist, k=10, policy="beam", budget_ms=1000)
        assert [i.item_id for i in r.items] == [i.item_id for i in beam.items]  # beam-only
        # the drafter is known down (from its failed call in r): no time is kept back for its answer while
        # it is, the verifier gets the whole budget
        assert svc.drafter.until > t_r
        assert svc.queue.reserve(0.030) == 0.0 or time.monotonic() >= svc.drafter.until
        both_down = None
        await stack.stop_one("verifier")
        both_down = await stack.recommend(hist, k=10, policy="specgr", budget_ms=30)
        assert both_down.stats.degraded and len(both_down.items) == 10
    finally:
        if "verifier" not in stack.runners:
            await stack.start_one("verifier")
        await stack.start_one("drafter")
    t0 = time.monotonic()
    while True:  # back to normal once the channels reconnect (about a second)
        r = await stack.recommend(hist, k=10, policy="specgr")
        if not r.stats.degraded:
            break
        assert time.monotonic() - t0 < 5.0, r.stats.degraded_reason
        await asyncio.sleep(0.2)


async def recovered(stack, hist, policy: str) -> None:
    """Until the drafter no longer counts as down and ``policy`` answers undegraded (earlier tests stopped
    services); 10 s at most."""
    svc = stack.runners["gateway"].service
    t0 = time.monotonic()
    while svc.drafter.is_down() or (await stack.recommend(hist, k=10, policy=policy, budget_ms=500)).stats.degraded:
        assert time.monotonic() - t0 < 10.0, "the stack did not recover within 10 s"
        await asyncio.sleep(0.1)


@pytest.mark.asyncio(loop_scope="session")
async def test_auto_skips_the_verifiers_tiers_while_its_breaker_refuses(stack, serving_bundle):
    """With the verifier's breaker open, ``auto`` chooses the drafter's list itself: served by the drafter, not
    degraded (before, it admitted a verifier tier that then fell back, flagged degraded); closed again, a
    verifier tier serves."""
    svc = stack.runners["gateway"].service
    hist = histories(serving_bundle, 1, seed=12)[0]
    await recovered(stack, hist, "drafter")  # the drafter an earlier test restarted answers again (its channel
    await recovered(stack, hist, "beam")  # may still be reconnecting when its cooldown is over), and the verifier
    for _ in range(svc.breaker.failures):
        svc.breaker.result(False)
    try:
        assert svc.breaker.refusing()
        r = await stack.recommend(hist, k=10, policy="auto", budget_ms=500)
        assert r.stats.served_by == "drafter" and not r.stats.degraded, (r.stats.served_by, r.stats.degraded_reason)
        assert len(r.items) == 10
    finally:
        svc.breaker.result(True)
    r = await stack.recommend(hist, k=10, policy="auto", budget_ms=500)
    assert r.stats.served_by != "drafter" and not r.stats.degraded, (r.stats.served_by, r.stats.degraded_reason)


@pytest.mark.asyncio(loop_scope="session")
@pytest.mark.parametrize("policy", ["beam", "strict", "specgr", "nezha", "drafter"])
async def test_exclude_history_through_the_gateway_equals_in_process(stack, serving_bundle, policy):
    """exclude_history travels gateway -> verifier (the SIDs to cut) -> back: the same list as in process,
    K items, none from the history (all of it, beyond the model's window too)."""
    engine = serving_bundle.engine(drafter="retrieval")
    engine.max_history = 8  # the stack gateway's window: the model sees the last 8, all are excluded
    params = PARAMS.get(policy, {})
    local = make_policy(policy, engine, **params)
    ids = serving_bundle.catalogue.ids
    index = {i: n for n, i in enumerate(ids)}
    for hist in histories(serving_bundle, 3, seed=11):
        rows = np.array([index[h] for h in hist])
        want = local.run([RecRequest(rows, 10, exclude_history=True)])[0]
        got = await stack.recommend(hist, k=10, policy=policy, params=params, exclude_history=True)
        assert [it.item_id for it in got.items] == [ids[r] for r in want.items], policy
        assert not {it.item_id for it in got.items} & set(hist) and len({it.item_id for it in got.items}) == 10
        assert not got.stats.degraded
        plain = await stack.recommend(hist, k=10, policy=policy, params=params)
        assert len(plain.items) == 10  # off by default: the same request without it is the TIGER protocol's


@pytest.mark.asyncio(loop_scope="session")
async def test_ignored_history_ids_are_listed_in_the_stats(stack, serving_bundle):
    ids = serving_bundle.catalogue.ids
    r = await stack.recommend(["no-such-item", ids[3], "another-unknown", ids[5]], k=5, policy="beam")
    assert list(r.stats.ignored_history) == ["no-such-item", "another-unknown"] and len(r.items) == 5
    r = await stack.recommend([ids[3], ids[5]], k=5, policy="beam")
    assert list(r.stats.ignored_history) == []


@pytest.mark.asyncio(loop_scope="session")
async def test_degraded_failed_and_sampled_requests_are_logged_as_one_json_line(stack, serving_bundle):
    """Every degraded (or failed) request: one line, event ``request``, with its request id and reason;
    answers that went as asked only at ``log_sample_rate`` (0 by default)."""
    import json

    import structlog
    from structlog.testing import capture_logs

    svc = stack.runners["gateway"].service
    hist = histories(serving_bundle, 1, seed=11)[0]
    await recovered(stack, hist, "specgr")
    md = (("x-request-id", "req-degraded-1"),)
    req = recommender_pb2.RecommendRequest(history=hist, k=10, policy="beam", budget_ms=500, user_id="u-42")
    with capture_logs() as logs:
        ok = await stack.gateway.Recommend(req, timeout=30)  # as asked, sample rate 0: no line
        for _ in range(svc.breaker.failures):  # opens the breaker: the drafter answers
            svc.breaker.result(False)
        try:
            deg = await stack.gateway.Recommend(req, metadata=md, timeout=30)
        finally:
            svc.breaker.result(True)
        with pytest.raises(grpc.aio.AioRpcError):
            await stack.gateway.Recommend(recommender_pb2.RecommendRequest(history=["nope"], k=10), timeout=30,
                                          metadata=(("x-request-id", "req-bad-2"),))
    assert not ok.stats.degraded and deg.stats.degraded and deg.stats.request_id == "req-degraded-1"
    lines = [e for e in logs if e["event"] == "request"]
    assert [e["outcome"] for e in lines] == ["degraded", "failed"], lines
    d, f = lines
    assert d["request_id"] == "req-degraded-1" and d["reason"] == deg.stats.degraded_reason and "breaker" in d["reason"]
    assert (
        d["served_by"] == "drafter" and d["policy"] == "beam" and d["user_id"] == "u-42" and d["log_level"] == "warning"
    )
    assert f["request_id"] == "req-bad-2" and f["code"] == "INVALID_ARGUMENT" and f["reason"].startswith("history:")
    # rendered as the services render (log_json): one line of JSON
    text = structlog.processors.JSONRenderer()(None, "warning", dict(d))
    assert "\n" not in text and json.loads(text)["request_id"] == "req-degraded-1"

    svc.requests_log.sample_rate = 1.0
    try:
        with capture_logs() as logs:
            await stack.gateway.Recommend(req, metadata=(("x-request-id", "req-ok-3"),), timeout=30)
    finally:
        svc.requests_log.sample_rate = 0.0
    sampled = [e for e in logs if e["event"] == "request"]
    assert [(e["outcome"], e["request_id"], e["code"]) for e in sampled] == [("ok", "req-ok-3", "OK")]
