"""The catalogue's Redis key schema and the codecs of what is stored there.

Every key of a namespace ``ns`` starts with the hash tag ``{ns}``, so the
whole namespace lives in one Redis Cluster slot and MULTI/EXEC, COPY and Lua
work there as on a standalone server.

Global keys::

    {ns}:current        STRING  the current version ("a3f29c.17")
    {ns}:versions       ZSET    published versions still stored (score = the version's counter)
    {ns}:epoch          STRING  this catalogue's lineage, a random id made by its first write
    {ns}:seq            STRING  version counter (INCR; versions only grow, rollback included)
    {ns}:next_row       STRING  next free catalogue row (rows are never reused)
    {ns}:level_sizes    STRING  codes per SID level, "256,256,256,256"
    {ns}:bundle         STRING  fingerprint of the bundle (SID space) the catalogue belongs to
    {ns}:loading        STRING  short lock so replicas starting together bulk-load once
    {ns}:restoring      STRING  short lock so replicas that see a lost catalogue restore it once
    {ns}:events         pub/sub channel: JSON {"namespace", "version", "op", "base"} per published version

A version's name is ``<epoch>.<counter>``. When Redis loses everything (a
restart without persistence), the next write makes a new epoch, and so does
the item set's restore after Redis went back to an old snapshot (whose counter
would repeat names), so a version name never means two catalogues.

A version's content is one *data* set of keys plus the *layers* over it.
The data (written by a bulk load, or by a rollback across one, then changed
only by pruning, below)::

    {ns}:d:<d>:sid2item  HASH    SID "12.7.200.0" -> item id (the valid SIDs)
    {ns}:d:<d>:items     HASH    item id -> JSON record {row, sid, unseen[, title, text]}
    {ns}:d:<d>:pfx       HASH    prefix -> allowed next codes with counts, "3:1,9:2"
                                 (prefix "" = first level, "12" = after code 12, ...; the
                                 counts let a deletion drop a code exactly when its last
                                 item goes)
    {ns}:d:<d>:packed    HASH    "0", "1", ... -> the items as the bulk load wrote them, packed
                                 (itemset.v1.PackedItems, a few arrays per field): how a mirror
                                 reads millions of items in seconds (absent: read the items hash)
    {ns}:d:<d>:dirty     SET     item ids changed in the data since (folds add them): a mirror
                                 reads these, and the layers' items, on top of the packed copy

Per version ``v`` (written once, then only read, until pruned)::

    {ns}:v:<v>:meta      HASH    op, base, created, items (count), fingerprint, data (<d>),
                                 layers (the versions whose overlays it reads, newest first)
                                 (exists from staging on; the version is published when it
                                 is in {ns}:versions)
    {ns}:v:<v>:sid2item  HASH    the overlay of a write: only the fields it changed, over its
    {ns}:v:<v>:items     HASH    base's content; "" = the field is gone. A bulk load has none
    {ns}:v:<v>:pfx       HASH    (its content is its data)

A field of version ``v`` is the first of its layers' overlays that holds it,
else the data's. A write costs what it changes: its overlay, never a copy of
the catalogue. Pruning the oldest version folds the next version's overlay
into the data (one Lua script, atomic to readers), so the data is always the
oldest stored version's content and a reader holding an older ``layers``
list still reads right (a folded overlay is empty, the data holds it).

A version's *fingerprint* is the XOR of a hash of every (item id, SID,
unseen) it holds: order-free, so a write updates it from its changes alone,
and anyone holding the items can check it.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from specrec_rpc.fingerprint import EMPTY_FINGERPRINT, fingerprint  # noqa: F401 (re-exported)

DATA_KEYS = ("sid2item", "items", "pfx")  # the hashes a field is read from (data and overlays alike)
DATA_EXTRA = ("packed", "dirty")  # the data's own
VERSION_KEYS = ("meta", *DATA_KEYS)
STAGING_TTL_S = 6 * 3600
ROOT = ""  # the prefix field of the first level


class Keys:
    """The key names of one namespace."""

    def __init__(self, namespace: str):
        self.ns = namespace
        self.tag = "{" + namespace + "}"
        self.channel = self.key("events")

    def key(self, name: str) -> str:
        return f"{self.tag}:{name}"

    def vkey(self, version: str, name: str) -> str:
        return f"{self.tag}:v:{version}:{name}"

    def version_keys(self, version: str) -> list[str]:
        """The meta and the overlay keys of a version."""
        return [self.vkey(version, k) for k in VERSION_KEYS]

    def dkey(self, data: str, name: str) -> str:
        return f"{self.tag}:d:{data}:{name}"

    def data_keys(self, data: str) -> list[str]:
        """The data's hashes (:data:`DATA_KEYS`), then its packed copy and its dirty set."""
        return [self.dkey(data, k) for k in (*DATA_KEYS, *DATA_EXTRA)]


@dataclass(frozen=True)
class Layout:
    """Where a version's content lives: its data's id and the versions whose overlays lie over it (newest
    first). A layout read once stays right while the version is stored (see the module's doc)."""

    data: str
    layers: tuple[str, ...] = ()

    @classmethod
    def of_meta(cls, meta: dict) -> Layout:
        layers = meta.get("layers") or ""
        return cls(meta.get("data") or "", tuple(x for x in layers.split(",") if x))

    def over(self, version: str) -> Layout:
        """The layout of a version written as an overlay over this one."""
        return Layout(self.data, (version, *self.layers))

    def live(self, stored: Sequence[str]) -> Layout:
        """This layout less the overlays already folded into its data, given the stored versions (oldest first).
        A pruning folds the next version's overlay into the data (:data:`.publish._FOLD`) but the metas of the
        versions after it still name that overlay; an overlay is live while its version is stored and newer than
        the oldest stored one (whose overlay the last pruning folded, or which has data of its own). A new
        version is laid over its base's live overlays only: named on, folded ones made every version's reads and
        writes slower than the last's (one-item upserts from 7 ms to 33 ms p50 over 600 writes at 12k items)."""
        live = set(stored[1:])
        return Layout(self.data, tuple(v for v in self.layers if v in live))

    def keys(self, keys: Keys, name: str) -> list[str]:
        """The keys a field ``name`` is read from, in order: the overlays, newest first, then the data."""
        return [*(keys.vkey(v, name) for v in self.layers), keys.dkey(self.data, name)]


def merge_layers(values: Sequence[Sequence[str | None]]) -> list[str | None]:
    """Per field: the first layer's value that is not None ("" = gone: None), given HMGET answers of the
    overlays newest first, then the data's."""
    out: list[str | None] = list(values[-1])
    for vals in reversed(values[:-1]):
        for i, v in enumerate(vals):
            if v is not None:
                out[i] = v or None
    return out


def version_name(epoch: str, counter: int) -> str:
    return f"{epoch}.{counter}"


def version_counter(version: str) -> int:
    """The counter of a version name (0 for a name that has none)."""
    tail = version.rsplit(".", 1)[-1]
    return int(tail) if tail.isdigit() else 0


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


def bump(masks: dict[str, dict[int, int]], touched: set[str], sid: Sequence[int], delta: int) -> None:
    """Add (+1) or remove (-1) a SID's codes in the prefix masks, noting the prefixes touched."""
    for pfx, c in prefix_steps(sid):
        m = masks.setdefault(pfx, {})
        m[c] = m.get(c, 0) + delta
        if m[c] <= 0:
            m.pop(c)
        touched.add(pfx)


@dataclass(slots=True)
class Record:
    """One item as stored in a version (slots: the item set's mirror holds one per item, millions of them)."""

    item_id: str
    row: int
    sid: tuple[int, ...]
    title: str = ""
    text: str = ""
    unseen: bool = False

    def dumps(self) -> str:
        o: dict = {"row": self.row, "sid": sid_str(self.sid), "unseen": self.unseen}
        if self.title:  # empty texts are left out: at ten million items every byte per item is 10 MB
            o["title"] = self.title
        if self.text:
            o["text"] = self.text
        return json.dumps(o, ensure_ascii=False, separators=(",", ":"))

    @classmethod
    def loads(cls, item_id: str, raw: str) -> Record:
        o = json.loads(raw)
        return cls(
            item_id, int(o["row"]), parse_sid(o["sid"]), o.get("title", ""), o.get("text", ""), bool(o.get("unseen"))
        )
