"""Serving at a budget over real gRPC and a real Redis: ``auto`` picks what fits,
overload is shed or degraded within the budget, a lost verifier session never
becomes INTERNAL, and replicas share the load and survive losing one."""

from __future__ import annotations

import asyncio
import gc
import time

import grpc
import numpy as np
import pytest
import pytest_asyncio

from verifier_svc.sessions import SessionNotFound

from .stack import Stack, histories

GRACE_MS = 10.0  # server-side total over the budget allowed here: the gateway, the services and the test share 2 cores


async def _stack(redis_url, bundle_dir, prefix, **gateway):
    ns = f"{prefix}-{time.time_ns()}"
    # slow_verifier stands for a slow device, which computes off the event loop (compute_on_loop off): every
    # service of this stack shares the test's one event loop, where a batch slowed on the loop would stall the
    # gateway and the drafter too, which separate processes never do
    st = Stack(redis_url, ns, bundle_dir, gateway_overrides=gateway, verifier_overrides={"compute_on_loop": False})
    return await st.start(), ns


@pytest_asyncio.fixture(scope="module", loop_scope="session")
async def stack(redis_url, serving_bundle_dir):
    from specrec_stack.localstack import delete_keys, namespace_pattern

    st, ns = await _stack(redis_url, serving_bundle_dir, "srv")
    yield st
    await st.stop()
    delete_keys(redis_url, namespace_pattern(ns))


def slow_verifier(stack, seconds: float):
    """Inject a delay into every batch the verifier computes (returns the undo)."""
    b = stack.runners["verifier"].service.batcher
    real = b.run_batch

    def slow(jobs):
        time.sleep(seconds)
        return real(jobs)

    b.run_batch = slow
    return lambda: setattr(b, "run_batch", real)


@pytest.mark.asyncio(loop_scope="session")
async def test_auto_answers_with_a_cheaper_model_when_the_verifier_is_slow(stack, serving_bundle):
    gc.collect()  # the garbage of the tests before (their models and stacks) is not this test's stall
    hists = histories(serving_bundle, 50, seed=21)
    for h in hists[:10]:  # learn the costs with a fast verifier
        r = await stack.recommend(h, k=10, policy="auto", budget_ms=300)
        assert r.stats.served_by in ("beam", "strict")
    undo = slow_verifier(stack, 0.060)  # every verifier batch now takes > 60 ms
    try:
        # Each verifier tier (beam/strict, nezha) has to miss before its tail estimate passes the budget
        # (once while it holds fewer than 100 requests, it then reads as their largest; a few times after:
        # under 1 in 100 slow ones leave a p99 where it was), and how many misses end in
        # fill rather than the drafter's answer depends on how busy the 2 shared cores are: so the claims
        # are about the last 20 of 40 requests, after the estimates caught up.
        served, totals, fills, started = [], [], [], []
        for h in hists[10:]:
            started.append(time.monotonic())
            r = await stack.recommend(h, k=10, policy="auto", budget_ms=40)
            # what auto chose: the policy that served, or for a request cut at its deadline (the fill,
            # exit_reason budget) the one its reason names as still running
            cut = r.stats.exit_reason == "budget" and r.stats.served_by == "fill"
            served.append("drafter" if cut and "drafter still running" in r.stats.degraded_reason
                          else r.stats.served_by)
            totals.append(r.stats.total_ms)
            assert len(r.items) == 10
            # the fill of a request cut at its deadline (a probe whose drafter fallback came late) is counted apart
            fills.append(all(it.source == "fill" for it in r.items) and r.stats.exit_reason != "budget")
        # the estimates catch up: auto moves to the drafter's list, a model answer, within the budget; a
        # probe of a verifier tier (once in probe_s = 1 s each) may still end in fill
        assert all(s in ("drafter", "fill") for s in served[-5:]) and served[-5:].count("drafter") >= 4, served
        # fill (flagged) only before the estimates caught up, and then at most for a probe of each of the two
        # verifier tiers per second of the last 20 requests
        probes = 2 * (1 + int(time.monotonic() - started[-20]))
        assert sum(fills[-20:]) <= probes, (served, fills, probes)
        # a verifier call that does not answer leaves the drafter its reserve: answers come within the budget
        # (one stall of the interpreter the four services share may push one past it, in a full run once by 350 ms;
        # waiting for the 60 ms verifier would push every verifier try past 80 ms)
        assert np.percentile(totals, 90) <= 40 + GRACE_MS and sorted(totals)[-2] <= 80, totals
    finally:
        undo()


@pytest.mark.asyncio(loop_scope="session")
async def test_a_callers_deadline_shorter_than_the_budget_is_planned_for(stack, serving_bundle):
    """The caller's gRPC deadline (300 ms) comes before the budget (1 s) and the verifier takes 400 ms a
    batch: the gateway plans for the deadline and answers from the drafter (flagged), not DEADLINE_EXCEEDED."""
    h = histories(serving_bundle, 1, seed=24)[0]
    await stack.recommend(h, k=10, policy="beam")  # warm
    undo = slow_verifier(stack, 0.400)
    gw = stack.runners["gateway"].service
    s = gw.s
    gw.s = s.model_copy(update={"reply_margin_ms": 50.0})  # room for 2 shared cores (the default is 5 ms)
    try:
        r = await stack.recommend(h, k=10, policy="beam", budget_ms=1000, timeout=0.3)  # late: DEADLINE_EXCEEDED
        assert r.stats.total_ms < 300 - 50 + GRACE_MS, r.stats  # planned for the caller's deadline less the margin
        assert r.stats.degraded and r.stats.served_by in ("drafter", "fill") and len(r.items) == 10, r.stats
    finally:
        gw.s = s
        undo()
    await asyncio.sleep(0.5)  # let the slowed batch finish before the next test


@pytest.mark.asyncio(loop_scope="session")
async def test_overload_is_shed_or_answered_never_failed(stack, serving_bundle):
    """A verifier slowed to 10 ms a batch and 120 requests at once: each one is answered (K items, any fill
    flagged) or refused with RESOURCE_EXHAUSTED, nothing else, and none hangs. How late answers and refusals
    come is measured by ``bench/overload.py``, with the machine to itself, not here."""
    undo = slow_verifier(stack, 0.010)
    try:
        hists = histories(serving_bundle, 120, seed=22)

        async def one(h):
            try:
                return "ok", await stack.recommend(h, k=10, policy="auto", budget_ms=30.0, timeout=10)
            except grpc.aio.AioRpcError as e:
                return e.code().name, None

        res = await asyncio.wait_for(asyncio.gather(*(one(h) for h in hists)), timeout=60)
        codes = {c for c, _ in res}
        assert codes <= {"ok", "RESOURCE_EXHAUSTED"}, codes
        answered = [r for c, r in res if c == "ok"]
        assert answered
        for r in answered:
            assert len(r.items) == 10
            if any(it.source == "fill" for it in r.items):  # fill only ever flagged
                assert r.stats.degraded and r.stats.degraded_reason
        # what the gateway admits it answers by the budget (its own clock, from the request's arrival): a request
        # still running at its deadline is cut then; only stalls of the one interpreter the four services share
        # here (120 requests at once) may push an answer past it, so the bound is on the median and the p90
        totals = [r.stats.total_ms for r in answered]
        assert np.median(totals) <= 30.0 + GRACE_MS and np.percentile(totals, 90) <= 30.0 + 3 * GRACE_MS, \
            sorted(totals)[-10:]
    finally:
        undo()


@pytest.mark.asyncio(loop_scope="session")
async def test_a_lost_session_is_reencoded_not_internal(stack, serving_bundle):
    """The verifier forgets a session between two calls of a request (as after a restart):
    the gateway sends the history again and the answer is the undisturbed one. (``strict`` level by level, on
    the NEZHA head: Search "head", Score and Search "beam" on one session; on the distilled drafter it is one call.)"""
    h = histories(serving_bundle, 1, seed=23)[0]
    params = {"n_drafts": 10, "drafter": "head"}
    want = await stack.recommend(h, k=10, policy="strict", params=params)
    store = stack.runners["verifier"].service.sessions
    real_get, lost = store.get, []

    def forgetful(key):
        if not lost:
            lost.append(key)
            store.pop(key)
            raise SessionNotFound(f"session: unknown or expired session {key!r}")
        return real_get(key)

    store.get = forgetful
    try:
        got = await stack.recommend(h, k=10, policy="strict", params=params)
    finally:
        store.get = real_get
    assert lost, "the test did not lose a session"
    assert [i.item_id for i in got.items] == [i.item_id for i in want.items]
    assert not got.stats.degraded


@pytest.mark.asyncio(loop_scope="session")
async def test_two_replicas_share_the_load_and_losing_one_costs_no_error(redis_url, serving_bundle_dir, serving_bundle):
    from specrec_stack.localstack import delete_keys, free_port, namespace_pattern

    ns = f"rep-{time.time_ns()}"
    st = Stack(redis_url, ns, serving_bundle_dir)
    try:
        await st.start_one("itemset")
        for name in ("verifier", "drafter"):
            st.ports[name + "2"] = free_port()
            await st.start_one(name)
            await st.start_one(name, "2")
        st.gateway_overrides = {"verifier_addr": f"{st.addr('verifier')},{st.addr('verifier2')}",
                                "drafter_addr": f"{st.addr('drafter')},{st.addr('drafter2')}"}
        await st.start_one("gateway")
        st.channels = {}
        hists = histories(serving_bundle, 80, seed=24)

        async def burst(hs, policy):
            return await asyncio.gather(*(st.recommend(h, k=10, policy=policy, budget_ms=1000) for h in hs),
                                        return_exceptions=True)

        res = await burst(hists, "specgr")
        assert not [r for r in res if isinstance(r, Exception)]
        gw = st.runners["gateway"].service
        for reps in (gw.verifiers, gw.drafters):
            shares = np.asarray(list(reps.shares().values()), dtype=float)
            # power of two choices on outstanding calls sends more to the replica that answers faster; on two
            # shared cores one replica can run at half the other's pace for a whole burst (CI saw 27 against 65
            # calls), so the bar is that both take a real share, not that they split evenly
            assert len(shares) == 2 and (shares / shares.sum()).min() >= 0.2, reps.shares()
        # one verifier and one drafter replica go away in the middle of a burst: no request fails
        task = asyncio.ensure_future(burst(hists, "specgr"))
        await asyncio.sleep(0.05)
        await st.stop_one("verifier2")
        await st.stop_one("drafter2")
        res = await task
        errors = [r for r in res if isinstance(r, Exception)]
        assert not errors, errors[:3]
        assert all(len(r.items) == 10 for r in res)
    finally:
        await st.stop()
        delete_keys(redis_url, namespace_pattern(ns))
