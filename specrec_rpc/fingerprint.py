"""Content fingerprints of a catalogue version, shared by the item set (which
writes them) and its followers (which check what they received).

A fingerprint is the XOR of a 128-bit hash of every (item id, SID, unseen
flag) of the version: order-free, so a write updates it from its changes
alone, and anyone holding the items can recompute it.

Two schemes. Fingerprints written since 0.3 start with :data:`SCHEME`: the
item hash is numpy over whole columns (:func:`item_digests`), about 0.3 s per
million items, where hashing each item with SHA-256 in Python took 1.1 s and
the follower of a ten-million-item catalogue spent two thirds of its start
checking it. A version's fingerprint keeps its base's scheme (a write XORs its
changes in with the base's item hash), so a catalogue bulk-loaded before 0.3
keeps its SHA-256 fingerprints (the first 16 bytes of SHA-256 over
"<id>\\x00<SID codes joined by dots>\\x00<0|1>" per item), still checked, until
its next bulk load. Neither is a cryptographic commitment: they catch items
lost or changed on their way, not forgery.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Sequence

import numpy as np

SCHEME = "fp2:"
EMPTY_FINGERPRINT = SCHEME + "0" * 32  # of no items: what a new catalogue starts from
LEGACY_EMPTY = "0" * 32

_P = np.uint64(0x100000001B3)  # the FNV-64 prime: odd, so every power of it is invertible mod 2**64
_LEN = np.uint64(0x9E3779B97F4A7C15)
_LANES = (np.uint64(0x243F6A8885A308D3), np.uint64(0x13198A2E03707344))
_CHUNK = 1 << 17  # items hashed per numpy pass (bounds the temporaries at a few MB)
_pow_cache = np.ones(1, np.uint64)


def is_legacy(fp: str) -> bool:
    """Whether ``fp`` is a SHA-256 fingerprint (written before 0.3)."""
    return not fp.startswith(SCHEME)


def _powers(n: int) -> np.ndarray:
    """_P**0 .. _P**(n-1) mod 2**64 (numpy's uint64 products wrap)."""
    global _pow_cache
    if len(_pow_cache) < n:
        out = np.full(max(n, 2 * len(_pow_cache)), _P, np.uint64)
        out[0] = 1
        _pow_cache = np.cumprod(out, dtype=np.uint64)
    return _pow_cache[:n]


def _fmix(h: np.ndarray) -> np.ndarray:
    """MurmurHash3's 64-bit finaliser, in place."""
    h ^= h >> np.uint64(33)
    h *= np.uint64(0xFF51AFD7ED558CCD)
    h ^= h >> np.uint64(33)
    h *= np.uint64(0xC4CEB9FE1A85EC53)
    h ^= h >> np.uint64(33)
    return h


def item_digests(id_bytes: bytes, id_ends: np.ndarray, codes: np.ndarray, unseen: np.ndarray) -> np.ndarray:
    """The current scheme's item hashes, [n, 2] uint64, of items given as their ids' UTF-8 bytes joined
    (``id_bytes``, item i's ending at ``id_ends[i]``: a packed message's ids as they travel), their SID codes
    [n, L] and unseen flags [n]. Per item: the id's bytes b_j as the polynomial sum (b_j + 1) * P**j mod 2**64,
    its length mixed in, then each code and the flag folded in by XOR and a multiply by P, then two lanes
    finalised (MurmurHash3's fmix64) from it with different seeds."""
    ends = np.asarray(id_ends, np.int64)
    n = len(ends)
    if n == 0:
        return np.zeros((0, 2), np.uint64)
    starts = np.concatenate([np.zeros(1, np.int64), ends[:-1]])
    lens = ends - starts
    b = np.frombuffer(id_bytes, np.uint8, count=int(ends[-1])).astype(np.uint64)
    b += np.uint64(1)
    b *= _powers(int(lens.max(initial=1)))[np.arange(len(b), dtype=np.int64) - np.repeat(starts, lens)]
    cs = np.zeros(len(b) + 1, np.uint64)
    np.cumsum(b, dtype=np.uint64, out=cs[1:])
    h = cs[ends] - cs[starts]  # each id's sum (differences of wrapping sums wrap back)
    h ^= lens.astype(np.uint64) * _LEN
    for col in np.asarray(codes).reshape(n, -1).T:
        h ^= col.astype(np.uint64)
        h *= _P
    h ^= np.asarray(unseen).astype(np.uint64)
    h *= _P
    return np.stack([_fmix(h ^ lane) for lane in _LANES], axis=1)


def _xor_into(acc: int, digests: np.ndarray) -> int:
    if len(digests):
        hi, lo = (int(x) for x in np.bitwise_xor.reduce(digests, axis=0))
        acc ^= (hi << 64) | lo
    return acc


def join_strings(values: Sequence[str]) -> tuple[bytes, np.ndarray]:
    """Strings as their UTF-8 bytes joined and each one's end, int64 (how a packed message carries a column of
    strings, :mod:`.packed`, and how :func:`item_digests` reads ids)."""
    enc = [v.encode() for v in values]
    return b"".join(enc), np.cumsum(np.fromiter((len(e) for e in enc), np.int64, len(enc)), dtype=np.int64)


def split_strings(buf: bytes, ends: np.ndarray, n: int) -> list[str]:
    """:func:`join_strings` undone: ``n`` strings (``n`` empty ones when there are no ends)."""
    if not len(ends):
        return [""] * n
    e = np.asarray(ends, np.int64).tolist()
    starts = [0, *e[:-1]]
    try:
        s = buf.decode("ascii")  # the common case: character offsets are byte offsets
        return [s[a:b] for a, b in zip(starts, e)]
    except UnicodeDecodeError:
        return [buf[a:b].decode() for a, b in zip(starts, e)]


def fingerprint_columns(ids: Sequence[str], codes: np.ndarray, unseen: np.ndarray,
                        base: str = EMPTY_FINGERPRINT) -> str:
    """The fingerprint of items given as columns (ids, SID codes [n, L], unseen flags [n]) XOR-ed into ``base``
    (adding and removing are the same operation), in ``base``'s scheme."""
    if not len(ids):
        return base
    codes = np.asarray(codes)
    unseen = np.asarray(unseen, bool)
    if is_legacy(base):  # one SHA-256 per item, the digests XOR-ed by numpy
        digests = b"".join(hashlib.sha256(f"{i}\x00{s}\x00{int(u)}".encode()).digest()[:16]
                           for i, s, u in zip(ids, sid_strings(codes.reshape(len(ids), -1)), unseen.tolist()))
        acc = _xor_into(int(base, 16), np.frombuffer(digests, dtype=">u8").reshape(-1, 2))
        return f"{acc:032x}"
    acc = int(base[len(SCHEME):], 16)
    for lo in range(0, len(ids), _CHUNK):
        hi = min(lo + _CHUNK, len(ids))
        acc = _xor_into(acc, item_digests(*join_strings(ids[lo:hi]), codes[lo:hi], unseen[lo:hi]))
    return f"{SCHEME}{acc:032x}"


def fingerprint_packed(id_bytes: bytes, id_ends: np.ndarray, codes: np.ndarray, unseen: np.ndarray,
                       base: str = EMPTY_FINGERPRINT) -> str:
    """:func:`fingerprint_columns` of items whose ids are still packed (joined UTF-8 bytes and their ends, as a
    ``PackedItems`` message carries them): no Python string per item in the current scheme."""
    if is_legacy(base):
        return fingerprint_columns(split_strings(id_bytes, id_ends, len(id_ends)), codes, unseen, base)
    ends = np.asarray(id_ends, np.int64)
    acc = int(base[len(SCHEME):], 16)
    for lo in range(0, len(ends), _CHUNK):
        hi = min(lo + _CHUNK, len(ends))
        off = int(ends[lo - 1]) if lo else 0
        acc = _xor_into(acc, item_digests(id_bytes[off:int(ends[hi - 1])], ends[lo:hi] - off, codes[lo:hi],
                                          unseen[lo:hi]))
    return f"{SCHEME}{acc:032x}"


def fingerprint(items: Iterable[tuple[str, Sequence[int], bool]], base: str = EMPTY_FINGERPRINT) -> str:
    """:func:`fingerprint_columns` of (item id, SID codes, unseen) tuples: a write's changes."""
    items = list(items)
    if not items:
        return base
    return fingerprint_columns([i for i, _, _ in items], np.asarray([list(s) for _, s, _ in items], np.int64),
                               np.asarray([bool(u) for _, _, u in items]), base)


def sid_strings(codes) -> list[str]:
    """Rows of SID codes (a numpy array [N, L]) -> "12.7.200.0" each, as the item set's keys spell them (one
    table lookup per code, no str() per code: ten million items in seconds)."""
    if codes.shape[1] == 0:
        return [""] * len(codes)
    tab = [str(i) for i in range(int(codes.max(initial=0)) + 1)]
    cols = [[tab[c] for c in col] for col in codes.T.tolist()]
    return [".".join(t) for t in zip(*cols)]
