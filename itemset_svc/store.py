"""The catalogue in Redis: versioned, immutable once published.

Every key of a namespace ``ns`` starts with the hash tag ``{ns}``, so the
whole namespace lives in one Redis Cluster slot and MULTI/EXEC, COPY and Lua
work there as on a standalone server.

Global keys::

    {ns}:current        STRING  the current version ("17")
    {ns}:versions       ZSET    published versions still stored (score = version number)
    {ns}:seq            STRING  version counter (INCR; versions only grow, rollback included)
    {ns}:next_row       STRING  next free catalogue row (rows are never reused)
    {ns}:level_sizes    STRING  codes per SID level, "256,256,256,256"
    {ns}:loading        STRING  short lock so replicas starting together bulk-load once
    {ns}:events         pub/sub channel: JSON {"namespace", "version", "op", "base"} per published version

Per version ``v`` (written once, then only read, until pruned)::

    {ns}:v:<v>:meta      HASH    op, base, created (exists from staging on; the version is
                                 published when it is in {ns}:versions)
    {ns}:v:<v>:sids      SET     valid SIDs, "12.7.200.0"
    {ns}:v:<v>:sid2item  HASH    SID -> item id
    {ns}:v:<v>:items     HASH    item id -> JSON record {row, sid, title, text, unseen}
    {ns}:v:<v>:pfx       HASH    prefix -> allowed next codes with counts, "3:1,9:2"
                                 (prefix "" = first level, "12" = after code 12, ...; the
                                 counts let a deletion drop a code exactly when its last
                                 item goes)

A write (upsert, delete, rollback) stages version ``n = INCR seq``: the base
version's four data keys are COPYed server-side (rollback copies the target
instead), the changes are applied to the copies, and one Lua script checks that
the current pointer still names the base (else the write is retried on the new
base), makes the staged keys persistent, swaps ``current``, adds ``n`` to
``versions`` and publishes. Readers that resolved version ``v`` keep reading
exactly ``v``. Staged keys carry a TTL until published, so a writer that dies
half-way leaves nothing behind for long; a failed write drops its staged keys
and never touches a published version. After each publish the oldest versions
beyond ``keep_versions`` are deleted (the current one is always the newest).
"""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass, field
from typing import Awaitable, Callable, Iterable, Sequence

import numpy as np
import redis.asyncio as aioredis
import structlog
from prometheus_client import Counter, Gauge, Histogram
from redis.asyncio.retry import Retry
from redis.backoff import ExponentialBackoff
from redis.exceptions import BusyLoadingError, ConnectionError as RedisConnectionError, TimeoutError as RedisTimeoutError

from specrec_rpc.errors import FailedPrecondition, InvalidArgument, Unavailable
from specrec_rpc.server import LATENCY_BUCKETS

from .settings import check_namespace

VERSION_KEYS = ("meta", "sids", "sid2item", "items", "pfx")
DATA_KEYS = VERSION_KEYS[1:]
STAGING_TTL_S = 6 * 3600
ROOT = ""  # the prefix field of the first level

REDIS_SECONDS = Histogram("specrec_itemset_redis_seconds", "Redis round trips of the item set, by operation",
                          ["op"], buckets=LATENCY_BUCKETS)
WRITES = Counter("specrec_itemset_writes", "catalogue writes by operation and outcome", ["op", "outcome"])
ITEMS_WRITTEN = Counter("specrec_itemset_items_written", "items added, replaced or removed by writes", ["op"])
COLLISIONS = Counter("specrec_itemset_collisions", "upserted items whose computed RQ codes were already used")
CATALOGUE_ITEMS = Gauge("specrec_itemset_catalogue_items", "items in the version published last", ["namespace"])


class VersionNotFound(LookupError):
    """A catalogue version that is not (or no longer) stored: NOT_FOUND."""


class WriteConflict(RuntimeError):
    """Other writers kept publishing versions while this write was being built: ABORTED."""


class CatalogueEmpty(FailedPrecondition):
    pass


# -- SIDs and prefix masks ---------------------------------------------------------


def sid_str(codes: Iterable[int]) -> str:
    return ".".join(str(int(c)) for c in codes)


def parse_sid(s: str) -> tuple[int, ...]:
    return tuple(int(c) for c in s.split(".")) if s else ()


def prefix_steps(sid: Sequence[int]) -> list[tuple[str, int]]:
    """(prefix field, next code) for every level of a SID."""
    return [(sid_str(sid[:lvl]), int(sid[lvl])) for lvl in range(len(sid))]


def parse_mask(raw: str | None) -> dict[int, int]:
    if not raw:
        return {}
    out = {}
    for part in raw.split(","):
        c, n = part.split(":")
        out[int(c)] = int(n)
    return out


def format_mask(mask: dict[int, int]) -> str:
    return ",".join(f"{c}:{n}" for c, n in sorted(mask.items()) if n > 0)


def build_masks(sids: Iterable[Sequence[int]]) -> dict[str, dict[int, int]]:
    masks: dict[str, dict[int, int]] = {}
    for sid in sids:
        for p, c in prefix_steps(sid):
            m = masks.setdefault(p, {})
            m[c] = m.get(c, 0) + 1
    return masks


@dataclass
class Record:
    """One item as stored in a version."""

    item_id: str
    row: int
    sid: tuple[int, ...]
    title: str = ""
    text: str = ""
    unseen: bool = False

    def dumps(self) -> str:
        return json.dumps({"row": self.row, "sid": sid_str(self.sid), "title": self.title, "text": self.text,
                           "unseen": self.unseen}, ensure_ascii=False, separators=(",", ":"))

    @classmethod
    def loads(cls, item_id: str, raw: str) -> "Record":
        o = json.loads(raw)
        return cls(item_id, int(o["row"]), parse_sid(o["sid"]), o.get("title", ""), o.get("text", ""), bool(o.get("unseen")))


@dataclass
class UpsertSpec:
    """One item to add or replace. ``sid`` None: computed from ``text``."""

    item_id: str
    text: str = ""
    title: str = ""
    sid: tuple[int, ...] | None = None
    seen: bool = False
    field: str = ""  # how error messages name it, e.g. "items[3]"

    def __post_init__(self) -> None:
        if not self.field:
            self.field = f"item {self.item_id!r}"


@dataclass
class WriteResult:
    version: str
    items: list[Record] = field(default_factory=list)
    collisions: int = 0
    published: bool = True  # False: nothing changed, no version made


@dataclass
class CatalogueInfo:
    version: str  # "" when the namespace holds no version yet
    n_items: int
    level_sizes: list[int]
    stored_versions: list[str]


Encoder = Callable[[list[str]], Awaitable[np.ndarray]]

# KEYS: current, versions, level_sizes, next_row, then the staged version's keys (meta first)
# ARGV: expected current ("*" = any, "" = none), new version, channel, message, level_sizes ("" = keep), min next_row ("" = keep)
_COMMIT = """
local cur = redis.call('GET', KEYS[1])
if ARGV[1] ~= '*' and (cur or '') ~= ARGV[1] then return {0, cur or ''} end
if redis.call('EXISTS', KEYS[5]) == 0 then return {-1, cur or ''} end
for i = 5, #KEYS do redis.call('PERSIST', KEYS[i]) end
if ARGV[5] ~= '' then redis.call('SET', KEYS[3], ARGV[5]) end
if ARGV[6] ~= '' then
  local nr = tonumber(redis.call('GET', KEYS[4]) or '0')
  if nr < tonumber(ARGV[6]) then redis.call('SET', KEYS[4], ARGV[6]) end
end
redis.call('SET', KEYS[1], ARGV[2])
redis.call('ZADD', KEYS[2], tonumber(ARGV[2]), ARGV[2])
redis.call('PUBLISH', ARGV[3], ARGV[4])
return {1, ARGV[2]}
"""

# KEYS: the lock; ARGV: token. Deletes the lock only if we still hold it.
_UNLOCK = """
if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('DEL', KEYS[1]) end
return 0
"""

REDIS_DOWN = (RedisConnectionError, RedisTimeoutError, BusyLoadingError, OSError, asyncio.TimeoutError)


def make_client(url: str, timeout_s: float = 2.0, cluster: bool = False):
    """A ``redis.asyncio`` client with bounded timeouts: one quick retry on a
    connection error (a pooled connection may be stale after a Redis restart),
    none on a timeout, so a hung Redis costs one ``timeout_s``, not several."""
    kw = dict(decode_responses=True, socket_timeout=timeout_s, socket_connect_timeout=timeout_s,
              retry=Retry(ExponentialBackoff(cap=0.2, base=0.02), 1, supported_errors=(RedisConnectionError,)),
              health_check_interval=30)
    if cluster:
        return aioredis.RedisCluster.from_url(url, **kw)
    return aioredis.from_url(url, **kw)


class RedisCatalogue:
    """Every read and write of one namespace's catalogue (see the module docstring)."""

    def __init__(self, client, namespace: str = "specrec", keep_versions: int = 3,
                 default_level_sizes: Sequence[int] | None = None, max_attempts: int = 3):
        if keep_versions < 1:
            raise ValueError("keep_versions must be >= 1")
        self.r = client
        self.ns = check_namespace(namespace)
        self.tag = "{" + namespace + "}"
        self.keep = int(keep_versions)
        self.default_level_sizes = list(default_level_sizes) if default_level_sizes else None
        self.max_attempts = max_attempts
        self.channel = self.key("events")
        self._lock = asyncio.Lock()
        self._commit = self.r.register_script(_COMMIT)
        self._unlock = self.r.register_script(_UNLOCK)
        self.log = structlog.get_logger("itemset.store").bind(namespace=namespace)

    @classmethod
    def from_url(cls, url: str, namespace: str = "specrec", timeout_s: float = 2.0, cluster: bool = False, **kw):
        return cls(make_client(url, timeout_s, cluster), namespace, **kw)

    # -- keys ---------------------------------------------------------------------
    def key(self, name: str) -> str:
        return f"{self.tag}:{name}"

    def vkey(self, version: str, name: str) -> str:
        return f"{self.tag}:v:{version}:{name}"

    def version_keys(self, version: str) -> list[str]:
        return [self.vkey(version, k) for k in VERSION_KEYS]

    # -- plumbing -----------------------------------------------------------------
    async def _t(self, op: str, aw):
        t0 = time.perf_counter()
        try:
            return await aw
        finally:
            REDIS_SECONDS.labels(op).observe(time.perf_counter() - t0)

    def pipe(self, transaction: bool = True):
        return self.r.pipeline(transaction=transaction)

    async def ping(self) -> bool:
        return bool(await self._t("ping", self.r.ping()))

    async def close(self) -> None:
        await self.r.aclose()

    async def state(self) -> tuple[str | None, list[int] | None]:
        """(current version or None, level sizes or None), in one round trip."""
        cur, ls = await self._t("state", self.r.mget([self.key("current"), self.key("level_sizes")]))
        return (cur or None), ([int(x) for x in ls.split(",")] if ls else None)

    async def level_sizes(self) -> list[int] | None:
        return (await self.state())[1] or self.default_level_sizes

    async def stored_versions(self) -> list[str]:
        return list(await self._t("versions", self.r.zrange(self.key("versions"), 0, -1)))

    async def info(self) -> CatalogueInfo:
        cur, ls = await self.state()
        p = self.pipe()
        p.zrange(self.key("versions"), 0, -1)
        if cur:
            p.hlen(self.vkey(cur, "items"))
        res = await self._t("info", p.execute())
        return CatalogueInfo(cur or "", int(res[1]) if cur else 0, ls or self.default_level_sizes or [], list(res[0]))

    async def _not_found(self, version: str) -> VersionNotFound:
        stored = await self.stored_versions()
        return VersionNotFound(f"catalogue version {version!r} is not stored "
                               f"(stored: {', '.join(stored) if stored else 'none'})")

    async def _read(self, op: str, version: str, fill: Callable) -> tuple[str, list]:
        """Run ``fill(pipe, v)``'s commands on version ``v`` ("" = current) in one
        MULTI, together with the check that ``v`` is published and stored."""
        for _ in range(3):
            v = version
            if not v:
                v, _ls = await self.state()
                if v is None:
                    raise CatalogueEmpty(f"namespace {self.ns!r} holds no catalogue version yet (bulk-load a bundle first)")
            p = self.pipe()
            p.zscore(self.key("versions"), v)
            fill(p, v)
            res = await self._t(op, p.execute())
            if res[0] is not None:
                return v, res[1:]
            if version:
                raise await self._not_found(version)
            # the current version was pruned between the two round trips: resolve again
        raise Unavailable("the catalogue changes faster than it can be read")

    # -- reads --------------------------------------------------------------------
    async def resolve(self, item_ids: Sequence[str], version: str = "") -> tuple[str, list[Record | None]]:
        ids = list(item_ids)
        v, res = await self._read("resolve", version, lambda p, v: p.hmget(self.vkey(v, "items"), ids) if ids else None)
        raws = res[0] if ids else []
        return v, [Record.loads(i, raw) if raw else None for i, raw in zip(ids, raws)]

    async def lookup(self, sids: Sequence[str], version: str = "") -> tuple[str, list[str | None]]:
        """Per SID ("12.7.200.0"): the item id, or None when not a valid SID of the version."""
        sids = list(sids)

        def fill(p, v):
            if sids:
                p.smismember(self.vkey(v, "sids"), sids)
                p.hmget(self.vkey(v, "sid2item"), sids)

        v, res = await self._read("lookup", version, fill)
        if not sids:
            return v, []
        return v, [(owner or None) if int(member) else None for member, owner in zip(res[0], res[1])]

    async def allowed(self, prefixes: Sequence[str], version: str = "") -> tuple[str, list[list[int]]]:
        """Per prefix field ("" = first level, "12.7"): allowed next codes, ascending."""
        prefixes = list(prefixes)
        v, res = await self._read("allowed", version,
                                  lambda p, v: p.hmget(self.vkey(v, "pfx"), prefixes) if prefixes else None)
        raws = res[0] if prefixes else []
        return v, [sorted(parse_mask(raw)) for raw in raws]

    async def snapshot(self, version: str = "", batch: int = 2000) -> tuple[str, list[int], list[Record]]:
        """Every item of a version, sorted by row."""
        v, res = await self._read("snapshot", version, lambda p, v: p.get(self.key("level_sizes")))
        ls = [int(x) for x in res[0].split(",")] if res[0] else (self.default_level_sizes or [])
        records: dict[str, Record] = {}
        cursor = 0
        t0 = time.perf_counter()
        while True:
            cursor, chunk = await self.r.hscan(self.vkey(v, "items"), cursor, count=batch)
            for item_id, raw in chunk.items():
                records[item_id] = Record.loads(item_id, raw)
            if cursor == 0:
                break
        REDIS_SECONDS.labels("snapshot_scan").observe(time.perf_counter() - t0)
        if await self._t("snapshot", self.r.zscore(self.key("versions"), v)) is None:
            raise await self._not_found(v)  # pruned while we read it
        return v, ls, sorted(records.values(), key=lambda r: r.row)

    # -- writes -------------------------------------------------------------------
    async def _stage(self, new: str, source: str | None, op: str, base: str | None) -> None:
        p = self.pipe()
        meta = self.vkey(new, "meta")
        p.hset(meta, mapping={"op": op, "base": base or "", "source": source or "", "created": f"{time.time():.3f}"})
        p.expire(meta, STAGING_TTL_S)
        if source:
            for name in DATA_KEYS:
                p.copy(self.vkey(source, name), self.vkey(new, name))
                p.expire(self.vkey(new, name), STAGING_TTL_S)
        await self._t("stage", p.execute())

    async def _drop(self, version: str) -> None:
        """Delete a staged (unpublished) version; never raises."""
        try:
            await asyncio.shield(self.r.unlink(*self.version_keys(version)))
        except BaseException as e:  # noqa: BLE001 - best effort: the staged keys expire anyway
            self.log.warning("could not drop staged version", version=version, error=repr(e))

    async def _publish(self, new: str, expected: str, op: str, base: str | None,
                       level_sizes: str = "", min_next_row: str = "") -> bool:
        msg = json.dumps({"namespace": self.ns, "version": new, "op": op, "base": base or ""})
        keys = [self.key("current"), self.key("versions"), self.key("level_sizes"), self.key("next_row"),
                *self.version_keys(new)]
        ok, cur = await self._t("publish", self._commit(keys=keys, args=[expected, new, self.channel, msg,
                                                                          level_sizes, min_next_row]))
        if int(ok) == -1:
            raise Unavailable(f"staged version {new} expired before it was published")
        return int(ok) == 1

    async def _prune(self) -> list[str]:
        try:
            stored = await self.stored_versions()
            victims = stored[: max(0, len(stored) - self.keep)]
            if victims:
                p = self.pipe()
                p.zrem(self.key("versions"), *victims)
                # (execute_command: a cluster pipeline's unlink() is a coroutine, not a queued command)
                p.execute_command("UNLINK", *[k for v in victims for k in self.version_keys(v)])
                await self._t("prune", p.execute())
                self.log.info("pruned versions", versions=victims)
            return victims
        except REDIS_DOWN as e:  # the write itself is published; pruning is retried after the next one
            self.log.warning("pruning failed", error=repr(e))
            return []

    async def _write(self, op: str, apply, source: str | None = None) -> WriteResult:
        """Stage a new version from the current one (or from ``source``), let
        ``apply(new, base, level_sizes)`` change it, publish it if the current
        version is still ``base``; retried on a conflict. ``apply`` returns a
        WriteResult, or None when nothing changes (no version is made)."""
        async with self._lock:
            for attempt in range(self.max_attempts):
                base, ls = await self.state()
                level_sizes = ls or self.default_level_sizes
                if level_sizes is None:
                    raise FailedPrecondition(f"namespace {self.ns!r} has no SID level sizes yet: bulk-load a bundle "
                                             f"or configure one")
                new = str(await self._t("seq", self.r.incr(self.key("seq"))))
                try:
                    await self._stage(new, source if source is not None else base, op, base)
                    result = await apply(new, base, level_sizes)
                    if result is None:
                        await self._drop(new)
                        WRITES.labels(op, "noop").inc()
                        return WriteResult(base or "", published=False)
                    ok = await self._publish(new, base or "", op, base, "" if ls else ",".join(map(str, level_sizes)))
                except BaseException:
                    await self._drop(new)
                    WRITES.labels(op, "failed").inc()
                    raise
                if ok:
                    WRITES.labels(op, "ok").inc()
                    ITEMS_WRITTEN.labels(op).inc(len(result.items))
                    result.version = new
                    await self._prune()
                    await self._count(new)
                    self.log.info("published", version=new, op=op, base=base, items=len(result.items),
                                  collisions=result.collisions)
                    return result
                await self._drop(new)
                self.log.warning("write conflict, retrying", op=op, base=base, attempt=attempt + 1)
            WRITES.labels(op, "conflict").inc()
            raise WriteConflict(f"{op}: other writers published versions meanwhile ({self.max_attempts} attempts); retry")

    async def _count(self, version: str) -> None:
        try:
            CATALOGUE_ITEMS.labels(self.ns).set(await self._t("count", self.r.hlen(self.vkey(version, "items"))))
        except REDIS_DOWN:
            pass

    async def _masks(self, new: str, prefixes: Iterable[str]) -> dict[str, dict[int, int]]:
        fields = sorted(set(prefixes))
        if not fields:
            return {}
        raws = await self._t("masks", self.r.hmget(self.vkey(new, "pfx"), fields))
        return {f: parse_mask(raw) for f, raw in zip(fields, raws)}

    def _write_changes(self, p, new: str, removed: list[Record], added: list[Record], masks: dict[str, dict[int, int]],
                       touched: set[str], deleted_ids: list[str] = ()) -> None:
        if removed:
            old = [sid_str(r.sid) for r in removed]
            p.srem(self.vkey(new, "sids"), *old)
            p.hdel(self.vkey(new, "sid2item"), *old)
        if deleted_ids:
            p.hdel(self.vkey(new, "items"), *deleted_ids)
        if added:
            p.sadd(self.vkey(new, "sids"), *[sid_str(r.sid) for r in added])
            p.hset(self.vkey(new, "sid2item"), mapping={sid_str(r.sid): r.item_id for r in added})
            p.hset(self.vkey(new, "items"), mapping={r.item_id: r.dumps() for r in added})
        keep = {f: format_mask(masks[f]) for f in touched if format_mask(masks[f])}
        gone = [f for f in touched if f not in keep]
        if keep:
            p.hset(self.vkey(new, "pfx"), mapping=keep)
        if gone:
            p.hdel(self.vkey(new, "pfx"), *gone)
        for k in self.version_keys(new):  # keys created just now carry the staging TTL too
            p.expire(k, STAGING_TTL_S)

    @staticmethod
    def _bump(masks, touched, sid, delta: int) -> None:
        for pfx, c in prefix_steps(sid):
            m = masks.setdefault(pfx, {})
            m[c] = m.get(c, 0) + delta
            if m[c] <= 0:
                m.pop(c)
            touched.add(pfx)

    async def upsert(self, specs: Sequence[UpsertSpec], encode: Encoder | None = None) -> WriteResult:
        """Add or replace items. A spec without a SID gets one from its text
        (``encode(texts) -> [n, L-1]`` RQ codes) plus the lowest collision digit
        free in the version; an existing item keeps its row, and keeps its SID
        when no SID is given and its text is unchanged."""
        specs = list(specs)
        ids = [s.item_id for s in specs]
        if len(set(ids)) != len(ids):
            raise InvalidArgument("items", "duplicate item ids")
        code_cache: dict[str, tuple[int, ...]] = {}

        async def apply(new: str, base: str | None, level_sizes: list[int]) -> WriteResult:
            L, coll = len(level_sizes), level_sizes[-1]
            raws = await self._t("upsert_read", self.r.hmget(self.vkey(new, "items"), ids))
            old = {i: Record.loads(i, raw) for i, raw in zip(ids, raws) if raw}
            # 1. where each SID comes from: explicit, kept, or computed from the text
            fixed: dict[int, tuple[int, ...]] = {}
            compute: list[int] = []
            for k, s in enumerate(specs):
                if s.sid is not None:
                    if len(s.sid) != L or any(not 0 <= c < n for c, n in zip(s.sid, level_sizes)):
                        raise InvalidArgument(f"{s.field}.sid.codes", f"not a SID for level sizes {level_sizes}")
                    fixed[k] = tuple(int(c) for c in s.sid)
                elif s.item_id in old and old[s.item_id].text == s.text and len(old[s.item_id].sid) == L:
                    fixed[k] = old[s.item_id].sid
                else:
                    compute.append(k)
            todo = [specs[k].text for k in compute if specs[k].text not in code_cache]
            if todo:
                if encode is None:
                    raise FailedPrecondition(f"{specs[compute[0]].field}: no SID tokenizer is configured "
                                             f"(set a bundle); give a sid")
                codes = np.asarray(await encode(list(dict.fromkeys(todo))), dtype=np.int64)
                for text, row in zip(dict.fromkeys(todo), codes):
                    code_cache[text] = tuple(int(c) for c in row)
            for k in compute:
                c = code_cache[specs[k].text]
                if len(c) != L - 1 or any(not 0 <= x < n for x, n in zip(c, level_sizes)):
                    raise FailedPrecondition(f"{specs[k].field}: the tokenizer's codes {list(c)} do not fit the "
                                             f"catalogue's level sizes {level_sizes}")
            # 2. explicit and kept SIDs must not belong to an item that stays
            claimed: dict[tuple[int, ...], int] = {}
            for k, sid in fixed.items():
                if sid in claimed:
                    j = claimed[sid]
                    raise InvalidArgument(f"{specs[k].field}.sid", f"{sid_str(sid)} is also given to {specs[j].field}")
                claimed[sid] = k
            fixed_keys = list(fixed)
            owners = await self._t("upsert_read", self.r.hmget(self.vkey(new, "sid2item"),
                                                               [sid_str(fixed[k]) for k in fixed_keys])) if fixed_keys else []
            batch = set(ids)
            for k, owner in zip(fixed_keys, owners):
                if owner and owner != specs[k].item_id and owner not in batch:
                    raise FailedPrecondition(f"{specs[k].field}.sid: {sid_str(fixed[k])} is already item {owner!r} "
                                             f"in version {base}")
            # 3. prefix masks: remove the replaced items' SIDs, add the fixed ones, then place computed ones
            need = {p for r in old.values() for p, _ in prefix_steps(r.sid)}
            need |= {p for sid in fixed.values() for p, _ in prefix_steps(sid)}
            need |= {p for k in compute for p, _ in prefix_steps(code_cache[specs[k].text] + (0,))}
            masks = await self._masks(new, need)
            touched: set[str] = set()
            for r in old.values():
                self._bump(masks, touched, r.sid, -1)
            for sid in fixed.values():
                self._bump(masks, touched, sid, +1)
            sids: dict[int, tuple[int, ...]] = dict(fixed)
            collided = 0
            for k in compute:
                codes = code_cache[specs[k].text]
                used = masks.get(sid_str(codes), {})
                digit = 0
                while digit in used:
                    digit += 1
                if digit >= coll:
                    raise FailedPrecondition(
                        f"{specs[k].field}: collision overflow for item {specs[k].item_id!r}: {len(used)} items already "
                        f"share RQ codes {sid_str(codes)}, no collision digit below {coll} is free")
                collided += bool(used)
                sids[k] = codes + (digit,)
                self._bump(masks, touched, sids[k], +1)
            # 4. rows: existing items keep theirs, new ones take fresh ones (never reused)
            fresh = [k for k, s in enumerate(specs) if s.item_id not in old]
            first = 0
            if fresh:
                first = int(await self._t("rows", self.r.incrby(self.key("next_row"), len(fresh)))) - len(fresh)
            rows = {k: first + j for j, k in enumerate(fresh)}
            records = []
            for k, s in enumerate(specs):
                o = old.get(s.item_id)
                sid = sids[k]
                # the model was trained on an item's SID: a replaced item stays seen while its SID does not change
                unseen = not (s.seen or (o is not None and not o.unseen and o.sid == sid))
                records.append(Record(s.item_id, o.row if o is not None else rows[k], sid,
                                      s.title or s.text, s.text, unseen))
            p = self.pipe()
            self._write_changes(p, new, list(old.values()), records, masks, touched)
            await self._t("upsert_write", p.execute())
            if collided:
                COLLISIONS.inc(collided)
            return WriteResult(new, records, collided)

        return await self._write("upsert", apply)

    async def delete(self, item_ids: Sequence[str]) -> WriteResult:
        """Remove items; unknown ids are ignored (no version is made when none is known)."""
        ids = list(dict.fromkeys(item_ids))

        async def apply(new: str, base: str | None, level_sizes: list[int]) -> WriteResult | None:
            raws = await self._t("delete_read", self.r.hmget(self.vkey(new, "items"), ids)) if ids else []
            old = [Record.loads(i, raw) for i, raw in zip(ids, raws) if raw]
            if not old:
                return None
            masks = await self._masks(new, {p for r in old for p, _ in prefix_steps(r.sid)})
            touched: set[str] = set()
            for r in old:
                self._bump(masks, touched, r.sid, -1)
            p = self.pipe()
            self._write_changes(p, new, old, [], masks, touched, [r.item_id for r in old])
            await self._t("delete_write", p.execute())
            return WriteResult(new, old)

        return await self._write("delete", apply)

    async def rollback(self, version: str) -> WriteResult:
        """Publish a copy of a stored version as a new version (version numbers only grow)."""
        if await self._t("versions", self.r.zscore(self.key("versions"), version)) is None:
            raise await self._not_found(version)
        cur, _ = await self.state()
        if cur == version:
            return WriteResult(version, published=False)

        async def apply(new: str, base: str | None, level_sizes: list[int]) -> WriteResult:
            # the source may have been pruned before it was copied (pruning removes it from
            # the list and its keys in one MULTI, so still listed now = copied intact)
            if await self._t("versions", self.r.zscore(self.key("versions"), version)) is None:
                raise await self._not_found(version)
            return WriteResult(new)

        return await self._write("rollback", apply, source=version)

    async def bulk_load(self, records: Sequence[Record], level_sizes: Sequence[int], force: bool = False,
                        chunk: int = 2000, progress: bool = False) -> str:
        """Publish ``records`` as a fresh version (built from nothing, pipelined
        in chunks) and make it current, whatever the current version is."""
        level_sizes = [int(x) for x in level_sizes]
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
        async with self._lock:
            cur, ls = await self.state()
            if cur and not force:
                await self._check_compatible(cur, ls, records, level_sizes)
            new = str(await self._t("seq", self.r.incr(self.key("seq"))))
            bar = None
            if progress:
                from tqdm.auto import tqdm

                bar = tqdm(total=len(records), unit="item", desc=f"loading version {new}")
            try:
                await self._stage(new, None, "load", cur)
                for lo in range(0, len(records), chunk):
                    part = records[lo: lo + chunk]
                    p = self.pipe(transaction=False)
                    p.sadd(self.vkey(new, "sids"), *[sid_str(r.sid) for r in part])
                    p.hset(self.vkey(new, "sid2item"), mapping={sid_str(r.sid): r.item_id for r in part})
                    p.hset(self.vkey(new, "items"), mapping={r.item_id: r.dumps() for r in part})
                    p.expire(self.vkey(new, "sids"), STAGING_TTL_S)
                    await self._t("load_chunk", p.execute())
                    if bar is not None:
                        bar.update(len(part))
                masks = build_masks(r.sid for r in records)
                fields = list(masks.items())
                for lo in range(0, len(fields), chunk * 4):
                    p = self.pipe(transaction=False)
                    p.hset(self.vkey(new, "pfx"), mapping={f: format_mask(m) for f, m in fields[lo: lo + chunk * 4]})
                    await self._t("load_chunk", p.execute())
                p = self.pipe()
                for k in self.version_keys(new):
                    p.expire(k, STAGING_TTL_S)
                await p.execute()
                next_row = max((r.row for r in records), default=-1) + 1
                await self._publish(new, "*", "load", cur, ",".join(map(str, level_sizes)), str(next_row))
            except BaseException:
                await self._drop(new)
                WRITES.labels("load", "failed").inc()
                raise
            finally:
                if bar is not None:
                    bar.close()
            WRITES.labels("load", "ok").inc()
            ITEMS_WRITTEN.labels("load").inc(len(records))
            CATALOGUE_ITEMS.labels(self.ns).set(len(records))
            await self._prune()
            self.log.info("published", version=new, op="load", base=cur, items=len(records))
            return new

    async def _check_compatible(self, cur: str, ls: list[int] | None, records: Sequence[Record],
                                level_sizes: list[int]) -> None:
        if ls and list(ls) != list(level_sizes):
            raise ValueError(f"namespace {self.ns!r} holds SIDs with level sizes {ls}, the bundle has {level_sizes} "
                             f"(force to replace)")
        by_row = {r.row: r.item_id for r in records}
        async for item_id, raw in self.r.hscan_iter(self.vkey(cur, "items"), count=2000):
            row = Record.loads(item_id, raw).row
            if row in by_row and by_row[row] != item_id:
                raise ValueError(f"row {row} is item {item_id!r} in version {cur} but {by_row[row]!r} in the bundle: "
                                 f"rows must stay stable (force to replace)")

    async def try_lock(self, name: str, ttl_s: float) -> str | None:
        token = f"{time.time():.6f}-{id(self)}"
        ok = await self.r.set(self.key(name), token, nx=True, px=int(ttl_s * 1000))
        return token if ok else None

    async def unlock(self, name: str, token: str) -> None:
        await self._unlock(keys=[self.key(name)], args=[token])
