"""A verifier whose device fails leaves rotation, and the gateway answers from the other replica.

Two verifier replicas, a drafter and the gateway on loopback over a real Redis; the second verifier's device fails
on purpose (``fault_device_error_after``: its batches raise the CUDA error a failed GPU raises;
``fault_hang_after``: a batch never ends, and its ``hang_s`` watchdog finds it) in the middle of a burst of
requests. Then:

- every request is answered by the model (``served_by`` beam, not degraded, no catalogue fill): the calls in flight
  on the failed replica answered UNAVAILABLE (reason DEVICE_FAILED), and the gateway re-encoded their histories
  on the other replica within their budgets;
- the failed replica's health says NOT_SERVING, its metric says which failure, a direct call to it answers
  UNAVAILABLE with the reason DEVICE_FAILED, and the gateway has ejected it;
- it never gets a request again; the healthy replica serves them all;
- a bad request (INVALID_ARGUMENT) takes no replica out.
"""

from __future__ import annotations

import asyncio
import time

import grpc
import numpy as np
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from specrec_rpc.errors import Reason, reason_of_rpc
from specrec_rpc.tensors import to_msg
from specrec_rpc.v1 import verifier_pb2, verifier_pb2_grpc
from specrec_stack.localstack import delete_keys, free_port, namespace_pattern

from .stack import Stack, histories

BUDGET_MS = 1000.0


def _metric(name: str, **labels: str) -> float:
    from prometheus_client import REGISTRY

    return sum(s.value for m in REGISTRY.collect() for s in m.samples
               if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()))


async def _health(st: Stack, key: str) -> int:
    async with grpc.aio.insecure_channel(st.addr(key)) as ch:
        r = await health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(service=""), timeout=3)
    return r.status


async def _beam(st: Stack, key: str, sids: np.ndarray):
    async with grpc.aio.insecure_channel(st.addr(key)) as ch:
        req = verifier_pb2.SearchRequest(ref=verifier_pb2.SessionRef(history_sids=to_msg(sids)), search="beam",
                                         widths={"width": 10})
        return await verifier_pb2_grpc.VerifierStub(ch).Search(req, timeout=5)


async def _two_verifiers(redis_url: str, bundle, prefix: str, **failing) -> Stack:
    """Item set, verifier and verifier2 (with ``failing``'s settings), drafter, and a gateway over both."""
    st = Stack(redis_url, f"{prefix}-{time.time_ns()}", bundle)
    await st.start_one("itemset")
    st.ports["verifier2"] = free_port()
    await st.start_one("verifier")
    await st.start_one("verifier", "2", **failing)
    await st.start_one("drafter")
    st.gateway_overrides = {"verifier_addr": f"{st.addr('verifier')},{st.addr('verifier2')}"}
    await st.start_one("gateway")
    st.channels = {}
    return st


async def _burst(st: Stack, hists: list, waves: int = 8):
    """The histories' beam lists through the gateway, ``waves`` requests at a time."""
    out = []
    for i in range(0, len(hists), waves):
        out += await asyncio.gather(*(st.recommend(h, k=10, policy="beam", budget_ms=BUDGET_MS)
                                      for h in hists[i : i + waves]), return_exceptions=True)
    return out


def _all_model_lists(res: list) -> None:
    errors = [r for r in res if isinstance(r, Exception)]
    assert not errors, errors[:3]
    bad = [(r.stats.served_by, r.stats.degraded_reason) for r in res
           if r.stats.served_by != "beam" or r.stats.degraded or len(r.items) != 10
           or any(it.source == "fill" for it in r.items)]
    assert not bad, bad[:5]


async def _out_of_rotation_for_good(st: Stack, hists: list, kind: str) -> None:
    """verifier2 failed (``kind``): NOT_SERVING, ejected, refusing with DEVICE_FAILED, and never asked again."""
    v2 = st.runners["verifier2"].service
    assert v2.out_of_rotation is not None and v2.out_of_rotation.kind == kind, v2.out_of_rotation
    assert _metric("specrec_verifier_device_failed", kind=kind) == 1.0
    assert await _health(st, "verifier2") == health_pb2.HealthCheckResponse.NOT_SERVING
    assert await _health(st, "verifier") == health_pb2.HealthCheckResponse.SERVING
    gw = st.runners["gateway"].service
    assert gw.verifiers.ejected() == [st.addr("verifier2")]
    sids = np.asarray(v2.bundle.sids[:3], dtype=np.int64)[None]
    with pytest.raises(grpc.aio.AioRpcError) as e:
        await _beam(st, "verifier2", sids)
    assert e.value.code() == grpc.StatusCode.UNAVAILABLE and reason_of_rpc(e.value) == Reason.DEVICE_FAILED
    assert "device failed" in e.value.details()
    # never picked again: every request of another burst goes to the healthy replica
    before = gw.verifiers.shares()
    _all_model_lists(await _burst(st, hists))
    after = gw.verifiers.shares()
    assert after[st.addr("verifier2")] == before[st.addr("verifier2")], (before, after)
    assert after[st.addr("verifier")] - before[st.addr("verifier")] == len(hists), (before, after)
    assert await _health(st, "verifier2") == health_pb2.HealthCheckResponse.NOT_SERVING


@pytest.mark.asyncio(loop_scope="session")
async def test_a_verifier_whose_gpu_fails_leaves_rotation_and_the_other_answers(redis_url, serving_bundle_dir,
                                                                                serving_bundle):
    # (the fault is armed below, once the gateway's warm-up has run: the failure comes in the test's own burst)
    st = await _two_verifiers(redis_url, serving_bundle_dir, "devfail", fault_device_error_after=10**6)
    try:
        v2 = st.runners["verifier2"].service
        # a bad request is the caller's fault: INVALID_ARGUMENT, and both replicas stay in rotation
        bad = np.full((1, 3, len(v2.level_sizes)), 10**6, dtype=np.int64)
        for key in ("verifier", "verifier2"):
            with pytest.raises(grpc.aio.AioRpcError) as e:
                await _beam(st, key, bad)
            assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert await _health(st, key) == health_pb2.HealthCheckResponse.SERVING
        assert v2.out_of_rotation is None
        v2.faults.error_after = v2.faults.batches + 3  # three more batches, then every one fails
        res = await _burst(st, histories(serving_bundle, 48, seed=51))
        assert v2.faults.batches > v2.faults.error_after, "the failing replica got no request after its fault"
        _all_model_lists(res)
        await _out_of_rotation_for_good(st, histories(serving_bundle, 16, seed=52), "error")
    finally:
        await st.stop()
        delete_keys(redis_url, namespace_pattern(st.namespace))


@pytest.mark.asyncio(loop_scope="session")
async def test_a_verifier_whose_gpu_hangs_leaves_rotation_and_the_other_answers(redis_url, serving_bundle_dir,
                                                                                serving_bundle):
    st = await _two_verifiers(redis_url, serving_bundle_dir, "devhang", fault_hang_after=10**6, hang_s=0.5)
    try:
        v2 = st.runners["verifier2"].service
        v2.faults.hang_after = v2.faults.batches + 2  # two more batches, then one that never ends
        res = await _burst(st, histories(serving_bundle, 48, seed=53))
        assert v2.faults.batches > v2.faults.hang_after, "the hanging replica got no request after its fault"
        # the requests on the hung batch waited for the watchdog (0.5 s), then were answered by the other replica
        _all_model_lists(res)
        await _out_of_rotation_for_good(st, histories(serving_bundle, 16, seed=54), "hang")
    finally:
        await st.stop()
        delete_keys(redis_url, namespace_pattern(st.namespace))
