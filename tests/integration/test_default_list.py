"""The list ``auto`` serves by default travels from the bundle to the gateway (real gRPC servers on loopback, a real
Redis): ``tune-fusion``'s decision (``fusion.default`` in bundle.json) is in the drafter service's ``Describe``
(``Fusion.default_list``), the gateway reads it with the fusion, and its ``auto`` serves the decided list first, as
in process: here the drafter's own list although the fused list scored higher on validation (it did not beat the
drafter's by more than chance)."""

from __future__ import annotations

import pytest
import pytest_asyncio

from specrec.policies import RecRequest, make_policy
from specrec_rpc.v1 import drafter_pb2

from .stack import histories, running


@pytest.fixture(scope="module")
def undecided_bundle_dir(fused_bundle_dir, tmp_path_factory):
    """The fused bundle with Beauty-like validation figures (the fused list a little above the drafter's own)
    and tune-fusion's decision: the drafter's own list, the difference not above chance."""
    from specrec.bundle import Bundle

    b = Bundle.load(fused_bundle_dir)
    b.meta["fusion"] = {**b.meta["fusion"],
                        "valid": {"fused": {"recall@10": 0.104}, "drafter": {"recall@10": 0.101},
                                  "beam": {"recall@10": 0.082}},
                        "default": {"list": "drafter", "why": "interval [-0.0010, +0.0071]: not above 0"}}
    return b.save(tmp_path_factory.mktemp("undecided") / "bundle")


@pytest_asyncio.fixture(scope="module", loop_scope="session")
async def stack(redis_url, undecided_bundle_dir):
    async with running(redis_url, "default-list", undecided_bundle_dir, verifier_overrides={"warmup_k": [5]}) as st:
        yield st


@pytest.mark.asyncio(loop_scope="session")
async def test_the_drafter_tells_the_default_list_and_the_gateways_auto_serves_it_as_in_process(stack):
    from specrec.bundle import Bundle

    bundle = Bundle.load(stack.bundle)
    info = await stack.drafter.Describe(drafter_pb2.DescribeDrafterRequest())
    assert info.HasField("fusion") and info.fusion.default_list == "drafter"
    assert dict(info.fusion.valid_recall)["fused"] > dict(info.fusion.valid_recall)["drafter"]
    gateway = stack.runners["gateway"].service
    assert gateway.drafter_info.fusion is not None and gateway.drafter_info.fusion.default == "drafter"
    eng = bundle.engine(drafter="sasrec")
    assert eng.drafter.fusion.default == "drafter"
    for h in histories(bundle, 4, seed=3):
        a = await stack.recommend(h, k=5, policy="auto", budget_ms=1000)
        assert a.stats.served_by == "drafter" and not a.stats.degraded, a.stats
        idx = [bundle.catalogue.lookup(i) for i in h]
        import numpy as np

        local = make_policy("auto", eng).run([RecRequest(np.array(idx), 5)])[0]
        assert local.served_by == "drafter"
        assert [it.item_id for it in a.items] == [bundle.catalogue.ids[i] for i in local.items.tolist()]
        f = await stack.recommend(h, k=5, policy="fused", budget_ms=1000)  # still there when asked for
        assert f.stats.served_by == "fused"
