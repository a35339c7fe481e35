"""The ItemSet gRPC servicer: each RPC validated, answered from the store, its errors mapped.

Validation names the bad field (INVALID_ARGUMENT, :mod:`.validation`); writes need
``authorization: Bearer <write_token>`` (absent: UNAUTHENTICATED, wrong:
PERMISSION_DENIED); an unknown version is NOT_FOUND; Redis down or slow is
UNAVAILABLE; any other failure is INTERNAL (details in the log). No exception
reaches a client as UNKNOWN, streaming RPC included (one error model:
:mod:`specrec_rpc.errors`; the item set's domain errors join its table here).

Reads go to Redis (:class:`~.store.RedisCatalogue`); while Redis cannot answer,
reads of the mirror's version are answered from the mirror (:mod:`.mirror`).
``Snapshot`` is served from the mirror when it holds exactly the version asked
for, and as a delta when it knows the writes since the follower's version. A
write that fails the way writes fail in a failover (Redis unreachable or
read-only, too few replicas) is tried again (``write_retry_s``, within the
caller's deadline), then answers UNAVAILABLE. The service behind it
(start, stop, the mirror's upkeep) is :class:`~.service.ItemSetService`.
"""

from __future__ import annotations

import asyncio
import hmac
import time
from collections import OrderedDict
from collections.abc import Sequence
from typing import Any, Protocol

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
from specrec_rpc.packed import Columns, pack
from specrec_rpc.v1 import common_pb2, itemset_pb2, itemset_pb2_grpc

from .metrics import DELTAS, MIRROR_READS, WRITE_RETRIES
from .mirror import Mirror, records_columns
from .publish import WriteResult
from .settings import ItemSetSettings
from .store import (
    REDIS_DOWN,
    Record,
    RedisCatalogue,
    UpsertSpec,
    VersionNotFound,
    WriteConflict,
    WriteRejected,
    sid_str,
)
from .tokenizer import SidTokenizer
from .validation import (
    DEFAULT_CHUNK,
    MAX_CHUNK,
    check_count,
    check_item_id,
    check_sid,
    check_text,
    check_version,
)


class ItemSet(Protocol):
    """What the servicer needs of the item set (:class:`itemset_svc.service.ItemSetService`, which builds it): the
    servicer is its adapter to the wire and does not import it."""

    settings: ItemSetSettings
    store: RedisCatalogue | None
    tokenizer: SidTokenizer | None
    mirror: Mirror | None
    log: Any  # a structlog logger

    async def encode(self, texts: list[str]): ...

    async def refresh_mirror(self) -> None: ...

    def index_mirror(self) -> None: ...

    def mirror_write(self, res: WriteResult) -> None: ...


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


def _packed_chunks(version: str, level_sizes: list[int], cols: Columns, fingerprint: str) -> list:
    """A full snapshot (items by column, sorted by row) as packed chunks (:mod:`specrec_rpc.packed`: a few
    arrays per message, not a message per item); the first carries the level sizes, the count and the
    fingerprint."""
    out = [itemset_pb2.SnapshotChunk(version=version, packed=m) for m in pack(cols)]
    out[0].level_sizes.extend(level_sizes)
    out[0].n_items, out[0].fingerprint = len(cols), fingerprint
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
    def __init__(self, service: ItemSet):
        self.svc = service
        self.log = service.log
        # snapshot messages: per record object (unchanged records are the same objects from one version of
        # the mirror to the next), and the chunks of the last versions served
        self._pb: dict[int, tuple[Record, common_pb2.Item]] = {}
        self._chunks: OrderedDict[tuple[str, int], list] = OrderedDict()
        self._packing: dict[tuple[str, int], asyncio.Future] = {}  # packed snapshots being packed, by key

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
        if m is None or not m.exact or m.version != (version or m.version):  # "" asks for the current version
            return None
        version = m.version
        key = (version, size)
        if key not in self._chunks:
            v, ls, records, fp = m.snapshot()
            if len(self._pb) > 2 * len(records) + 1024:  # records of old versions: drop them all, rebuild
                self._pb.clear()
            self._chunks[key] = _chunks(v, ls, [self._item_pb(r) for r in records], fp, size)
            while len(self._chunks) > 2:
                self._chunks.popitem(last=False)
        return self._chunks[key]

    async def _mirror_packed(self, version: str) -> list | None:
        """:meth:`_mirror_chunks`, packed (kept for the last versions served, like the others). The columns are
        taken on the event loop (where writes change the mirror), packed on a thread (seconds at ten million
        items: the loop keeps answering health checks and polls), once for the followers that ask together."""
        m = self.svc.mirror
        if m is None or not m.exact or m.version != (version or m.version):  # "" asks for the current version
            return None
        key = (m.version, -1)
        if key not in self._chunks:
            packing = self._packing.get(key)
            if packing is None:
                packing = self._packing[key] = asyncio.ensure_future(asyncio.to_thread(_packed_chunks, *m.columns()))
            try:
                chunks = await asyncio.shield(packing)
            finally:
                if packing.done():
                    self._packing.pop(key, None)
            self._chunks[key] = chunks
            while len(self._chunks) > 2:
                self._chunks.popitem(last=False)
            self.svc.index_mirror()
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
        chunks = self._mirror_delta(version, since, size)
        if chunks is None:
            chunks = await self._mirror_packed(version) if request.packed else self._mirror_chunks(version, size)
        if chunks is None:
            v, ls, records, fp = await self.read("Snapshot", version, lambda st: st.snapshot(version),
                                                 lambda m: m.snapshot())
            chunks = (_packed_chunks(v, ls, records_columns(records, len(ls)), fp) if request.packed
                      else _chunks(v, ls, [to_pb(r) for r in records], fp, size))
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
