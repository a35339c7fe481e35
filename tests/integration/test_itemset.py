"""The item-set service against a real Redis, over real gRPC on loopback."""

from __future__ import annotations

import asyncio
import json
import os
import re
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import grpc
import numpy as np
import pytest
import redis.asyncio as aioredis
from grpc_health.v1 import health_pb2, health_pb2_grpc

from itemset_svc.keys import version_counter
from itemset_svc.service import ItemSetService
from itemset_svc.settings import ItemSetSettings
from itemset_svc.store import Record, RedisCatalogue
from specrec.itemset import LocalItemSet
from specrec_rpc.catalogue import FETCHES, CatalogueWatcher
from specrec_rpc.server import Runner
from specrec_rpc.v1 import common_pb2, itemset_pb2, itemset_pb2_grpc
from specrec_stack.localstack import free_port

ROOT = Path(__file__).resolve().parents[2]
TOKEN = "s3cret-token"
AUTH = (("authorization", f"Bearer {TOKEN}"),)
N = 200  # items in the tiny bundle
LEVELS = [16, 16, 16, 64]

Sid = common_pb2.Sid
Item = itemset_pb2.UpsertItem


@dataclass
class Harness:
    service: ItemSetService
    runner: Runner
    channel: grpc.aio.Channel
    stub: itemset_pb2_grpc.ItemSetStub
    namespace: str

    async def close(self) -> None:
        await self.channel.close()
        await self.runner.stop(0)

    async def version(self) -> str:
        return (await self.stub.GetVersion(itemset_pb2.GetVersionRequest())).version

    async def snapshot(self, version: str = "", chunk_size: int = 0) -> tuple[list, list]:
        chunks = [
            c async for c in self.stub.Snapshot(itemset_pb2.SnapshotRequest(version=version, chunk_size=chunk_size))
        ]
        return chunks, [it for c in chunks for it in c.items]

    async def upsert(self, *items, **kw):
        return await self.stub.Upsert(itemset_pb2.UpsertRequest(items=list(items)), metadata=AUTH, **kw)


def settings(redis_url: str, namespace: str, bundle=None, **kw) -> ItemSetSettings:
    base = dict(host="127.0.0.1", port=0, metrics_port=0, redis_url=redis_url, namespace=namespace,
                write_token=TOKEN, bundle=bundle, startup_wait_s=5.0, log_json=False)
    base.update(kw)
    return ItemSetSettings(**base)


async def start_itemset(s: ItemSetSettings, service_cls=ItemSetService) -> Harness:
    service = service_cls(s)
    runner = Runner(service)
    port = await runner.start()
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{port}")
    return Harness(service, runner, channel, itemset_pb2_grpc.ItemSetStub(channel), s.namespace)


@pytest.fixture
async def itemset(redis_url, namespace, tiny_bundle_dir):
    h = await start_itemset(settings(redis_url, namespace, tiny_bundle_dir))
    yield h
    await h.close()


async def expect_status(aw, code: grpc.StatusCode, *fragments: str) -> str:
    with pytest.raises(grpc.aio.AioRpcError) as ei:
        await aw
    err = ei.value
    assert err.code() == code, f"expected {code.name}, got {err.code().name}: {err.details()}"
    for f in fragments:
        assert f in (err.details() or ""), f"{f!r} not in {err.details()!r}"
    return err.details()


def codes_of_text(bundle, text: str) -> tuple[int, ...]:
    from specrec.ids.embed import TextEmbedder

    emb = TextEmbedder(cache=False)([text])
    return tuple(int(c) for c in bundle.semantic_ids.encode(emb)[0])


def used_digits(sids: np.ndarray, codes) -> set[int]:
    codes = np.asarray(codes)
    return {int(s[-1]) for s in sids if np.array_equal(s[:-1], codes)}


def oracle_allowed(oracle: LocalItemSet, prefix) -> list[int]:
    rows = oracle.items_with_prefix(list(prefix))
    return sorted({int(c) for c in oracle.sids[rows, len(prefix)]})


async def redis_keys(redis_url: str, namespace: str) -> list[str]:
    r = aioredis.from_url(redis_url, decode_responses=True)
    try:
        return [k async for k in r.scan_iter(match="{" + namespace + "}*", count=1000)]
    finally:
        await r.aclose()


def versions_in_keys(keys: list[str]) -> set[str]:
    return {m.group(1) for k in keys if (m := re.search(r"\}:v:([0-9a-f]+\.\d+):", k))}


# -- bulk load and reads --------------------------------------------------------------


async def test_bulk_load_snapshot_roundtrip(itemset, tiny_bundle):
    b = tiny_bundle
    info = await itemset.stub.GetVersion(itemset_pb2.GetVersionRequest())
    assert info.version and info.n_items == N
    assert list(info.level_sizes) == LEVELS == b.cfg.level_sizes
    assert list(info.stored_versions) == [info.version]
    chunks, items = await itemset.snapshot(chunk_size=64)
    assert len(chunks) == 4 and {c.version for c in chunks} == {info.version}
    assert chunks[0].n_items == N and list(chunks[0].level_sizes) == LEVELS
    assert all(not c.level_sizes and c.n_items == 0 for c in chunks[1:])
    assert [it.row for it in items] == list(range(N))
    assert [it.item_id for it in items] == b.catalogue.ids
    assert np.array_equal(np.array([list(it.sid.codes) for it in items]), b.sids)
    assert np.array_equal(np.array([it.unseen for it in items]), ~b.seen)
    assert (~b.seen).any() and b.seen.any()
    assert [it.title for it in items] == b.catalogue.titles and [it.text for it in items] == b.catalogue.texts


async def test_reads_equal_local_oracle(itemset, tiny_bundle):
    b = tiny_bundle
    oracle = LocalItemSet(b.sids, b.seen, b.cfg.level_sizes)
    rng = np.random.default_rng(0)
    stub = itemset.stub
    version = await itemset.version()

    ids = [b.catalogue.ids[i] for i in rng.choice(N, 40)] + ["no-such-item", "another missing"]
    rng.shuffle(ids)
    res = await stub.Resolve(itemset_pb2.ResolveRequest(item_ids=ids))
    assert res.version == version
    assert [it.item_id for it in res.items] == [i for i in ids if i in b.catalogue.index]
    assert sorted(res.missing) == ["another missing", "no-such-item"]
    for it in res.items:
        row = b.catalogue.index[it.item_id]
        assert it.row == row and list(it.sid.codes) == b.sids[row].tolist() and it.unseen == (not b.seen[row])

    valid = b.sids[rng.choice(N, 100)]
    rand = np.stack([rng.integers(0, n, 300) for n in LEVELS], 1)
    near = valid.copy()
    near[:, -1] = (near[:, -1] + 1) % LEVELS[-1]  # same RQ codes, another collision digit
    q = np.concatenate([valid, rand, near])
    res = await stub.Lookup(itemset_pb2.LookupRequest(sids=[Sid(codes=s.tolist()) for s in q]))
    expected_valid = oracle.contains(q)
    assert list(res.valid) == expected_valid.tolist() and res.version == version
    rows = oracle.lookup(q)
    assert list(res.item_ids) == [b.catalogue.ids[r] if r >= 0 else "" for r in rows]
    assert expected_valid[:100].all() and not expected_valid.all()

    from prometheus_client import REGISTRY

    n_before = REGISTRY.get_sample_value("specrec_itemset_redis_seconds_count", {"op": "lookup"})
    await stub.Lookup(itemset_pb2.LookupRequest(sids=[Sid(codes=valid[0].tolist())]))
    assert REGISTRY.get_sample_value("specrec_itemset_redis_seconds_count", {"op": "lookup"}) == n_before + 1

    prefixes = [[]] + [s[:k].tolist() for s in q[::7] for k in (1, 2, 3)]
    res = await stub.AllowedCodes(itemset_pb2.AllowedCodesRequest(prefixes=[Sid(codes=p) for p in prefixes]))
    assert res.version == version
    assert [list(a.codes) for a in res.allowed] == [oracle_allowed(oracle, p) for p in prefixes]
    assert any(not a.codes for a in res.allowed)  # random prefixes that lead nowhere


async def test_upsert_by_text_makes_new_version(itemset, tiny_bundle, redis_url):
    b, stub = tiny_bundle, itemset.stub
    v1 = await itemset.version()
    text = "Zephyr velvet lipstick, long-wear, limited edition 0.5 oz"
    resp = await itemset.upsert(Item(item_id="new-1", text=text, title="Zephyr lipstick"))
    v2 = resp.version
    assert version_counter(v2) > version_counter(v1) and len(resp.items) == 1
    from prometheus_client import REGISTRY

    assert REGISTRY.get_sample_value("specrec_itemset_writes_total", {"op": "upsert", "outcome": "ok"}) >= 1
    it = resp.items[0]
    codes = codes_of_text(b, text)
    assert tuple(it.sid.codes[:3]) == codes
    used = used_digits(b.sids, codes)
    assert it.sid.codes[3] == min(set(range(64)) - used)
    assert resp.collisions == (1 if used else 0)
    assert it.row == N and it.unseen and it.title == "Zephyr lipstick" and it.text == text

    info = await stub.GetVersion(itemset_pb2.GetVersionRequest())
    assert info.version == v2 and info.n_items == N + 1 and list(info.stored_versions) == [v1, v2]
    res = await stub.Resolve(itemset_pb2.ResolveRequest(item_ids=["new-1"]))
    assert res.version == v2 and res.items[0] == it
    old = await stub.Resolve(itemset_pb2.ResolveRequest(item_ids=["new-1"], version=v1))
    assert old.version == v1 and list(old.missing) == ["new-1"] and not old.items

    q = itemset_pb2.LookupRequest(sids=[it.sid])
    assert list((await stub.Lookup(q)).item_ids) == ["new-1"]
    q.version = v1
    assert list((await stub.Lookup(q)).valid) == [False]
    pfx = [Sid(codes=list(codes)), Sid(codes=list(codes[:2]))]
    now = await stub.AllowedCodes(itemset_pb2.AllowedCodesRequest(prefixes=pfx))
    before = await stub.AllowedCodes(itemset_pb2.AllowedCodesRequest(prefixes=pfx, version=v1))
    assert sorted(used | {it.sid.codes[3]}) == list(now.allowed[0].codes)
    assert sorted(used) == list(before.allowed[0].codes)
    assert codes[2] in now.allowed[1].codes

    _, items_v1 = await itemset.snapshot(v1)
    _, items_v2 = await itemset.snapshot()
    assert len(items_v1) == N and [x.item_id for x in items_v1] == b.catalogue.ids
    assert len(items_v2) == N + 1 and items_v2[-1] == it

    # a second new item takes the next row; rows are never reused
    resp3 = await itemset.upsert(Item(item_id="new-2", text="Quartz ionic hair dryer, travel, 1875 watt"))
    assert resp3.items[0].row == N + 1 and resp3.items[0].title == resp3.items[0].text
    # nothing half-written stays behind: every version in Redis is a stored one
    keys = await redis_keys(redis_url, itemset.namespace)
    stored = set((await stub.GetVersion(itemset_pb2.GetVersionRequest())).stored_versions)
    assert versions_in_keys(keys) == stored


async def test_collisions_replacement_and_explicit_sids(itemset, tiny_bundle):
    b, stub = tiny_bundle, itemset.stub
    r = int(np.nonzero(b.seen)[0][3])
    text = b.catalogue.texts[r]
    codes = codes_of_text(b, text)
    assert codes == tuple(b.sids[r][:3])
    used = used_digits(b.sids, codes)
    free = sorted(set(range(64)) - used)
    resp = await itemset.upsert(Item(item_id="dup-a", text=text), Item(item_id="dup-b", text=text))
    assert resp.collisions == 2
    assert [tuple(i.sid.codes) for i in resp.items] == [codes + (free[0],), codes + (free[1],)]
    assert [i.row for i in resp.items] == [N, N + 1]

    # RQ codes no item has: collision digit 0, no collision
    candidates = ["Cast iron skillet, 12 inch, pre-seasoned", "Telescope equatorial mount with tripod",
                  "Mechanical keyboard, tactile switches", "Garden hose nozzle, 8 patterns", "Chess set, walnut"]
    fresh = next(t for t in candidates if not used_digits(b.sids, codes_of_text(b, t)))
    resp = await itemset.upsert(Item(item_id="fresh", text=fresh))
    assert resp.collisions == 0 and tuple(resp.items[0].sid.codes) == codes_of_text(b, fresh) + (0,)

    # replacing an item keeps its row; same text keeps its SID and seen flag
    item_id = b.catalogue.ids[r]
    resp = await itemset.upsert(Item(item_id=item_id, text=text, title="renamed"))
    it = resp.items[0]
    assert it.row == r and list(it.sid.codes) == b.sids[r].tolist() and not it.unseen and it.title == "renamed"
    assert resp.collisions == 0
    # new text: new SID, same row, unseen (the model never saw that SID)
    new_text = "Solstice mineral sunscreen, spf 50, reef-safe, value pack"
    resp = await itemset.upsert(Item(item_id=item_id, text=new_text))
    it = resp.items[0]
    assert it.row == r and tuple(it.sid.codes[:3]) == codes_of_text(b, new_text) and it.unseen
    info = await stub.GetVersion(itemset_pb2.GetVersionRequest())
    assert info.n_items == N + 3
    look = await stub.Lookup(itemset_pb2.LookupRequest(sids=[Sid(codes=b.sids[r].tolist()), it.sid]))
    assert list(look.valid) == [False, True] and list(look.item_ids) == ["", item_id]

    # explicit SIDs: stored as given; one that another item holds is refused
    taken = {tuple(s) for s in b.sids.tolist()}
    sid = next((a, 0, 0, 0) for a in range(16) if (a, 0, 0, 0) not in taken)
    resp = await itemset.upsert(Item(item_id="explicit-1", sid=Sid(codes=list(sid)), title="Explicit", seen=True))
    it = resp.items[0]
    assert tuple(it.sid.codes) == sid and not it.unseen and it.text == "" and it.title == "Explicit"
    v = await itemset.version()
    other = b.catalogue.ids[0]
    await expect_status(itemset.upsert(Item(item_id="explicit-2", sid=Sid(codes=b.sids[0].tolist()))),
                        grpc.StatusCode.FAILED_PRECONDITION, "items[0].sid", repr(other))
    # two items may swap SIDs in one write
    s0, s1 = b.sids[0].tolist(), b.sids[1].tolist()
    id0, id1 = b.catalogue.ids[0], b.catalogue.ids[1]
    resp = await itemset.upsert(
        Item(item_id=id0, sid=Sid(codes=s1), text="x"), Item(item_id=id1, sid=Sid(codes=s0), text="y")
    )
    look = await stub.Lookup(itemset_pb2.LookupRequest(sids=[Sid(codes=s0), Sid(codes=s1)]))
    assert list(look.item_ids) == [id1, id0] and version_counter(resp.version) > version_counter(v)


async def test_collision_overflow_loses_nothing(itemset, tiny_bundle, redis_url):
    b, stub = tiny_bundle, itemset.stub
    before = await stub.GetVersion(itemset_pb2.GetVersionRequest())
    _, snap_before = await itemset.snapshot()
    text = "Nimbus crackle nail polish, pastel, set of 2"
    used = used_digits(b.sids, codes_of_text(b, text))
    bad = 64 - len(used)  # the first item that finds no free collision digit
    items = [Item(item_id=f"ov-{i}", text=text) for i in range(66)]
    await expect_status(itemset.upsert(*items), grpc.StatusCode.FAILED_PRECONDITION, f"items[{bad}]", f"'ov-{bad}'",
                        "collision")
    after = await stub.GetVersion(itemset_pb2.GetVersionRequest())
    assert after == before
    _, snap_after = await itemset.snapshot()
    assert snap_after == snap_before
    assert versions_in_keys(await redis_keys(redis_url, itemset.namespace)) == set(before.stored_versions)
    # exactly as many as fit are accepted
    resp = await itemset.upsert(*items[:bad])
    assert len(resp.items) == bad and len({tuple(i.sid.codes) for i in resp.items}) == bad


async def test_delete(itemset, tiny_bundle):
    b, stub = tiny_bundle, itemset.stub
    v1 = await itemset.version()
    # items whose RQ codes are shared, and one that is alone under its prefix
    groups: dict[tuple, list[int]] = {}
    for r, s in enumerate(b.sids.tolist()):
        groups.setdefault(tuple(s[:3]), []).append(r)
    shared = next(rs for rs in groups.values() if len(rs) >= 2)[0]
    alone = next(rs for rs in groups.values() if len(rs) == 1)[0]
    gone = [shared, alone]
    ids = [b.catalogue.ids[r] for r in gone]
    resp = await stub.Delete(itemset_pb2.DeleteRequest(item_ids=ids + ["never-existed"]), metadata=AUTH)
    v2 = resp.version
    assert version_counter(v2) > version_counter(v1) and sorted(i.item_id for i in resp.items) == sorted(ids)
    active = np.ones(N, bool)
    active[gone] = False
    oracle = LocalItemSet(b.sids, b.seen, LEVELS, active=active)
    prefixes = [[]] + [b.sids[r][:k].tolist() for r in gone for k in (1, 2, 3)]
    res = await stub.AllowedCodes(itemset_pb2.AllowedCodesRequest(prefixes=[Sid(codes=p) for p in prefixes]))
    assert [list(a.codes) for a in res.allowed] == [oracle_allowed(oracle, p) for p in prefixes]
    assert list(res.allowed[3].codes) != [] and b.sids[shared][3] not in res.allowed[3].codes
    q = [Sid(codes=b.sids[r].tolist()) for r in gone]
    assert list((await stub.Lookup(itemset_pb2.LookupRequest(sids=q))).valid) == [False, False]
    assert list((await stub.Lookup(itemset_pb2.LookupRequest(sids=q, version=v1))).valid) == [True, True]
    _, items = await itemset.snapshot()
    assert len(items) == N - 2 and [i.row for i in items] == [r for r in range(N) if r not in gone]
    # deleting only unknown ids makes no version
    resp = await stub.Delete(itemset_pb2.DeleteRequest(item_ids=["never-existed"] + ids), metadata=AUTH)
    assert resp.version == v2 and not resp.items and await itemset.version() == v2
    # a new item never takes a deleted item's row
    resp = await itemset.upsert(Item(item_id="after-delete", text="Borealis clay face mask, detox, 8 oz"))
    assert resp.items[0].row == N
    # re-adding a deleted id gives it a new row
    resp = await itemset.upsert(Item(item_id=ids[0], text=b.catalogue.texts[shared]))
    assert resp.items[0].row == N + 1


async def test_rollback_and_retention(itemset, tiny_bundle, redis_url):
    b, stub = tiny_bundle, itemset.stub
    v1 = await itemset.version()
    va = (await itemset.upsert(Item(item_id="a", text="Aurel matte lipstick, red, 1 oz"))).version
    _, snap_va = await itemset.snapshot(va)
    vb = (await stub.Delete(itemset_pb2.DeleteRequest(item_ids=[b.catalogue.ids[7]]), metadata=AUTH)).version
    vc = (await itemset.upsert(Item(item_id="c", text="Corra argan shampoo, repair, 8 oz"))).version
    info = await stub.GetVersion(itemset_pb2.GetVersionRequest())
    assert list(info.stored_versions) == [va, vb, vc] and info.version == vc
    await expect_status(stub.Resolve(itemset_pb2.ResolveRequest(item_ids=["a"], version=v1)),
                        grpc.StatusCode.NOT_FOUND, repr(v1))
    await expect_status(itemset.stub.Rollback(itemset_pb2.RollbackRequest(version=v1), metadata=AUTH),
                        grpc.StatusCode.NOT_FOUND, repr(v1))

    resp = await stub.Rollback(itemset_pb2.RollbackRequest(version=va), metadata=AUTH)
    vd = resp.version
    assert version_counter(vd) > version_counter(vc)
    info = await stub.GetVersion(itemset_pb2.GetVersionRequest())
    assert info.version == vd and list(info.stored_versions) == [vb, vc, vd] and info.n_items == N + 1
    _, snap_vd = await itemset.snapshot()
    assert snap_vd == snap_va
    assert versions_in_keys(await redis_keys(redis_url, itemset.namespace)) == {vb, vc, vd}
    # rolling back to the current version changes nothing
    resp = await stub.Rollback(itemset_pb2.RollbackRequest(version=vd), metadata=AUTH)
    assert resp.version == vd and await itemset.version() == vd
    # rows stay unique across the rollback: "c" (row N+1) is gone, its row is not reused
    resp = await itemset.upsert(Item(item_id="e", text="Elara floral perfume, eau de parfum, 1.7 oz"))
    assert resp.items[0].row == N + 2


async def test_concurrent_writers_lose_nothing(redis_url, namespace, tiny_bundle_dir):
    """Two replicas (own processes' stores, own locks) writing at once: every write lands."""
    from itemset_svc.load import load_bundle
    from itemset_svc.store import UpsertSpec

    a = RedisCatalogue.from_url(redis_url, namespace, max_attempts=50)
    b = RedisCatalogue.from_url(redis_url, namespace, max_attempts=50)
    try:
        await load_bundle(tiny_bundle_dir, a)
        taken = {tuple(s) for _, _, recs, _ in [await a.snapshot()] for s in (r.sid for r in recs)}
        free = [s for s in ((x, y, 15, 63) for x in range(16) for y in range(16)) if s not in taken][:24]

        async def write(store, k):
            return await store.upsert([UpsertSpec(f"c-{k}", sid=free[k], title=f"c{k}")])

        results = await asyncio.gather(*[write(a if k % 2 else b, k) for k in range(24)])
        assert len({r.version for r in results}) == 24
        _, _, recs, _ = await a.snapshot()
        ids = {r.item_id for r in recs}
        assert all(f"c-{k}" in ids for k in range(24)) and len(recs) == N + 24
        rows = [r.row for r in recs]
        assert len(set(rows)) == len(rows)
    finally:
        await a.close()
        await b.close()


async def test_pubsub_announces_versions(itemset, redis_url):
    r = aioredis.from_url(redis_url, decode_responses=True)
    ps = r.pubsub()
    try:
        await ps.subscribe("{" + itemset.namespace + "}:events")
        assert (await ps.get_message(timeout=2.0))["type"] == "subscribe"
        resp = await itemset.upsert(Item(item_id="p-1", text="Halo keratin conditioner, silk, 8 oz"))
        msg = await ps.get_message(ignore_subscribe_messages=True, timeout=2.0)
        body = json.loads(msg["data"])
        assert body["version"] == resp.version and body["op"] == "upsert" and body["namespace"] == itemset.namespace
    finally:
        await ps.aclose()
        await r.aclose()


async def test_catalogue_watcher_sees_upsert(itemset):
    watcher = CatalogueWatcher(itemset.channel, poll_s=0.1)
    snap = await watcher.start(wait_s=10)
    try:
        assert len(snap.itemset) == N and snap.version == await itemset.version()
        t0 = time.monotonic()
        resp = await itemset.upsert(Item(item_id="watched", text="Lumi waterproof mascara, black, curl"))
        while "watched" not in watcher.current.index:
            assert time.monotonic() - t0 < 10.0, "the watcher did not see the new item within 10 s"
            await asyncio.sleep(0.02)
        cur = watcher.current
        row = cur.index["watched"]
        assert cur.version == resp.version and row == resp.items[0].row
        assert cur.itemset.sids[row].tolist() == list(resp.items[0].sid.codes) and cur.itemset.is_unseen([row])[0]
        assert cur.itemset.contains(cur.itemset.sids[[row]])[0]
    finally:
        await watcher.stop()


async def test_a_snapshot_served_from_the_mirror_equals_the_one_read_from_redis(itemset):
    """Right after its own write the item set's mirror holds that version and serves its snapshot from
    memory; once the mirror moved on, the same version is read from Redis: both are the same catalogue."""
    watcher = CatalogueWatcher(itemset.channel)
    v1 = (await itemset.upsert(Item(item_id="mirror-1", text="Halo argan oil shampoo, 12 oz"))).version
    from_mirror = await watcher.fetch(v1)
    await itemset.upsert(Item(item_id="mirror-2", text="Halo argan oil conditioner, 12 oz"))
    from_redis = await watcher.fetch(v1)
    assert from_mirror.version == from_redis.version == v1 and from_mirror.fingerprint == from_redis.fingerprint
    assert from_mirror.ids == from_redis.ids and from_mirror.texts == from_redis.texts
    assert from_mirror.titles == from_redis.titles and "mirror-1" in from_mirror.index
    assert (from_mirror.itemset.sids == from_redis.itemset.sids).all() and "mirror-2" not in from_redis.index
    again = await watcher.fetch(v1)  # served again (from the cache of chunks, or Redis): the same
    assert again.fingerprint == from_mirror.fingerprint and again.ids == from_mirror.ids


async def test_catalogue_watcher_coalesces_versions_written_faster_than_its_min_reload(itemset):
    """Three upserts in quick succession: a watcher with min_reload_s installs one version for all three
    (each install fetches and indexes the whole catalogue), no sooner than min_reload_s after the last."""
    watcher = CatalogueWatcher(itemset.channel, poll_s=0.05, min_reload_s=1.0)
    await watcher.start(wait_s=10)
    seen: list[str] = []
    watcher.listeners.append(lambda snap, old: seen.append(snap.version))
    try:
        t0 = watcher.installed_at
        last = None
        for i in range(3):
            last = await itemset.upsert(Item(item_id=f"burst-{i}", text=f"Lumi lip balm, shade {i}"))
        while "burst-2" not in watcher.current.index:
            assert time.monotonic() - t0 < 10.0, "the watcher did not install the burst within 10 s"
            await asyncio.sleep(0.02)
        assert seen == [last.version] and watcher.current.version == last.version
        assert watcher.installed_at - t0 >= 1.0
        assert {f"burst-{i}" for i in range(3)} <= set(watcher.current.index)
    finally:
        await watcher.stop()


def assert_same_catalogue(got, want) -> None:
    """Two snapshots of one version hold the same catalogue (rows past the shorter one hold nothing)."""
    assert got.version == want.version and got.fingerprint == want.fingerprint and got.index == want.index
    n = min(got.itemset.n_rows, want.itemset.n_rows)
    for snap in (got, want):
        assert not snap.itemset.active[n:].any()
    act = want.itemset.active[:n]
    assert (got.itemset.active[:n] == act).all()
    assert (got.itemset.sids[:n][act] == want.itemset.sids[:n][act]).all()
    assert (got.itemset.seen[:n][act] == want.itemset.seen[:n][act]).all()
    assert got.ids[:n] == want.ids[:n] and got.texts[:n] == want.texts[:n] and got.titles[:n] == want.titles[:n]
    rows = np.nonzero(act)[0]
    assert got.itemset.contains(want.itemset.sids[rows]).all() and len(got.itemset) == len(want.itemset)
    assert got.itemset.order[0].tolist() == want.itemset.order[0].tolist()


async def test_catalogue_watcher_follows_writes_by_deltas(itemset, tiny_bundle):
    """A watcher asks for each new version as a delta over the one it holds: an added item, a replaced one
    (new text, so a new SID in the same row) and a deleted one come as those changes only, and each
    version it builds from them is the catalogue a full snapshot gives. A version the item set cannot
    chain to (not one of its writes) gets every item."""
    b = tiny_bundle
    prepared: list = []  # what the watcher's prepare hook saw (the verifier builds its search tables there)
    watcher = CatalogueWatcher(itemset.channel, poll_s=0.05, prepare=prepared.append)
    await watcher.start(wait_s=10)
    full = CatalogueWatcher(itemset.channel)
    deltas0 = FETCHES.labels("delta")._value.get()
    try:
        writes = [
            lambda: itemset.upsert(Item(item_id="delta-new", text="Borealis rose toner, alcohol free, 6 oz")),
            lambda: itemset.upsert(Item(item_id=b.catalogue.ids[5], text="Lumi volumising mascara, brown")),
            lambda: itemset.stub.Delete(itemset_pb2.DeleteRequest(item_ids=[b.catalogue.ids[7]]), metadata=AUTH),
        ]
        for i, write in enumerate(writes):
            v = (await write()).version
            t0 = time.monotonic()
            while watcher.current.version != v:
                assert time.monotonic() - t0 < 10.0, f"the watcher did not install {v} within 10 s"
                await asyncio.sleep(0.02)
            assert FETCHES.labels("delta")._value.get() == deltas0 + i + 1 and prepared[-1] is watcher.current
            assert_same_catalogue(watcher.current, await full.fetch(v))
        cur = watcher.current
        assert "delta-new" in cur.index and b.catalogue.ids[7] not in cur.index and not cur.itemset.active[7]
        assert cur.texts[5] == "Lumi volumising mascara, brown" and cur.itemset.sids[5].tolist() != b.sids[5].tolist()
        # two writes between looks: one delta over both
        await watcher.stop()  # no more polling: the fetches below are the only ones
        v1 = await watcher.fetch(await itemset.version())
        for i in range(2):
            v = (await itemset.upsert(Item(item_id=f"delta-burst-{i}", text=f"Halo nail polish, shade {i}"))).version
        assert_same_catalogue(await watcher.fetch(v, since=v1), await full.fetch(v))
        assert FETCHES.labels("delta")._value.get() == deltas0 + 3 + 1
        # a base the item set never wrote from (a bundle loaded afresh, another replica): every item
        stranger = await full.fetch(v)
        stranger.version = "77.1"
        fulls = FETCHES.labels("full")._value.get()
        assert_same_catalogue(await watcher.fetch(v, since=stranger), await full.fetch(v))
        assert FETCHES.labels("delta")._value.get() == deltas0 + 3 + 1 and FETCHES.labels("full")._value.get() > fulls
    finally:
        await watcher.stop()
        await full.stop()


async def test_a_version_requests_ask_for_before_the_poll_installs_it_is_fetched_once(itemset):
    """Requests pinned to a version this service has not installed yet (another service's poll was
    first) share one fetch of it, a delta over the current version; the poll then installs that copy,
    however soon after the last install, without fetching it again."""
    watcher = CatalogueWatcher(itemset.channel, poll_s=0.05, min_reload_s=60.0)
    await watcher.start(wait_s=10)
    try:
        v = (await itemset.upsert(Item(item_id="pinned-1", text="Halo argan oil serum, 2 oz"))).version
        fetched = [FETCHES.labels(k)._value.get() for k in ("delta", "full")]
        snaps = await asyncio.gather(*[watcher.get(v) for _ in range(8)])
        assert all(s is snaps[0] for s in snaps) and snaps[0].version == v and "pinned-1" in snaps[0].index
        assert [FETCHES.labels(k)._value.get() for k in ("delta", "full")] == [fetched[0] + 1, fetched[1]]
        t0 = time.monotonic()
        while watcher.current.version != v:
            assert time.monotonic() - t0 < 10.0, "the poll did not install the version already fetched"
            await asyncio.sleep(0.02)
        assert watcher.current is snaps[0]
        assert [FETCHES.labels(k)._value.get() for k in ("delta", "full")] == [fetched[0] + 1, fetched[1]]
    finally:
        await watcher.stop()


# -- lifecycle -----------------------------------------------------------------------


async def test_health_serving_only_after_start(redis_url, namespace, tiny_bundle_dir):
    gate = asyncio.Event()

    class Gated(ItemSetService):
        async def start(self):
            await gate.wait()
            await super().start()

    port = free_port()
    runner = Runner(Gated(settings(redis_url, namespace, tiny_bundle_dir, port=port)))
    task = asyncio.create_task(runner.start())
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{port}")
    health = health_pb2_grpc.HealthStub(channel)
    try:
        deadline = time.monotonic() + 10
        while True:
            try:
                got = await health.Check(health_pb2.HealthCheckRequest(service="specrec.v1.ItemSet"), timeout=1)
                break
            except grpc.aio.AioRpcError:
                assert time.monotonic() < deadline, "the server never started listening"
                await asyncio.sleep(0.05)
        assert got.status == health_pb2.HealthCheckResponse.NOT_SERVING
        overall = await health.Check(health_pb2.HealthCheckRequest(service=""), timeout=1)
        assert overall.status == health_pb2.HealthCheckResponse.NOT_SERVING
        await expect_status(itemset_pb2_grpc.ItemSetStub(channel).GetVersion(itemset_pb2.GetVersionRequest()),
                            grpc.StatusCode.UNAVAILABLE, "starting")
        gate.set()
        assert await asyncio.wait_for(task, 60) == port
        for name in ("", "specrec.v1.ItemSet"):
            got = await health.Check(health_pb2.HealthCheckRequest(service=name), timeout=1)
            assert got.status == health_pb2.HealthCheckResponse.SERVING
        info = await itemset_pb2_grpc.ItemSetStub(channel).GetVersion(itemset_pb2.GetVersionRequest())
        assert info.n_items == N  # loaded at start: the namespace was empty
    finally:
        gate.set()
        await channel.close()
        if not task.done():
            task.cancel()
        await runner.stop(0)


async def test_empty_namespace_without_load(redis_url, namespace, tiny_bundle_dir):
    h = await start_itemset(settings(redis_url, namespace, tiny_bundle_dir, load_if_empty=False, warm_up=False))
    try:
        info = await h.stub.GetVersion(itemset_pb2.GetVersionRequest())
        assert info.version == "" and info.n_items == 0 and list(info.level_sizes) == LEVELS
        await expect_status(h.snapshot(), grpc.StatusCode.FAILED_PRECONDITION, namespace)
        await expect_status(h.stub.Resolve(itemset_pb2.ResolveRequest(item_ids=["x"])),
                            grpc.StatusCode.FAILED_PRECONDITION, "no catalogue version")
        resp = await h.upsert(Item(item_id="first", sid=Sid(codes=[1, 2, 3, 0]), title="First"))
        assert resp.items[0].row == 0
        chunks, items = await h.snapshot()
        assert chunks[0].version == resp.version and list(chunks[0].level_sizes) == LEVELS and len(items) == 1
    finally:
        await h.close()


async def test_load_command_and_row_guard(redis_url, namespace, tiny_bundle_dir, tiny_bundle):
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    out = subprocess.run([sys.executable, "-m", "itemset_svc.load", "--bundle", str(tiny_bundle_dir),
                          "--redis-url", redis_url, "--namespace", namespace, "--no-progress"],
                         capture_output=True, text=True, env=env, cwd=ROOT, timeout=120)
    assert out.returncode == 0, out.stderr
    version = json.loads(out.stdout.strip().splitlines()[-1])["version"]
    store = RedisCatalogue.from_url(redis_url, namespace)
    try:
        info = await store.info()
        assert info.version == version and info.n_items == N and info.level_sizes == LEVELS
        # a catalogue that would move items to other rows is refused unless forced
        recs = [Record(b, r, tuple(s), "", "", False) for r, (b, s) in
                enumerate(zip(reversed(tiny_bundle.catalogue.ids), tiny_bundle.sids.tolist()))]
        with pytest.raises(ValueError, match="rows must stay stable"):
            await store.bulk_load(recs, LEVELS)
        with pytest.raises(ValueError, match="level sizes"):
            await store.bulk_load(recs, [16, 16, 16, 128])
        assert (await store.info()).version == version
        forced = await store.bulk_load(recs, LEVELS, force=True)
        assert version_counter(forced) > version_counter(version) and (await store.info()).n_items == N
    finally:
        await store.close()


# -- bad input, auth, Redis down -----------------------------------------------------------


async def test_bad_input_names_the_field(itemset):
    stub = itemset.stub
    v = await itemset.version()
    IA, NF = grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.NOT_FOUND
    ok_sid = Sid(codes=[0, 0, 0, 0])
    many = [f"id-{i}" for i in range(10_001)]
    R, L, A = itemset_pb2.ResolveRequest, itemset_pb2.LookupRequest, itemset_pb2.AllowedCodesRequest
    cases = [
        (stub.Resolve(R(item_ids=["a", "b", "c", ""])), IA, "item_ids[3]: empty"),
        (stub.Resolve(R(item_ids=["x" * 257])), IA, "item_ids[0]: 257 characters"),
        (stub.Resolve(R(item_ids=["ok", "bad\x07id"])), IA, "item_ids[1]: non-printable"),
        (stub.Resolve(R(item_ids=many)), IA, "item_ids: 10001 entries"),
        (stub.Resolve(R(item_ids=["a"], version="latest")), IA, "version:"),
        (stub.Resolve(R(item_ids=["a"], version="987654")), NF, "'987654'"),
        (stub.Lookup(L(sids=[ok_sid, ok_sid, Sid(codes=[1, 2, 3])])), IA, "sids[2].codes: expected 4 codes, got 3"),
        (stub.Lookup(L(sids=[Sid(codes=[16, 0, 0, 0])])), IA, "sids[0].codes[0]: code 16 out of range [0, 16)"),
        (stub.Lookup(L(sids=[Sid(codes=[0, 0, 0, -1])])), IA, "sids[0].codes[3]"),
        (stub.Lookup(L(sids=[ok_sid] * 10_001)), IA, "sids: 10001 entries"),
        (stub.Lookup(L(sids=[ok_sid], version="987654")), NF, "987654"),
        (stub.AllowedCodes(A(prefixes=[Sid(), Sid(codes=[1, 2, 3, 4])])), IA, "prefixes[1].codes:"),
        (stub.AllowedCodes(A(prefixes=[Sid(codes=[1, 99])])), IA, "prefixes[0].codes[1]"),
        (itemset.snapshot(chunk_size=-1), IA, "chunk_size"),
        (itemset.snapshot(version="987654"), NF, "987654"),
        (itemset.snapshot(version="-3"), IA, "version:"),
        (itemset.upsert(), IA, "items: empty"),
        (itemset.upsert(Item(item_id="t1")), IA, "items[0].text: required when no sid is given"),
        (itemset.upsert(Item(item_id="t1", text="a"), Item(item_id="", text="b")), IA, "items[1].item_id: empty"),
        (itemset.upsert(Item(item_id="t1", text="a" * 10_001)), IA, "items[0].text: 10001 characters"),
        (itemset.upsert(Item(item_id="t1", text="a", title="b" * 10_001)), IA, "items[0].title"),
        (itemset.upsert(Item(item_id="t1", text="a"), Item(item_id="t1", text="b")), IA, "items[1].item_id"),
        (itemset.upsert(Item(item_id="t1", sid=Sid(codes=[1, 2]))), IA, "items[0].sid.codes: expected 4 codes"),
        (itemset.upsert(Item(item_id="t1", sid=Sid(codes=[1, 2, 3, 64]))), IA, "items[0].sid.codes[3]"),
        (itemset.upsert(*[Item(item_id=i, text="t") for i in many]), IA, "items: 10001 entries"),
        (
            itemset.upsert(
                Item(item_id="t1", sid=Sid(codes=[5, 5, 5, 5])), Item(item_id="t2", sid=Sid(codes=[5, 5, 5, 5]))
            ),
            IA,
            "items[1].sid",
        ),
        (stub.Delete(itemset_pb2.DeleteRequest(), metadata=AUTH), IA, "item_ids: empty"),
        (stub.Delete(itemset_pb2.DeleteRequest(item_ids=["a", "b", ""]), metadata=AUTH), IA, "item_ids[2]: empty"),
        (stub.Rollback(itemset_pb2.RollbackRequest(), metadata=AUTH), IA, "version: required"),
        (stub.Rollback(itemset_pb2.RollbackRequest(version="v1"), metadata=AUTH), IA, "version:"),
        (stub.Rollback(itemset_pb2.RollbackRequest(version="424242"), metadata=AUTH), NF, "'424242'"),
    ]
    for call, code, fragment in cases:
        await expect_status(call, code, fragment)
    assert await itemset.version() == v  # nothing was written


async def test_write_auth(redis_url, namespace, itemset):
    stub = itemset.stub
    req = itemset_pb2.UpsertRequest(items=[Item(item_id="z", text="Zed")])
    unauth, denied = grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.PERMISSION_DENIED
    await expect_status(stub.Upsert(req), unauth, "Bearer")
    await expect_status(stub.Upsert(itemset_pb2.UpsertRequest()), unauth)  # auth comes before validation
    await expect_status(stub.Upsert(req, metadata=(("authorization", "Basic " + TOKEN),)), unauth)
    await expect_status(stub.Upsert(req, metadata=(("authorization", "Bearer wrong"),)), denied, "invalid write token")
    await expect_status(stub.Upsert(req, metadata=(("authorization", f"Bearer {TOKEN}x"),)), denied)
    await expect_status(stub.Delete(itemset_pb2.DeleteRequest(item_ids=["1"])), unauth)
    await expect_status(
        stub.Delete(itemset_pb2.DeleteRequest(item_ids=["1"]), metadata=(("authorization", "Bearer no"),)), denied
    )
    await expect_status(stub.Rollback(itemset_pb2.RollbackRequest(version="1")), unauth)
    assert (await stub.GetVersion(itemset_pb2.GetVersionRequest())).n_items == N
    # no token configured: every write is refused, reads still work
    h = await start_itemset(settings(redis_url, namespace, None, write_token=""))
    try:
        await expect_status(h.stub.Upsert(req, metadata=AUTH), denied, "disabled")
        await expect_status(h.stub.Delete(itemset_pb2.DeleteRequest(item_ids=["1"]), metadata=AUTH), denied)
        assert (await h.stub.GetVersion(itemset_pb2.GetVersionRequest())).n_items == N
    finally:
        await h.close()


async def _silent_server():
    """A TCP server that accepts connections and never answers (a hung Redis)."""
    conns = []

    async def handle(reader, writer):
        conns.append(writer)
        await reader.read(1 << 20)

    server = await asyncio.start_server(handle, "127.0.0.1", 0)
    return server, conns


@pytest.mark.parametrize("failure", ["closed port", "hung server"])
async def test_redis_down_is_unavailable(namespace, failure):
    server = None
    if failure == "closed port":
        url = f"redis://127.0.0.1:{free_port()}/0"
    else:
        server, conns = await _silent_server()
        url = f"redis://127.0.0.1:{server.sockets[0].getsockname()[1]}/0"
    h = await start_itemset(settings(url, namespace, None, startup_wait_s=0.1, redis_timeout_s=0.3, write_retry_s=0))
    try:
        UN = grpc.StatusCode.UNAVAILABLE
        stub = h.stub
        t0 = time.monotonic()
        await expect_status(stub.GetVersion(itemset_pb2.GetVersionRequest(), timeout=10), UN, "redis")
        await expect_status(stub.Resolve(itemset_pb2.ResolveRequest(item_ids=["1"]), timeout=10), UN)
        await expect_status(stub.Lookup(itemset_pb2.LookupRequest(sids=[Sid(codes=[0, 0, 0, 0])]), timeout=10), UN)
        await expect_status(stub.AllowedCodes(itemset_pb2.AllowedCodesRequest(prefixes=[Sid()]), timeout=10), UN)
        await expect_status(h.snapshot(), UN, "redis")
        await expect_status(h.upsert(Item(item_id="x", sid=Sid(codes=[0, 0, 0, 0])), timeout=10), UN)
        await expect_status(stub.Delete(itemset_pb2.DeleteRequest(item_ids=["x"]), metadata=AUTH, timeout=10), UN)
        await expect_status(stub.Rollback(itemset_pb2.RollbackRequest(version="1"), metadata=AUTH, timeout=10), UN)
        assert time.monotonic() - t0 < 20
        health = health_pb2_grpc.HealthStub(h.channel)
        assert (await health.Check(health_pb2.HealthCheckRequest(service=""))).status == \
            health_pb2.HealthCheckResponse.SERVING
    finally:
        await h.close()
        if server is not None:
            for w in conns:
                w.close()
            server.close()


# -- catalogue integrity: a Redis that loses its data ------------------------------------------


def _own_redis(tmp: Path):
    """A private redis-server without persistence (never the machine's own)."""
    import shutil
    import subprocess

    binary = shutil.which("redis-server")
    if binary is None:
        pytest.skip("needs redis-server") if not os.environ.get("SPECREC_CI") else pytest.fail("needs redis-server")
    port = free_port()
    cmd = [binary, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no", "--dir", str(tmp)]

    def start():
        p = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        from specrec_stack.localstack import redis_ping

        t0 = time.monotonic()
        while not redis_ping(f"redis://127.0.0.1:{port}/0"):
            assert time.monotonic() - t0 < 10, "redis-server did not start"
            time.sleep(0.05)
        return p

    return f"redis://127.0.0.1:{port}/0", start


async def test_redis_that_lost_its_data_gets_the_catalogue_back(tmp_path, tiny_bundle_dir):
    """Redis restarts empty: the item set notices and publishes its own copy as a new version (a new
    name: another epoch), an upsert lands on the full catalogue, and no version name means two
    catalogues. A follower sees the new version and checks its fingerprint."""
    url, start = _own_redis(tmp_path)
    proc = start()
    h = await start_itemset(settings(url, "lossy", tiny_bundle_dir, watch_s=0.2))
    watcher = CatalogueWatcher(h.channel, poll_s=0.1)
    try:
        before = await h.stub.GetVersion(itemset_pb2.GetVersionRequest())
        await watcher.start()
        assert before.n_items == N and watcher.current.fingerprint == before.fingerprint
        proc.kill()
        proc.wait()
        proc = start()  # empty: no persistence
        t0 = time.monotonic()
        while True:
            info = await h.stub.GetVersion(itemset_pb2.GetVersionRequest())
            if info.version and info.n_items == N:
                break
            assert time.monotonic() - t0 < 10.0, f"not restored within 10 s: {info}"
            await asyncio.sleep(0.05)
        assert info.version != before.version and info.fingerprint == before.fingerprint
        assert info.version.rsplit(".", 1)[0] != before.version.rsplit(".", 1)[0]  # a new epoch
        resp = await h.upsert(Item(item_id="after-loss", sid=Sid(codes=[15, 15, 15, 63])))
        after = await h.stub.GetVersion(itemset_pb2.GetVersionRequest())
        assert after.version == resp.version and after.n_items == N + 1  # never a 1-item catalogue
        t0 = time.monotonic()
        while watcher.current.version != after.version:
            assert time.monotonic() - t0 < 10.0, "the follower did not see the new version within 10 s"
            await asyncio.sleep(0.05)
        assert len(watcher.current.itemset) == N + 1 and watcher.current.fingerprint == after.fingerprint
    finally:
        await watcher.stop()
        await h.close()
        proc.kill()


async def test_a_write_on_an_emptied_redis_restores_first(tmp_path, tiny_bundle_dir):
    """No watch loop this time: the write itself finds Redis empty and restores before writing."""
    url, start = _own_redis(tmp_path)
    proc = start()
    h = await start_itemset(settings(url, "lossy2", tiny_bundle_dir, watch_s=0))
    try:
        r = aioredis.from_url(url)
        await r.flushall()  # the item set's own private server: a loss of everything
        await r.aclose()
        resp = await h.upsert(Item(item_id="x1", sid=Sid(codes=[15, 15, 14, 63])))
        info = await h.stub.GetVersion(itemset_pb2.GetVersionRequest())
        assert info.version == resp.version and info.n_items == N + 1
    finally:
        await h.close()
        proc.kill()


async def test_redis_rolled_back_to_an_old_snapshot_gets_a_new_name(tmp_path, tiny_bundle_dir):
    """Redis comes back with an older copy of the same lineage (a restored snapshot): the item set
    publishes its own, newer copy in a new epoch, so no version name can mean two catalogues (the
    counter of the old copy would hand out names that were already used after the snapshot)."""
    url, start = _own_redis(tmp_path)
    proc = start()
    h = await start_itemset(settings(url, "rolled", tiny_bundle_dir, watch_s=0.2))
    r = aioredis.from_url(url)
    try:
        v1 = (await h.stub.GetVersion(itemset_pb2.GetVersionRequest())).version
        snapshot = {k: await r.dump(k) for k in await r.keys("*")}  # what an old RDB would hold
        names = {v1}
        for i in range(2):
            names.add((await h.upsert(Item(item_id=f"late-{i}", sid=Sid(codes=[15, 15, 13 - i, 63])))).version)
        async with r.pipeline(transaction=True) as pipe:  # at once, as Redis loading an old RDB file
            pipe.flushall()
            for k, v in snapshot.items():
                pipe.restore(k, 0, v)
            await pipe.execute()
        t0 = time.monotonic()
        while True:
            info = await h.stub.GetVersion(itemset_pb2.GetVersionRequest())
            if info.n_items == N + 2:
                break
            assert time.monotonic() - t0 < 10.0, f"not restored within 10 s: {info}"
            await asyncio.sleep(0.05)
        assert info.version not in names
        assert info.version.rsplit(".", 1)[0] != v1.rsplit(".", 1)[0]  # a new epoch
        resp = await h.upsert(Item(item_id="after", sid=Sid(codes=[15, 15, 11, 63])))
        assert resp.version not in names
    finally:
        await r.aclose()
        await h.close()
        proc.kill()


async def test_two_replicas_restore_a_lost_catalogue_once(tmp_path, tiny_bundle_dir):
    """Both item-set replicas notice the loss at the same moment: one restores (a lock in Redis), the
    other follows it, so the same content is not published as two versions."""
    url, start = _own_redis(tmp_path)
    proc = start()
    a = await start_itemset(settings(url, "twice", tiny_bundle_dir, watch_s=0))
    b = await start_itemset(settings(url, "twice", tiny_bundle_dir, watch_s=0))
    r = aioredis.from_url(url)
    try:
        await r.flushall()
        done = await asyncio.gather(a.service.check_integrity(), b.service.check_integrity())
        assert sorted(done) == ["", "restored"], done
        # either replica may win the lock; the other one follows what the winner published
        restorer, follower = (a, b) if done[0] == "restored" else (b, a)
        info = await restorer.stub.GetVersion(itemset_pb2.GetVersionRequest())
        assert info.n_items == N and list(info.stored_versions) == [info.version]  # one version, not two
        assert await follower.service.check_integrity() == "followed"
        assert follower.service.mirror.version == info.version
        resp = await follower.upsert(Item(item_id="via-follower", sid=Sid(codes=[15, 15, 15, 63])))
        after = await restorer.stub.GetVersion(itemset_pb2.GetVersionRequest())
        assert after.version == resp.version and after.n_items == N + 1
    finally:
        await r.aclose()
        await a.close()
        await b.close()
        proc.kill()


async def test_the_watch_loop_does_not_take_its_own_write_for_another_replicas(itemset, monkeypatch):
    """A look at Redis that lands while this process's write is published but not yet in the mirror (the
    write still prunes old versions) must not follow it as another replica's write: that reads the whole
    catalogue again and drops the mirror's log of changes, so every watcher then fetches every item (in a
    soak with an upsert a second the item set's RSS rose in steps of ~20 MB, one per such look)."""
    svc = itemset.service
    store, mirror = svc.store, svc.mirror
    base = mirror.version
    looks: list[asyncio.Future] = []
    prune = store._prune

    async def look_then_prune():  # right after the publish, still inside the write
        looks.append(asyncio.ensure_future(svc.check_integrity()))
        await asyncio.sleep(0.05)  # the watch loop's tick lands here
        return await prune()

    monkeypatch.setattr(store, "_prune", look_then_prune)
    resp = await itemset.upsert(Item(item_id="own-write", sid=Sid(codes=[15, 15, 15, 63])))
    assert await looks[0] == ""  # nothing to follow: the write brought the mirror along itself
    assert svc.mirror is mirror and mirror.version == resp.version
    records, removed_rows = mirror.delta(base)  # watchers still get the change alone
    assert [r.item_id for r in records] == ["own-write"] and removed_rows == []


async def test_followers_refuse_another_bundles_catalogue(itemset, tiny_bundle_dir):
    watcher = CatalogueWatcher(itemset.channel, poll_s=0.1, expect_bundle="0123456789abcdef")
    with pytest.raises(Exception, match="another|belongs to bundle"):
        await watcher.start(wait_s=0.5)
