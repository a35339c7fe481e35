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

Per version ``v`` (written once, then only read, until pruned)::

    {ns}:v:<v>:meta      HASH    op, base, created, items, fingerprint (exists from staging on;
                                 the version is published when it is in {ns}:versions)
    {ns}:v:<v>:sids      SET     valid SIDs, "12.7.200.0"
    {ns}:v:<v>:sid2item  HASH    SID -> item id
    {ns}:v:<v>:items     HASH    item id -> JSON record {row, sid, title, text, unseen}
    {ns}:v:<v>:pfx       HASH    prefix -> allowed next codes with counts, "3:1,9:2"
                                 (prefix "" = first level, "12" = after code 12, ...; the
                                 counts let a deletion drop a code exactly when its last
                                 item goes)

A version's *fingerprint* is the XOR of a hash of every (item id, SID,
unseen) it holds: order-free, so a write updates it from its changes alone,
and anyone holding the items can check it.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from specrec_rpc.fingerprint import EMPTY_FINGERPRINT, fingerprint  # noqa: F401 (re-exported)

VERSION_KEYS = ("meta", "sids", "sid2item", "items", "pfx")
DATA_KEYS = VERSION_KEYS[1:]
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
        return [self.vkey(version, k) for k in VERSION_KEYS]


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


def build_masks(sids: Iterable[Sequence[int]]) -> dict[str, dict[int, int]]:
    masks: dict[str, dict[int, int]] = {}
    for sid in sids:
        for p, c in prefix_steps(sid):
            m = masks.setdefault(p, {})
            m[c] = m.get(c, 0) + 1
    return masks


def bump(masks: dict[str, dict[int, int]], touched: set[str], sid: Sequence[int], delta: int) -> None:
    """Add (+1) or remove (-1) a SID's codes in the prefix masks, noting the prefixes touched."""
    for pfx, c in prefix_steps(sid):
        m = masks.setdefault(pfx, {})
        m[c] = m.get(c, 0) + delta
        if m[c] <= 0:
            m.pop(c)
        touched.add(pfx)


@dataclass
class Record:
    """One item as stored in a version."""

    item_id: str
    row: int
    sid: tuple[int, ...]
    title: str = ""
    text: str = ""
    unseen: bool = False

    def dumps(self) -> str:
        return json.dumps({"row": self.row, "sid": sid_str(self.sid), "title": self.title, "text": self.text,
                           "unseen": self.unseen}, ensure_ascii=False, separators=(",", ":"))

    @classmethod
    def loads(cls, item_id: str, raw: str) -> Record:
        o = json.loads(raw)
        return cls(
            item_id, int(o["row"]), parse_sid(o["sid"]), o.get("title", ""), o.get("text", ""), bool(o.get("unseen"))
        )


# -- fingerprints (see specrec_rpc.fingerprint) --------------------------------------------
def records_fingerprint(records: Iterable[Record]) -> str:
    return fingerprint((r.item_id, r.sid, r.unseen) for r in records)
