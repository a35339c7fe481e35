"""The store's bulk load: a whole catalogue published as one fresh version, built from nothing.

The records are written into a staged version in pipelined chunks (items and
SIDs, then the prefix masks, then the meta with the content fingerprint) and
published like any write (:mod:`.publish`), whatever the current version is.
Loading over a catalogue that gives some row to another item, or uses other
level sizes, is refused unless ``force``. :mod:`.load` reads a bundle and
calls :meth:`CatalogueBulkLoad.bulk_load`; a restore (:mod:`.integrity`) calls
:meth:`CatalogueBulkLoad._bulk_load` from inside a write.
"""

from __future__ import annotations

from collections.abc import Sequence

from .keys import STAGING_TTL_S, Record, build_masks, format_mask, records_fingerprint, sid_str
from .metrics import CATALOGUE_ITEMS, ITEMS_WRITTEN, WRITES
from .publish import VersionPublisher


class CatalogueBulkLoad(VersionPublisher):
    """The bulk-load half of :class:`~.store.RedisCatalogue`."""

    async def bulk_load(self, records: Sequence[Record], level_sizes: Sequence[int], force: bool = False,
                        chunk: int = 2000, progress: bool = False, bundle: str = "") -> str:
        """Publish ``records`` as a fresh version (built from nothing, pipelined
        in chunks) and make it current, whatever the current version is.
        ``bundle``: the fingerprint of the bundle the catalogue belongs to."""
        level_sizes = [int(x) for x in level_sizes]
        self._check_records(records, level_sizes)
        async with self._lock:
            cur, ls = await self.state()
            if cur and not force:
                await self._check_compatible(cur, ls, records, level_sizes)
            return await self._bulk_load(records, level_sizes, chunk, progress, bundle)

    async def _bulk_load(self, records: Sequence[Record], level_sizes: Sequence[int], chunk: int = 2000,
                         progress: bool = False, bundle: str = "", new_epoch: bool = False) -> str:
        """:meth:`bulk_load` with the write lock already held (restores call it from inside a write)."""
        level_sizes = [int(x) for x in level_sizes]
        cur, _ = await self.state()
        new = await self._new_version(new_epoch)
        bar = None
        if progress:
            from tqdm.auto import tqdm

            bar = tqdm(total=len(records), unit="item", desc=f"loading version {new}")
        try:
            await self._stage(new, None, "load", cur)
            await self._load_items(new, records, chunk, bar)
            next_row = max((r.row for r in records), default=-1) + 1
            if bundle:
                await self._t("load_chunk", self.r.set(self.keys.key("bundle"), bundle))
            _, need, acked = await self._publish(new, "*", "load", cur, ",".join(map(str, level_sizes)), str(next_row))
        except BaseException:
            await self._drop(new)
            WRITES.labels("load", "failed").inc()
            raise
        finally:
            if bar is not None:
                bar.close()
        if acked < need:
            await self._prune()
            raise self._unacknowledged("load", new, need, acked)
        WRITES.labels("load", "ok").inc()
        ITEMS_WRITTEN.labels("load").inc(len(records))
        CATALOGUE_ITEMS.labels(self.ns).set(len(records))
        await self._prune()
        self.log.info("published", version=new, op="load", base=cur, items=len(records))
        return new

    @staticmethod
    def _check_records(records: Sequence[Record], level_sizes: list[int]) -> None:
        L = len(level_sizes)
        ids = [r.item_id for r in records]
        if len(set(ids)) != len(ids):
            raise ValueError("duplicate item ids in the catalogue")
        seen_sids: dict[tuple, str] = {}
        for r in records:
            if len(r.sid) != L or any(not 0 <= c < n for c, n in zip(r.sid, level_sizes)):
                raise ValueError(f"item {r.item_id!r}: SID {list(r.sid)} does not fit level sizes {level_sizes}")
            if r.sid in seen_sids:
                raise ValueError(f"items {seen_sids[r.sid]!r} and {r.item_id!r} share SID {sid_str(r.sid)}")
            seen_sids[r.sid] = r.item_id

    async def _load_items(self, new: str, records: Sequence[Record], chunk: int, bar) -> None:
        k = self.keys
        for lo in range(0, len(records), chunk):
            part = records[lo : lo + chunk]
            p = self.pipe(transaction=False)
            p.sadd(k.vkey(new, "sids"), *[sid_str(r.sid) for r in part])
            p.hset(k.vkey(new, "sid2item"), mapping={sid_str(r.sid): r.item_id for r in part})
            p.hset(k.vkey(new, "items"), mapping={r.item_id: r.dumps() for r in part})
            p.expire(k.vkey(new, "sids"), STAGING_TTL_S)
            await self._t("load_chunk", p.execute())
            if bar is not None:
                bar.update(len(part))
        fields = list(build_masks(r.sid for r in records).items())
        for lo in range(0, len(fields), chunk * 4):
            p = self.pipe(transaction=False)
            p.hset(k.vkey(new, "pfx"), mapping={f: format_mask(m) for f, m in fields[lo : lo + chunk * 4]})
            await self._t("load_chunk", p.execute())
        p = self.pipe()
        p.hset(k.vkey(new, "meta"), mapping={"fingerprint": records_fingerprint(records), "items": len(records)})
        for key in k.version_keys(new):
            p.expire(key, STAGING_TTL_S)
        await p.execute()

    async def _check_compatible(self, cur: str, ls: list[int] | None, records: Sequence[Record],
                                level_sizes: list[int]) -> None:
        if ls and list(ls) != list(level_sizes):
            raise ValueError(f"namespace {self.ns!r} holds SIDs with level sizes {ls}, the bundle has {level_sizes} "
                             f"(force to replace)")
        by_row = {r.row: r.item_id for r in records}
        async for item_id, raw in self.r.hscan_iter(self.keys.vkey(cur, "items"), count=2000):
            row = Record.loads(item_id, raw).row
            if row in by_row and by_row[row] != item_id:
                raise ValueError(f"row {row} is item {item_id!r} in version {cur} but {by_row[row]!r} in the bundle: "
                                 f"rows must stay stable (force to replace)")
