"""The item set's own copy of the current catalogue (the *mirror*), and reads from it.

Every item-set process keeps every item of the version it last published or
saw. Two jobs (see :mod:`itemset_svc.service`):

- when Redis lost the catalogue, the mirror is published again;
- while Redis cannot answer (a failover: the primary is gone and no replica is
  promoted yet, or a restart), reads of the mirror's version are answered from
  it: ``GetVersion``, ``Resolve``, ``Lookup``, ``AllowedCodes`` and
  ``Snapshot`` give what Redis would give for that version. Other versions
  stay UNAVAILABLE, and writes wait for a primary.

The SID index and prefix masks are built on the first read that needs them
and dropped whenever the mirror changes.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from .keys import Record, build_masks, records_fingerprint, sid_str
from .reads import CatalogueInfo
from .writes import WriteResult


@dataclass
class Mirror:
    """The item set's own copy of the current catalogue."""

    version: str
    fingerprint: str
    level_sizes: list[int]
    records: dict[str, Record]
    bundle: str = ""
    _by_sid: dict[str, str] | None = field(default=None, repr=False)
    _masks: dict[str, dict[int, int]] | None = field(default=None, repr=False)

    def apply(self, res: WriteResult) -> None:
        """A write this process published: its changes only."""
        if not res.published:
            return
        for r in res.removed:
            self.records.pop(r.item_id, None)
        for r in res.items:
            self.records[r.item_id] = r
        self.version, self.fingerprint = res.version, records_fingerprint(self.records.values())
        self._by_sid = self._masks = None

    # -- reads (the same answers as CatalogueReads for self.version) --------------------------
    def info(self) -> CatalogueInfo:
        return CatalogueInfo(self.version, len(self.records), list(self.level_sizes), [self.version], self.fingerprint,
                             self.bundle)

    def resolve(self, item_ids: Sequence[str]) -> list[Record | None]:
        return [self.records.get(i) for i in item_ids]

    def lookup(self, sids: Sequence[str]) -> list[str | None]:
        if self._by_sid is None:
            self._by_sid = {sid_str(r.sid): r.item_id for r in self.records.values()}
        return [self._by_sid.get(s) for s in sids]

    def allowed(self, prefixes: Sequence[str]) -> list[list[int]]:
        if self._masks is None:
            self._masks = build_masks(r.sid for r in self.records.values())
        return [sorted(c for c, n in self._masks.get(p, {}).items() if n > 0) for p in prefixes]

    def snapshot(self) -> tuple[str, list[int], list[Record], str]:
        return (
            self.version,
            list(self.level_sizes),
            sorted(self.records.values(), key=lambda r: r.row),
            self.fingerprint,
        )
