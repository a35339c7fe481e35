"""The item set's own copy of the current catalogue (the *mirror*), and reads from it.

Every item-set process keeps every item of the version it last published or
saw. Two jobs (see :mod:`itemset_svc.integrity`):

- when Redis lost the catalogue, the mirror is published again;
- while Redis cannot answer (a failover: the primary is gone and no replica is
  promoted yet, or a restart), reads of the mirror's version are answered from
  it: ``GetVersion``, ``Resolve``, ``Lookup``, ``AllowedCodes`` and
  ``Snapshot`` give what Redis would give for that version. Other versions
  stay UNAVAILABLE, and writes wait for a primary.

The SID index and prefix masks are built on the first read that needs them
and dropped whenever the mirror changes.

The mirror also remembers what its last writes changed (:attr:`Mirror.changes`),
so a follower that holds an earlier version gets only the difference
(:meth:`Mirror.delta`) instead of the whole catalogue.

At millions of items the records are a :class:`RecordTable`: the data's packed
copy by column (read from Redis in seconds, :meth:`~.reads.CatalogueReads.snapshot_columns`)
and a dict of the items changed since, so the mirror holds arrays, not an object
per item, and hands followers a packed snapshot (:meth:`Mirror.columns`) without
building one.
"""

from __future__ import annotations

import dataclasses
import threading
from collections import OrderedDict
from collections.abc import Iterator, MutableMapping, Sequence
from dataclasses import dataclass, field

import numpy as np

from specrec.ids.trie import mixed_radix
from specrec_rpc.fingerprint import fingerprint, sid_strings
from specrec_rpc.packed import Columns

from .keys import Record, parse_sid
from .publish import WriteResult
from .reads import CatalogueInfo


class RecordTable(MutableMapping):
    """item id -> :class:`Record`, as packed columns (``base``) and the items changed since (``over``: a Record,
    or None for an item of ``base`` that is gone). A Record is made only for an item asked for."""

    def __init__(self, base: Columns, over: dict[str, Record | None] | None = None):
        self.base = dataclasses.replace(base, packed_ids=[])  # (the ids' wire bytes: 170 MB at 10M items)
        self._pos: dict[str, int] | None = None
        self._pos_lock = threading.Lock()
        self.over: dict[str, Record | None] = {}
        self._n = len(base)  # items held
        for i, r in (over or {}).items():
            if r is None:
                self.pop(i, None)
            else:
                self[i] = r

    @property
    def indexed(self) -> bool:
        """Whether :attr:`pos` is built."""
        return self._pos is not None

    @property
    def pos(self) -> dict[str, int]:
        """item id -> its position in ``base``, built on first need (the item set builds it on a thread once
        it has packed the followers' snapshot, :meth:`~.integrity.CatalogueIntegrity.index_mirror`): ten million
        ids take ~6 s and a GB, and a mirror hands out snapshots without it, so followers need not wait for it."""
        if self._pos is None:
            with self._pos_lock:
                if self._pos is None:
                    self._pos = {i: j for j, i in enumerate(self.base.ids)}
        return self._pos

    def _base(self, j: int) -> Record:
        b = self.base
        return Record(b.ids[j], int(b.rows[j]), tuple(int(c) for c in b.codes[j]), b.titles[j], b.texts[j],
                      bool(b.unseen[j]))

    def __getitem__(self, item_id: str) -> Record:
        if item_id in self.over:
            r = self.over[item_id]
            if r is None:
                raise KeyError(item_id)
            return r
        return self._base(self.pos[item_id])

    def __setitem__(self, item_id: str, r: Record) -> None:
        self._n += item_id not in self
        self.over[item_id] = r

    def __delitem__(self, item_id: str) -> None:
        if item_id not in self:
            raise KeyError(item_id)
        self._n -= 1
        if item_id in self.pos:
            self.over[item_id] = None
        else:
            del self.over[item_id]

    def __contains__(self, item_id) -> bool:
        return self.over[item_id] is not None if item_id in self.over else item_id in self.pos

    def __len__(self) -> int:
        return self._n

    def __iter__(self) -> Iterator[str]:
        for i in self.base.ids:
            if i not in self.over:
                yield i
        for i, r in self.over.items():
            if r is not None:
                yield i

    def columns(self) -> Columns:
        """Every item by column, sorted by row (numpy over the base, the changed items appended)."""
        b = self.base
        if not self.over and (len(b) < 2 or bool((b.rows[1:] > b.rows[:-1]).all())):
            return Columns(b.rows, b.codes, b.unseen, b.ids, b.titles, b.texts)  # the base as it is (shared, read only)
        keep = np.fromiter((i not in self.over for i in b.ids), bool, len(b)) if self.over else np.ones(len(b), bool)
        new = [r for r in self.over.values() if r is not None]
        L = b.codes.shape[1]
        rows = np.concatenate([b.rows[keep], np.asarray([r.row for r in new], np.int64)])
        codes = np.concatenate([b.codes[keep], np.asarray([r.sid for r in new], np.int64).reshape(len(new), L)])
        unseen = np.concatenate([b.unseen[keep], np.asarray([r.unseen for r in new], bool)])
        idx = np.flatnonzero(keep).tolist()
        ids = [b.ids[j] for j in idx] + [r.item_id for r in new]
        titles = [b.titles[j] for j in idx] + [r.title for r in new]
        texts = [b.texts[j] for j in idx] + [r.text for r in new]
        order = np.argsort(rows, kind="stable")
        ol = order.tolist()
        return Columns(rows[order], codes[order], unseen[order], [ids[j] for j in ol], [titles[j] for j in ol],
                       [texts[j] for j in ol])


def records_columns(records: Sequence[Record], levels: int) -> Columns:
    """Records (sorted as wanted) by column."""
    n = len(records)
    return Columns(np.fromiter((r.row for r in records), np.int64, n),
                   np.asarray([r.sid for r in records], dtype=np.int64).reshape(n, levels),
                   np.fromiter((r.unseen for r in records), bool, n), [r.item_id for r in records],
                   [r.title for r in records], [r.text for r in records])


async def read_mirror(store, version: str, bundle: str = "") -> Mirror:
    """The mirror of ``version`` read from Redis: from the data's packed copy where it has one (a
    :class:`RecordTable`), else every item of the items hash."""
    got = await store.snapshot_columns(version)
    if got is not None:
        v, ls, cols, changed, fp = got
        return Mirror(v, fp, ls, RecordTable(cols, changed), bundle)
    v, ls, records, fp = await store.snapshot(version, batch=10_000)
    return Mirror(v, fp, ls, {r.item_id: r for r in records}, bundle)


@dataclass
class Mirror:
    """The item set's own copy of the current catalogue."""

    version: str
    fingerprint: str
    level_sizes: list[int]
    records: MutableMapping[str, Record]  # a dict, or a RecordTable (millions of items)
    bundle: str = ""
    # to version -> (from version, records written, records taken out), oldest first, the last max_changes
    changes: OrderedDict[str, tuple[str, list[Record], list[Record]]] = field(default_factory=OrderedDict,
                                                                             repr=False)
    max_changes: int = 256
    # False once a write it applied was made from another version than the mirror's (another replica wrote
    # between): the content may be off, so no snapshot or delta is served from it until it is read again
    exact: bool = True
    _logged: int = field(default=0, repr=False)  # records held by the log
    _by_sid: dict[str, str] | None = field(default=None, repr=False)
    _sorted: tuple[np.ndarray, np.ndarray] | None = field(default=None, repr=False)  # items' keys, codes by key

    def apply(self, res: WriteResult) -> bool:
        """A write this process published: its changes only. False when the write was made from another
        version than the mirror's: its changes are applied all the same (the best copy there is while
        Redis cannot be read), but the mirror is no longer :attr:`exact` and its log is dropped."""
        if not res.published:
            return True
        follows = res.base is None or res.base == self.version
        out: list[Record] = []  # the mirror's own records that leave (the fingerprint follows what it held)
        for r in res.removed:
            old = self.records.pop(r.item_id, None)
            if old is not None:
                out.append(old)
        for r in res.items:
            old = self.records.get(r.item_id)
            if old is not None:
                out.append(old)
            self.records[r.item_id] = r
        fp = fingerprint(((r.item_id, r.sid, r.unseen) for r in out + list(res.items)), self.fingerprint)
        if not follows:
            self.exact = False
            self.changes.clear()
        self.renamed(res.version, fp, list(res.items), out)
        return follows

    def renamed(self, version: str, fp: str, written: list[Record] | None = None,
                out: list[Record] | None = None) -> None:
        """The mirror's content is now ``version`` (after :meth:`apply`, or published again as is by a
        restore): the step is remembered for :meth:`delta`. A name seen before (Redis went back to an older
        state and the counter repeats) cuts the log: it could no longer be followed back safely."""
        if version == self.version or version in self.changes:
            self.changes.clear()
        elif self.exact:
            self.changes[version] = (self.version, written or [], out or [])
            self._logged += len(written or []) + len(out or [])
            # at most max_changes writes, and no more records than the catalogue holds (a full snapshot is
            # cheaper than a delta that large)
            while self.changes and (len(self.changes) > self.max_changes
                                    or self._logged > max(len(self.records), 1000)):
                _, (_, w, o) = self.changes.popitem(last=False)
                self._logged -= len(w) + len(o)
        if not self.changes:
            self._logged = 0
        self.version, self.fingerprint = version, fp
        self._by_sid = self._sorted = None

    def delta(self, since: str) -> tuple[list[Record], list[int]] | None:
        """What changed from version ``since`` to the mirror's: the records added or changed (their
        current content, by row) and the rows that hold no item any more; None when the mirror does not
        know the writes from ``since`` (too old, another lineage, or written by another replica)."""
        if not since or not self.exact:
            return None
        steps: list[tuple[str, list[Record], list[Record]]] = []
        v = self.version
        while v != since:
            step = self.changes.get(v)
            if step is None or len(steps) > len(self.changes):  # not logged, or (never) a cycle
                return None
            steps.append(step)
            v = step[0]
        touched: set[str] = set()
        rows_out: set[int] = set()
        for _, written, out in steps:
            touched.update(r.item_id for r in written)
            touched.update(r.item_id for r in out)
            rows_out.update(r.row for r in out)
        now = [self.records[i] for i in touched if i in self.records]
        rows_out -= {r.row for r in now}
        return sorted(now, key=lambda r: r.row), sorted(rows_out)

    # -- reads (the same answers as CatalogueReads for self.version) --------------------------
    def info(self) -> CatalogueInfo:
        return CatalogueInfo(self.version, len(self.records), list(self.level_sizes), [self.version], self.fingerprint,
                             self.bundle)

    def resolve(self, item_ids: Sequence[str]) -> list[Record | None]:
        return [self.records.get(i) for i in item_ids]

    def lookup(self, sids: Sequence[str]) -> list[str | None]:
        if self._by_sid is None:  # built by column: millions of items in seconds, not an object per item
            cols = self.columns()[2]
            self._by_sid = dict(zip(sid_strings(cols.codes), cols.ids))
        return [self._by_sid.get(s) for s in sids]

    def allowed(self, prefixes: Sequence[str]) -> list[list[int]]:
        """Per prefix, the next codes with an item: the items' mixed-radix keys sorted once, then per prefix a
        binary search for its range and the codes in it (no table of every prefix)."""
        L = len(self.level_sizes)
        if self._sorted is None:
            codes = self.columns()[2].codes
            keys = mixed_radix(codes, self.level_sizes)
            order = np.argsort(keys, kind="stable")
            self._sorted = keys[order], codes[order]
        keys, codes = self._sorted
        out: list[list[int]] = []
        for p in prefixes:
            try:
                pre = parse_sid(p)
            except ValueError:
                out.append([])
                continue
            if len(pre) >= L or any(not 0 <= c < n for c, n in zip(pre, self.level_sizes)):
                out.append([])
                continue
            lo_key = 0
            for c, n in zip([*pre, *[0] * (L - len(pre))], self.level_sizes):
                lo_key = lo_key * n + c
            span = int(np.prod(self.level_sizes[len(pre):], dtype=np.int64))
            lo, hi = np.searchsorted(keys, [lo_key, lo_key + span])
            out.append(np.unique(codes[lo:hi, len(pre)]).tolist())
        return out

    def columns(self) -> tuple[str, list[int], Columns, str]:
        """:meth:`snapshot` by column (a packed snapshot, a restore's bulk load)."""
        if isinstance(self.records, RecordTable):
            cols = self.records.columns()
        else:
            cols = records_columns(sorted(self.records.values(), key=lambda r: r.row), len(self.level_sizes))
        return self.version, list(self.level_sizes), cols, self.fingerprint

    def snapshot(self) -> tuple[str, list[int], list[Record], str]:
        return (
            self.version,
            list(self.level_sizes),
            sorted(self.records.values(), key=lambda r: r.row),
            self.fingerprint,
        )
