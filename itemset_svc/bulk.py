"""The store's bulk load: a whole catalogue published as one fresh version, built from nothing.

The catalogue comes as arrays (:class:`CatalogueArrays`: ids, SID codes
``[N, L]``, unseen flags, rows; titles and texts optional), so ten million
items never become ten million Python objects at once: the checks (distinct
ids and SIDs, codes in range) are numpy's, the prefix masks are counted with
``np.unique`` per level, the fingerprint is numpy over each chunk's packed
ids and codes (:mod:`specrec_rpc.fingerprint`), and the items, SIDs and masks are formatted and written chunk by
chunk (``chunk`` items per HSET, a few HSETs per pipelined round trip) into
the version's own data keys (:mod:`.keys`). Then the meta with the content
fingerprint, and the version is published like any write (:mod:`.publish`),
whatever the current version is. Loading over a catalogue that gives some row
to another item, or uses other level sizes, is refused unless ``force``.
:mod:`.load` reads a bundle and calls :meth:`CatalogueBulkLoad.bulk_load`; a
restore (:mod:`.integrity`) calls :meth:`CatalogueBulkLoad._bulk_load` from
inside a write.
"""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable, Iterator, Sequence
from dataclasses import dataclass, field

import numpy as np

from specrec_rpc.fingerprint import fingerprint_packed, sid_strings
from specrec_rpc.packed import Columns, pack

from .keys import EMPTY_FINGERPRINT, STAGING_TTL_S, Layout, Record
from .metrics import CATALOGUE_ITEMS, ITEMS_WRITTEN, WRITES
from .publish import VersionPublisher

ROUND_TRIP_ITEMS = 20_000  # items (or mask fields) per pipelined round trip


@dataclass
class CatalogueArrays:
    """A whole catalogue as arrays, by item: ids, SID codes ``[N, L]``, unseen flags, rows (default 0..N-1);
    titles and texts optional (None: empty)."""

    item_ids: Sequence[str]
    sids: np.ndarray
    unseen: np.ndarray
    rows: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))  # empty: 0..N-1
    titles: Sequence[str] | None = None
    texts: Sequence[str] | None = None

    def __post_init__(self) -> None:
        self.sids = np.asarray(self.sids, dtype=np.int64).reshape(len(self.item_ids), -1)
        self.unseen = np.asarray(self.unseen, dtype=bool).reshape(-1)
        self.rows = np.asarray(self.rows, dtype=np.int64).reshape(-1)
        if len(self.rows) == 0:
            self.rows = np.arange(len(self.item_ids), dtype=np.int64)
        if not len(self.unseen) == len(self.rows) == len(self.item_ids):
            raise ValueError("catalogue arrays of different lengths")

    def __len__(self) -> int:
        return len(self.item_ids)

    @classmethod
    def of_records(cls, records: Sequence[Record]) -> CatalogueArrays:
        L = max((len(r.sid) for r in records), default=0)
        if any(len(r.sid) != L for r in records):
            bad = next(r for r in records if len(r.sid) != L)
            raise ValueError(f"item {bad.item_id!r}: SID {list(bad.sid)} is not {L} codes long")
        return cls([r.item_id for r in records], np.asarray([r.sid for r in records], dtype=np.int64).reshape(-1, L),
                   np.asarray([r.unseen for r in records], dtype=bool), np.asarray([r.row for r in records]),
                   [r.title for r in records], [r.text for r in records])


def item_json(row: int, sid: str, unseen: bool, title: str, text: str) -> str:
    """What :meth:`Record.dumps` writes, for one item."""
    if title or text:
        o: dict = {"row": row, "sid": sid, "unseen": unseen}
        if title:
            o["title"] = title
        if text:
            o["text"] = text
        return json.dumps(o, ensure_ascii=False, separators=(",", ":"))
    return f'{{"row":{row},"sid":"{sid}","unseen":{"true" if unseen else "false"}}}'


def prefix_masks(sids: np.ndarray, level_sizes: Sequence[int]) -> Iterator[tuple[list[str], list[str]]]:
    """The prefix masks (:mod:`.keys`) of a catalogue, level by level in chunks: (prefix fields, masks)."""
    for lvl in range(sids.shape[1]):
        code = sids[:, lvl]
        key = np.zeros(len(sids), dtype=np.int64)
        for d in range(lvl):
            key = key * level_sizes[d] + sids[:, d]
        pair, counts = np.unique(key * level_sizes[lvl] + code, return_counts=True)
        pkey, codes = pair // level_sizes[lvl], pair % level_sizes[lvl]
        starts = np.flatnonzero(np.r_[True, pkey[1:] != pkey[:-1]])
        ends = np.r_[starts[1:], len(pkey)]
        # the prefix's own codes back from its key (mixed radix), for its field name
        first = np.zeros((len(starts), lvl), dtype=np.int64)
        rest = pkey[starts].copy()
        for d in range(lvl - 1, -1, -1):
            first[:, d] = rest % level_sizes[d]
            rest //= level_sizes[d]
        pair_strs = [f"{c}:{n}" for c, n in zip(codes.tolist(), counts.tolist())]
        for lo in range(0, len(starts), ROUND_TRIP_ITEMS):
            hi = min(lo + ROUND_TRIP_ITEMS, len(starts))
            fields = sid_strings(first[lo:hi])
            masks = [",".join(pair_strs[a:b]) for a, b in zip(starts[lo:hi].tolist(), ends[lo:hi].tolist())]
            yield fields, masks


class CatalogueBulkLoad(VersionPublisher):
    """The bulk-load half of :class:`~.store.RedisCatalogue`."""

    snapshot_columns: Callable[[str], Awaitable[tuple[str, list[int], Columns, dict, str] | None]]  # the read half's

    async def bulk_load(self, records: Sequence[Record] | CatalogueArrays, level_sizes: Sequence[int],
                        force: bool = False, chunk: int = 5000, progress: bool = False, bundle: str = "") -> str:
        """Publish a catalogue (records, or :class:`CatalogueArrays`) as a fresh version (its own data,
        pipelined in chunks) and make it current, whatever the current version is.
        ``bundle``: the fingerprint of the bundle the catalogue belongs to."""
        cat = records if isinstance(records, CatalogueArrays) else CatalogueArrays.of_records(records)
        level_sizes = [int(x) for x in level_sizes]
        self._check_arrays(cat, level_sizes)
        async with self._lock:
            cur, ls = await self.state()
            if cur and not force:
                await self._check_compatible(cur, ls, cat, level_sizes)
            return await self._bulk_load(cat, level_sizes, chunk, progress, bundle)

    async def _bulk_load(self, records: Sequence[Record] | CatalogueArrays, level_sizes: Sequence[int],
                         chunk: int = 5000, progress: bool = False, bundle: str = "", new_epoch: bool = False) -> str:
        """:meth:`bulk_load` with the write lock already held (restores call it from inside a write)."""
        cat = records if isinstance(records, CatalogueArrays) else CatalogueArrays.of_records(records)
        level_sizes = [int(x) for x in level_sizes]
        cur, _ = await self.state()
        new = await self._new_version(new_epoch)
        bar = None
        if progress:
            from specrec.terminal import progress_bar

            bar = progress_bar(total=len(cat), unit="item", desc=f"loading version {new}")
        try:
            await self._stage(new, Layout(new), "load", cur)
            await self._load_items(new, cat, level_sizes, chunk, bar)
            next_row = int(cat.rows.max(initial=-1)) + 1
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
        ITEMS_WRITTEN.labels("load").inc(len(cat))
        CATALOGUE_ITEMS.labels(self.ns).set(len(cat))
        await self._prune()
        self.log.info("published", version=new, op="load", base=cur, items=len(cat))
        return new

    @staticmethod
    def _check_arrays(cat: CatalogueArrays, level_sizes: list[int]) -> None:
        from specrec.ids.trie import mixed_radix

        L = len(level_sizes)
        if len(set(cat.item_ids)) != len(cat):
            raise ValueError("duplicate item ids in the catalogue")
        if len(cat) == 0:
            return
        bad = (cat.sids < 0) | (cat.sids >= np.asarray(level_sizes)) if cat.sids.shape[1] == L else None
        if bad is None or bad.any():
            i = 0 if bad is None else int(np.flatnonzero(bad.any(axis=1))[0])
            raise ValueError(f"item {cat.item_ids[i]!r}: SID {cat.sids[i].tolist()} does not fit level sizes "
                             f"{level_sizes}")
        keys = mixed_radix(cat.sids, level_sizes)
        order = np.argsort(keys, kind="stable")
        dup = np.flatnonzero(keys[order][1:] == keys[order][:-1])
        if len(dup):
            a, b = int(order[dup[0]]), int(order[dup[0] + 1])
            raise ValueError(f"items {cat.item_ids[a]!r} and {cat.item_ids[b]!r} share SID "
                             f"{'.'.join(map(str, cat.sids[a].tolist()))}")

    async def _load_items(self, new: str, cat: CatalogueArrays, level_sizes: list[int], chunk: int, bar) -> None:
        k = self.keys
        fp = EMPTY_FINGERPRINT
        rows = cat.rows.tolist()
        step = max(chunk, ROUND_TRIP_ITEMS)
        for lo in range(0, len(cat), step):
            hi = min(lo + step, len(cat))
            sids = sid_strings(cat.sids[lo:hi])
            ids = list(cat.item_ids[lo:hi])
            unseen = cat.unseen[lo:hi]
            titles = cat.titles[lo:hi] if cat.titles is not None else [""] * (hi - lo)
            texts = cat.texts[lo:hi] if cat.texts is not None else [""] * (hi - lo)
            recs = [item_json(r, s, u, ti, te)
                    for r, s, u, ti, te in zip(rows[lo:hi], sids, unseen.tolist(), titles, texts)]
            packed = pack(Columns(cat.rows[lo:hi], cat.sids[lo:hi], unseen, ids, list(titles), list(texts)),
                          max_bytes=1 << 40)[0]
            fp = fingerprint_packed(packed.ids, np.frombuffer(packed.id_ends, "<i8"), cat.sids[lo:hi], unseen, fp)
            p = self.pipe(transaction=False)
            p.hset(k.dkey(new, "packed"), str(lo // step), packed.SerializeToString())
            for a in range(0, hi - lo, chunk):
                b = min(a + chunk, hi - lo)
                p.hset(k.dkey(new, "sid2item"), mapping=dict(zip(sids[a:b], ids[a:b])))
                p.hset(k.dkey(new, "items"), mapping=dict(zip(ids[a:b], recs[a:b])))
            for name in ("items", "sid2item", "packed"):
                p.expire(k.dkey(new, name), STAGING_TTL_S)
            await self._t("load_chunk", p.execute())
            if bar is not None:
                bar.update(hi - lo)
        for fields, masks in prefix_masks(cat.sids, level_sizes):
            p = self.pipe(transaction=False)
            for a in range(0, len(fields), chunk):
                p.hset(k.dkey(new, "pfx"), mapping=dict(zip(fields[a:a + chunk], masks[a:a + chunk])))
            p.expire(k.dkey(new, "pfx"), STAGING_TTL_S)
            await self._t("load_chunk", p.execute())
        p = self.pipe()
        p.hset(k.vkey(new, "meta"), mapping={"fingerprint": fp, "items": len(cat)})
        for key in self._staged_keys(new):
            p.expire(key, STAGING_TTL_S)
        await p.execute()

    async def _check_compatible(self, cur: str, ls: list[int] | None, cat: CatalogueArrays,
                                level_sizes: list[int]) -> None:
        if ls and list(ls) != list(level_sizes):
            raise ValueError(f"namespace {self.ns!r} holds SIDs with level sizes {ls}, the bundle has {level_sizes} "
                             f"(force to replace)")
        by_row = dict(zip(cat.rows.tolist(), cat.item_ids))

        def check(item_id: str, row: int) -> None:
            if row in by_row and by_row[row] != item_id:
                raise ValueError(f"row {row} is item {item_id!r} in version {cur} but {by_row[row]!r} in the "
                                 f"bundle: rows must stay stable (force to replace)")

        packed = await self.snapshot_columns(cur)  # the data's packed copy, and what changed since
        if packed is not None:
            _, _, cols, changed, _ = packed
            for item_id, row in zip(cols.ids, cols.rows.tolist()):
                if item_id not in changed:
                    check(item_id, row)
            for item_id, rec in changed.items():
                if rec is not None:
                    check(item_id, rec.row)
            return
        lay = await self.layout(cur)
        seen: set[str] = set()
        for key in lay.keys(self.keys, "items"):  # overlays newest first, then the data
            async for item_id, raw in self.r.hscan_iter(key, count=2000):
                if item_id not in seen:
                    seen.add(item_id)
                    if raw:
                        check(item_id, json.loads(raw)["row"])
