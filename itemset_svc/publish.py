"""Publishing a version: how every write becomes a new catalogue version, atomically and durably.

A write (upsert, delete, rollback; :mod:`.writes`) stages version ``n``: the
base version's four data keys are COPYed server-side (rollback copies the
target instead), the changes are applied to the copies, and one Lua script
checks that the current pointer still names the base (else the write is
retried on the new base), makes the staged keys persistent, swaps
``current``, adds ``n`` to ``versions`` and publishes. Readers that resolved
version ``v`` keep reading exactly ``v``. Staged keys carry a TTL until
published, so a writer that dies half-way leaves nothing behind for long; a
failed write drops its staged keys and never touches a published version.
After each publish the oldest versions beyond ``keep_versions`` are deleted
(the current one is always the newest). A bulk load (:mod:`.bulk`) stages a
version built from nothing and publishes it the same way.

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
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

from specrec_rpc.errors import FailedPrecondition, Unavailable

from .client import REDIS_DOWN
from .keys import (
    DATA_KEYS,
    EMPTY_FINGERPRINT,
    STAGING_TTL_S,
    Keys,
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
