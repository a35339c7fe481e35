"""Writing the catalogue: every write publishes a new version, atomically.

A write (upsert, delete, rollback) stages version ``n``: the base version's
four data keys are COPYed server-side (rollback copies the target instead),
the changes are applied to the copies, and one Lua script checks that the
current pointer still names the base (else the write is retried on the new
base), makes the staged keys persistent, swaps ``current``, adds ``n`` to
``versions`` and publishes. Readers that resolved version ``v`` keep reading
exactly ``v``. Staged keys carry a TTL until published, so a writer that dies
half-way leaves nothing behind for long; a failed write drops its staged keys
and never touches a published version. After each publish the oldest versions
beyond ``keep_versions`` are deleted (the current one is always the newest).

Before publishing, a write checks that it holds as many items as its base
plus what it added minus what it removed: a copy that lost data (Redis
restarted in the middle) never becomes a smaller catalogue.

Durability. The publish script and a ``WAIT <n> <ms>`` go down one
connection (WAIT counts the replicas holding that connection's last write,
which comes after every key the write staged, so they hold the whole
version). A write is acknowledged only when ``n`` replicas hold it: with
fewer, :class:`NotAcknowledged` (UNAVAILABLE) says it is published on the
primary but may be lost in a failover. Retrying is safe: an upsert of the same
items publishes the same content again, a delete of removed ids changes
nothing. ``n`` is ``write_replicas``, or (auto) 1 for a replicated Redis (a
Sentinel URL, or a primary once seen with a replica), 0 for a lone Redis: after
a failover that left the new primary without a replica, writes are refused
(UNAVAILABLE, retried within ``write_retry_s``) until one connects, never
acknowledged with no replica holding them. ``write_replicas = 0`` opts in to
primary-only acknowledgements.
"""

from __future__ import annotations

import asyncio
import json
import secrets
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

from specrec_rpc.errors import FailedPrecondition, InvalidArgument, Unavailable

from .client import REDIS_DOWN
from .keys import (
    DATA_KEYS,
    EMPTY_FINGERPRINT,
    STAGING_TTL_S,
    Keys,
    Record,
    build_masks,
    bump,
    fingerprint,
    format_mask,
    parse_mask,
    prefix_steps,
    records_fingerprint,
    sid_str,
    version_counter,
    version_name,
)
from .metrics import CATALOGUE_ITEMS, COLLISIONS, ITEMS_WRITTEN, WRITES

if TYPE_CHECKING:
    from .reads import VersionNotFound


class WriteConflict(RuntimeError):
    """Other writers kept publishing versions while this write was being built: ABORTED."""


class WriteRejected(FailedPrecondition):
    """The staged version would not hold what its base held (data lost underneath): nothing is published."""


class NotAcknowledged(Unavailable):
    """Published on the primary, but fewer replicas than required hold it: not acknowledged (UNAVAILABLE).
    A failover may lose it; retrying the same write is safe."""


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
    removed: list[Record] = field(default_factory=list)  # records the write took out (replaced or deleted)
    base: str | None = None  # the version it was made from (set when published)


@dataclass
class Staged:
    """A version being built: its name, its base, the SID level sizes."""

    version: str
    base: str | None
    level_sizes: list[int]


Encoder = Callable[[list[str]], Awaitable[np.ndarray]]

# KEYS: current, versions, level_sizes, next_row, then the staged version's keys (meta first)
# ARGV: expected current ("*" = any, "" = none), new version, channel, message, level_sizes ("" = keep),
#       min next_row ("" = keep), the new version's counter (its ZSET score)
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
redis.call('ZADD', KEYS[2], tonumber(ARGV[7]), ARGV[2])
redis.call('PUBLISH', ARGV[3], ARGV[4])
return {1, ARGV[2]}
"""

# KEYS: current, versions, then the staged version's keys; ARGV: the staged version. Deletes its keys
# unless it was published after all (a publish whose answer was lost, e.g. the connection dropped
# right after the script ran): a published version is never dropped.
_DROP = """
if redis.call('GET', KEYS[1]) == ARGV[1] or redis.call('ZSCORE', KEYS[2], ARGV[1]) then return 0 end
for i = 3, #KEYS do redis.call('UNLINK', KEYS[i]) end
return 1
"""

# KEYS: the lock; ARGV: token. Deletes the lock only if we still hold it.
_UNLOCK = """
if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('DEL', KEYS[1]) end
return 0
"""


class CatalogueWrites:
    """The write half of :class:`~.store.RedisCatalogue`."""

    # what RedisCatalogue provides (its own attributes, and the read half's methods)
    r: Any  # the redis.asyncio client (standalone, Sentinel or cluster)
    keys: Keys
    ns: str
    keep: int
    cluster: bool
    max_attempts: int
    write_replicas: int
    replicated: bool  # a Sentinel URL, or a primary once seen with a replica
    wait_ms: int
    default_level_sizes: list[int] | None
    log: Any  # structlog logger
    _lock: asyncio.Lock
    _commit: Any  # registered Lua scripts
    _unlock: Any
    _drop_staged: Any
    pipe: Callable[..., Any]
    _t: Callable[[str, Awaitable[Any]], Awaitable[Any]]
    state: Callable[[], Awaitable[tuple[str | None, list[int] | None]]]
    stored_versions: Callable[[], Awaitable[list[str]]]
    _not_found: Callable[[str], Awaitable[VersionNotFound]]

    # -- versions -------------------------------------------------------------------
    async def _new_version(self, new_epoch: bool = False) -> str:
        """``<epoch>.<counter>``; the epoch is made by the first write of a lineage (SETNX), or anew
        (``new_epoch``: a restore over data that went back in time, whose counter would hand out
        names already used)."""
        k = self.keys
        epoch = secrets.token_hex(3)
        p = self.pipe()
        p.set(k.key("epoch"), epoch, nx=not new_epoch)
        p.get(k.key("epoch"))
        p.incr(k.key("seq"))
        _, epoch, n = await self._t("seq", p.execute())
        return version_name(epoch, int(n))

    async def _stage(self, new: str, source: str | None, op: str, base: str | None) -> None:
        k = self.keys
        p = self.pipe()
        meta = k.vkey(new, "meta")
        p.hset(meta, mapping={"op": op, "base": base or "", "source": source or "", "created": f"{time.time():.3f}"})
        p.expire(meta, STAGING_TTL_S)
        if source:
            for name in DATA_KEYS:
                p.copy(k.vkey(source, name), k.vkey(new, name))
                p.expire(k.vkey(new, name), STAGING_TTL_S)
        await self._t("stage", p.execute())

    async def _drop(self, version: str) -> None:
        """Delete a staged version unless it was published after all; never raises."""
        k = self.keys
        try:
            await asyncio.shield(self._drop_staged(keys=[k.key("current"), k.key("versions"), *k.version_keys(version)],
                                                   args=[version]))
        except BaseException as e:  # noqa: BLE001 - best effort: the staged keys expire anyway
            self.log.warning("could not drop staged version", version=version, error=repr(e))

    async def replicas_needed(self) -> int:
        """Replicas a write must reach before it is acknowledged (``write_replicas``, or auto)."""
        if self.write_replicas >= 0:
            return self.write_replicas
        if self.cluster:
            return 0
        if self.replicated:  # a Sentinel URL, or a replica seen before: a write no replica holds is not acknowledged
            return 1
        info = await self._t("replicas", self.r.info("replication"))
        n = int(info.get("connected_slaves", 0) or 0)
        if n:
            self.replicated = True
        return min(1, n)

    async def _publish(self, new: str, expected: str, op: str, base: str | None,
                       level_sizes: str = "", min_next_row: str = "") -> tuple[bool, int, int]:
        """(published, replicas required, replicas that hold it) -- the script and its WAIT on one connection."""
        k = self.keys
        need = await self.replicas_needed()
        msg = json.dumps({"namespace": self.ns, "version": new, "op": op, "base": base or ""})
        keys = [k.key("current"), k.key("versions"), k.key("level_sizes"), k.key("next_row"), *k.version_keys(new)]
        args = [expected, new, k.channel, msg, level_sizes, min_next_row, version_counter(new)]
        if need:
            p = self.r.pipeline(transaction=False)
            await self._commit(keys=keys, args=args, client=p)
            p.wait(need, self.wait_ms)
            (ok, _cur), acked = await self._t("publish", p.execute())
        else:
            (ok, _cur), acked = await self._t("publish", self._commit(keys=keys, args=args)), 0
        if int(ok) == -1:
            raise Unavailable(f"staged version {new} expired before it was published")
        return int(ok) == 1, need, int(acked)

    def _unacknowledged(self, op: str, version: str, need: int, acked: int) -> NotAcknowledged:
        WRITES.labels(op, "unacknowledged").inc()
        self.log.warning("write not acknowledged", op=op, version=version, replicas=acked, required=need,
                         wait_ms=self.wait_ms)
        return NotAcknowledged(f"{op}: version {version} reached {acked} of {need} required replica(s) within "
                               f"{self.wait_ms} ms: not acknowledged (a failover may lose it; retrying is safe)")

    async def _prune(self) -> list[str]:
        try:
            stored = await self.stored_versions()
            victims = stored[: max(0, len(stored) - self.keep)]
            if victims:
                p = self.pipe()
                p.zrem(self.keys.key("versions"), *victims)
                # (execute_command: a cluster pipeline's unlink() is a coroutine, not a queued command)
                p.execute_command("UNLINK", *[k for v in victims for k in self.keys.version_keys(v)])
                await self._t("prune", p.execute())
                self.log.info("pruned versions", versions=victims)
            return victims
        except REDIS_DOWN as e:  # the write itself is published; pruning is retried after the next one
            self.log.warning("pruning failed", error=repr(e))
            return []

    async def _check_counts(self, st: Staged, result: WriteResult) -> None:
        """The staged version holds its base's items, plus the new, minus the removed (else: data was lost)."""
        if st.base is None:
            return
        k = self.keys
        p = self.pipe()
        p.hlen(k.vkey(st.base, "items"))
        p.hlen(k.vkey(st.version, "items"))
        n_base, n_new = await self._t("count", p.execute())
        added = len({r.item_id for r in result.items} - {r.item_id for r in result.removed})
        want = (
            int(n_base)
            + added
            - (len(result.removed) - len({r.item_id for r in result.items} & {r.item_id for r in result.removed}))
        )
        if int(n_new) != want:
            raise WriteRejected(f"catalogue: the new version would hold {n_new} items where {want} are due "
                                f"(base {st.base} holds {n_base}); data was lost underneath, nothing was published")

    async def _set_fingerprint(self, st: Staged, result: WriteResult) -> str:
        """The staged version's content fingerprint: its base's, updated by the write's changes."""
        k = self.keys
        base_fp = EMPTY_FINGERPRINT
        if st.base is not None:
            base_fp = (
                await self._t("fingerprint", self.r.hget(k.vkey(st.base, "meta"), "fingerprint"))
            ) or EMPTY_FINGERPRINT
        fp = fingerprint(((r.item_id, r.sid, r.unseen) for r in [*result.removed, *result.items]), base_fp)
        await self._t("fingerprint", self.r.hset(k.vkey(st.version, "meta"), "fingerprint", fp))
        return fp

    async def _write(self, op: str, apply, source: str | None = None) -> WriteResult:
        """Stage a new version from the current one (or from ``source``), let
        ``apply(staged)`` change it, publish it if the current version is still
        the base; retried on a conflict. ``apply`` returns a WriteResult, or
        None when nothing changes (no version is made)."""
        async with self._lock:
            for attempt in range(self.max_attempts):
                base, ls = await self.state()
                if base is None:
                    await self.guard_empty()
                    base, ls = await self.state()
                level_sizes = ls or self.default_level_sizes
                if level_sizes is None:
                    raise FailedPrecondition(f"namespace {self.ns!r} has no SID level sizes yet: bulk-load a bundle "
                                             f"or configure one")
                st = Staged(await self._new_version(), base, level_sizes)
                try:
                    await self._stage(st.version, source if source is not None else base, op, base)
                    result = await apply(st)
                    if result is None:
                        await self._drop(st.version)
                        WRITES.labels(op, "noop").inc()
                        return WriteResult(base or "", published=False)
                    if op != "rollback":
                        await self._check_counts(st, result)
                        await self._set_fingerprint(st, result)
                    ok, need, acked = await self._publish(st.version, base or "", op, base,
                                                          "" if ls else ",".join(map(str, level_sizes)))
                except BaseException:
                    await self._drop(st.version)
                    WRITES.labels(op, "failed").inc()
                    raise
                if ok:
                    result.version, result.base = st.version, st.base
                    await self._prune()
                    await self._count(st.version)
                    if acked < need:
                        raise self._unacknowledged(op, st.version, need, acked)
                    WRITES.labels(op, "ok").inc()
                    ITEMS_WRITTEN.labels(op).inc(len(result.items))
                    self.log.info("published", version=st.version, op=op, base=base, items=len(result.items),
                                  collisions=result.collisions, replicas=acked)
                    return result
                await self._drop(st.version)
                self.log.warning("write conflict, retrying", op=op, base=base, attempt=attempt + 1)
            WRITES.labels(op, "conflict").inc()
            raise WriteConflict(
                f"{op}: other writers published versions meanwhile ({self.max_attempts} attempts); retry"
            )

    async def guard_empty(self) -> None:
        """Hook before a write finds no current version (the store: nothing; the service restores or refuses)."""

    async def _count(self, version: str) -> None:
        try:
            CATALOGUE_ITEMS.labels(self.ns).set(await self._t("count", self.r.hlen(self.keys.vkey(version, "items"))))
        except REDIS_DOWN:
            pass

    async def _masks(self, new: str, prefixes) -> dict[str, dict[int, int]]:
        fields = sorted(set(prefixes))
        if not fields:
            return {}
        raws = await self._t("masks", self.r.hmget(self.keys.vkey(new, "pfx"), fields))
        return {f: parse_mask(raw) for f, raw in zip(fields, raws)}

    def _write_changes(self, p, new: str, removed: list[Record], added: list[Record], masks: dict[str, dict[int, int]],
                       touched: set[str], deleted_ids: Sequence[str] = ()) -> None:
        k = self.keys
        if removed:
            old = [sid_str(r.sid) for r in removed]
            p.srem(k.vkey(new, "sids"), *old)
            p.hdel(k.vkey(new, "sid2item"), *old)
        if deleted_ids:
            p.hdel(k.vkey(new, "items"), *deleted_ids)
        if added:
            p.sadd(k.vkey(new, "sids"), *[sid_str(r.sid) for r in added])
            p.hset(k.vkey(new, "sid2item"), mapping={sid_str(r.sid): r.item_id for r in added})
            p.hset(k.vkey(new, "items"), mapping={r.item_id: r.dumps() for r in added})
        keep = {f: format_mask(masks[f]) for f in touched if format_mask(masks[f])}
        gone = [f for f in touched if f not in keep]
        if keep:
            p.hset(k.vkey(new, "pfx"), mapping=keep)
        if gone:
            p.hdel(k.vkey(new, "pfx"), *gone)
        for key in k.version_keys(new):  # keys created just now carry the staging TTL too
            p.expire(key, STAGING_TTL_S)

    # -- upsert, in four phases ---------------------------------------------------------------
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

        async def apply(st: Staged) -> WriteResult:
            raws = await self._t("upsert_read", self.r.hmget(self.keys.vkey(st.version, "items"), ids))
            old = {i: Record.loads(i, raw) for i, raw in zip(ids, raws) if raw}
            fixed, compute = await self._sid_sources(specs, old, st, encode, code_cache)
            await self._check_claims(specs, fixed, st)
            sids, masks, touched, collided = await self._place(specs, old, fixed, compute, code_cache, st)
            records = await self._records(specs, old, sids)
            p = self.pipe()
            self._write_changes(p, st.version, list(old.values()), records, masks, touched)
            await self._t("upsert_write", p.execute())
            if collided:
                COLLISIONS.inc(collided)
            return WriteResult(st.version, records, collided, removed=list(old.values()))

        return await self._write("upsert", apply)

    async def _sid_sources(self, specs, old, st: Staged, encode, code_cache) -> tuple[dict[int, tuple], list[int]]:
        """Phase 1: where each SID comes from: explicit, kept, or computed from the text."""
        L, level_sizes = len(st.level_sizes), st.level_sizes
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
                raise FailedPrecondition(
                    f"{specs[compute[0]].field}: no SID tokenizer is configured (set a bundle); give a sid"
                )
            codes = np.asarray(await encode(list(dict.fromkeys(todo))), dtype=np.int64)
            for text, row in zip(dict.fromkeys(todo), codes):
                code_cache[text] = tuple(int(c) for c in row)
        for k in compute:
            c = code_cache[specs[k].text]
            if len(c) != L - 1 or any(not 0 <= x < n for x, n in zip(c, level_sizes)):
                raise FailedPrecondition(f"{specs[k].field}: the tokenizer's codes {list(c)} do not fit the "
                                         f"catalogue's level sizes {level_sizes}")
        return fixed, compute

    async def _check_claims(self, specs, fixed: dict[int, tuple], st: Staged) -> None:
        """Phase 2: explicit and kept SIDs must not belong to an item that stays."""
        claimed: dict[tuple[int, ...], int] = {}
        for k, sid in fixed.items():
            if sid in claimed:
                raise InvalidArgument(
                    f"{specs[k].field}.sid", f"{sid_str(sid)} is also given to {specs[claimed[sid]].field}"
                )
            claimed[sid] = k
        keys = list(fixed)
        if not keys:
            return
        owners = await self._t("upsert_read", self.r.hmget(self.keys.vkey(st.version, "sid2item"),
                                                           [sid_str(fixed[k]) for k in keys]))
        batch = {s.item_id for s in specs}
        for k, owner in zip(keys, owners):
            if owner and owner != specs[k].item_id and owner not in batch:
                raise FailedPrecondition(f"{specs[k].field}.sid: {sid_str(fixed[k])} is already item {owner!r} "
                                         f"in version {st.base}")

    async def _place(self, specs, old, fixed, compute, code_cache, st: Staged):
        """Phase 3: prefix masks: remove the replaced items' SIDs, add the fixed ones, then give
        computed ones the lowest free collision digit."""
        coll = st.level_sizes[-1]
        need = {p for r in old.values() for p, _ in prefix_steps(r.sid)}
        need |= {p for sid in fixed.values() for p, _ in prefix_steps(sid)}
        need |= {p for k in compute for p, _ in prefix_steps(code_cache[specs[k].text] + (0,))}
        masks = await self._masks(st.version, need)
        touched: set[str] = set()
        for r in old.values():
            bump(masks, touched, r.sid, -1)
        for sid in fixed.values():
            bump(masks, touched, sid, +1)
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
            bump(masks, touched, sids[k], +1)
        return sids, masks, touched, collided

    async def _records(self, specs, old, sids) -> list[Record]:
        """Phase 4: rows (existing items keep theirs, new ones take fresh ones, never reused) and records."""
        fresh = [k for k, s in enumerate(specs) if s.item_id not in old]
        first = 0
        if fresh:
            first = int(await self._t("rows", self.r.incrby(self.keys.key("next_row"), len(fresh)))) - len(fresh)
        rows = {k: first + j for j, k in enumerate(fresh)}
        records = []
        for k, s in enumerate(specs):
            o = old.get(s.item_id)
            sid = sids[k]
            # the model was trained on an item's SID: a replaced item stays seen while its SID does not change
            unseen = not (s.seen or (o is not None and not o.unseen and o.sid == sid))
            records.append(
                Record(s.item_id, o.row if o is not None else rows[k], sid, s.title or s.text, s.text, unseen)
            )
        return records

    # -- delete, rollback ----------------------------------------------------------------------
    async def delete(self, item_ids: Sequence[str]) -> WriteResult:
        """Remove items; unknown ids are ignored (no version is made when none is known)."""
        ids = list(dict.fromkeys(item_ids))

        async def apply(st: Staged) -> WriteResult | None:
            raws = await self._t("delete_read", self.r.hmget(self.keys.vkey(st.version, "items"), ids)) if ids else []
            old = [Record.loads(i, raw) for i, raw in zip(ids, raws) if raw]
            if not old:
                return None
            masks = await self._masks(st.version, {p for r in old for p, _ in prefix_steps(r.sid)})
            touched: set[str] = set()
            for r in old:
                bump(masks, touched, r.sid, -1)
            p = self.pipe()
            self._write_changes(p, st.version, old, [], masks, touched, [r.item_id for r in old])
            await self._t("delete_write", p.execute())
            return WriteResult(st.version, [], removed=old)

        return await self._write("delete", apply)

    async def rollback(self, version: str) -> WriteResult:
        """Publish a copy of a stored version as a new version (version names only grow)."""
        if await self._t("versions", self.r.zscore(self.keys.key("versions"), version)) is None:
            raise await self._not_found(version)
        cur, _ = await self.state()
        if cur == version:
            return WriteResult(version, published=False)

        async def apply(st: Staged) -> WriteResult:
            # the source may have been pruned before it was copied (pruning removes it from
            # the list and its keys in one MULTI, so still listed now = copied intact)
            if await self._t("versions", self.r.zscore(self.keys.key("versions"), version)) is None:
                raise await self._not_found(version)
            fp = await self._t("fingerprint", self.r.hget(self.keys.vkey(version, "meta"), "fingerprint"))
            await self._t("fingerprint", self.r.hset(self.keys.vkey(st.version, "meta"), "fingerprint",
                                                     fp or EMPTY_FINGERPRINT))
            return WriteResult(st.version)

        return await self._write("rollback", apply, source=version)

    # -- bulk load -----------------------------------------------------------------------------
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

    async def try_lock(self, name: str, ttl_s: float) -> str | None:
        token = f"{time.time():.6f}-{id(self)}"
        ok = await self.r.set(self.keys.key(name), token, nx=True, px=int(ttl_s * 1000))
        return token if ok else None

    async def unlock(self, name: str, token: str) -> None:
        await self._unlock(keys=[self.keys.key(name)], args=[token])
