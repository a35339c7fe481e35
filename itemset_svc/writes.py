"""The changes a write makes: upsert, delete and rollback, each applied to a staged version.

Each write hands :meth:`~.publish.VersionPublisher._write` an ``apply(staged)``
that changes the staged copy of the base version; staging, the checks before
publishing, the publish with its ``WAIT`` and the retry on a conflict are
:mod:`.publish`'s.

An upsert runs in four phases: where each SID comes from (given, kept because
the text did not change, or computed from the text by the tokenizer); that
given and kept SIDs belong to no item that stays; the prefix masks, where a
computed SID takes the lowest collision digit still free; then the records
(an existing item keeps its row, a new one takes a fresh row, never reused).
A delete takes items out (unknown ids are ignored). A rollback publishes a
copy of a stored version as a new version.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from specrec_rpc.errors import FailedPrecondition, InvalidArgument

from .keys import (
    DATA_EXTRA,
    DATA_KEYS,
    EMPTY_FINGERPRINT,
    STAGING_TTL_S,
    Layout,
    Record,
    bump,
    format_mask,
    merge_layers,
    parse_mask,
    prefix_steps,
    sid_str,
)
from .metrics import COLLISIONS
from .publish import Staged, VersionPublisher, WriteResult

if TYPE_CHECKING:
    from .reads import VersionNotFound


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


Encoder = Callable[[list[str]], Awaitable[np.ndarray]]


class CatalogueWrites(VersionPublisher):
    """The write half of :class:`~.store.RedisCatalogue`: upsert, delete, rollback."""

    _not_found: Callable[[str], Awaitable[VersionNotFound]]  # the read half's
    hmget: Callable[[str, str, str, list[str]], Awaitable[list[str | None]]]
    hmget_layers: Callable[..., int]
    _layouts: dict[str, Layout]

    async def _masks(self, new: str, prefixes) -> dict[str, dict[int, int]]:
        fields = sorted(set(prefixes))
        raws = await self.hmget("masks", new, "pfx", fields)
        return {f: parse_mask(raw) for f, raw in zip(fields, raws)}

    def _write_changes(self, p, st: Staged, removed: list[Record], added: list[Record],
                       masks: dict[str, dict[int, int]], touched: set[str], deleted_ids: Sequence[str] = ()) -> None:
        """The write's changes into the staged version's overlay ("" = gone), only what changed."""
        k = self.keys

        def put(name: str, fields: dict[str, str]) -> None:
            if not st.base:  # data of its own (a write into an empty namespace): nothing under it to hide
                if gone := [f for f, v in fields.items() if not v]:
                    p.hdel(st.target(k, name), *gone)
                fields = {f: v for f, v in fields.items() if v}
            if fields:
                p.hset(st.target(k, name), mapping=fields)

        sid2item = {sid_str(r.sid): "" for r in removed}
        items = dict.fromkeys(deleted_ids, "")
        sid2item.update({sid_str(r.sid): r.item_id for r in added})
        items.update({r.item_id: r.dumps() for r in added})
        put("sid2item", sid2item)
        put("items", items)
        put("pfx", {f: format_mask(masks[f]) for f in touched})
        for name in DATA_KEYS:  # keys created just now carry the staging TTL too
            p.expire(st.target(k, name), STAGING_TTL_S)

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
            raws = await self.hmget("upsert_read", st.version, "items", ids)
            old = {i: Record.loads(i, raw) for i, raw in zip(ids, raws) if raw}
            fixed, compute = await self._sid_sources(specs, old, st, encode, code_cache)
            await self._check_claims(specs, fixed, st)
            sids, masks, touched, collided = await self._place(specs, old, fixed, compute, code_cache, st)
            records = await self._records(specs, old, sids)
            p = self.pipe()
            self._write_changes(p, st, list(old.values()), records, masks, touched)
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
        owners = await self.hmget("upsert_read", st.version, "sid2item", [sid_str(fixed[k]) for k in keys])
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
            raws = await self.hmget("delete_read", st.version, "items", ids)
            old = [Record.loads(i, raw) for i, raw in zip(ids, raws) if raw]
            if not old:
                return None
            masks = await self._masks(st.version, {p for r in old for p, _ in prefix_steps(r.sid)})
            touched: set[str] = set()
            for r in old:
                bump(masks, touched, r.sid, -1)
            p = self.pipe()
            self._write_changes(p, st, old, [], masks, touched, [r.item_id for r in old])
            await self._t("delete_write", p.execute())
            return WriteResult(st.version, [], removed=old)

        return await self._write("delete", apply)

    async def _copy_content(self, st: Staged, version: str, target: Layout) -> None:
        """Across a bulk load (the target lies on other data than the current version): the staged version
        gets data of its own, a server-side copy of the target's data with its overlays applied (O(items))."""
        k = self.keys
        lay = Layout(st.version)
        p = self.pipe()
        p.zscore(k.key("versions"), version)
        for name in (*DATA_KEYS, *DATA_EXTRA):
            p.copy(k.dkey(target.data, name), k.dkey(st.version, name), replace=True)
            p.expire(k.dkey(st.version, name), STAGING_TTL_S)
        for v in reversed(target.layers):  # oldest first
            for name in DATA_KEYS:
                p.hgetall(k.vkey(v, name))
        res = await self._t("rollback_copy", p.execute())
        if res[0] is None:
            raise await self._not_found(version)
        overlays = res[1 + 2 * (len(DATA_KEYS) + len(DATA_EXTRA)):]
        w = self.pipe()
        w.hset(k.vkey(st.version, "meta"), mapping={"data": lay.data, "layers": ""})
        for j, ov in enumerate(overlays):
            name = DATA_KEYS[j % len(DATA_KEYS)]
            if put := {f: v for f, v in ov.items() if v}:
                w.hset(k.dkey(st.version, name), mapping=put)
            if gone := [f for f, v in ov.items() if not v]:
                w.hdel(k.dkey(st.version, name), *gone)
            if name == "items" and ov:  # changed since the packed copy
                w.sadd(k.dkey(st.version, "dirty"), *ov)
        await self._t("rollback_copy", w.execute())
        self._layouts[st.version] = lay

    async def rollback(self, version: str) -> WriteResult:
        """Publish a copy of a stored version as a new version (version names only grow)."""
        if await self._t("versions", self.r.zscore(self.keys.key("versions"), version)) is None:
            raise await self._not_found(version)
        cur, _ = await self.state()
        if cur == version:
            return WriteResult(version, published=False)

        async def apply(st: Staged) -> WriteResult:
            k = self.keys
            target, cur = await self.layout(version), await self.layout(st.version)
            if target.data == cur.data:
                # the same data: the new overlay resets what the versions since the target changed
                extra = [v for v in cur.layers if v not in target.layers]
                p = self.pipe()
                for v in extra:
                    for name in DATA_KEYS:
                        p.hkeys(k.vkey(v, name))
                found = await self._t("rollback_read", p.execute()) if extra else []
                fields = {name: sorted({f for j, v in enumerate(extra) for f in found[j * 3 + i]})
                          for i, name in enumerate(DATA_KEYS)}
                p = self.pipe()
                p.zscore(k.key("versions"), version)
                n = [self.hmget_layers(p, target, name, fields[name]) if fields[name] else 0 for name in DATA_KEYS]
                res = await self._t("rollback_read", p.execute())
                if res[0] is None:  # pruned meanwhile
                    raise await self._not_found(version)
                at = 1
                w = self.pipe()
                for name, m in zip(DATA_KEYS, n):
                    if m:
                        vals = merge_layers(res[at: at + m])
                        at += m
                        w.hset(st.target(k, name), mapping={f: v or "" for f, v in zip(fields[name], vals)})
                        w.expire(st.target(k, name), STAGING_TTL_S)
                await self._t("rollback_write", w.execute())
            else:
                await self._copy_content(st, version, target)
            meta = await self._t("rollback_read", self.r.hmget(k.vkey(version, "meta"), ["fingerprint", "items"]))
            await self._t("fingerprint", self.r.hset(k.vkey(st.version, "meta"),
                                                     mapping={"fingerprint": meta[0] or EMPTY_FINGERPRINT,
                                                              "items": meta[1] or 0}))
            return WriteResult(st.version)

        return await self._write("rollback", apply, source=version)
