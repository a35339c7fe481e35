"""Local snapshots of the catalogue, kept in step with the item-set service.

Drafter, verifier and gateway each hold a :class:`CatalogueWatcher`: it
downloads the current version (``ItemSet.Snapshot``, packed: a few arrays per
message, :mod:`.packed`, so millions of items arrive and are indexed with numpy,
:func:`build_snapshot_columns`), builds a
:class:`~specrec.itemset.LocalItemSet` (trie, prefix ranges) and polls
``GetVersion`` every ``poll_s`` seconds; a new version is fetched, built off
the event loop, and swapped in atomically, then listeners are told. A new
version is asked for as a delta over the one held (``since``): the item set
sends only the changed items when it knows the writes between them, and the
watcher applies them to a copy of its arrays (:func:`apply_delta`) instead of
indexing every item again: the strings and the id index lay the changed rows
over the older version's (:mod:`.rowindex`), the trie and
the SID order are the older version's edited, so a version that changes one
item of ten million costs a follower a few hundred ms of copies. The last
``keep`` versions stay available so a request pinned to a version is served
from exactly that version.
"""

from __future__ import annotations

import asyncio
import gc
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field

import grpc
import numpy as np
import structlog
from prometheus_client import Counter, Gauge

from specrec.itemset import LocalItemSet

from .errors import FailedPrecondition, Unavailable
from .fingerprint import EMPTY_FINGERPRINT, LEGACY_EMPTY, fingerprint, is_legacy
from .packed import Columns, unpack
from .rowindex import IdIndex, RowStrings, id_index
from .v1 import itemset_pb2, itemset_pb2_grpc


@dataclass
class Snapshot:
    version: str
    itemset: LocalItemSet
    ids: Sequence[str]  # by row ("" for rows not in this version): a list, or a RowStrings (a delta's version)
    titles: Sequence[str]
    texts: Sequence[str]
    # item id -> row: a dict, a HashIndex past rowindex.HASHED_INDEX_FROM rows, or a delta's IdIndex (rowindex.rows_of
    # looks up many at once)
    index: Mapping[str, int] = field(default_factory=dict)
    fingerprint: str = ""  # content fingerprint (specrec_rpc.fingerprint), checked against the items

    @property
    def level_sizes(self) -> list[int]:
        return self.itemset.level_sizes


class CatalogueMismatch(FailedPrecondition):
    """The catalogue belongs to another bundle, or its content does not match its fingerprint."""


def build_snapshot(version: str, level_sizes: list[int], items: list, expect_fingerprint: str = "",
                   min_rows: int = 0, index: bool = True, trie: bool = True) -> Snapshot:
    """A snapshot from Item messages (:func:`build_snapshot_columns` does the work)."""
    L = len(level_sizes)
    cols = Columns(np.fromiter((it.row for it in items), np.int64, len(items)),
                   np.asarray([list(it.sid.codes) for it in items], dtype=np.int64).reshape(len(items), L),
                   np.fromiter((it.unseen for it in items), bool, len(items)), [it.item_id for it in items],
                   [it.title for it in items], [it.text for it in items])
    return build_snapshot_columns(version, level_sizes, cols, expect_fingerprint, min_rows, index, trie)


def build_snapshot_columns(version: str, level_sizes: list[int], cols: Columns, expect_fingerprint: str = "",
                           min_rows: int = 0, index: bool = True, trie: bool = True) -> Snapshot:
    """A snapshot from items by column (a packed snapshot, :mod:`.packed`): numpy over the arrays, one pass
    over the ids for the index, the content checked against ``expect_fingerprint``. ``index`` False: no id ->
    row index, titles or texts (all ""), for a service that reads rows only (the verifier: at ten million items
    the index alone is 6 s of a copy and a GB); the ids stay, a delta's fingerprint reads them. ``trie`` False:
    the SID order is built, the trie only if something asks for it (the drafter reads the order alone)."""
    n = max(int(cols.rows.max(initial=-1)) + 1, min_rows)
    L = len(level_sizes)
    sids = np.zeros((n, L), dtype=np.int64)
    seen = np.zeros(n, dtype=bool)
    active = np.zeros(n, dtype=bool)
    sids[cols.rows] = cols.codes
    seen[cols.rows] = ~cols.unseen
    active[cols.rows] = True
    titles: Sequence[str]
    texts: Sequence[str]
    if len(cols) == n and np.array_equal(cols.rows, np.arange(n)):  # every row, in order: the columns are it
        ids, titles, texts = list(cols.ids), list(cols.titles), list(cols.texts)
    else:
        ids, titles, texts = [""] * n, [""] * n, [""] * n
        for r, i, t, x in zip(cols.rows.tolist(), cols.ids, cols.titles, cols.texts):
            ids[r], titles[r], texts[r] = i, t, x
    if not index:
        titles = texts = RowStrings([], {}, n)
    # in the announced fingerprint's scheme (a catalogue loaded before 0.3 keeps SHA-256 ones)
    got = cols.fingerprint(LEGACY_EMPTY if expect_fingerprint and is_legacy(expect_fingerprint)
                           else EMPTY_FINGERPRINT)
    if expect_fingerprint and got != expect_fingerprint:
        raise CatalogueMismatch(f"catalogue version {version}: content fingerprint {got} differs from the announced "
                                f"{expect_fingerprint} (items lost or changed in transit)")
    itemset = _built(LocalItemSet(sids, seen, list(level_sizes), version=version, active=active), trie)
    return Snapshot(version, itemset, ids, titles, texts, id_index(ids, active) if index else {}, got)


def _built(itemset: LocalItemSet, trie: bool) -> LocalItemSet:
    """``itemset`` with its SID order, and with ``trie`` its trie, built now, not on the first request."""
    if trie:
        _ = itemset.trie
    _ = itemset.order
    return itemset


def apply_delta(base: Snapshot, version: str, items: list, removed_rows: list[int],
                expect_fingerprint: str = "") -> Snapshot:
    """``base`` with a delta applied (the items added or changed, by row, and the rows emptied): a new
    snapshot, ``base`` untouched. Its fingerprint is ``base``'s with the changed rows' old and new
    content XOR-ed in, checked against the announced one (a mismatch raises :class:`CatalogueMismatch`:
    the caller fetches every item instead). Only the changes are indexed: the strings and the id index
    are ``base``'s with the changed rows laid over them (:class:`RowStrings`, :class:`IdIndex`), the trie
    and order are ``base``'s edited (:meth:`~specrec.itemset.LocalItemSet.changed`); the SID arrays are
    copied."""
    old = base.itemset
    n = max([old.n_rows, *(it.row + 1 for it in items)])
    grow = n - old.n_rows
    sids = np.concatenate([old.sids, np.zeros((grow, old.sids.shape[1]), np.int64)]) if grow else old.sids.copy()
    seen = np.concatenate([old.seen, np.zeros(grow, bool)]) if grow else old.seen.copy()
    active = np.concatenate([old.active, np.zeros(grow, bool)]) if grow else old.active.copy()
    ids_c: dict[int, str] = {}  # the changed rows' strings, and the changed ids' rows (None: gone)
    titles_c: dict[int, str] = {}
    texts_c: dict[int, str] = {}
    index_c: dict[str, int | None] = {}

    def id_at(r: int) -> str:
        return ids_c[r] if r in ids_c else base.ids[r] if r < old.n_rows else ""

    def row_of(i: str) -> int | None:
        return index_c[i] if i in index_c else base.index.get(i)

    touched = sorted({int(r) for r in removed_rows} | {it.row for it in items})
    # the rows' old content leaves the fingerprint (XOR), the new content joins it
    leaving = [(id_at(r), sids[r].tolist(), not seen[r]) for r in touched if r < old.n_rows and active[r]]
    for r in removed_rows:
        if r < n and active[r]:
            if row_of(id_at(r)) == r:
                index_c[id_at(r)] = None
            active[r] = False
            ids_c[r] = titles_c[r] = texts_c[r] = ""
    for it in items:
        r = it.row
        if active[r] and id_at(r) != it.item_id and row_of(id_at(r)) == r:
            index_c[id_at(r)] = None
        sids[r] = list(it.sid.codes)
        seen[r] = not it.unseen
        active[r] = True
        ids_c[r], titles_c[r], texts_c[r] = it.item_id, it.title, it.text
        index_c[it.item_id] = r
    got = fingerprint(leaving + [(it.item_id, it.sid.codes, it.unseen) for it in items], base.fingerprint)
    if expect_fingerprint and got != expect_fingerprint:
        raise CatalogueMismatch(f"catalogue version {version} as a delta over {base.version}: content fingerprint "
                                f"{got} differs from the announced {expect_fingerprint}")
    itemset = _built(old.changed(sids, seen, active, np.asarray(touched, dtype=np.int64), version),
                     "trie" in old.__dict__)
    new_ids = RowStrings.over(base.ids, ids_c, n)
    return Snapshot(version, itemset, new_ids, RowStrings.over(base.titles, titles_c, n),
                    RowStrings.over(base.texts, texts_c, n), IdIndex.over(base.index, index_c, new_ids), got)


Listener = Callable[[Snapshot, Snapshot | None], Awaitable[None] | None]

STALENESS = Gauge("specrec_catalogue_staleness_seconds", "Seconds since this service last heard from the item set "
                  "(a catalogue poll that answered); grows while the item set is unreachable")
FETCHES = Counter("specrec_catalogue_fetches", "catalogue versions this service fetched, by how they came: "
                  "'delta' (the changed items over the version held) or 'full' (every item)", ["kind"])
_WATCHERS: list = []
STALENESS.set_function(lambda: max((time.monotonic() - w.last_ok for w in _WATCHERS if w.last_ok), default=0.0))


def version_number(version: str) -> int:
    """The counter at the end of a catalogue version name ("<epoch>.<n>" -> n; 0 when it has none)."""
    tail = version.rsplit(".", 1)[-1]
    return int(tail) if tail.isdigit() else 0


CATALOGUE_VERSION = Gauge("specrec_catalogue_version", "The catalogue version this service serves: the counter at "
                          "the end of its name (<epoch>.<n>), 0 before the first")
CATALOGUE_VERSION.set_function(lambda: max((version_number(w.current.version) for w in _WATCHERS if w.current),
                                           default=0))


class CatalogueWatcher:
    """Follows the item set. With ``expect_bundle`` (the SID-space fingerprint of
    the bundle this service serves) a catalogue of another bundle is refused:
    at start the watcher waits for the right one (the service stays
    NOT_SERVING, e.g. while a Helm upgrade loads the new catalogue), later it
    keeps serving the versions it has and says why in :attr:`refused`."""

    def __init__(self, channel: grpc.aio.Channel, poll_s: float = 0.5, keep: int = 3, timeout_s: float = 30.0,
                 expect_bundle: str = "", min_reload_s: float = 0.0, collect_every_s: float = 10.0,
                 prepare: Callable[[Snapshot], object] | None = None, index: bool = True, trie: bool = True):
        self.stub = itemset_pb2_grpc.ItemSetStub(channel)
        # False: the snapshots hold no id -> row index, titles or texts (build_snapshot_columns)
        self.index = index
        # False: the snapshots build no trie (the SID order only, all the drafter reads; 3-4 s of a copy at 10M)
        self.trie = trie
        # run on every fetched version off the event loop, before it is installed: what the service would
        # otherwise build on a request's path the first time it sees the version (the verifier's search tables)
        self.prepare = prepare
        self.poll_s, self.keep, self.timeout_s = poll_s, keep, timeout_s
        # a new version is installed at most this often: versions written faster are coalesced (each install
        # fetches and indexes the whole catalogue, tens of ms of CPU per service on Beauty)
        self.min_reload_s = min_reload_s
        self.installed_at = 0.0
        # after dropping old versions, a full garbage collection at most this often (see _install)
        self.collect_every_s = collect_every_s
        self._collected_at = float("-inf")  # the first drop may collect at once, however young the clock
        self.expect_bundle = expect_bundle
        self.refused = ""
        _WATCHERS.append(self)
        self.snapshots: dict[str, Snapshot] = {}
        self.current: Snapshot | None = None
        self.listeners: list[Listener] = []
        self._task: asyncio.Task | None = None
        self._pending: dict[str, asyncio.Future] = {}  # version -> its fetch for get(), shared by the callers
        self.log = structlog.get_logger("catalogue")
        self.last_ok = 0.0

    def check_bundle(self, bundle: str) -> None:
        if self.expect_bundle and bundle and bundle != self.expect_bundle:
            raise CatalogueMismatch(
                f"the catalogue belongs to bundle {bundle}, this service serves bundle "
                f"{self.expect_bundle}: refused (load this bundle's catalogue, or roll the service)"
            )

    async def fetch(self, version: str = "", since: Snapshot | None = None) -> Snapshot:
        """Version ``version`` ("" = the current one); with ``since`` (a version held, of the same
        item-set lineage) as a delta over it when the item set can send one."""
        items, level_sizes, got, fp, base, removed, packed = [], [], version, "", "", [], []
        req = itemset_pb2.SnapshotRequest(version=version, since=since.version if since is not None else "",
                                          packed=True)
        try:
            async for chunk in self.stub.Snapshot(req, timeout=self.timeout_s):
                got = chunk.version
                if chunk.level_sizes:
                    level_sizes = list(chunk.level_sizes)
                fp = fp or chunk.fingerprint
                base = base or chunk.base
                removed.extend(chunk.removed_rows)
                items.extend(chunk.items)
                if chunk.HasField("packed"):
                    packed.append(chunk.packed)
        except grpc.aio.AioRpcError as e:
            if e.code() in (grpc.StatusCode.NOT_FOUND, grpc.StatusCode.FAILED_PRECONDITION):
                raise FailedPrecondition(f"catalogue version {version!r} is not available: {e.details()}") from None
            raise Unavailable(f"item set unavailable: {e.code().name}: {e.details()}") from None
        if base and since is not None and base == since.version and level_sizes == since.level_sizes:
            try:
                snap = await asyncio.to_thread(self._prepared, apply_delta, since, got, items, removed, fp)
                FETCHES.labels("delta").inc()
                return snap
            except CatalogueMismatch as e:
                self.log.warning("catalogue delta refused: fetching every item", error=str(e))
                return await self.fetch(version)
        if base:  # a delta this watcher cannot apply (another base, other level sizes): every item instead
            if since is None:
                raise Unavailable(f"the item set answered a delta over {base!r} for a full snapshot of {version!r}")
            self.log.warning("catalogue delta over another version: fetching every item", base=base,
                             held=since.version)
            return await self.fetch(version)
        FETCHES.labels("full").inc()
        # rows are never reused: a full copy keeps at least the rows of the one held (its last rows may hold
        # deleted items, which a full snapshot cannot show), so arrays indexed by row never shrink
        rows = since.itemset.n_rows if since is not None and level_sizes == since.level_sizes else 0
        if packed:
            cols = await asyncio.to_thread(unpack, packed, len(level_sizes), self.index)
            return await asyncio.to_thread(self._prepared, build_snapshot_columns, got, level_sizes, cols, fp, rows,
                                           self.index, self.trie)
        return await asyncio.to_thread(self._prepared, build_snapshot, got, level_sizes, items, fp, rows, self.index,
                                       self.trie)

    def _prepared(self, build: Callable[..., Snapshot], *args) -> Snapshot:
        snap = build(*args)
        if self.prepare is not None:
            self.prepare(snap)
        return snap

    async def _install(self, snap: Snapshot) -> None:
        old = self.current
        self.snapshots[snap.version] = snap
        dropped = 0
        for v in list(self.snapshots)[: -self.keep]:  # oldest first (insertion order)
            if v != snap.version:
                dropped += self.snapshots.pop(v, None) is not None
        if dropped and time.monotonic() - self._collected_at >= self.collect_every_s:
            # a version a request used stays reachable from reference cycles (an exception caught on its path
            # keeps its traceback's frames, and so their engine and snapshot), and the collector's full passes
            # are rare in a large heap: in a soak with an upsert a second the gateway held ~40 versions of
            # ~2 MB each and grew 85% in ten minutes. A full pass after dropping versions frees them (a few ms)
            self._collected_at = time.monotonic()
            gc.collect()
        self.current = snap
        self.installed_at = time.monotonic()
        self.log.info("catalogue version", version=snap.version, items=len(snap.itemset))
        for fn in self.listeners:
            r = fn(snap, old)
            if asyncio.iscoroutine(r):
                await r

    async def start(self, wait_s: float = 120.0) -> Snapshot:
        """Fetch the current version (retrying until the item set answers), then poll."""
        t0 = time.monotonic()
        while True:
            try:
                info = await self.stub.GetVersion(itemset_pb2.GetVersionRequest(), timeout=self.timeout_s)
                self.check_bundle(info.bundle)
                await self._install(await self.fetch(""))
                break
            except grpc.aio.AioRpcError as e:
                if time.monotonic() - t0 > wait_s:
                    raise Unavailable(f"item set unavailable: {e.code().name}: {e.details()}") from None
                self.log.warning("waiting for the item set", error=e.details())
                await asyncio.sleep(1.0)
            except (Unavailable, FailedPrecondition) as e:
                if time.monotonic() - t0 > wait_s:
                    raise
                self.log.warning("waiting for the item set", error=str(e))
                await asyncio.sleep(1.0)
        self.last_ok = time.monotonic()
        self._task = asyncio.create_task(self._poll())
        assert self.current is not None  # _install set it
        return self.current

    async def _poll(self) -> None:
        while True:
            await asyncio.sleep(self.poll_s)
            try:
                info = await self.stub.GetVersion(itemset_pb2.GetVersionRequest(), timeout=max(1.0, self.poll_s * 4))
                self.last_ok = time.monotonic()
                changed = (self.current is None or info.version != self.current.version
                           or (info.fingerprint and info.fingerprint != self.current.fingerprint))
                pending = self._pending.get(info.version)
                if pending is not None:  # a request pinned to it is fetching it now: that copy, not another
                    await asyncio.shield(pending)
                ready = self.snapshots.get(info.version)  # fetched already for a request pinned to it
                if changed and ready is None and time.monotonic() - self.installed_at < self.min_reload_s:
                    continue  # coalesced: installed on a later poll (with whatever version is current then)
                if changed:
                    try:
                        self.check_bundle(info.bundle)
                    except CatalogueMismatch as e:
                        if self.refused != str(e):
                            self.log.error("catalogue refused", error=str(e))
                        self.refused = str(e)
                        continue
                    self.refused = ""
                    if ready is None or (info.fingerprint and ready.fingerprint != info.fingerprint):
                        ready = await self.fetch(info.version, since=self.current)
                    await self._install(ready)
            except asyncio.CancelledError:
                raise
            except Exception as e:  # keep serving the versions we have
                self.log.warning("catalogue poll failed", error=str(e))

    async def get(self, version: str = "") -> Snapshot:
        """Version ``version`` ("" = the current one). A version this service has not installed (another
        service follows the item set a poll ahead of it, or is pinned to an older one) is fetched once,
        as a delta over the current one where the item set can send that, however many requests ask for
        it meanwhile; the poll then installs it without fetching it again."""
        if not version or (self.current is not None and version == self.current.version):
            if self.current is None:
                raise Unavailable("no catalogue version yet: start() has not finished")
            return self.current
        snap = self.snapshots.get(version)
        if snap is not None:
            return snap
        fut = self._pending.get(version)
        if fut is None:
            fut = self._pending[version] = asyncio.ensure_future(self._fetch_pinned(version))
        return await asyncio.shield(fut)  # a caller that gives up does not cancel the others' fetch

    async def _fetch_pinned(self, version: str) -> Snapshot:
        try:
            snap = await self.fetch(version, since=self.current)
            self.snapshots[version] = snap
            return snap
        finally:
            self._pending.pop(version, None)

    async def stop(self) -> None:
        if self in _WATCHERS:
            _WATCHERS.remove(self)
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except asyncio.CancelledError:
                pass
