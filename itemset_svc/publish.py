"""Publishing a version: how every write becomes a new catalogue version, atomically and durably.

A write (upsert, delete, rollback; :mod:`.writes`) stages version ``n``: its
meta names the base's data and the base's layers not yet folded into it
(:meth:`.keys.Layout.live`) with its own overlay on top (:mod:`.keys`), the
changes are written to that overlay only (what a write costs is what it
changes, whatever the catalogue's size), and one Lua script
checks that the current pointer still names the base (else the write is
retried on the new base), makes the staged keys persistent, swaps
``current``, adds ``n`` to ``versions`` and publishes. Readers that resolved
version ``v`` keep reading exactly ``v``. Staged keys carry a TTL until
published, so a writer that dies half-way leaves nothing behind for long; a
failed write drops its staged keys and never touches a published version.
After each publish the oldest versions beyond ``keep_versions`` are deleted
(the current one is always the newest): each in one Lua script that folds the
next version's overlay into the data (O(its changes)), or deletes the data
when the next version has data of its own. A bulk load (:mod:`.bulk`) stages
a version with data of its own and publishes it the same way.

Before publishing, a write checks that its base's meta and data are still
there, and records its item count (the base's, plus what it added, minus
what it removed): data lost underneath (Redis restarted in the middle) never
becomes a smaller catalogue.

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
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

from specrec_rpc.errors import FailedPrecondition, Unavailable

from .client import REDIS_DOWN
from .keys import (
    EMPTY_FINGERPRINT,
    STAGING_TTL_S,
    Keys,
    Layout,
    Record,
    fingerprint,
    version_counter,
    version_name,
)
from .metrics import CATALOGUE_ITEMS, ITEMS_WRITTEN, WRITES


class WriteConflict(RuntimeError):
    """Other writers kept publishing versions while this write was being built: ABORTED."""


class WriteRejected(FailedPrecondition):
    """The staged version would not hold what its base held (data lost underneath): nothing is published."""


class NotAcknowledged(Unavailable):
    """Published on the primary, but fewer replicas than required hold it: not acknowledged (UNAVAILABLE).
    A failover may lose it; retrying the same write is safe."""


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

    def target(self, keys: Keys, name: str) -> str:
        """Where its changes go: its overlay over its base's content, or (no base) data of its own."""
        return keys.vkey(self.version, name) if self.base else keys.dkey(self.version, name)


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

# KEYS: versions, then the pruned version's meta and overlays (4), the next version's meta and overlays (4), the
# pruned version's data (3 hashes, its packed copy, its dirty set); ARGV: the pruned version, the next one
# ("" = none), the pruned version's data id.
# The data is the oldest version's content: when the next version lies over the same data its overlay is folded
# in (and emptied: readers holding its old layout read the same; the items it changed join the dirty set, which
# readers of the packed copy read again), else no version is left on the data: deleted.
_FOLD = """
if not redis.call('ZSCORE', KEYS[1], ARGV[1]) then return 0 end
if ARGV[2] ~= '' and redis.call('HGET', KEYS[6], 'data') == ARGV[3] then
  for j = 0, 2 do
    local kv = redis.call('HGETALL', KEYS[7 + j])
    for i = 1, #kv, 2 do
      if kv[i + 1] == '' then redis.call('HDEL', KEYS[10 + j], kv[i])
      else redis.call('HSET', KEYS[10 + j], kv[i], kv[i + 1]) end
      if j == 1 then redis.call('SADD', KEYS[14], kv[i]) end
    end
    redis.call('UNLINK', KEYS[7 + j])
  end
  redis.call('HSET', KEYS[6], 'layers', '')
else
  redis.call('UNLINK', KEYS[10], KEYS[11], KEYS[12], KEYS[13], KEYS[14])
end
redis.call('ZREM', KEYS[1], ARGV[1])
redis.call('UNLINK', KEYS[2], KEYS[3], KEYS[4], KEYS[5])
return 1
"""

# KEYS: current, versions, then the staged version's keys; ARGV: the staged version. Deletes its keys
# unless it was published after all (a publish whose answer was lost, e.g. the connection dropped
# right after the script ran): a published version is never dropped.
_DROP = """
if redis.call('GET', KEYS[1]) == ARGV[1] or redis.call('ZSCORE', KEYS[2], ARGV[1]) then return 0 end
for i = 3, #KEYS do redis.call('UNLINK', KEYS[i]) end
return 1
"""


class VersionPublisher:
    """Staging, checking, publishing and pruning versions: the part of :class:`~.store.RedisCatalogue` every
    write goes through."""

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
    _drop_staged: Any
    _fold: Any
    _layouts: dict[str, Layout]  # version -> its layout, as read once
    layout: Callable[[str], Awaitable[Layout]]
    pipe: Callable[..., Any]
    _t: Callable[[str, Awaitable[Any]], Awaitable[Any]]
    state: Callable[[], Awaitable[tuple[str | None, list[int] | None]]]
    stored_versions: Callable[[], Awaitable[list[str]]]

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

    async def _stage(self, new: str, lay: Layout, op: str, base: str | None, source: str | None = None) -> None:
        """The staged version's meta: what it is made from, and its layout (its own data, or its overlay over
        its base's)."""
        meta = self.keys.vkey(new, "meta")
        p = self.pipe()
        p.hset(meta, mapping={"op": op, "base": base or "", "source": source or "", "created": f"{time.time():.3f}",
                              "data": lay.data, "layers": ",".join(lay.layers)})
        p.expire(meta, STAGING_TTL_S)
        await self._t("stage", p.execute())
        self._layouts[new] = lay

    def _staged_keys(self, version: str) -> list[str]:
        """Every key a staged version may have made: its meta, its overlays, data of its own."""
        return [*self.keys.version_keys(version), *self.keys.data_keys(version)]

    async def _drop(self, version: str) -> None:
        """Delete a staged version unless it was published after all; never raises."""
        k = self.keys
        self._layouts.pop(version, None)
        try:
            await asyncio.shield(self._drop_staged(keys=[k.key("current"), k.key("versions"),
                                                         *self._staged_keys(version)], args=[version]))
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
        keys = [k.key("current"), k.key("versions"), k.key("level_sizes"), k.key("next_row"), *self._staged_keys(new)]
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
        """Delete the oldest versions beyond ``keep``, oldest first, each folding the next one's overlay into
        the data (:data:`_FOLD`): what it costs is the next version's changes."""
        k = self.keys
        try:
            stored = await self.stored_versions()
            victims = stored[: max(0, len(stored) - self.keep)]
            for i, v in enumerate(victims):
                nxt = stored[i + 1] if i + 1 < len(stored) else ""
                try:
                    data = (await self.layout(v)).data
                except FailedPrecondition:  # written by an item set before layers: its keys were all its own
                    p = self.pipe()
                    p.zrem(k.key("versions"), v)
                    p.execute_command("UNLINK", *k.version_keys(v), k.vkey(v, "sids"))
                    await self._t("prune", p.execute())
                    continue
                keys = [k.key("versions"), *k.version_keys(v), *k.version_keys(nxt or v), *k.data_keys(data)]
                await self._t("prune", self._fold(keys=keys, args=[v, nxt, data]))
                self._layouts.pop(v, None)
                self._layouts.pop(nxt, None)  # its layers were folded: read again (the old one stays right)
            if victims:
                self.log.info("pruned versions", versions=victims)
            return victims
        except REDIS_DOWN as e:  # the write itself is published; pruning is retried after the next one
            self.log.warning("pruning failed", error=repr(e))
            return []

    async def _check_counts(self, st: Staged, result: WriteResult) -> None:
        """The staged version's item count: its base's, plus the new, minus the removed; refused when the
        base's meta or data is gone (data was lost underneath)."""
        k = self.keys
        if st.base is None:
            await self._t("count", self.r.hset(k.vkey(st.version, "meta"), "items", len(result.items)))
            return
        lay = await self.layout(st.version)
        p = self.pipe()
        p.hget(k.vkey(st.base, "meta"), "items")
        p.exists(k.dkey(lay.data, "items"), k.vkey(st.version, "meta"))
        n_base, present = await self._t("count", p.execute())
        written = {r.item_id for r in result.items}
        removed = {r.item_id for r in result.removed}
        want = int(n_base or 0) + len(written - removed) - len(removed - written)
        if n_base is None or int(present) < 2:
            raise WriteRejected(f"catalogue: the base version {st.base} or its data is gone (Redis lost data "
                                f"underneath); nothing was published")
        await self._t("count", self.r.hset(k.vkey(st.version, "meta"), "items", want))

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
                    lay = Layout(st.version)
                    if base:  # over the base's overlays that are not folded into its data yet
                        lay = (await self.layout(base)).live(await self.stored_versions()).over(st.version)
                    await self._stage(st.version, lay, op, base, source)
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
            n = await self._t("count", self.r.hget(self.keys.vkey(version, "meta"), "items"))
            CATALOGUE_ITEMS.labels(self.ns).set(int(n or 0))
        except REDIS_DOWN:
            pass
