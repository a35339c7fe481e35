"""The ItemSet gRPC service: a thin adapter over :class:`~itemset_svc.store.RedisCatalogue`.

Validation names the bad field (INVALID_ARGUMENT); writes need
``authorization: Bearer <write_token>`` (absent: UNAUTHENTICATED, wrong:
PERMISSION_DENIED); an unknown version is NOT_FOUND; Redis down or slow is
UNAVAILABLE; any other failure is INTERNAL (details in the log). No exception
reaches a client as UNKNOWN, streaming RPC included (one error model:
:mod:`specrec_rpc.errors`).

Catalogue integrity. The service keeps its own copy of the current catalogue
(the *mirror*: every item of the version it last published or saw). A watch
loop compares Redis with it every ``watch_s``: when Redis lost the catalogue
(restarted without persistence, flushed) or went back to an older version of
the same lineage (restored from an old snapshot), the mirror is published again
as a new version -- in a new epoch, so the version name is new -- and writes
wait for that. A write never starts from an empty Redis while the mirror
holds a catalogue. So nothing is lost and nothing is published smaller than
what it was based on (see :mod:`.writes`); followers see a new version and
fetch it. The choice is to restore rather than to refuse writes: restoring
keeps serving and loses nothing; the restore is logged and counted
(``specrec_itemset_restores_total``).

Replicated Redis (Sentinel, or a primary with replicas). A write is
acknowledged only once ``WAIT`` says a replica holds it (:mod:`.writes`), so
an acknowledged write survives the loss of the primary. After a failover the
promoted replica may lack writes that were never acknowledged: there, an
older version than the mirror's is what a failover leaves, not a loss, and
the mirror follows it (restoring would bring back versions whose names the
new primary may hand out again). While no primary answers, reads of the
mirror's version come from the mirror (:mod:`.mirror`), and writes retry
(``write_retry_s``, within the caller's deadline), then answer UNAVAILABLE.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import re
import time
from collections import OrderedDict
from collections.abc import Sequence

import grpc
from redis.exceptions import ReadOnlyError

from specrec.ids.semantic import CollisionOverflow
from specrec_rpc.errors import (
    FailedPrecondition,
    InvalidArgument,
    PermissionDenied,
    Unauthenticated,
    Unavailable,
    handle_errors,
    register,
    require,
)
from specrec_rpc.redis_url import safe_url
from specrec_rpc.server import Service
from specrec_rpc.v1 import common_pb2, itemset_pb2, itemset_pb2_grpc

from .keys import version_counter
from .metrics import DELTAS, MIRROR_READS, RESTORES, WRITE_RETRIES
from .mirror import Mirror
from .settings import ItemSetSettings
from .store import (
    REDIS_DOWN,
    NotAcknowledged,
    Record,
    RedisCatalogue,
    UpsertSpec,
    VersionNotFound,
    WriteConflict,
    WriteRejected,
    WriteResult,
    sid_str,
)
from .tokenizer import SidTokenizer

MAX_ENTRIES = 10_000
MAX_ID_CHARS = 256
MAX_TEXT_CHARS = 10_000
DEFAULT_CHUNK = 5_000
MAX_CHUNK = 100_000


# -- validation --------------------------------------------------------------------


def check_count(field: str, n: int) -> None:
    require(n <= MAX_ENTRIES, field, f"{n} entries, at most {MAX_ENTRIES:,} per call")


def check_item_id(field: str, s: str) -> None:
    require(len(s) > 0, field, "empty")
    require(len(s) <= MAX_ID_CHARS, field, f"{len(s)} characters, at most {MAX_ID_CHARS}")
    require(s.isprintable(), field, "non-printable characters")


def check_text(field: str, s: str) -> None:
    require(len(s) <= MAX_TEXT_CHARS, field, f"{len(s)} characters, at most {MAX_TEXT_CHARS:,}")


# <epoch>.<counter>; a bare counter is a well-formed name too
VERSION_RE = re.compile(r"(?:[0-9a-z]{1,32}\.)?[0-9]{1,19}")


def check_version(field: str, s: str) -> str:
    require(s == "" or VERSION_RE.fullmatch(s) is not None, field,
            f"{s[:40]!r} is not a catalogue version ('<epoch>.<counter>' as Version returns, or empty for the "
            "current one)")
    return s


def check_sid(field: str, codes, level_sizes: list[int], prefix: bool = False) -> list[int]:
    codes = list(codes)
    L = len(level_sizes)
    if prefix:
        require(len(codes) < L, field, f"{len(codes)} codes; a prefix has at most {L - 1} (shorter than a full SID)")
    else:
        require(len(codes) == L, field, f"expected {L} codes, got {len(codes)}")
    for lvl, c in enumerate(codes):
        require(0 <= c < level_sizes[lvl], f"{field}[{lvl}]", f"code {c} out of range [0, {level_sizes[lvl]})")
    return codes


def _chunks(version: str, level_sizes: list[int], items: list, fingerprint: str, size: int,
            base: str = "", removed_rows: Sequence[int] = (), n_items: int | None = None) -> list:
    """A snapshot (or, with ``base``, a delta over that version) as its stream of chunks (the first one
    carries the level sizes, the count, the fingerprint and the removed rows)."""
    out = []
    for lo in range(0, max(len(items), 1), size):
        chunk = itemset_pb2.SnapshotChunk(version=version, items=items[lo: lo + size], base=base)
        if lo == 0:
            chunk.level_sizes.extend(level_sizes)
            chunk.n_items = len(items) if n_items is None else n_items
            chunk.fingerprint = fingerprint
            chunk.removed_rows.extend(removed_rows)
        out.append(chunk)
    return out


def to_pb(r: Record) -> common_pb2.Item:
    return common_pb2.Item(item_id=r.item_id, sid=common_pb2.Sid(codes=list(r.sid)), title=r.title, text=r.text,
                           unseen=r.unseen, row=r.row)


# -- error mapping: the item set's domain errors join the one table ---------------------------
register(VersionNotFound, grpc.StatusCode.NOT_FOUND)
register(WriteConflict, grpc.StatusCode.ABORTED)
register(CollisionOverflow, grpc.StatusCode.FAILED_PRECONDITION)
register(REDIS_DOWN, grpc.StatusCode.UNAVAILABLE, "redis unavailable: ")
register(ReadOnlyError, grpc.StatusCode.UNAVAILABLE, "redis is read-only: ")

# a write that failed on one of these is tried again from the start (a failover in progress): each
# attempt stages a fresh version, and publishing the same change twice gives the same content
RETRYABLE = (*REDIS_DOWN, ReadOnlyError, Unavailable, WriteRejected)


def unary(fn):
    return handle_errors(fn)


def stream(fn):
    return handle_errors(fn)


# -- servicer ----------------------------------------------------------------------


class ItemSetServicer(itemset_pb2_grpc.ItemSetServicer):
    def __init__(self, service: ItemSetService):
        self.svc = service
        self.log = service.log
        # snapshot messages: per record object (unchanged records are the same objects from one version of
        # the mirror to the next), and the chunks of the last versions served
        self._pb: dict[int, tuple[Record, common_pb2.Item]] = {}
        self._chunks: OrderedDict[tuple[str, int], list] = OrderedDict()

    def _item_pb(self, r: Record) -> common_pb2.Item:
        got = self._pb.get(id(r))
        if got is None or got[0] is not r:
            got = self._pb[id(r)] = (r, to_pb(r))
        return got[1]

    def _mirror_chunks(self, version: str, size: int) -> list | None:
        """A snapshot of ``version`` from the mirror, when the mirror holds exactly that version (versions
        never change, and the watchers check the content fingerprint): no read of the whole catalogue from
        Redis and no message per item built again. None otherwise."""
        m = self.svc.mirror
        if m is None or not m.exact or not version or m.version != version:
            return None
        key = (version, size)
        if key not in self._chunks:
            v, ls, records, fp = m.snapshot()
            if len(self._pb) > 2 * len(records) + 1024:  # records of old versions: drop them all, rebuild
                self._pb.clear()
            self._chunks[key] = _chunks(v, ls, [self._item_pb(r) for r in records], fp, size)
            while len(self._chunks) > 2:
                self._chunks.popitem(last=False)
        return self._chunks[key]

    def _mirror_delta(self, version: str, since: str, size: int) -> list | None:
        """The changes from ``since`` to ``version`` as a delta stream, when the mirror holds ``version``
        and knows the writes from ``since`` (:meth:`Mirror.delta`). None otherwise (a full snapshot)."""
        m = self.svc.mirror
        if m is None or not since or not version or m.version != version:
            return None
        d = m.delta(since)
        if d is None:
            return None
        records, removed_rows = d
        if len(self._pb) > 2 * len(m.records) + 1024:  # records of old versions: drop them all
            self._pb.clear()
        DELTAS.inc()
        return _chunks(m.version, list(m.level_sizes), [self._item_pb(r) for r in records], m.fingerprint, size,
                       base=since, removed_rows=removed_rows, n_items=len(m.records))

    @property
    def store(self) -> RedisCatalogue:
        if self.svc.store is None:
            raise Unavailable("the item set is starting")
        return self.svc.store

    def authorize(self, context) -> None:
        token = self.svc.settings.write_token.get_secret_value()
        header = None
        for md in context.invocation_metadata() or ():
            if md.key.lower() == "authorization":
                header = md.value
        if not token:
            raise PermissionDenied("writes are disabled on this item set (no write token configured)")
        if header is None:
            raise Unauthenticated("writes need metadata 'authorization: Bearer <token>'")
        scheme, _, given = str(header).partition(" ")
        if scheme.lower() != "bearer" or not given.strip():
            raise Unauthenticated("authorization metadata must be 'Bearer <token>'")
        if not hmac.compare_digest(given.strip().encode(), token.encode()):
            raise PermissionDenied("invalid write token")

    async def level_sizes(self) -> list[int]:
        try:
            ls = await self.store.level_sizes()
        except REDIS_DOWN:
            if self.svc.mirror is None:
                raise
            ls = self.svc.mirror.level_sizes
        if ls is None and self.svc.tokenizer is not None:
            ls = self.svc.tokenizer.level_sizes
        if ls is None:
            raise FailedPrecondition(f"namespace {self.store.ns!r} has no catalogue yet (bulk-load a bundle)")
        return ls

    async def read(self, method: str, version: str, from_redis, from_mirror):
        """``from_redis()``; while Redis cannot answer, ``from_mirror(mirror)`` for the mirror's version."""
        store = self.store
        try:
            return await from_redis(store)
        except REDIS_DOWN:
            m = self.svc.mirror
            if m is None or (version and version != m.version):
                raise
            MIRROR_READS.labels(method).inc()
            return from_mirror(m)

    async def write(self, context, op: str, attempt):
        """``attempt()`` again while it fails as a failover makes writes fail, for ``write_retry_s`` at most
        and within the caller's deadline; then its error (UNAVAILABLE)."""
        budget = self.svc.settings.write_retry_s
        left = context.time_remaining() if context is not None else None
        if left is not None:
            budget = min(budget, left - 0.1)  # keep time to answer before the caller gives up
        deadline = time.monotonic() + budget
        delay, tries = 0.05, 0
        while True:
            tries += 1
            try:
                res = await attempt()
                if tries > 1:
                    self.log.info("write went through after retries", op=op, attempts=tries)
                return res
            except RETRYABLE as e:
                wait = min(delay, deadline - time.monotonic())
                if wait <= 0:
                    raise
                WRITE_RETRIES.labels(op).inc()
                self.log.warning("write failed, retrying", op=op, attempt=tries, error=f"{type(e).__name__}: {e}")
                await asyncio.sleep(wait)
                delay = min(2 * delay, 0.5)

    # -- reads --------------------------------------------------------------------
    @unary
    async def GetVersion(self, request, context):
        info = await self.read("GetVersion", "", lambda st: st.info(), lambda m: m.info())
        return itemset_pb2.CatalogueInfo(version=info.version, n_items=info.n_items, level_sizes=info.level_sizes,
                                         stored_versions=info.stored_versions, fingerprint=info.fingerprint,
                                         bundle=info.bundle)

    @unary
    async def Resolve(self, request, context):
        version = check_version("version", request.version)
        ids = list(request.item_ids)
        check_count("item_ids", len(ids))
        for i, item_id in enumerate(ids):
            check_item_id(f"item_ids[{i}]", item_id)
        v, recs = await self.read("Resolve", version, lambda st: st.resolve(ids, version),
                                  lambda m: (m.version, m.resolve(ids)))
        return itemset_pb2.ResolveResponse(items=[to_pb(r) for r in recs if r is not None],
                                           missing=[i for i, r in zip(ids, recs) if r is None], version=v)

    @unary
    async def Lookup(self, request, context):
        version = check_version("version", request.version)
        check_count("sids", len(request.sids))
        ls = await self.level_sizes()
        keys = [sid_str(check_sid(f"sids[{i}].codes", s.codes, ls)) for i, s in enumerate(request.sids)]
        v, owners = await self.read("Lookup", version, lambda st: st.lookup(keys, version),
                                    lambda m: (m.version, m.lookup(keys)))
        return itemset_pb2.LookupResponse(valid=[o is not None for o in owners], item_ids=[o or "" for o in owners],
                                          version=v)

    @unary
    async def AllowedCodes(self, request, context):
        version = check_version("version", request.version)
        check_count("prefixes", len(request.prefixes))
        ls = await self.level_sizes()
        keys = [sid_str(check_sid(f"prefixes[{i}].codes", p.codes, ls, prefix=True))
                for i, p in enumerate(request.prefixes)]
        v, allowed = await self.read("AllowedCodes", version, lambda st: st.allowed(keys, version),
                                     lambda m: (m.version, m.allowed(keys)))
        return itemset_pb2.AllowedCodesResponse(allowed=[common_pb2.Sid(codes=a) for a in allowed], version=v)

    @stream
    async def Snapshot(self, request, context):
        version = check_version("version", request.version)
        require(request.chunk_size >= 0, "chunk_size", f"{request.chunk_size} is negative")
        require(request.chunk_size <= MAX_CHUNK, "chunk_size", f"{request.chunk_size}, at most {MAX_CHUNK:,}")
        size = request.chunk_size or DEFAULT_CHUNK
        since = check_version("since", request.since)
        chunks = self._mirror_delta(version, since, size) or self._mirror_chunks(version, size)
        if chunks is None:
            v, ls, records, fp = await self.read("Snapshot", version, lambda st: st.snapshot(version),
                                                 lambda m: m.snapshot())
            chunks = _chunks(v, ls, [to_pb(r) for r in records], fp, size)
        for chunk in chunks:
            yield chunk

    # -- writes -------------------------------------------------------------------
    @unary
    async def Upsert(self, request, context):
        self.authorize(context)
        items = request.items
        require(len(items) > 0, "items", "empty: give at least one item")
        check_count("items", len(items))
        ls = await self.level_sizes()
        specs, first = [], {}
        for i, it in enumerate(items):
            f = f"items[{i}]"
            check_item_id(f"{f}.item_id", it.item_id)
            if it.item_id in first:
                raise InvalidArgument(f"{f}.item_id", f"{it.item_id!r} is also items[{first[it.item_id]}]")
            first[it.item_id] = i
            check_text(f"{f}.text", it.text)
            check_text(f"{f}.title", it.title)
            sid = None
            if it.HasField("sid") and len(it.sid.codes):
                sid = tuple(check_sid(f"{f}.sid.codes", it.sid.codes, ls))
            elif not it.text.strip():
                raise InvalidArgument(f"{f}.text", "required when no sid is given")
            specs.append(UpsertSpec(it.item_id, it.text, it.title, sid, it.seen, f))
        encode = self.svc.encode if self.svc.tokenizer is not None else None
        t0 = time.perf_counter()
        res = await self.write(context, "upsert", lambda: self.store.upsert(specs, encode))
        self.svc.mirror_write(res)
        self.log.info("upsert", version=res.version, items=len(res.items), collisions=res.collisions,
                      ms=round((time.perf_counter() - t0) * 1000, 1))
        return itemset_pb2.WriteResponse(version=res.version, items=[to_pb(r) for r in res.items],
                                         collisions=res.collisions)

    @unary
    async def Delete(self, request, context):
        self.authorize(context)
        ids = list(request.item_ids)
        require(len(ids) > 0, "item_ids", "empty: give at least one item id")
        check_count("item_ids", len(ids))
        for i, item_id in enumerate(ids):
            check_item_id(f"item_ids[{i}]", item_id)
        res = await self.write(context, "delete", lambda: self.store.delete(ids))
        self.svc.mirror_write(res)
        self.log.info("delete", version=res.version, removed=len(res.removed), published=res.published)
        return itemset_pb2.WriteResponse(version=res.version, items=[to_pb(r) for r in res.removed])

    @unary
    async def Rollback(self, request, context):
        self.authorize(context)
        require(request.version != "", "version", "required: one of the stored versions")
        version = check_version("version", request.version)
        res = await self.write(context, "rollback", lambda: self.store.rollback(version))
        try:
            await self.svc.refresh_mirror()
        except REDIS_DOWN:
            pass  # acknowledged; the watch loop follows it when Redis answers again
        self.log.info("rollback", to=version, version=res.version, published=res.published)
        return itemset_pb2.WriteResponse(version=res.version)


# -- service -----------------------------------------------------------------------


class ItemSetService(Service):
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

    @property
    def live_store(self) -> RedisCatalogue:
        """The store, from start() until stop()."""
        if self.store is None:
            raise Unavailable("the item set is not started, or is stopping")
        return self.store

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

    # -- catalogue integrity ------------------------------------------------------------------
    async def refresh_mirror(self) -> None:
        """Copy the current catalogue into the mirror (a full read; after a rollback or another replica's write)."""
        info = await self.live_store.info()
        if not info.version:
            return
        v, ls, records, fp = await self.live_store.snapshot(info.version)
        self.mirror = Mirror(v, fp, ls, {r.item_id: r for r in records}, info.bundle)

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
                records = sorted(m.records.values(), key=lambda r: r.row)
                version = await store._bulk_load(records, m.level_sizes, bundle=m.bundle, new_epoch=True)
        finally:
            await store.unlock("restoring", token)
        RESTORES.labels(store.ns).inc()
        self.log.error("catalogue restored from the item set's copy", reason=reason, lost_version=m.version,
                       version=version, items=len(records))
        m.renamed(version, m.fingerprint)  # the same content under a new name: followers need no new copy
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
