"""A bundle whose SASRec and GR model rank together (a fusion chosen by ``specrec tune-fusion``), served by the
whole stack over real gRPC and a real Redis: the drafter service drafts with SASRec by default and says how its
scores are fused (``Describe``, read once), the gateway's ``fused`` ranks by both models exactly as in-process,
``auto`` tries it first, and the ``drafter`` policy answers with SASRec's own list."""

from __future__ import annotations

import numpy as np
import pytest
import pytest_asyncio

from specrec.policies import RecRequest, make_policy
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
async def test_a_fused_request_cut_at_its_deadline_answers_with_sasrecs_list_not_fill(stack, monkeypatch):
    """The GR's pass hangs past the deadline (the gateway's worker thread stuck in its Search call): the gateway's cut
    at the deadline answers with the list fused holds, the item drafter's own (flagged, ``exit_reason`` budget), as
    the ``drafter`` policy would, not with the catalogue's fill."""
    import time

    from gateway.remote import RemoteVerifier
    from specrec.bundle import Bundle

    bundle = Bundle.load(stack.bundle)
    h = histories(bundle, 1, seed=5)[0]
    own = await stack.recommend(h, k=5, policy="drafter", budget_ms=1000)
    real = RemoteVerifier.search

    def hangs(self, *a, **kw):
        time.sleep(0.3)  # past the 80 ms budget, whatever its own call's deadline
        return real(self, *a, **kw)

    monkeypatch.setattr(RemoteVerifier, "search", hangs)
    r = await stack.recommend(h, k=5, policy="fused", budget_ms=80)
    monkeypatch.setattr(RemoteVerifier, "search", real)
    assert r.stats.exit_reason == "budget" and r.stats.degraded, r.stats
    assert r.stats.served_by == "drafter", r.stats
    assert [it.item_id for it in r.items] == [it.item_id for it in own.items]
    assert not any(it.source == "fill" for it in r.items)
    await asyncio_sleep(0.4)  # the hung thread finishes before the next test


async def asyncio_sleep(s: float) -> None:
    import asyncio

    await asyncio.sleep(s)
