"""Reading the catalogue: every read resolves one version and reads exactly it.

A read of the current version resolves ``current`` first, then reads with the
check that the version is still stored (published and not pruned) in the
same MULTI; a version pruned in between is resolved again.
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any

from specrec_rpc.errors import FailedPrecondition, Unavailable

from .keys import EMPTY_FINGERPRINT, Keys, Record, parse_mask
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

    async def info(self) -> CatalogueInfo:
        k = self.keys
        cur, ls = await self.state()
        p = self.pipe()
        p.zrange(k.key("versions"), 0, -1)
        p.get(k.key("bundle"))
        if cur:
            p.hlen(k.vkey(cur, "items"))
            p.hget(k.vkey(cur, "meta"), "fingerprint")
        res = await self._t("info", p.execute())
        return CatalogueInfo(cur or "", int(res[2]) if cur else 0, ls or self.default_level_sizes or [], list(res[0]),
                             (res[3] if cur else None) or EMPTY_FINGERPRINT, res[1] or "")

    async def _not_found(self, version: str) -> VersionNotFound:
        stored = await self.stored_versions()
        return VersionNotFound(f"catalogue version {version!r} is not stored "
                               f"(stored: {', '.join(stored) if stored else 'none'})")

    async def _read(self, op: str, version: str, fill: Callable) -> tuple[str, list]:
        """Run ``fill(pipe, v)``'s commands on version ``v`` ("" = current) in one
        MULTI, together with the check that ``v`` is published and stored."""
        for _ in range(3):
            v: str | None = version
            if not v:
                v, _ls = await self.state()
                if v is None:
                    raise CatalogueEmpty(
                        f"namespace {self.ns!r} holds no catalogue version yet (bulk-load a bundle first)"
                    )
            p = self.pipe()
            p.zscore(self.keys.key("versions"), v)
            fill(p, v)
            res = await self._t(op, p.execute())
            if res[0] is not None:
                return v, res[1:]
            if version:
                raise await self._not_found(version)
            # the current version was pruned between the two round trips: resolve again
        raise Unavailable("the catalogue changes faster than it can be read")

    async def resolve(self, item_ids: Sequence[str], version: str = "") -> tuple[str, list[Record | None]]:
        ids = list(item_ids)
        v, res = await self._read(
            "resolve", version, lambda p, v: p.hmget(self.keys.vkey(v, "items"), ids) if ids else None
        )
        raws = res[0] if ids else []
        return v, [Record.loads(i, raw) if raw else None for i, raw in zip(ids, raws)]

    async def lookup(self, sids: Sequence[str], version: str = "") -> tuple[str, list[str | None]]:
        """Per SID ("12.7.200.0"): the item id, or None when not a valid SID of the version."""
        sids = list(sids)

        def fill(p, v):
            if sids:
                p.smismember(self.keys.vkey(v, "sids"), sids)
                p.hmget(self.keys.vkey(v, "sid2item"), sids)

        v, res = await self._read("lookup", version, fill)
        if not sids:
            return v, []
        return v, [(owner or None) if int(member) else None for member, owner in zip(res[0], res[1])]

    async def allowed(self, prefixes: Sequence[str], version: str = "") -> tuple[str, list[list[int]]]:
        """Per prefix field ("" = first level, "12.7"): allowed next codes, ascending."""
        prefixes = list(prefixes)
        v, res = await self._read("allowed", version,
                                  lambda p, v: p.hmget(self.keys.vkey(v, "pfx"), prefixes) if prefixes else None)
        raws = res[0] if prefixes else []
        return v, [sorted(parse_mask(raw)) for raw in raws]

    async def snapshot(self, version: str = "", batch: int = 2000) -> tuple[str, list[int], list[Record], str]:
        """Every item of a version, sorted by row, and the version's fingerprint."""
        k = self.keys

        def fill(p, v):
            p.get(k.key("level_sizes"))
            p.hget(k.vkey(v, "meta"), "fingerprint")

        v, res = await self._read("snapshot", version, fill)
        ls = [int(x) for x in res[0].split(",")] if res[0] else (self.default_level_sizes or [])
        records: dict[str, Record] = {}
        cursor = 0
        t0 = time.perf_counter()
        while True:
            cursor, chunk = await self.r.hscan(k.vkey(v, "items"), cursor, count=batch)
            for item_id, raw in chunk.items():
                records[item_id] = Record.loads(item_id, raw)
            if cursor == 0:
                break
        REDIS_SECONDS.labels("snapshot_scan").observe(time.perf_counter() - t0)
        if await self._t("snapshot", self.r.zscore(k.key("versions"), v)) is None:
            raise await self._not_found(v)  # pruned while we read it
        return v, ls, sorted(records.values(), key=lambda r: r.row), res[1] or EMPTY_FINGERPRINT
