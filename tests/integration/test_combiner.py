"""A bundle whose fused list is ranked by a learned combiner (``specrec tune-fusion`` kept one), served by the whole
stack over real gRPC and a real Redis: the drafter service sends the combiner with its fusion (``Describe``), and
the gateway's ``fused`` ranks by it exactly as in-process, not by the weight beside it."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest
import pytest_asyncio

from specrec.policies import RecRequest, make_policy
from specrec_rpc.v1 import drafter_pb2

from .stack import histories, running


@pytest_asyncio.fixture(scope="module", loop_scope="session")
async def stack(redis_url, combiner_bundle_dir):
    async with running(redis_url, "combiner", combiner_bundle_dir, verifier_overrides={"warmup_k": [5, 10]}) as st:
        yield st


@pytest.mark.asyncio(loop_scope="session")
async def test_the_drafter_sends_the_combiner_with_its_fusion(stack):
    from specrec.bundle import Bundle

    fusion = Bundle.load(stack.bundle).fusion
    assert fusion is not None and fusion.combiner is not None
    info = await stack.drafter.Describe(drafter_pb2.DescribeDrafterRequest())
    c = info.fusion.combiner
    assert info.fusion.HasField("combiner") and (c.inputs, c.hidden, c.features) == (
        fusion.combiner.inputs, fusion.combiner.hidden, fusion.combiner.features)
    assert list(c.weights) == fusion.combiner.flat()  # doubles: the same list in-process and at the gateway
    assert info.fusion.weight == pytest.approx(0.4)  # the mix stays beside it for a caller that knows no combiner


@pytest.mark.asyncio(loop_scope="session")
async def test_fused_ranks_by_the_combiner_as_in_process(stack):
    from specrec.bundle import Bundle

    bundle = Bundle.load(stack.bundle)
    eng = bundle.engine(drafter="sasrec")
    mix_eng = bundle.engine(drafter="sasrec")
    mix_eng.drafter.fusion = replace(mix_eng.drafter.fusion, combiner=None)
    differs = 0
    for h in histories(bundle, 6, seed=3):
        r = await stack.recommend(h, k=5, policy="fused", budget_ms=1000)
        assert r.stats.served_by == "fused" and not r.stats.degraded
        idx = np.array([bundle.catalogue.lookup(i) for i in h])
        local = make_policy("fused", eng).run([RecRequest(idx, 5)])[0]
        served = [it.item_id for it in r.items]
        assert [bundle.catalogue.ids[i] for i in local.items.tolist()] == served
        mix = make_policy("fused", mix_eng).run([RecRequest(idx, 5)])[0]
        differs += [bundle.catalogue.ids[i] for i in mix.items.tolist()] != served
    assert differs > 0  # the combiner, not the weight, ranked them
