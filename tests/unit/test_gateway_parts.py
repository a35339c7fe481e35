"""The gateway's pieces without a server: validation into a ValidRequest (one Deadline), admission's
Admitted, the queue model and the reserve (costs from running requests), the response."""

from __future__ import annotations

import numpy as np
import pytest

from gateway.queueing import QueueModel
from gateway.request import Admitted, validate
from gateway.servicer import respond
from gateway.settings import GatewaySettings
from specrec.costs import CostModel, Resource
from specrec.policies import RecRequest, make_policy
from specrec.policies.breaker import Cooldown
from specrec_rpc.catalogue import Snapshot
from specrec_rpc.errors import InvalidArgument
from specrec_rpc.v1 import recommender_pb2

from .policy_fixtures import make_engine


@pytest.fixture(scope="module")
def eng():
    return make_engine(40)


@pytest.fixture(scope="module")
def snap(eng):
    n = eng.itemset.n_rows
    ids = [f"item-{r}" for r in range(n)]
    return Snapshot("v7", eng.itemset, ids, [f"title {r}" for r in range(n)], [""] * n,
                    {i: r for r, i in enumerate(ids)})


def settings(**kw):
    return GatewaySettings(**{"metrics_port": 0, **kw})


def req(**kw):
    return recommender_pb2.RecommendRequest(**{"history": ["item-1", "item-2"], "k": 5, **kw})


def test_a_valid_request_is_typed_and_carries_one_deadline(snap):
    s = settings(policy_defaults={"specgr": {"gamma": -2.0}})
    v = validate(req(history=["item-3", "nope", "item-4"], policy="specgr", params={"delta": "7"}, budget_ms=20),
                 s, snap, t0=100.0, rid="r1")
    assert v.policy == "specgr" and v.params == {"gamma": -2.0, "delta": 7}
    assert v.rows.tolist() == [3, 4] and v.ignored == ["nope"] and v.k == 5 and v.rid == "r1"
    assert v.deadline.at == pytest.approx(100.02) and v.budget_ms == 20
    rec = v.rec_request()
    assert rec.deadline is v.deadline and rec.k == 5 and rec.history is v.rows  # the same object, not a copy
    # no budget given: the default; a caller deadline before the budget wins
    v = validate(req(), s, snap, t0=100.0, caller_deadline=100.01)
    assert v.policy == "auto" and v.budget_ms == 30.0 and v.deadline.at == pytest.approx(100.01)
    assert validate(req(k=1000), s, snap, t0=0.0).k == snap.itemset.n_rows  # at most the catalogue


@pytest.mark.parametrize("kw,field", [
    (dict(history=[]), "history"),
    (dict(history=["nope"]), "history"),
    (dict(k=0), "k"),
    (dict(budget_ms=-1), "budget_ms"),
    (dict(policy="nope"), "policy"),
    (dict(policy="specgr", params={"gamma": "5"}), "params.gamma"),
    (dict(policy="specgr", params={"nope": "1"}), "params.nope"),
])
def test_a_bad_field_is_named_with_its_place_in_a_batch(snap, kw, field):
    with pytest.raises(InvalidArgument) as e:
        validate(req(**kw), settings(), snap, t0=0.0, prefix="requests[3].")
    assert e.value.field == f"requests[3].{field}"


def test_admitted_keeps_the_params_only_for_the_policy_asked(snap):
    v = validate(req(policy="beam", params={"width": "7"}), settings(), snap, t0=0.0)
    assert Admitted(v, "beam", v.params).resource is Resource.VERIFIER
    assert Admitted(v, "drafter", {}).resource is Resource.DRAFTER


def test_the_queue_wait_is_the_requests_ahead_at_the_cost_learned_by_running(eng):
    costs = CostModel(resource_alpha=1.0)  # the last request's time is the cost: the arithmetic stays plain
    q = QueueModel(costs, reserve_s=0.006, drafter=Cooldown(1.0))
    t = [0.0]
    eng.clock = lambda: t[0]
    real = eng.verifier.encode

    def slow(*a, **kw):
        t[0] += 0.005
        return real(*a, **kw)

    eng.verifier.encode = slow
    try:
        t0 = eng.clock()
        res = make_policy("beam", eng).run([RecRequest(np.array([1, 2, 3]), 5)])[0]
        costs.observe_resource(Resource.VERIFIER, eng.clock() - t0)  # what the gateway's run_policy does
    finally:
        eng.verifier.encode = real
    assert res.served_by == "beam" and costs.resource(Resource.VERIFIER) == pytest.approx(0.005)
    for _ in range(3):
        q.take(Resource.VERIFIER)
    q.take(Resource.DRAFTER)
    assert q.wait("beam") == pytest.approx(2 * 0.005)  # two admitted ahead of the newest one
    assert q.wait("auto") == q.wait("beam") and q.wait("drafter") == 0.0
    q.done(Resource.VERIFIER)
    assert q.wait("beam") == pytest.approx(0.005)


def test_the_reserve_for_the_drafters_answer():
    costs = CostModel(resource_alpha=1.0)
    down = Cooldown(1.0)
    q = QueueModel(costs, reserve_s=0.006, drafter=down)
    assert q.reserve(0.030) == pytest.approx(0.006)  # the setting, while the drafter is cheap
    costs.observe_resource(Resource.DRAFTER, 0.005)  # a drafter answer took 5 ms
    assert q.reserve(0.030) == pytest.approx(0.010)  # twice its cost
    assert q.reserve(0.010) == pytest.approx(0.008)  # at most 80% of what is left
    down.failed()
    assert q.reserve(0.030) == 0.0  # the drafter is down: the verifier gets it all


def test_the_response_names_the_version_the_request_and_what_it_ignored(eng, snap):
    v = validate(req(history=["item-1", "nope"], budget_ms=50), settings(), snap, t0=0.0, rid="abc")
    res = make_policy("beam", eng).run([v.rec_request()])[0]
    resp = respond(v, res, t0=0.0)
    assert [i.item_id for i in resp.items] == [f"item-{r}" for r in res.items.tolist()]
    st = resp.stats
    assert st.catalogue_version == "v7" and st.request_id == "abc" and list(st.ignored_history) == ["nope"]
    assert st.policy == "auto" and st.served_by == "beam" and not st.degraded
