"""Content fingerprints (specrec_rpc.fingerprint): order-free, XOR-updatable, the same from tuples, columns and
packed messages, sensitive to every field, and the SHA-256 scheme of catalogues loaded before 0.3 still kept."""

import hashlib
import random

import numpy as np
import pytest

from specrec_rpc import fingerprint as F
from specrec_rpc.catalogue import CatalogueMismatch, build_snapshot_columns
from specrec_rpc.packed import Columns, pack, unpack

ITEMS = [(f"item-{i}", (i % 7, i % 5, i % 3), i % 4 == 0) for i in range(50)] + [("é-ü", (1, 2, 0), False)]


def columns(items):
    return Columns(np.arange(len(items)), np.asarray([s for _, s, _ in items], np.int64),
                   np.asarray([u for _, _, u in items]), [i for i, _, _ in items], [""] * len(items),
                   [""] * len(items))


def reference_hash(item_id: str, sid, unseen: bool) -> int:
    """The scheme as item_digests' docstring states it, in Python integers."""
    M, P = (1 << 64) - 1, 0x100000001B3

    def fmix(h):
        h ^= h >> 33
        h = (h * 0xFF51AFD7ED558CCD) & M
        h ^= h >> 33
        h = (h * 0xC4CEB9FE1A85EC53) & M
        return h ^ (h >> 33)

    data = item_id.encode()
    h = sum((b + 1) * pow(P, j, 1 << 64) for j, b in enumerate(data)) & M
    h ^= (len(data) * 0x9E3779B97F4A7C15) & M
    for c in [*sid, int(unseen)]:
        h = ((h ^ c) * P) & M
    return (fmix(h ^ 0x243F6A8885A308D3) << 64) | fmix(h ^ 0x13198A2E03707344)


def test_the_scheme_is_what_it_says_and_stays():
    """Fingerprints are stored in Redis and checked by other processes: the scheme may not drift."""
    acc = 0
    for it in ITEMS:
        acc ^= reference_hash(*it)
    assert F.fingerprint(ITEMS) == f"{F.SCHEME}{acc:032x}"
    assert F.fingerprint([("a", (1, 2, 3), False)]) == "fp2:1a884b0648cfbab00e03f7b1ca5786f8"
    assert F.fingerprint([]) == F.EMPTY_FINGERPRINT


def test_order_free_and_xor_updatable():
    fp = F.fingerprint(ITEMS)
    shuffled = ITEMS[:]
    random.Random(0).shuffle(shuffled)
    assert F.fingerprint(shuffled) == fp and fp.startswith(F.SCHEME)
    assert F.fingerprint(ITEMS[10:], F.fingerprint(ITEMS[:10])) == fp
    assert F.fingerprint(ITEMS[:10], fp) == F.fingerprint(ITEMS[10:])  # removing is adding again


def test_tuples_columns_and_packed_messages_agree(monkeypatch):
    monkeypatch.setattr(F, "_CHUNK", 7)  # chunks that cut the items and a message's ids
    cols = columns(ITEMS)
    want = F.fingerprint(ITEMS)
    assert cols.fingerprint() == want
    got = unpack(pack(cols, max_bytes=200), 3)
    assert len(got.packed_ids) > 2 and got.fingerprint() == want


@pytest.mark.parametrize("change", [
    lambda it: [("item-0x", *it[0][1:]), *it[1:]],  # an id's byte
    lambda it: [(it[0][0], (it[0][1][0], it[0][1][1], 2), it[0][2]), *it[1:]],  # a code
    lambda it: [(it[0][0], it[0][1], not it[0][2]), *it[1:]],  # the unseen flag
    lambda it: [("item-0", (3, 1, 1), True), ("item-1", (0, 0, 0), False), *it[2:]],  # SIDs swapped
    lambda it: [("item-0i", *it[0][1:]), ("tem-1", *it[1][1:]), *it[2:]],  # a byte moved across ids
    lambda it: it[1:],  # an item lost
])
def test_every_field_counts(change):
    assert F.fingerprint(change(ITEMS)) != F.fingerprint(ITEMS)


def test_a_catalogue_loaded_before_0_3_keeps_its_sha256_scheme():
    legacy = F.fingerprint(ITEMS, F.LEGACY_EMPTY)
    acc = 0
    for i, s, u in ITEMS:
        key = f"{i}\x00{'.'.join(str(c) for c in s)}\x00{int(u)}"
        acc ^= int.from_bytes(hashlib.sha256(key.encode()).digest()[:16], "big")
    assert F.is_legacy(legacy) and legacy == f"{acc:032x}"
    assert F.fingerprint(ITEMS[:3], F.fingerprint(ITEMS[3:], F.LEGACY_EMPTY)) == legacy  # writes follow the base
    cols = unpack(pack(columns(ITEMS)), 3)
    assert build_snapshot_columns("e.1", [8, 8, 4], cols, legacy).fingerprint == legacy
    assert build_snapshot_columns("e.1", [8, 8, 4], cols, F.fingerprint(ITEMS)).fingerprint == F.fingerprint(ITEMS)
    with pytest.raises(CatalogueMismatch, match="content fingerprint"):
        build_snapshot_columns("e.1", [8, 8, 4], unpack(pack(columns(ITEMS[1:])), 3), legacy)
