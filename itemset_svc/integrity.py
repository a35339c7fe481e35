"""Catalogue integrity: the item set's own copy of the catalogue (the mirror), kept and restored.

The service keeps its own copy of the current catalogue (the *mirror*,
:mod:`.mirror`: every item of the version it last published or saw). A watch
loop compares Redis with it every ``watch_s``: when Redis lost the catalogue
(restarted without persistence, flushed) or went back to an older version of
the same lineage (restored from an old snapshot), the mirror is published again
as a new version -- in a new epoch, so the version name is new -- and writes
wait for that. A write never starts from an empty Redis while the mirror
holds a catalogue. So nothing is lost and nothing is published smaller than
what it was based on (see :mod:`.publish`); followers see a new version and
fetch it. The choice is to restore rather than to refuse writes: restoring
keeps serving and loses nothing; the restore is logged and counted
(``specrec_itemset_restores_total``).

Replicated Redis (Sentinel, or a primary with replicas). A write is
acknowledged only once ``WAIT`` says a replica holds it (:mod:`.publish`), so
an acknowledged write survives the loss of the primary. After a failover the
promoted replica may lack writes that were never acknowledged: there, an
older version than the mirror's is what a failover leaves, not a loss, and
the mirror follows it (restoring would bring back versions whose names the
new primary may hand out again). While no primary answers, reads of the
mirror's version come from the mirror (:mod:`.servicer`), and writes retry
(``write_retry_s``, within the caller's deadline), then answer UNAVAILABLE.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from typing import Any

from specrec_rpc.errors import Unavailable

from .bulk import CatalogueArrays
from .keys import version_counter
from .metrics import RESTORES
from .mirror import Mirror, RecordTable, read_mirror
from .settings import ItemSetSettings
from .store import REDIS_DOWN, RedisCatalogue, WriteResult


class CatalogueIntegrity:
    """The mirror's half of :class:`~.service.ItemSetService`: keep the mirror, restore Redis from it."""

    # what ItemSetService provides (set in its __init__ and start())
    settings: ItemSetSettings
    log: Any  # structlog logger
    store: RedisCatalogue | None
    mirror: Mirror | None
    _refreshes: set[asyncio.Task]

    @property
    def live_store(self) -> RedisCatalogue:
        """The store, from start() until stop()."""
        if self.store is None:
            raise Unavailable("the item set is not started, or is stopping")
        return self.store

    async def refresh_mirror(self) -> None:
        """Copy the current catalogue into the mirror (a full read; after a rollback or another replica's write)."""
        info = await self.live_store.info()
        if not info.version:
            return
        self.mirror = await read_mirror(self.live_store, info.version, info.bundle)

    def index_mirror(self) -> None:
        """Build the mirror's id index (:attr:`RecordTable.pos`) on a thread, if it has none yet: called once the
        followers' packed snapshot is made (the two would share one GIL), so they do not wait for it, and a
        write or a read by id later finds it built."""
        records = self.mirror.records if self.mirror is not None else None
        if isinstance(records, RecordTable) and not records.indexed:
            task = asyncio.ensure_future(asyncio.to_thread(lambda: records.pos))
            self._refreshes.add(task)
            task.add_done_callback(self._refreshes.discard)

    def mirror_write(self, res: WriteResult) -> None:
        """Apply a write this replica published to the mirror (its changes only). A write made from another
        version than the mirror's (another replica wrote in between) leaves the mirror inexact: it is read
        from Redis again."""
        if self.mirror is not None and not self.mirror.apply(res):
            self.log.info("mirror behind a write's base: reading the catalogue again", base=res.base,
                          version=res.version)
            self._background_refresh()

    def _background_refresh(self) -> None:
        async def refresh() -> None:
            try:
                await self.refresh_mirror()
            except Exception as e:  # noqa: BLE001 - the watch loop looks again
                self.log.warning("mirror refresh failed", error=str(e))

        task = asyncio.ensure_future(refresh())
        self._refreshes.add(task)
        task.add_done_callback(self._refreshes.discard)

    async def _guard_empty(self) -> None:
        """Before a write finds Redis without a catalogue: restore the mirror first (inside the write's lock)."""
        if self.mirror is not None:
            await self._restore("a write found no current version", locked=True)

    def _lost(self, cur: str | None) -> bool:
        """Redis lost the mirror's catalogue (none there) or, a lone Redis, went back to an older version of
        its lineage. With replicas an older version is what a failover leaves: only writes that were never
        acknowledged are missing, so the mirror follows it instead."""
        m = self.mirror
        if m is None or cur == m.version:
            return False
        if cur is None:
            return True
        if self.store is not None and self.store.replicated:
            return False
        same_lineage = cur.rsplit(".", 1)[0] == m.version.rsplit(".", 1)[0]
        return same_lineage and version_counter(cur) < version_counter(m.version)

    async def _restore(self, reason: str, locked: bool = False) -> bool:
        """Publish the mirror again, in a new epoch (after a loss there is none; after a rollback the old
        counter would repeat names). One replica restores (a lock in Redis); the others follow it: a
        write waits for that restore, the watch loop sees the new version on its next look."""
        m, store = self.mirror, self.live_store
        assert m is not None  # called only with a mirror to publish
        token = await store.try_lock("restoring", 60)
        if token is None:
            if locked:
                await self._wait_restored()
            return False
        try:
            # under the write lock (locked: inside a write already), so no write of this process lands
            # between the look at Redis and the restore, and the records are the mirror's latest
            async with contextlib.nullcontext() if locked else store._lock:
                cur, _ = await store.state()
                if not self._lost(cur):
                    return False  # another replica got there first
                _, ls, cols, _ = m.columns()
                version = await store._bulk_load(CatalogueArrays(cols.ids, cols.codes, cols.unseen, cols.rows,
                                                                 cols.titles, cols.texts), ls, bundle=m.bundle,
                                                 new_epoch=True)
        finally:
            await store.unlock("restoring", token)
        RESTORES.labels(store.ns).inc()
        self.log.error("catalogue restored from the item set's copy", reason=reason, lost_version=m.version,
                       version=version, items=len(cols))
        # the same content under a new name: followers need no new copy (the fingerprint is the bulk load's: a
        # mirror of a catalogue loaded before 0.3 held a SHA-256 one, and followers fetch once more for it)
        m.renamed(version, await store.fingerprint(version))
        return True

    async def _wait_restored(self, timeout_s: float = 30.0) -> None:
        t0 = time.monotonic()
        while (await self.live_store.state())[0] is None:
            if time.monotonic() - t0 > timeout_s:
                raise Unavailable("the catalogue is being restored by another item-set replica: retry")
            await asyncio.sleep(0.05)

    async def check_integrity(self) -> str:
        """One look at Redis against the mirror; what was done ("" when nothing)."""
        store = self.live_store
        # the look is taken under the write lock: a write of this process holds it from its base to its publish
        # and after (pruning), and its changes reach the mirror as soon as it lets go. Looking in between would
        # take this process's own write for another replica's, and follow it by reading the whole catalogue
        # again: a full copy of every record, and a mirror without its log of changes, so every watcher then
        # fetches the whole catalogue too (RSS steps of tens of MB in a soak with an upsert a second)
        async with store._lock:
            m = self.mirror
            cur, _ = await store.state()
            # after a failover the new primary can give a name the old one had used to other content, and a
            # write made from a version the mirror had not seen leaves it inexact
            differs = (m is not None and cur is not None and cur == m.version
                       and (not m.exact or await store.fingerprint(cur) != m.fingerprint))
        if m is None:
            if cur is not None:
                await self.refresh_mirror()
            return ""
        if cur == m.version:
            if differs:
                await self.refresh_mirror()
                return "followed"
            return ""
        if self._lost(cur):
            done = await self._restore("Redis holds no catalogue (its data was lost)" if cur is None else
                                       f"Redis went back to version {cur} (its data was rolled back)")
            return "restored" if done else ""  # "": another replica restores; the next look follows it
        await self.refresh_mirror()  # another replica wrote, or an operator loaded: follow it
        return "followed"

    async def _watch_loop(self) -> None:
        while True:
            await asyncio.sleep(self.settings.watch_s)
            try:
                await self.check_integrity()
            except asyncio.CancelledError:
                raise
            except REDIS_DOWN:
                pass  # Redis is down: nothing to compare now
            except Unavailable as e:  # e.g. a restore that no replica acknowledged: the next look follows it
                self.log.warning("integrity check incomplete", error=str(e))
            except Exception:  # noqa: BLE001 - keep watching
                self.log.exception("integrity check failed")
