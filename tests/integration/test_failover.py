"""A real Redis failover under load: Sentinel promotes the replica, nothing acknowledged is lost.

A ``redis-server`` primary, one replica and three ``redis-sentinel``
processes run on free loopback ports (:mod:`specrec_stack.localsentinel`); the
whole stack runs on ``redis+sentinel://``. A writer upserts items through the
item set's gRPC service while a reader keeps asking the gateway for
recommendations; the primary is killed (SIGKILL) and the sentinels promote the
replica. Then:

- every write the item set acknowledged is in the catalogue (the promoted
  replica had it: writes wait for a replica before they are acknowledged);
- no call got INTERNAL; writes that could not be acknowledged answered
  UNAVAILABLE (or ran into their own deadline), and retried ones went through;
- every recommendation came back, degraded at most;
- writes are acknowledged again soon after the promotion (the recovery time is
  printed and bounded).
"""

from __future__ import annotations

import asyncio
import os
import time

import grpc
import numpy as np
import pytest
import redis

from itemset_svc.settings import ItemSetSettings
from itemset_svc.store import RedisCatalogue
from specrec_rpc.v1 import itemset_pb2
from specrec_stack.localsentinel import LocalSentinel, sentinel_available

from .stack import AUTH, Stack, histories


@pytest.fixture
def sentinel_redis(tmp_path):
    if not sentinel_available():
        if os.environ.get("SPECREC_CI"):
            pytest.fail("needs redis-server (apt-get install redis-server; redis-sentinel is used when present)")
        pytest.skip("needs redis-server")
    # two replicas: the failover leaves one, so writes go on being acknowledged (auto refuses a write no replica holds)
    rs = LocalSentinel(tmp_path / "redis", replicas=2).start()
    yield rs
    rs.stop()


WORDS = ("lipstick matte red velvet serum hydrating night cream shampoo argan oil mascara volume black eyeliner "
         "waterproof blush peach powder foundation liquid beige nail polish coral perfume floral musk sunscreen spf50 "
         "mineral toner rose clay mask charcoal brush kabuki comb bamboo lotion shea vanilla").split()


async def _writer(stack: Stack, stop: asyncio.Event, acked: dict, failed: list, t_base: float):
    rng = np.random.default_rng(0)
    k = 0
    while not stop.is_set():
        item_id = f"fo-{k}"
        text = " ".join(rng.choice(WORDS, size=5, replace=False))  # varied texts: varied SIDs, no collision overflow
        t = time.monotonic() - t_base
        try:
            resp = await stack.itemset.Upsert(itemset_pb2.UpsertRequest(items=[itemset_pb2.UpsertItem(
                item_id=item_id, title=f"failover item {k}", text=text)]),
                metadata=AUTH, timeout=6.0)
            acked[item_id] = (t, time.monotonic() - t_base, resp.version)
        except grpc.aio.AioRpcError as e:
            failed.append((item_id, t, e.code(), e.details()))
        k += 1
        await asyncio.sleep(0.02)


async def _reader(stack: Stack, stop: asyncio.Event, hist: list, answers: list, t_base: float):
    j = 0
    while not stop.is_set():
        t = time.monotonic() - t_base
        try:
            resp = await stack.recommend(hist[j % len(hist)], k=10, policy="beam", budget_ms=300, timeout=5.0)
            answers.append((t, "OK", resp.stats.degraded, len(resp.items)))
        except grpc.aio.AioRpcError as e:
            answers.append((t, e.code().name, True, 0))
        j += 1
        await asyncio.sleep(0.01)


def _mirror_reads() -> float:
    return _metric("specrec_itemset_mirror_reads_total")


def _metric(name: str) -> float:
    from prometheus_client import REGISTRY

    return sum(s.value for m in REGISTRY.collect() for s in m.samples if s.name == name)


async def test_killing_the_redis_primary_loses_no_acknowledged_write(sentinel_redis, serving_bundle_dir,
                                                                     serving_bundle):
    rs = sentinel_redis
    stack = Stack(rs.url, "failover", serving_bundle_dir, itemset_overrides=dict(redis_timeout_s=1.0, watch_s=0.2))
    await stack.start()
    stop = asyncio.Event()
    acked: dict[str, tuple[float, float, str]] = {}
    failed: list = []
    answers: list = []
    mirror_reads = _mirror_reads()
    t_base = time.monotonic()
    tasks = [asyncio.create_task(_writer(stack, stop, acked, failed, t_base)),
             asyncio.create_task(_reader(stack, stop, histories(serving_bundle, 20, seed=3), answers, t_base))]
    try:
        await asyncio.sleep(2.0)
        n_before = len(acked)
        assert n_before > 0, f"no write acknowledged before the fault: {failed[:3]}"
        old = rs.kill_primary()
        t_kill = time.monotonic() - t_base
        # no primary yet: reads are answered from the item set's copy, acknowledged writes included
        so_far = list(acked)
        during_info = await stack.itemset.GetVersion(itemset_pb2.GetVersionRequest(), timeout=3)
        during = await stack.itemset.Resolve(itemset_pb2.ResolveRequest(item_ids=so_far), timeout=3)
        assert during_info.version and not during.missing
        new, promoted_s = await asyncio.to_thread(rs.wait_promoted, old, 20.0)
        t_promoted = time.monotonic() - t_base
        await asyncio.sleep(3.0)  # load after the promotion
        stop.set()
        await asyncio.gather(*tasks)

        # every acknowledged write is in the catalogue the new primary serves
        info = await stack.itemset.GetVersion(itemset_pb2.GetVersionRequest())
        res = await stack.itemset.Resolve(itemset_pb2.ResolveRequest(item_ids=list(acked)))
        assert not res.missing, f"acknowledged writes lost: {list(res.missing)[:10]}"
        assert res.version == info.version
        # ... read from the new primary itself, not from the item set's copy
        store = RedisCatalogue.from_settings(ItemSetSettings(redis_url=rs.url, namespace="failover"))
        try:
            _, records = await store.resolve(list(acked))
            assert all(r is not None for r in records)
            assert store.replicated
        finally:
            await store.close()

        # no INTERNAL anywhere; a write that failed said UNAVAILABLE (or ran out of its own deadline)
        codes = {c for _, _, c, _ in failed}
        assert codes <= {grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED}, failed[:5]
        assert all(a[1] == "OK" and a[3] == 10 for a in answers), [a for a in answers if a[1] != "OK"][:5]
        asked = [a for a in answers if t_kill <= a[0] <= t_promoted]
        assert asked, "no recommendation was asked for during the failover"
        # the services' catalogue polls were answered from the item set's copy while there was no primary
        assert _mirror_reads() > mirror_reads

        # writes recover: acknowledged again soon after the promotion
        after = sorted(t_done for t_sent, t_done, _ in acked.values() if t_sent >= t_kill)
        assert after, f"no write acknowledged after the failover: {failed[-3:]}"
        recovery_s = after[0] - t_kill
        print(f"\nfailover: primary {old} -> {new} promoted {promoted_s:.2f} s after the kill; first write "
              f"acknowledged {recovery_s:.2f} s after it; {len(acked)} acknowledged ({n_before} before), "
              f"{len(failed)} not ({sorted(c.name for c in codes)}); {len(answers)} recommendations, "
              f"{sum(a[2] for a in answers)} degraded")
        assert recovery_s < promoted_s + 5.0
    finally:
        stop.set()
        for t in tasks:
            t.cancel()
        await stack.stop()


async def test_a_write_short_of_replicas_is_not_acknowledged_and_retrying_is_safe(tmp_path, tiny_bundle_dir):
    """WAIT reaches fewer replicas than required: UNAVAILABLE, though the primary published it; the same
    write again, with a requirement the replicas meet, is acknowledged and changes no content."""
    if not sentinel_available():
        pytest.skip("needs redis-server")
    from .test_itemset import settings, start_itemset

    rs = LocalSentinel(tmp_path / "redis", sentinels=0).start()  # a primary and its replica, no sentinels
    url = f"redis://127.0.0.1:{rs.data_ports[0]}/0"
    ok = strict = None
    item = itemset_pb2.UpsertItem(item_id="w-1", title="wait", text="velvet matte lipstick, deep red")
    try:
        ok = await start_itemset(settings(url, "wait", tiny_bundle_dir, watch_s=0))  # loads the catalogue
        strict = await start_itemset(settings(url, "wait", tiny_bundle_dir, write_replicas=2, write_wait_s=0.1,
                                              write_retry_s=0.3, watch_s=0))
        with pytest.raises(grpc.aio.AioRpcError) as e:
            await strict.upsert(item, timeout=5)
        assert e.value.code() == grpc.StatusCode.UNAVAILABLE and "not acknowledged" in e.value.details()
        first = (await ok.stub.Resolve(itemset_pb2.ResolveRequest(item_ids=["w-1"]))).items  # published on the primary
        resp = await ok.upsert(item, timeout=5)
        again = resp.items
        assert len(first) == len(again) == 1
        assert (first[0].row, list(first[0].sid.codes)) == (again[0].row, list(again[0].sid.codes))
        replica = RedisCatalogue.from_url(f"redis://127.0.0.1:{rs.data_ports[1]}/0", "wait")
        try:  # acknowledged: the replica holds it
            assert (await replica.info()).version == resp.version
        finally:
            await replica.close()
    finally:
        for h in (strict, ok):
            if h is not None:
                await h.close()
        rs.stop()


async def test_auto_acknowledges_no_write_once_the_replica_is_gone(tmp_path, tiny_bundle_dir):
    """write_replicas auto on a primary seen with a replica: the replica killed (as after a failover that left the
    new primary without one), a write is not acknowledged (UNAVAILABLE) rather than acknowledged with no replica
    holding it; write_replicas 0 opts in to primary-only acknowledgements."""
    if not sentinel_available():
        pytest.skip("needs redis-server")
    from .test_itemset import settings, start_itemset

    rs = LocalSentinel(tmp_path / "redis", sentinels=0).start()  # a primary and its replica, no sentinels
    url = f"redis://127.0.0.1:{rs.data_ports[0]}/0"
    auto = lone = None
    try:
        auto = await start_itemset(settings(url, "gone", tiny_bundle_dir, write_wait_s=0.1, write_retry_s=0.3,
                                            watch_s=0))
        await auto.upsert(itemset_pb2.UpsertItem(item_id="g-1", title="one", text="velvet matte lipstick"), timeout=5)
        rs.procs[rs.data_ports[1]].kill()  # the replica
        rs.procs[rs.data_ports[1]].wait()
        primary = redis.Redis(port=rs.data_ports[0])
        t0 = time.monotonic()
        while int(primary.info("replication")["connected_slaves"]):
            assert time.monotonic() - t0 < 5.0, "the primary still counts the killed replica"
            time.sleep(0.05)
        with pytest.raises(grpc.aio.AioRpcError) as e:
            await auto.upsert(itemset_pb2.UpsertItem(item_id="g-2", title="two", text="argan oil shampoo"), timeout=5)
        assert e.value.code() == grpc.StatusCode.UNAVAILABLE and "not acknowledged" in e.value.details()
        lone = await start_itemset(settings(url, "gone", tiny_bundle_dir, write_replicas=0, watch_s=0))
        await lone.upsert(itemset_pb2.UpsertItem(item_id="g-3", title="three", text="rose clay mask"), timeout=5)
    finally:
        for h in (auto, lone):
            if h is not None:
                await h.close()
        rs.stop()
