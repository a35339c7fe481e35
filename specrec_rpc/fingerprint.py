"""Content fingerprints of a catalogue version, shared by the item set (which
writes them) and its followers (which check what they received).

A fingerprint is the XOR of a hash of every (item id, SID, unseen flag) of
the version: order-free, so a write updates it from its changes alone, and
anyone holding the items can recompute it.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Sequence

EMPTY_FINGERPRINT = "0" * 32


def item_hash(item_id: str, sid: Sequence[int], unseen: bool) -> int:
    key = f"{item_id}\x00{'.'.join(str(int(c)) for c in sid)}\x00{int(bool(unseen))}"
    return int.from_bytes(hashlib.sha256(key.encode()).digest()[:16], "big")


def fingerprint(items: Iterable[tuple[str, Sequence[int], bool]], base: str = EMPTY_FINGERPRINT) -> str:
    """XOR of the items' hashes into ``base`` (adding and removing are the same operation)."""
    acc = int(base, 16)
    for item_id, sid, unseen in items:
        acc ^= item_hash(item_id, sid, unseen)
    return f"{acc:032x}"
