"""The item-set service (``python -m itemset_svc``): its lifecycle around the store.

:class:`ItemSetService` starts the tokenizer (its text embedder warms up in
the background), connects to Redis (waiting ``startup_wait_s``, then serving
UNAVAILABLE until Redis answers), checks the catalogue against the bundle and
bulk-loads it into an empty namespace, starts the watch loop, and stops all of
it. The pieces it serves with have a file each:

- :mod:`.servicer`   the gRPC RPCs (validation in :mod:`.validation`, error mapping, write retries);
- :mod:`.integrity`  the mirror of the catalogue, the watch loop and restores;
- :mod:`.store`      the catalogue in Redis (reads, writes, publishing versions, bulk load).
"""

from __future__ import annotations

import asyncio
import time

import grpc

from specrec_rpc.redis_url import safe_url
from specrec_rpc.server import Service
from specrec_rpc.v1 import itemset_pb2_grpc

from .integrity import CatalogueIntegrity
from .mirror import Mirror
from .servicer import ItemSetServicer
from .settings import ItemSetSettings
from .store import REDIS_DOWN, NotAcknowledged, RedisCatalogue
from .tokenizer import SidTokenizer


class ItemSetService(CatalogueIntegrity, Service):
    name = "itemset"
    grpc_services = ("specrec.v1.ItemSet",)

    def __init__(self, settings: ItemSetSettings):
        super().__init__(settings)
        self.settings: ItemSetSettings = settings
        self.store: RedisCatalogue | None = None
        self.tokenizer: SidTokenizer | None = None
        self._background: asyncio.Task | None = None
        self._tokenizer_ready: asyncio.Task | None = None  # the text embedder's first load (start() begins it)
        self._watch: asyncio.Task | None = None
        self.mirror: Mirror | None = None
        self._refreshes: set[asyncio.Task] = set()

    def add_to_server(self, server: grpc.aio.Server) -> None:
        itemset_pb2_grpc.add_ItemSetServicer_to_server(ItemSetServicer(self), server)

    async def encode(self, texts: list[str]):
        tok = self.tokenizer
        assert tok is not None  # the servicer encodes only when there is a tokenizer
        if self._tokenizer_ready is not None:
            await asyncio.shield(self._tokenizer_ready)  # its first load, once
        return await asyncio.to_thread(tok.codes, texts)

    async def _warm_up_tokenizer(self, tok) -> None:
        t0 = time.perf_counter()
        await asyncio.to_thread(tok.warm_up)
        self.log.info("tokenizer ready", bundle=str(self.settings.bundle), level_sizes=tok.level_sizes,
                      warmup_s=round(time.perf_counter() - t0, 2))

    async def start(self) -> None:
        s = self.settings
        if s.bundle is not None:
            self.tokenizer = await asyncio.to_thread(SidTokenizer.from_bundle, s.bundle)
            if s.warm_up:  # in the background: reads and SID checks need no text embedder, an upsert waits for it
                self._tokenizer_ready = asyncio.create_task(self._warm_up_tokenizer(self.tokenizer))
        store = RedisCatalogue.from_settings(s, keep_versions=s.keep_versions,
                                             default_level_sizes=self.tokenizer.level_sizes if self.tokenizer else None)
        if await self._wait_for_redis(store, s.startup_wait_s):
            try:
                await self._prepare(store)
            except BaseException:
                await store.close()
                raise
        else:
            self.log.error("redis unreachable; serving anyway (RPCs answer UNAVAILABLE until it is back)",
                           redis_url=safe_url(s.redis_url), waited_s=s.startup_wait_s)
            self._background = asyncio.create_task(self._prepare_later(store))
        self.store = store
        store.guard_empty = self._guard_empty
        if s.watch_s > 0:
            self._watch = asyncio.create_task(self._watch_loop())

    async def _wait_for_redis(self, store: RedisCatalogue, wait_s: float) -> bool:
        deadline = time.monotonic() + wait_s
        while True:
            try:
                await store.ping()
                return True
            except REDIS_DOWN as e:
                if time.monotonic() >= deadline:
                    return False
                self.log.warning("waiting for redis", error=repr(e))
                await asyncio.sleep(min(1.0, max(0.05, deadline - time.monotonic())))

    async def _prepare_later(self, store: RedisCatalogue) -> None:
        while True:
            if await self._wait_for_redis(store, 5.0):
                try:
                    await self._prepare(store)
                    return
                except REDIS_DOWN:
                    pass
                except Exception:  # noqa: BLE001
                    self.log.exception("catalogue preparation failed")
                    return

    async def _prepare(self, store: RedisCatalogue) -> None:
        """Check the catalogue against the tokenizer; bulk-load the bundle into an empty namespace."""
        s = self.settings
        cur, ls = await store.state()
        if self.tokenizer is not None and ls is not None and ls != self.tokenizer.level_sizes:
            raise RuntimeError(f"namespace {s.namespace!r} holds SIDs with level sizes {ls}, but the bundle "
                               f"{s.bundle} tokenizes to {self.tokenizer.level_sizes}")
        if cur is None and s.bundle is not None and s.load_if_empty:
            token = await store.try_lock("loading", 600)
            if token is None:
                self.log.info("another replica is loading the catalogue")
                return
            try:
                if (await store.state())[0] is None:
                    from .load import load_bundle

                    t0 = time.perf_counter()
                    version: str | None
                    try:
                        version = await load_bundle(s.bundle, store)
                    except NotAcknowledged as e:  # published; the bundle can load it again if it is lost
                        self.log.warning("bulk load not acknowledged by the replicas", error=str(e))
                        version = (await store.state())[0]
                    self.log.info("bulk-loaded bundle into empty namespace", version=version,
                                  seconds=round(time.perf_counter() - t0, 2))
            finally:
                await store.unlock("loading", token)
        else:
            self.log.info("catalogue", namespace=s.namespace, version=cur, level_sizes=ls)
        self.store = store
        await self.refresh_mirror()

    async def stop(self) -> None:
        if self._tokenizer_ready is not None and not self._tokenizer_ready.done():
            await asyncio.wait([self._tokenizer_ready], timeout=30)  # its thread cannot be cancelled
        if self._watch is not None:
            self._watch.cancel()
            try:
                await self._watch
            except (asyncio.CancelledError, Exception):  # noqa: BLE001
                pass
        if self._background is not None:
            self._background.cancel()
            try:
                await self._background
            except (asyncio.CancelledError, Exception):  # noqa: BLE001
                pass
        if self.store is not None:
            try:
                await self.store.close()
            except Exception as e:  # noqa: BLE001
                self.log.warning("closing redis failed", error=repr(e))
            self.store = None
