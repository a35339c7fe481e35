"""Items as a few arrays per message (``itemset.v1.PackedItems``): how a full catalogue snapshot of millions of
items travels from the item set to its followers without one protobuf message per item.

:func:`pack` cuts columns into messages of about ``max_bytes`` each (under gRPC's 4 MB default), :func:`unpack`
joins messages back into columns; both are numpy over the whole arrays, plus one slice per string.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from .fingerprint import EMPTY_FINGERPRINT, fingerprint_columns, fingerprint_packed, join_strings, split_strings
from .v1 import itemset_pb2

MAX_BYTES = 2 << 20  # per message, of the numbers and strings packed (gRPC's default limit is 4 MB)


@dataclass
class Columns:
    """Items by column: rows [n] int64, codes [n, L], unseen [n] bool, ids, titles, texts (lists of str)."""

    rows: np.ndarray
    codes: np.ndarray
    unseen: np.ndarray
    ids: list[str]
    titles: list[str]
    texts: list[str]
    # the ids as they travelled (per message: the joined UTF-8 bytes and their ends), kept by :func:`unpack` so
    # the fingerprint is computed without encoding every id again
    packed_ids: list[tuple[bytes, np.ndarray]] = field(default_factory=list, repr=False)

    def __len__(self) -> int:
        return len(self.ids)

    def fingerprint(self, base: str = EMPTY_FINGERPRINT) -> str:
        """The content fingerprint of these items XOR-ed into ``base`` (:mod:`.fingerprint`)."""
        if not self.packed_ids:
            return fingerprint_columns(self.ids, self.codes, self.unseen, base)
        lo = 0
        for buf, ends in self.packed_ids:
            hi = lo + len(ends)
            base = fingerprint_packed(buf, ends, self.codes[lo:hi], self.unseen[lo:hi], base)
            lo = hi
        return base


def pack(cols: Columns, max_bytes: int = MAX_BYTES) -> list[itemset_pb2.PackedItems]:
    """``cols`` as PackedItems messages of about ``max_bytes`` each (at least one, empty when no item)."""
    n = len(cols)
    if n == 0:
        return [itemset_pb2.PackedItems()]
    L = cols.codes.shape[1] if cols.codes.ndim == 2 else 0
    if L and (cols.codes.min() < 0 or cols.codes.max() > 0xFFFF):
        raise ValueError("SID codes must fit uint16 (0..65535) to be packed")
    id_bytes = sum(len(i) for i in cols.ids[:1000]) / min(n, 1000)
    text_bytes = sum(len(t) + len(x) for t, x in zip(cols.titles[:1000], cols.texts[:1000])) / min(n, 1000)
    per_item = 8 + 2 * L + 1 + 8 + id_bytes + (16 + text_bytes if text_bytes else 0)
    step = max(1, int(max_bytes // per_item))
    rows = np.ascontiguousarray(cols.rows, "<i8")
    codes = np.ascontiguousarray(cols.codes, "<u2")
    unseen = np.ascontiguousarray(cols.unseen, np.uint8)
    out = []
    for lo in range(0, n, step):
        hi = min(lo + step, n)
        ids, id_ends = join_strings(cols.ids[lo:hi])
        m = itemset_pb2.PackedItems(rows=rows[lo:hi].tobytes(), codes=codes[lo:hi].tobytes(),
                                    unseen=unseen[lo:hi].tobytes(), ids=ids, id_ends=id_ends.astype("<i8").tobytes())
        if any(cols.titles[lo:hi]) or any(cols.texts[lo:hi]):
            titles, t_ends = join_strings(cols.titles[lo:hi])
            texts, x_ends = join_strings(cols.texts[lo:hi])
            m.titles, m.title_ends, m.texts, m.text_ends = (titles, t_ends.astype("<i8").tobytes(), texts,
                                                            x_ends.astype("<i8").tobytes())
        out.append(m)
    return out


def unpack(messages: Sequence[itemset_pb2.PackedItems], levels: int, with_texts: bool = True) -> Columns:
    """PackedItems messages (in order) -> one :class:`Columns` (``with_texts`` False: titles and texts left "")."""
    rows = [np.frombuffer(m.rows, "<i8") for m in messages]
    n = [len(r) for r in rows]
    codes = [np.frombuffer(m.codes, "<u2").reshape(k, levels) for m, k in zip(messages, n)]
    ids, titles, texts = [], [], []
    packed_ids = [(m.ids, np.frombuffer(m.id_ends, "<i8")) for m, k in zip(messages, n) if k]
    if any(len(e) != k for (_, e), k in zip(packed_ids, [k for k in n if k])):
        packed_ids = []  # ids missing from a message: the fingerprint reads the (empty) strings instead
    for m, k in zip(messages, n):
        ids += split_strings(m.ids, np.frombuffer(m.id_ends, "<i8"), k)
        titles += split_strings(m.titles, np.frombuffer(m.title_ends if with_texts else b"", "<i8"), k)
        texts += split_strings(m.texts, np.frombuffer(m.text_ends if with_texts else b"", "<i8"), k)
    return Columns(np.concatenate(rows) if rows else np.zeros(0, np.int64),
                   np.concatenate(codes).astype(np.int64) if codes else np.zeros((0, levels), np.int64),
                   np.concatenate([np.frombuffer(m.unseen, np.uint8) for m in messages]).astype(bool)
                   if messages else np.zeros(0, bool), ids, titles, texts, packed_ids)
