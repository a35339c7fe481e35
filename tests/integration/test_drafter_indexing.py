"""The drafter service on a catalogue bigger than its bundle's (drafter_svc/service.py): it serves as soon as the
bundle's rows are indexed, indexes the rest in the background (rows pending are not drafted; the pending gauge
counts them), and loads only the ``modes`` asked for."""

from __future__ import annotations

import asyncio
import threading
import time

import grpc
import numpy as np
import pytest
from prometheus_client import REGISTRY
from structlog.testing import capture_logs

from drafter_svc.service import DrafterService, DrafterSettings
from itemset_svc.bulk import CatalogueArrays
from itemset_svc.load import bundle_arrays
from itemset_svc.store import RedisCatalogue
from specrec.bundle import sid_space_fingerprint
from specrec_rpc.server import Runner
from specrec_rpc.v1 import common_pb2, drafter_pb2

from .stack import Stack

pytestmark = pytest.mark.asyncio(loop_scope="session")

EXTRA = 300  # synthetic rows past the bundle's: a third with neither text nor title
PREFIX = [15, 15, 15]  # theirs alone (the bundle's codes are spread by RQ; checked below)


async def load_grown(redis_url: str, namespace: str, bundle_dir) -> list[str]:
    """The bundle's catalogue plus EXTRA unseen rows under PREFIX, bulk-loaded as the bundle's; their ids."""
    real, levels = bundle_arrays(bundle_dir)
    ids = [f"synth-{i}" for i in range(EXTRA)]
    sids = np.array([[*PREFIX, i % levels[-1]] for i in range(EXTRA)])
    sids[:, 2] -= np.arange(EXTRA) // levels[-1]  # unique SIDs: 15/15/15/x, 15/15/14/x, ...
    texts = ["" if i % 3 == 0 else f"velvet lipstick shade {i}" for i in range(EXTRA)]
    cat = CatalogueArrays([*real.item_ids, *ids], np.concatenate([real.sids, sids]),
                          np.concatenate([real.unseen, np.ones(EXTRA, bool)]),
                          titles=[*(real.titles or []), *[""] * EXTRA], texts=[*(real.texts or []), *texts])
    store = RedisCatalogue.from_url(redis_url, namespace, timeout_s=30.0)
    try:
        await store.bulk_load(cat, levels, bundle=sid_space_fingerprint(bundle_dir))
    finally:
        await store.close()
    return ids


def pending(mode: str) -> float | None:
    return REGISTRY.get_sample_value("specrec_drafter_pending_items", {"mode": mode})


async def test_serves_before_the_extra_rows_are_indexed(redis_url, namespace, serving_bundle_dir, serving_bundle,
                                                        monkeypatch):
    ids = await load_grown(redis_url, namespace, serving_bundle_dir)
    assert not any(tuple(s[:2]) == tuple(PREFIX[:2]) for s in serving_bundle.sids.tolist())
    gate = threading.Event()  # the background indexer waits here until the test lets it go
    encode = DrafterService._encode

    def held(self, d, snap, stop):
        gate.wait(30.0)
        return encode(self, d, snap, stop)

    monkeypatch.setattr(DrafterService, "_encode", held)
    stack = Stack(redis_url, namespace, serving_bundle_dir, drafter_overrides={"index_chunk": 64})
    stack.channels = {}
    await stack.start_one("itemset")
    try:
        await stack.start_one("drafter")  # returns once SERVING
        svc = stack.runners["drafter"].service
        n0 = len(serving_bundle.catalogue)
        assert svc.snap.itemset.n_rows == n0 + EXTRA
        assert {m: d.indexed for m, d in svc._indexed_modes().items()} == {"retrieval": n0, "self": n0}
        assert pending("retrieval") == pending("self") == EXTRA
        history = serving_bundle.catalogue.ids[:3]
        under = drafter_pb2.DraftQuery(history=history, n=50, prefixes=[common_pb2.Sid(codes=PREFIX[:2])])
        for mode in ("retrieval", "self"):
            r = await stack.drafter.Draft(drafter_pb2.DraftRequest(queries=[under], mode=mode))
            assert list(r.drafts[0].item_ids) == []  # every item under the prefix is pending
            # a history of pending items only: none of it is readable, still an answer
            r = await stack.drafter.Draft(drafter_pb2.DraftRequest(
                queries=[drafter_pb2.DraftQuery(history=[*history, ids[1]], n=10)], mode=mode))
            assert not set(r.drafts[0].item_ids) & set(ids)
        with capture_logs() as logs:
            gate.set()
            t0 = time.monotonic()
            while not any(e["event"] == "drafter indexed" for e in logs):  # logged once the backlog is done
                assert time.monotonic() - t0 < 30.0, {m: d.pending() for m, d in svc._indexed_modes().items()}
                assert not any(e["log_level"] == "error" for e in logs), logs
                await asyncio.sleep(0.05)
        assert pending("retrieval") == pending("self") == 0
        [done] = [e for e in logs if e["event"] == "drafter indexed"]
        assert {m: (p["indexed"], p["pending"], p["not_drafted"]) for m, p in done["modes"].items()} == {
            "retrieval": (n0 + EXTRA, 0, EXTRA // 3), "self": (n0 + EXTRA, 0, 0)}  # a third have no text
        for mode in ("retrieval", "self"):
            r = await stack.drafter.Draft(drafter_pb2.DraftRequest(
                queries=[drafter_pb2.DraftQuery(history=history, n=EXTRA, prefixes=under.prefixes)], mode=mode))
            got = set(r.drafts[0].item_ids)
            with_text = {i for j, i in enumerate(ids) if j % 3}
            # the self-drafter drafts from SIDs: every item; retrieval: only those it could read
            assert got == (with_text if mode == "retrieval" else set(ids)), mode
    finally:
        gate.set()
        await stack.stop()


async def test_modes_loads_only_the_drafters_asked_for(redis_url, namespace, serving_bundle_dir):
    with pytest.raises(ValueError, match="unknown drafter mode"):
        DrafterSettings(modes="self,vector")
    stack = Stack(redis_url, namespace, serving_bundle_dir, drafter_overrides={"modes": "self"})
    stack.channels = {}
    await stack.start_one("itemset")
    try:
        await stack.start_one("drafter")
        d = await stack.drafter.Describe(drafter_pb2.DescribeDrafterRequest())
        assert list(d.modes) == ["self"] and d.mode == "self"  # the bundle's best (retrieval) is not loaded
        with pytest.raises(grpc.aio.AioRpcError) as e:
            await stack.drafter.Draft(drafter_pb2.DraftRequest(
                queries=[drafter_pb2.DraftQuery(history=["x"], n=5)], mode="retrieval"))
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "mode" in e.value.details()
        assert "retrieval" in e.value.details() and "['self']" in e.value.details()
        # a mode the bundle lacks: the service does not start, naming the setting
        runner = Runner(DrafterService(DrafterSettings(**{**stack._settings("drafter").model_dump(), "port": 0,
                                                           "modes": "sasrec"})))
        try:
            with pytest.raises(ValueError, match="modes: \\['sasrec'\\] not in bundle"):
                await runner.start()
        finally:
            await runner.stop(0)
    finally:
        await stack.stop()
