"""A bundle whose SASRec and GR model rank together (a fusion chosen by ``specrec tune-fusion``), served by the
whole stack over real gRPC and a real Redis: the drafter service drafts with SASRec by default and says how its
scores are fused (``Describe``, read once), the gateway's ``fused`` ranks by both models exactly as in-process,
``auto`` tries it first, and the ``drafter`` policy answers with SASRec's own list."""

from __future__ import annotations

import grpc
import numpy as np
import pytest
import pytest_asyncio

from specrec.policies import RecRequest, make_policy
from specrec_rpc.tensors import from_msg, to_msg
from specrec_rpc.v1 import drafter_pb2

from .stack import histories, running


@pytest_asyncio.fixture(scope="module", loop_scope="session")
async def stack(redis_url, fused_bundle_dir):
    async with running(redis_url, "fused", fused_bundle_dir, verifier_overrides={"warmup_k": [5, 10]}) as st:
        yield st


@pytest.mark.asyncio(loop_scope="session")
async def test_the_drafter_drafts_with_sasrec_and_says_how_to_fuse(stack):
    from specrec.bundle import Bundle

    bundle = Bundle.load(stack.bundle)
    h = histories(bundle, 1, seed=1)[0]
    d = await stack.drafter.Draft(drafter_pb2.DraftRequest(queries=[drafter_pb2.DraftQuery(history=h, n=10)]))
    assert d.mode == "sasrec" and not d.drafts[0].sids  # no SIDs unless asked: the gateway reads its catalogue
    local = bundle.drafter("sasrec").draft([_request(bundle, h, 10)])[0]
    assert [bundle.catalogue.ids[r] for r in local.items] == list(d.drafts[0].item_ids)
    asked = await stack.drafter.Draft(drafter_pb2.DraftRequest(queries=[drafter_pb2.DraftQuery(history=h, n=10)],
                                                               with_sids=True))
    assert [list(s.codes) for s in asked.drafts[0].sids] == bundle.sids[local.items].tolist()
    # the gateway's way: the history as catalogue rows, the draft answered as rows and scores
    rows = np.array([bundle.catalogue.lookup(i) for i in h], np.int32)
    by_rows = await stack.drafter.Draft(drafter_pb2.DraftRequest(queries=[drafter_pb2.DraftQuery(
        history_rows=to_msg(rows), n=10)]))
    assert not by_rows.drafts[0].item_ids
    assert from_msg(by_rows.drafts[0].rows).tolist() == local.items.tolist()
    assert np.allclose(from_msg(by_rows.drafts[0].row_scores), list(d.drafts[0].scores), atol=1e-6)
    for bad, field in ((np.array([3, -1], np.int32), "history_rows"), (rows.astype(np.int64), "dtype")):
        with pytest.raises(grpc.aio.AioRpcError) as ei:
            await stack.drafter.Draft(drafter_pb2.DraftRequest(queries=[drafter_pb2.DraftQuery(
                history_rows=to_msg(bad), n=10)]))
        assert ei.value.code() == grpc.StatusCode.INVALID_ARGUMENT and field in ei.value.details()
    info = await stack.drafter.Describe(drafter_pb2.DescribeDrafterRequest())
    assert info.mode == "sasrec" and info.HasField("fusion") and "sasrec" in info.modes
    assert info.fusion.weight == pytest.approx(0.4) and info.fusion.norm == "z" and info.fusion.drafts == 20
    assert info.unseen_share == pytest.approx(0.2)


def _request(bundle, h, n):
    from specrec.drafters.base import DraftRequest

    return DraftRequest(np.array([bundle.catalogue.lookup(i) for i in h]), n)


@pytest.mark.asyncio(loop_scope="session")
async def test_fused_ranks_by_both_models_as_in_process_and_auto_tries_it_first(stack):
    from specrec.bundle import Bundle

    bundle = Bundle.load(stack.bundle)
    eng = bundle.engine(drafter="sasrec")
    for h in histories(bundle, 6, seed=3):
        r = await stack.recommend(h, k=5, policy="fused", budget_ms=1000)
        assert r.stats.served_by == "fused" and r.stats.exit_reason == "fused" and not r.stats.degraded
        idx = np.array([bundle.catalogue.lookup(i) for i in h])
        local = make_policy("fused", eng).run([RecRequest(idx, 5)])[0]
        assert local.stats.exit_reason == "fused"
        assert [bundle.catalogue.ids[i] for i in local.items.tolist()] == [it.item_id for it in r.items]
        a = await stack.recommend(h, k=5, policy="auto", budget_ms=1000)
        assert a.stats.served_by == "fused" and [it.item_id for it in a.items] == [it.item_id for it in r.items]
        d = await stack.recommend(h, k=5, policy="drafter", budget_ms=1000)  # the fallback: SASRec's own list
        own = eng.drafter.draft([_request(bundle, h, 5)])[0]
        assert [it.item_id for it in d.items] == [bundle.catalogue.ids[i] for i in own.items.tolist()]


@pytest.mark.asyncio(loop_scope="session")
async def test_the_drafter_drafts_on_its_loop_unless_an_append_holds_the_drafters(stack, monkeypatch):
    """A draft runs on the drafter's event loop thread when the drafters are free (no hand-off), and on the draft
    thread, after it, while an index append (or a version followed) holds them: the same draft either way."""
    import asyncio
    import threading

    from specrec.bundle import Bundle

    svc = stack.runners["drafter"].service
    drafter = svc.drafters["sasrec"]
    real, threads = drafter.draft, []
    monkeypatch.setattr(drafter, "draft", lambda reqs: threads.append(threading.current_thread().name) or real(reqs))
    h = histories(Bundle.load(stack.bundle), 1, seed=2)[0]
    ask = drafter_pb2.DraftRequest(queries=[drafter_pb2.DraftQuery(history=h, n=10)])
    free = await stack.drafter.Draft(ask)
    svc.lock.acquire()  # an append under way (on the draft thread, in the service)
    asyncio.get_running_loop().call_later(0.05, svc.lock.release)
    held = await stack.drafter.Draft(ask)
    assert threads[0] == threading.current_thread().name and threads[1].startswith("draft")
    assert list(free.drafts[0].item_ids) == list(held.drafts[0].item_ids)


@pytest.mark.asyncio(loop_scope="session")
async def test_fused_and_drafter_run_on_the_event_loop_as_the_worker_path_would(stack, monkeypatch):
    """The lists auto serves most run on the gateway's event loop (no worker thread takes them: the worker path's
    run_policy is never called), with the early encode the same, and with the fast path off (every policy on a
    worker thread) the same lists again."""
    from gateway.service import GatewayService
    from specrec.bundle import Bundle

    bundle = Bundle.load(stack.bundle)
    gateway = stack.runners["gateway"].service
    ran = []
    real = GatewayService.run_policy
    monkeypatch.setattr(GatewayService, "run_policy", lambda self, run: ran.append(run.policy) or real(self, run))
    hs = histories(bundle, 4, seed=9)
    lists = {}
    for policy in ("fused", "drafter"):
        lists[policy] = [[it.item_id for it in (await stack.recommend(h, k=5, policy=policy, budget_ms=1000)).items]
                         for h in hs]
    early = [await stack.recommend(h, k=5, policy="fused", budget_ms=1000, params={"encode_early": "true"})
             for h in hs]
    assert all("server.Encode" in r.stats.stage_ms and r.stats.served_by == "fused" for r in early)  # encoded apart
    assert ran == [] and [[it.item_id for it in r.items] for r in early] == lists["fused"]
    fast, gateway.fast = gateway.fast, None
    try:
        for policy in ("fused", "drafter"):
            worker = [[it.item_id for it in (await stack.recommend(h, k=5, policy=policy, budget_ms=1000)).items]
                      for h in hs]
            assert worker == lists[policy], policy
    finally:
        gateway.fast = fast
    assert ran == ["fused"] * len(hs) + ["drafter"] * len(hs)


@pytest.mark.asyncio(loop_scope="session")
async def test_a_fused_request_cut_at_its_deadline_answers_with_sasrecs_list_not_fill(stack):
    """The GR's pass runs past the deadline (the verifier holds its calls back 300 ms, on purpose): the gateway's
    cut at the deadline answers with the list fused holds, the item drafter's own (flagged, ``exit_reason``
    budget), as the ``drafter`` policy would, not with the catalogue's fill."""
    from specrec.bundle import Bundle

    bundle = Bundle.load(stack.bundle)
    h = histories(bundle, 1, seed=5)[0]
    own = await stack.recommend(h, k=5, policy="drafter", budget_ms=1000)
    verifier = stack.runners["verifier"].service
    verifier.s.fault_delay_ms = 300.0  # past the 80 ms budget, whatever its own call's deadline
    try:
        r = await stack.recommend(h, k=5, policy="fused", budget_ms=80)
    finally:
        verifier.s.fault_delay_ms = 0.0
    assert r.stats.exit_reason == "budget" and r.stats.degraded, r.stats
    assert r.stats.served_by == "drafter", r.stats
    assert [it.item_id for it in r.items] == [it.item_id for it in own.items]
    assert not any(it.source == "fill" for it in r.items)
    await asyncio_sleep(0.4)  # the held-back call ends before the next test


async def asyncio_sleep(s: float) -> None:
    import asyncio

    await asyncio.sleep(s)
