"""Reading the catalogue: every read resolves one version and reads exactly it.

A read of the current version resolves ``current`` first, then reads with the
check that the version is still stored (published and not pruned) in the
same MULTI; a version pruned in between is resolved again. A version's
content is its layers' overlays over its data (:mod:`.keys`): its layout is
read once from its meta and kept (it stays right while the version is
stored), and each field is read from every layer in the same MULTI and merged.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any

from redis.client import NEVER_DECODE

from specrec_rpc.errors import FailedPrecondition, Unavailable
from specrec_rpc.packed import Columns, unpack
from specrec_rpc.v1 import itemset_pb2

from .keys import EMPTY_FINGERPRINT, Keys, Layout, Record, merge_layers, parse_mask
from .metrics import REDIS_SECONDS


class VersionNotFound(LookupError):
    """A catalogue version that is not (or no longer) stored: NOT_FOUND."""


class CatalogueEmpty(FailedPrecondition):
    pass


@dataclass
class CatalogueInfo:
    version: str  # "" when the namespace holds no version yet
    n_items: int
    level_sizes: list[int]
    stored_versions: list[str]
    fingerprint: str = EMPTY_FINGERPRINT  # of the version's content
    bundle: str = ""  # fingerprint of the bundle the catalogue belongs to


class CatalogueReads:
    """The read half of :class:`~.store.RedisCatalogue` (needs ``r``, ``keys``, ``ns``, ``_t``)."""

    # what RedisCatalogue provides
    r: Any  # the redis.asyncio client (standalone, Sentinel or cluster)
    keys: Keys
    ns: str
    default_level_sizes: list[int] | None
    _layouts: dict[str, Layout]  # version -> its layout, as read once (see layout())
    pipe: Callable[..., Any]  # a pipeline on the client (MULTI by default)
    _t: Callable[[str, Awaitable[Any]], Awaitable[Any]]  # the awaitable, timed under the operation's name

    async def state(self) -> tuple[str | None, list[int] | None]:
        """(current version or None, level sizes or None), in one round trip."""
        k = self.keys
        cur, ls = await self._t("state", self.r.mget([k.key("current"), k.key("level_sizes")]))
        return (cur or None), ([int(x) for x in ls.split(",")] if ls else None)

    async def level_sizes(self) -> list[int] | None:
        return (await self.state())[1] or self.default_level_sizes

    async def fingerprint(self, version: str) -> str:
        """The content fingerprint a version's meta records."""
        fp = await self._t("fingerprint", self.r.hget(self.keys.vkey(version, "meta"), "fingerprint"))
        return fp or EMPTY_FINGERPRINT

    async def stored_versions(self) -> list[str]:
        return list(await self._t("versions", self.r.zrange(self.keys.key("versions"), 0, -1)))

    async def layout(self, version: str) -> Layout:
        """Where ``version``'s content lives (kept once read: it stays right while the version is stored)."""
        lay = self._layouts.get(version)
        if lay is None:
            raw = await self._t("layout", self.r.hmget(self.keys.vkey(version, "meta"), ["data", "layers"]))
            if raw[0] is None:
                if await self._t("versions", self.r.zscore(self.keys.key("versions"), version)) is None:
                    raise await self._not_found(version)
                raise FailedPrecondition(f"catalogue version {version!r} was written by an item set older than its "
                                         f"layered layout: bulk-load the catalogue again (itemset_svc.load --force)")
            lay = Layout.of_meta({"data": raw[0], "layers": raw[1]})
            if len(self._layouts) > 64:
                self._layouts.clear()
            self._layouts[version] = lay
        return lay

    def hmget_layers(self, p, lay: Layout, name: str, fields: list[str]) -> int:
        """Queue HMGET ``fields`` of every layer of ``name`` on pipeline ``p``; returns how many answers."""
        keys = lay.keys(self.keys, name)
        for key in keys:
            p.hmget(key, fields)
        return len(keys)

    async def hmget(self, op: str, version: str, name: str, fields: list[str]) -> list[str | None]:
        """Fields of ``name`` in ``version`` (its layers merged), in one MULTI; no check that it is stored."""
        if not fields:
            return []
        p = self.pipe()
        self.hmget_layers(p, await self.layout(version), name, fields)
        return merge_layers(await self._t(op, p.execute()))

    async def info(self) -> CatalogueInfo:
        k = self.keys
        cur, ls = await self.state()
        p = self.pipe()
        p.zrange(k.key("versions"), 0, -1)
        p.get(k.key("bundle"))
        if cur:
            p.hget(k.vkey(cur, "meta"), "items")
            p.hget(k.vkey(cur, "meta"), "fingerprint")
        res = await self._t("info", p.execute())
        return CatalogueInfo(cur or "", int(res[2] or 0) if cur else 0, ls or self.default_level_sizes or [],
                             list(res[0]),
                             (res[3] if cur else None) or EMPTY_FINGERPRINT, res[1] or "")

    async def _not_found(self, version: str) -> VersionNotFound:
        stored = await self.stored_versions()
        return VersionNotFound(f"catalogue version {version!r} is not stored "
                               f"(stored: {', '.join(stored) if stored else 'none'})")

    async def _read(self, op: str, version: str, fill: Callable) -> tuple[str, list]:
        """Run ``fill(pipe, v, layout)``'s commands on version ``v`` ("" = current) in one
        MULTI, together with the check that ``v`` is published and stored."""
        for _ in range(3):
            v: str | None = version
            if not v:
                v, _ls = await self.state()
                if v is None:
                    raise CatalogueEmpty(
                        f"namespace {self.ns!r} holds no catalogue version yet (bulk-load a bundle first)"
                    )
            try:
                lay = await self.layout(v)
            except VersionNotFound:
                if version:
                    raise
                continue  # the current version was pruned meanwhile: resolve again
            p = self.pipe()
            p.zscore(self.keys.key("versions"), v)
            fill(p, v, lay)
            res = await self._t(op, p.execute())
            if res[0] is not None:
                return v, res[1:]
            if version:
                raise await self._not_found(version)
            # the current version was pruned between the two round trips: resolve again
        raise Unavailable("the catalogue changes faster than it can be read")

    async def resolve(self, item_ids: Sequence[str], version: str = "") -> tuple[str, list[Record | None]]:
        ids = list(item_ids)
        v, res = await self._read("resolve", version,
                                  lambda p, v, lay: self.hmget_layers(p, lay, "items", ids) if ids else None)
        raws = merge_layers(res) if ids else []
        return v, [Record.loads(i, raw) if raw else None for i, raw in zip(ids, raws)]

    async def lookup(self, sids: Sequence[str], version: str = "") -> tuple[str, list[str | None]]:
        """Per SID ("12.7.200.0"): the item id, or None when not a valid SID of the version."""
        sids = list(sids)

        v, res = await self._read("lookup", version,
                                  lambda p, v, lay: self.hmget_layers(p, lay, "sid2item", sids) if sids else None)
        return v, (merge_layers(res) if sids else [])

    async def allowed(self, prefixes: Sequence[str], version: str = "") -> tuple[str, list[list[int]]]:
        """Per prefix field ("" = first level, "12.7"): allowed next codes, ascending."""
        prefixes = list(prefixes)
        v, res = await self._read("allowed", version,
                                  lambda p, v, lay: self.hmget_layers(p, lay, "pfx", prefixes) if prefixes else None)
        raws = merge_layers(res) if prefixes else []
        return v, [sorted(parse_mask(raw)) for raw in raws]

    async def snapshot_columns(self, version: str = "") -> tuple[str, list[int], Columns, dict, str] | None:
        """A version from its data's packed copy (:mod:`.keys`), without reading the items hash: (version,
        level sizes, the packed items by column, {item id: its Record, or None when gone} for the items changed
        since the copy was written, fingerprint); None when the data has no packed copy (read
        :meth:`snapshot`)."""
        k = self.keys

        def fill(p, v, lay):
            p.get(k.key("level_sizes"))
            p.hget(k.vkey(v, "meta"), "fingerprint")
            p.hlen(k.dkey(lay.data, "packed"))
            p.smembers(k.dkey(lay.data, "dirty"))  # with the layers' fields, in one MULTI: folds move ids
            for name in lay.layers:  # from the layers to the dirty set, never lose one
                p.hkeys(k.vkey(name, "items"))

        v, res = await self._read("snapshot", version, fill)
        n_packed = int(res[2])
        if not n_packed:
            return None
        lay = await self.layout(v)
        ls = [int(x) for x in res[0].split(",")] if res[0] else (self.default_level_sizes or [])
        changed = sorted(set(res[3]).union(*res[4:]))
        t0 = time.perf_counter()
        msgs = []
        for i in range(n_packed):
            raw = await self.r.execute_command("HGET", k.dkey(lay.data, "packed"), str(i), **{NEVER_DECODE: True})
            if raw is None:
                raise await self._not_found(v)  # the data went with its last version meanwhile
            msgs.append(itemset_pb2.PackedItems.FromString(raw))
        REDIS_SECONDS.labels("snapshot_packed").observe(time.perf_counter() - t0)
        raws = await self.hmget("snapshot", v, "items", changed) if changed else []
        if await self._t("snapshot", self.r.zscore(k.key("versions"), v)) is None:
            raise await self._not_found(v)  # pruned while we read it
        cols = await asyncio.to_thread(unpack, msgs, len(ls))
        return v, ls, cols, {i: (Record.loads(i, raw) if raw else None) for i, raw in zip(changed, raws)}, \
            res[1] or EMPTY_FINGERPRINT

    async def snapshot(self, version: str = "", batch: int = 2000) -> tuple[str, list[int], list[Record], str]:
        """Every item of a version, sorted by row, and the version's fingerprint."""
        k = self.keys

        def fill(p, v, lay):
            p.get(k.key("level_sizes"))
            p.hget(k.vkey(v, "meta"), "fingerprint")
            for name in lay.layers:  # the overlays first: one folded into the data meanwhile is held here
                p.hgetall(k.vkey(name, "items"))

        v, res = await self._read("snapshot", version, fill)
        lay = await self.layout(v)
        ls = [int(x) for x in res[0].split(",")] if res[0] else (self.default_level_sizes or [])
        raws: dict[str, str] = {}
        cursor = 0
        t0 = time.perf_counter()
        while True:
            cursor, chunk = await self.r.hscan(k.dkey(lay.data, "items"), cursor, count=batch)
            raws.update(chunk)
            if cursor == 0:
                break
        for overlay in reversed(res[2:]):  # oldest first
            for item_id, raw in overlay.items():
                if raw:
                    raws[item_id] = raw
                else:
                    raws.pop(item_id, None)
        records = {item_id: Record.loads(item_id, raw) for item_id, raw in raws.items()}
        REDIS_SECONDS.labels("snapshot_scan").observe(time.perf_counter() - t0)
        if await self._t("snapshot", self.r.zscore(k.key("versions"), v)) is None:
            raise await self._not_found(v)  # pruned while we read it
        return v, ls, sorted(records.values(), key=lambda r: r.row), res[1] or EMPTY_FINGERPRINT
