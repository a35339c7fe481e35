"""The item set's layout for big catalogues, against a real Redis, at small sizes (functional, not timed):
the bulk load from arrays, versions as overlays over one data copy (a write stages only what it changes,
pruning folds), rollback across a bulk load, and the packed snapshot a follower starts from."""

from __future__ import annotations

import argparse
import shutil

import grpc
import numpy as np
import pytest
import redis.asyncio as aioredis

from itemset_svc.bulk import CatalogueArrays
from itemset_svc.keys import bump, format_mask
from itemset_svc.mirror import RecordTable, read_mirror, records_columns
from itemset_svc.servicer import _packed_chunks, to_pb
from itemset_svc.store import Record, RedisCatalogue, UpsertSpec
from specrec_rpc.catalogue import build_snapshot, build_snapshot_columns
from specrec_rpc.errors import FailedPrecondition
from specrec_rpc.fingerprint import fingerprint
from specrec_rpc.packed import Columns, pack, unpack
from specrec_rpc.v1 import itemset_pb2

from .test_itemset import settings, start_itemset

LEVELS = [4, 4, 8]


def records_fingerprint(records) -> str:
    return fingerprint((r.item_id, r.sid, r.unseen) for r in records)


def catalogue(n: int, seed: int = 0) -> list[Record]:
    rng = np.random.default_rng(seed)
    keys = rng.choice(int(np.prod(LEVELS)), n, replace=False)
    recs = []
    for row, k in enumerate(keys.tolist()):
        sid = (k // 32, (k // 8) % 4, k % 8)
        recs.append(Record(f"it-{row}", row, sid, "title é" if row % 7 == 0 else "", "", bool(row % 3 == 0)))
    return recs


@pytest.fixture
async def store(redis_url, namespace):
    s = RedisCatalogue.from_url(redis_url, namespace, keep_versions=3)
    yield s
    await s.close()


async def content(store: RedisCatalogue, version: str = "") -> dict:
    v, ls, records, fp = await store.snapshot(version)
    return {r.item_id: (r.row, r.sid, r.unseen, r.title) for r in records}


async def test_bulk_load_from_arrays_equals_the_records(store, redis_url, namespace):
    recs = catalogue(100)
    cat = CatalogueArrays([r.item_id for r in recs], np.array([r.sid for r in recs]),
                          np.array([r.unseen for r in recs]), titles=[r.title for r in recs])
    v = await store.bulk_load(cat, LEVELS)
    info = await store.info()
    assert (info.version, info.n_items, info.fingerprint) == (v, 100, records_fingerprint(recs))
    _, _, got, fp = await store.snapshot()
    assert got == recs and fp == records_fingerprint(recs)
    masks: dict = {}  # the reference: one item at a time, as writes count them
    for rec in recs:
        bump(masks, set(), rec.sid, +1)
    _, allowed = await store.allowed(list(masks))
    assert allowed == [sorted(masks[p]) for p in masks]
    r = aioredis.from_url(redis_url, decode_responses=True)
    try:  # the masks' counts are exact (a delete drops a code when its last item goes)
        raw = await r.hgetall(store.keys.dkey(v, "pfx"))
        assert raw == {p: format_mask(m) for p, m in masks.items()}
    finally:
        await r.aclose()
    _, owners = await store.lookup(["9.9.9", ".".join(map(str, recs[5].sid))])
    assert owners == [None, "it-5"]


async def test_bulk_load_refuses_what_does_not_fit(store):
    recs = catalogue(10)
    dup = [*recs[:9], Record("x", 9, recs[0].sid)]
    with pytest.raises(ValueError, match="share SID"):
        await store.bulk_load(dup, LEVELS)
    with pytest.raises(ValueError, match="does not fit level sizes"):
        await store.bulk_load([*recs[:9], Record("x", 9, (4, 0, 0))], LEVELS)
    with pytest.raises(ValueError, match="duplicate item ids"):
        await store.bulk_load([*recs[:9], Record("it-0", 9, (3, 3, 7))], LEVELS)


async def test_a_write_stages_only_what_it_changes_and_pruning_folds(store, redis_url):
    recs = catalogue(60)
    v0 = await store.bulk_load(recs, LEVELS)
    free = sorted({(a, b, c) for a in range(4) for b in range(4) for c in range(8)} - {r.sid for r in recs})
    expect = {v0: await content(store)}
    versions = [v0]
    r = aioredis.from_url(redis_url, decode_responses=True)
    try:
        for j in range(6):
            if j % 3 == 2:
                res = await store.delete([f"it-{j}"])
            else:
                res = await store.upsert([UpsertSpec(f"new-{j}", sid=free[j]),
                                          UpsertSpec(f"it-{10 + j}", sid=free[20 + j])])
            versions.append(res.version)
            expect[res.version] = await content(store)
            # the version's overlay holds what the write changed, nothing more
            assert await r.hlen(store.keys.vkey(res.version, "items")) <= 2
            assert await r.hlen(store.keys.vkey(res.version, "sid2item")) <= 4
            stored = await store.stored_versions()
            assert stored == versions[-3:]
            for v in stored:  # every stored version reads exactly what it was, folds or not
                assert await content(store, v) == expect[v]
            # the data is the oldest stored version's content
            lay = await store.layout(stored[0])
            assert lay.layers == ()
            # a version lies over its base's overlays that were not folded when it was written (at most the one
            # folded by its own write's pruning), never over older ones: those would pile up, one a write, and every
            # read and write would look through them all
            assert set((await store.layout(res.version)).layers) <= set(stored)
            assert await r.hlen(store.keys.dkey(lay.data, "items")) == len(expect[stored[0]])
        # a reader that kept an old layout (its overlays since folded) still reads right
        stale = store._layouts.copy()
        other = RedisCatalogue.from_url(redis_url, store.ns)
        other._layouts.update(stale)
        await store.upsert([UpsertSpec("late", sid=free[40])])
        for v in (await store.stored_versions())[:-1]:
            assert await content(other, v) == expect[v]
            _, recs_v = await other.resolve(list(expect[v]), v)
            assert [x.item_id for x in recs_v if x] == list(expect[v])
        await other.close()
        # nothing of the pruned versions is left
        keys = [k async for k in r.scan_iter(match="{" + store.ns + "}:*", count=1000)]
        datas = {k.split(":d:")[1].split(":")[0] for k in keys if ":d:" in k}
        assert datas == {v0}
        assert {k.split(":v:")[1].rsplit(":", 1)[0] for k in keys if ":v:" in k} == set(await store.stored_versions())
    finally:
        await r.aclose()


async def test_rollback_within_the_data_and_across_a_bulk_load(store):
    recs = catalogue(40)
    v0 = await store.bulk_load(recs, LEVELS)
    free = sorted({(a, b, c) for a in range(4) for b in range(4) for c in range(8)} - {r.sid for r in recs})
    va = (await store.upsert([UpsertSpec("a", sid=free[0])])).version
    want_a = await content(store)
    await store.delete(["it-1", "it-2"])
    vb = (await store.rollback(va)).version
    assert await content(store) == want_a and (await store.info()).n_items == len(want_a)
    assert (await store.info()).fingerprint == await store.fingerprint(va)
    # a bulk load of other items, then back to a version on the old data: a copy of it, data of its own
    v1 = await store.bulk_load(catalogue(30, seed=1)[:25], LEVELS, force=True)
    assert v1 and v0
    vc = (await store.rollback(vb)).version
    assert await content(store) == want_a
    lay = await store.layout(vc)
    assert lay.data == vc and lay.layers == ()
    # and writes go on over it
    await store.delete(["a"])
    assert "a" not in await content(store) and (await store.info()).n_items == len(want_a) - 1


def test_pack_and_unpack_keep_every_column():
    n = 1000
    rng = np.random.default_rng(0)
    cols = Columns(rng.permutation(n), rng.integers(0, 300, (n, 4)), rng.random(n) < 0.3,
                   [f"id-{i}" for i in range(n)], ["" if i % 5 else f"tïtle {i}" for i in range(n)],
                   ["" if i % 9 else "a\ntext" for i in range(n)])
    msgs = pack(cols, max_bytes=4096)
    assert len(msgs) > 10 and all(m.ByteSize() < 8192 for m in msgs)
    got = unpack(msgs, 4)
    assert np.array_equal(got.rows, cols.rows) and np.array_equal(got.codes, cols.codes)
    assert np.array_equal(got.unseen, cols.unseen)
    assert (got.ids, got.titles, got.texts) == (cols.ids, cols.titles, cols.texts)
    assert len(unpack(pack(Columns(np.zeros(0, int), np.zeros((0, 4), int), np.zeros(0, bool), [], [], [])), 4)) == 0
    with pytest.raises(ValueError, match="uint16"):
        pack(Columns(np.arange(1), np.full((1, 4), 70_000), np.zeros(1, bool), ["a"], [""], [""]))


def test_a_follower_builds_the_same_snapshot_from_packed_chunks_as_from_items():
    recs = [r for r in catalogue(80) if r.row % 4]  # some rows empty
    fp = records_fingerprint(recs)
    items = [to_pb(r) for r in recs]
    a = build_snapshot("e.1", LEVELS, items, fp)
    chunks = _packed_chunks("e.1", LEVELS, records_columns(recs, 3), fp)
    b = build_snapshot_columns("e.1", LEVELS, unpack([c.packed for c in chunks], 3), chunks[0].fingerprint)
    assert chunks[0].n_items == len(recs) and list(chunks[0].level_sizes) == LEVELS
    assert (a.ids, a.titles, a.texts, a.index, a.fingerprint) == (b.ids, b.titles, b.texts, b.index, b.fingerprint)
    assert np.array_equal(a.itemset.sids, b.itemset.sids) and np.array_equal(a.itemset.active, b.itemset.active)
    assert np.array_equal(a.itemset.seen, b.itemset.seen)


async def test_the_service_answers_a_packed_snapshot(redis_url, namespace, tiny_bundle_dir):
    h = await start_itemset(settings(redis_url, namespace, tiny_bundle_dir))
    try:
        for _ in range(2):  # from Redis, then from the mirror (its chunks kept)
            chunks = [c async for c in h.stub.Snapshot(itemset_pb2.SnapshotRequest(packed=True))]
            items = [it async for c in h.stub.Snapshot(itemset_pb2.SnapshotRequest()) for it in c.items]
            assert all(not c.items for c in chunks) and chunks[0].n_items == len(items)
            cols = unpack([c.packed for c in chunks], len(chunks[0].level_sizes))
            assert cols.ids == [it.item_id for it in items] and cols.rows.tolist() == [it.row for it in items]
            assert cols.codes.tolist() == [list(it.sid.codes) for it in items]
            assert cols.titles == [it.title for it in items] and cols.unseen.tolist() == [it.unseen for it in items]
        with pytest.raises(grpc.aio.AioRpcError):
            [c async for c in h.stub.Snapshot(itemset_pb2.SnapshotRequest(packed=True, version="zz.1"))]
    finally:
        await h.close()


async def mirror_content(store: RedisCatalogue, version: str) -> dict:
    m = await read_mirror(store, version)
    assert isinstance(m.records, RecordTable)  # read from the data's packed copy
    _, _, cols, fp = m.columns()
    assert cols.rows.tolist() == sorted(cols.rows.tolist()) and len(cols) == len(m.records)
    assert fp == await store.fingerprint(version)
    got = {r.item_id: (r.row, r.sid, r.unseen, r.title) for r in m.records.values()}
    assert got == {i: (int(r), tuple(c), bool(u), t)
                   for i, r, c, u, t in zip(cols.ids, cols.rows, cols.codes.tolist(), cols.unseen, cols.titles)}
    return got


async def test_a_mirror_read_from_the_packed_copy_is_every_stored_version(store):
    recs = catalogue(50)
    await store.bulk_load(recs, LEVELS)
    free = sorted({(a, b, c) for a in range(4) for b in range(4) for c in range(8)} - {r.sid for r in recs})
    for j in range(5):  # writes, and folds of them into the data (the dirty set)
        if j == 3:
            await store.delete(["it-3", "new-0"])
        else:
            await store.upsert([UpsertSpec(f"new-{j}", sid=free[j]), UpsertSpec(f"it-{j}", sid=free[10 + j])])
        for v in await store.stored_versions():
            assert await mirror_content(store, v) == await content(store, v)
    va = (await store.stored_versions())[-1]  # still stored after the next bulk load
    await store.bulk_load(catalogue(20, seed=2), LEVELS, force=True)
    vr = (await store.rollback(va)).version  # data of its own, copied with its packed copy and dirty set
    assert await mirror_content(store, vr) == await content(store, va)


def test_a_record_table_is_a_mapping_of_its_columns_and_changes():
    recs = catalogue(10)
    assert RecordTable(unpack(pack(records_columns(recs, 3)), 3)).base.packed_ids == []  # the wire's bytes let go
    t = RecordTable(records_columns(recs, 3))
    assert t._pos is None and t.columns().ids == [r.item_id for r in recs]  # no id index for a snapshot
    assert len(t) == 10 and t["it-4"] == recs[4] and t._pos is not None
    assert "zz" not in t and list(t) == [r.item_id for r in recs]
    t["it-4"] = Record("it-4", 4, (3, 3, 7))
    t["new"] = Record("new", 10, (3, 3, 6))
    del t["it-0"]
    assert t.pop("it-1") == recs[1] and t.pop("it-1", None) is None
    assert len(t) == 9 and "it-0" not in t and t["it-4"].sid == (3, 3, 7)
    cols = t.columns()
    assert cols.ids == [f"it-{i}" for i in range(2, 10)] + ["new"] and cols.rows.tolist() == list(range(2, 11))
    assert cols.codes[2].tolist() == [3, 3, 7]
    t["it-0"] = recs[0]
    assert len(t) == 10 and t["it-0"] == recs[0]


async def test_a_forced_bulk_load_replaces_a_catalogue_written_before_layers(redis_url, namespace):
    """An item set older than the layered layout kept whole copies per version (with a SID set): reads of such a
    version are refused, saying to load again; a forced load does, and pruning deletes the old keys."""
    s = RedisCatalogue.from_url(redis_url, namespace, keep_versions=1)
    k = s.keys
    r = aioredis.from_url(redis_url, decode_responses=True)
    try:
        old = "abcdef.3"
        await r.hset(k.vkey(old, "meta"), mapping={"op": "load", "fingerprint": "0" * 32})
        await r.sadd(k.vkey(old, "sids"), "1.2.3")
        await r.hset(k.vkey(old, "sid2item"), "1.2.3", "x")
        await r.hset(k.vkey(old, "items"), "x", '{"row":0,"sid":"1.2.3","unseen":false}')
        await r.hset(k.vkey(old, "pfx"), "", "1:1")
        await r.set(k.key("current"), old)
        await r.zadd(k.key("versions"), {old: 3})
        await r.set(k.key("level_sizes"), "4,4,8")
        await r.set(k.key("epoch"), "abcdef")
        await r.set(k.key("seq"), 3)
        with pytest.raises(FailedPrecondition, match="load the catalogue again"):
            await s.resolve(["x"])
        v = await s.bulk_load(catalogue(10), LEVELS, force=True)
        assert await s.stored_versions() == [v] and len(await content(s)) == 10
        assert not [key async for key in r.scan_iter(match=k.vkey(old, "*"))]
    finally:
        await r.aclose()
        await s.close()


@pytest.mark.skipif(shutil.which("redis-server") is None, reason="needs redis-server (the part starts its own)")
def test_the_benchmarks_item_set_part_runs_end_to_end(monkeypatch):
    """bench.catalogue_scale's item-set part on 300 items in its own redis-server: every figure there (not timed)."""
    from bench import catalogue_scale as cs

    sids = cs.synthetic_sids(np.array([r.sid for r in catalogue(20)]), LEVELS, 120, seed=0)
    seen = np.zeros(len(sids), bool)
    seen[:20] = True
    out = cs.itemset_part("tiny", sids, seen, [f"i{j}" for j in range(len(sids))], LEVELS,
                          argparse.Namespace(seed=0, upserts=6))
    assert set(cs.ITEMSET_KEYS) <= set(out) and out["items"] == 120
    assert out["load_s"] > 0 and out["bytes_per_item"] > 0 and out["upsert_p99_ms"] >= out["upsert_p50_ms"] > 0
    assert out["delta_apply_ms"] > 0 and out["follower_load_s"] > 0


async def test_the_mirrors_lookups_and_masks_equal_redis(store):
    """What the item set answers from its mirror while Redis cannot (built by column, searched by key range)."""
    recs = catalogue(70)
    await store.bulk_load(recs, LEVELS)
    free = sorted({(a, b, c) for a in range(4) for b in range(4) for c in range(8)} - {r.sid for r in recs})
    await store.upsert([UpsertSpec("n1", sid=free[0]), UpsertSpec("it-2", sid=free[1])])
    await store.delete(["it-5"])
    m = await read_mirror(store, (await store.info()).version)
    prefixes = ["", *{".".join(map(str, r.sid[:n])) for r in recs for n in (1, 2)}, "3.3", "9", "1.x", "0.0.0"]
    assert m.allowed(prefixes) == (await store.allowed(prefixes))[1]
    sids = [".".join(map(str, s)) for s in [*(r.sid for r in recs), free[0], free[1], free[2]]]
    assert m.lookup(sids) == (await store.lookup(sids))[1]
