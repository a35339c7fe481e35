"""The gateway's pieces without a server: validation into a ValidRequest (one Deadline), admission's
Admitted, the queue model and the reserve (costs from running requests), the response."""

from __future__ import annotations

import time

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
    assert v.deadline.at == pytest.approx(100.02 - s.respond_ms / 1000) and v.budget_ms == 20  # time to respond kept
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
    costs = CostModel()
    t = [0.0]
    q = QueueModel(costs, reserve_s=0.006, drafter=Cooldown(1.0), clock=lambda: t[0])
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
    t[0] += 0.004
    q.done(Resource.VERIFIER)  # once one completed, its busy time per completion is the time per request
    assert q.wait("beam") == pytest.approx(0.004)


def test_the_queue_wait_follows_completions_when_requests_run_at_once():
    """Four requests that run together, each 20 ms of wall time, complete every 5 ms: the wait of the
    ones ahead is 5 ms each (the queue over the throughput), not 20 ms each as if they ran in turn."""
    costs = CostModel()
    t = [0.0]
    q = QueueModel(costs, 0.006, Cooldown(1.0), clock=lambda: t[0])
    costs.observe_resource(Resource.VERIFIER, 0.020)  # each request's own wall time
    for _ in range(4):
        q.take(Resource.VERIFIER)
    assert q.wait("beam") == pytest.approx(3 * 0.020)  # nothing completed yet: the cost model stands in
    for _ in range(4):  # arrivals keep the queue at four while completions come every 5 ms
        t[0] += 0.005
        q.done(Resource.VERIFIER)
        q.take(Resource.VERIFIER)
    assert q.wait("beam") == pytest.approx(3 * 0.005)
    for _ in range(4):
        t[0] += 0.005
        q.done(Resource.VERIFIER)
    t[0] += 1.0  # idle for a second: that time is not busy time
    for _ in range(3):
        q.take(Resource.VERIFIER)
    t[0] += 0.005
    q.done(Resource.VERIFIER)
    assert q.wait("beam") == pytest.approx(0.005)  # one ahead; counted as busy, the idle second would be the tail


def test_the_queue_wait_is_a_tail_scaled_by_the_square_root_of_the_queue():
    """Completions 2 ms and 8 ms apart in turn: mean 5 ms, p99 8 ms. One request ahead waits the tail; four
    wait 4 means plus sqrt(4) excesses of the tail (26 ms): 4 means (20 ms) answered late whenever the queue
    ran slow, 4 tails (32 ms) would count all four slow at once and shed at load."""
    costs = CostModel()
    t = [0.0]
    q = QueueModel(costs, 0.006, Cooldown(1.0), clock=lambda: t[0])
    for _ in range(5):
        q.take(Resource.DRAFTER)
    for gap in [0.002, 0.008] * 100:
        t[0] += gap
        q.done(Resource.DRAFTER)
        q.take(Resource.DRAFTER)
    assert q.wait("drafter") == pytest.approx(4 * 0.005 + 2.0 * (0.008 - 0.005))  # four ahead: sqrt(4) = 2
    q.done(Resource.DRAFTER, served=False)
    q.done(Resource.DRAFTER, served=False)
    q.done(Resource.DRAFTER, served=False)  # two left: one ahead of the newest
    assert q.wait("drafter") == pytest.approx(0.008)
    even = QueueModel(costs, 0.006, Cooldown(1.0), clock=lambda: t[0])
    for _ in range(5):
        even.take(Resource.DRAFTER)
    for _ in range(40):
        t[0] += 0.005
        even.done(Resource.DRAFTER)
        even.take(Resource.DRAFTER)
    assert even.wait("drafter") == pytest.approx(4 * 0.005)  # even completions: no excess to add


def test_the_queue_wait_follows_a_service_that_slows_down():
    """Completions every 5 ms for a while, then every 10 ms (a machine 2x slower): within three completions
    the wait of one request ahead is the new machine's."""
    costs = CostModel(window=200)
    t = [0.0]
    q = QueueModel(costs, 0.006, Cooldown(1.0), clock=lambda: t[0])
    q.take(Resource.VERIFIER)
    q.take(Resource.VERIFIER)
    for gap in [0.005] * 300 + [0.010] * 2:
        t[0] += gap
        q.done(Resource.VERIFIER)
        q.take(Resource.VERIFIER)
    assert q.wait("beam") < 0.006  # two slow completions in 200: not yet the tail
    t[0] += 0.010
    q.done(Resource.VERIFIER)
    q.take(Resource.VERIFIER)
    assert q.wait("beam") == pytest.approx(0.010)


def test_the_reserve_holds_the_drafters_queue():
    costs = CostModel()
    t = [0.0]
    q = QueueModel(costs, reserve_s=0.006, drafter=Cooldown(1.0), clock=lambda: t[0])
    assert q.reserve(0.030) == pytest.approx(0.006)
    q.take(Resource.DRAFTER)
    t[0] += 0.003
    q.done(Resource.DRAFTER)  # the drafter completes one every 3 ms while busy
    for _ in range(2):
        q.take(Resource.DRAFTER)  # two queued there now: a fallback would wait for both
    assert q.reserve(0.030) == pytest.approx(0.006 + 2 * 0.003)
    assert q.reserve(0.010) == pytest.approx(0.008)  # still at most 80% of what is left


def test_the_reserve_is_twice_the_drafters_mean_answer_or_the_setting():
    costs = CostModel()
    down = Cooldown(1.0)
    q = QueueModel(costs, reserve_s=0.006, drafter=down)
    assert q.reserve(0.030) == pytest.approx(0.006)  # the setting, while the drafter is cheap
    for ms in [3.0] * 147 + [9.0] * 3:  # drafter answers: 3 ms, and 2% of them 9 ms: mean 3.12 ms
        costs.observe_resource(Resource.DRAFTER, ms / 1000)
    assert q.reserve(0.030) == pytest.approx(2 * (147 * 0.003 + 3 * 0.009) / 150)  # twice the mean: 6.24 ms
    assert q.reserve(0.005) == pytest.approx(0.004)  # at most 80% of what is left
    down.failed()
    assert q.reserve(0.030) == 0.0  # the drafter is down: the verifier gets it all


def test_the_cost_settings_set_every_tail_the_gateway_keeps():
    from pydantic import ValidationError

    from gateway.service import GatewayService

    svc = GatewayService(settings(cost_quantile=0.95, cost_window=40))
    try:
        est = svc.costs.estimator()
        assert (est.q, est.window, est.min_samples) == (0.95, 40, 20)
        assert svc.queue.costs is svc.costs  # the queue's intervals and the reserve read the same model
    finally:
        svc.pool.shutdown()
    for bad in (dict(cost_quantile=1.0), dict(cost_quantile=0.4), dict(cost_window=5)):
        with pytest.raises(ValidationError):
            settings(**bad)


def test_the_response_names_the_version_the_request_and_what_it_ignored(eng, snap):
    v = validate(req(history=["item-1", "nope"], budget_ms=50), settings(), snap, t0=0.0, rid="abc")
    res = make_policy("beam", eng).run([v.rec_request()])[0]
    resp = respond(v, res, t0=0.0)
    assert [i.item_id for i in resp.items] == [f"item-{r}" for r in res.items.tolist()]
    st = resp.stats
    assert st.catalogue_version == "v7" and st.request_id == "abc" and list(st.ignored_history) == ["nope"]
    assert st.policy == "auto" and st.served_by == "beam" and not st.degraded


def test_the_early_cut_learns_how_late_the_loop_takes_up_an_answer(snap):
    """The cut's margin is read off the answers: the time from a worker finishing to the event loop taking
    the answer up (no ticking task of its own), capped at CUT_SHARE of the time left."""
    import asyncio
    import types
    from concurrent.futures import ThreadPoolExecutor

    from gateway.budget import CUT_SHARE, Budget
    from gateway.service import GatewayService

    costs = CostModel()
    queue = QueueModel(costs, 0.006, Cooldown(1.0))
    budget = Budget(settings(), queue, costs, lambda dependency: False)
    fake = types.SimpleNamespace(pool=ThreadPoolExecutor(1), queue=queue, budget=budget, fast=None)

    def run_policy(run):
        run.begin()
        run.done_at = time.monotonic()
        time.sleep(0.004)  # the loop takes it up at least 4 ms after the worker finished
        return "answer"

    fake.run_policy = run_policy
    fake._work = lambda *a: GatewayService._work(fake, *a)
    valid = validate(req(budget_ms=1000), settings(), snap, time.monotonic())
    assert budget.cut_margin(1.0) == 0.0  # nothing learned yet

    async def main():
        for _ in range(3):
            assert await GatewayService.serve(fake, Admitted(valid, "beam", {})) == "answer"

    asyncio.run(main())
    fake.pool.shutdown()
    assert budget.loop_lag.estimate.count == 3 and budget.cut_margin(1.0) >= 0.004
    assert budget.cut_margin(0.01) == pytest.approx(CUT_SHARE * 0.01)  # never more than its share of what is left
    assert Budget(settings(cut_early=False), queue, costs, lambda d: False).cut_margin(1.0) == 0.0


def test_a_request_abandoned_while_it_queues_never_runs_and_stops_counting_as_load(eng, snap):
    """Callers that leave while their requests wait for a worker (deadline, cancel) must not leave their
    requests counted busy: under overload that count would read as load for ever and shed everything."""
    import asyncio
    import threading
    import types
    from concurrent.futures import ThreadPoolExecutor

    from gateway.service import GatewayService

    queue = QueueModel(CostModel(), 0.006, Cooldown(1.0))
    gate, ran = threading.Event(), []
    fake = types.SimpleNamespace(pool=ThreadPoolExecutor(1), queue=queue, fast=None,
                                 budget=types.SimpleNamespace(cut_margin=lambda left: 0.0,
                                                                observe_lateness=lambda s: None))
    fake.run_policy = lambda run: ran.append(run) if run.begin() else None  # run_policy's first step
    fake._work = lambda *a: GatewayService._work(fake, *a)
    valid = validate(req(budget_ms=1000), settings(), snap, time.monotonic())  # no deadline passes here

    async def main():
        fake.pool.submit(gate.wait)  # the only worker is busy
        queued = Admitted(valid, "beam", {})
        queue.take(queued.resource)
        task = asyncio.ensure_future(GatewayService.serve(fake, queued))
        await asyncio.sleep(0.05)
        assert queue.pending[Resource.VERIFIER] == 1
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert queue.pending[Resource.VERIFIER] == 0 and queued.state == "abandoned"
        gate.set()
        running = Admitted(valid, "beam", {})
        queue.take(running.resource)
        await GatewayService.serve(fake, running)  # one that a worker took runs, and keeps its count
        assert ran == [running] and running.state == "running" and queue.pending[Resource.VERIFIER] == 1

    asyncio.run(main())
    fake.pool.shutdown()


def test_a_request_cut_at_its_deadline_is_cancelled_so_nothing_runs_on_for_it(eng, snap):
    """The deadline comes while the policy still waits on a call: the gateway answers (the fill, exit budget) and
    cancels the request, and the worker sees it at once instead of running on until its call's own timeout."""
    import asyncio
    import threading
    import types
    from concurrent.futures import ThreadPoolExecutor

    from gateway.service import GatewayService

    queue = QueueModel(CostModel(), 0.006, Cooldown(1.0))
    stopped = threading.Event()

    def run_policy(run):
        run.begin()
        watch = run.request.deadline.watch
        watch.on_cancel(stopped.set)  # as a call in flight is (gateway.calls.call)
        stopped.wait(5.0)
        queue.done(run.resource)

    fake = types.SimpleNamespace(pool=ThreadPoolExecutor(1), queue=queue, log=None, run_policy=run_policy, fast=None,
                                 budget=types.SimpleNamespace(cut_margin=lambda left: 0.0, observe_cut=lambda s: None),
                                 engine=lambda snap: eng)
    fake._cut = lambda run: GatewayService._cut(fake, run)
    fake._work = lambda *a: GatewayService._work(fake, *a)
    valid = validate(req(budget_ms=60), settings(respond_ms=0.0), snap, time.monotonic())

    async def main():
        run = Admitted(valid, "beam", {})
        queue.take(run.resource)
        t0 = time.monotonic()
        res = await GatewayService.serve(fake, run)
        assert res.served_by == "fill" and res.stats.exit_reason == "budget" and time.monotonic() - t0 < 1.0
        assert valid.deadline.cancelled and stopped.wait(1.0)

    asyncio.run(main())
    fake.pool.shutdown(wait=True)
    assert queue.pending[Resource.VERIFIER] == 0
