"""Request validation for the ItemSet RPCs: limits, and checks that name the bad field.

Each check raises :class:`~specrec_rpc.errors.InvalidArgument` (INVALID_ARGUMENT) with the field's name, e.g.
``items[3].sid.codes[1]: code 300 out of range [0, 256)``. The servicer (:mod:`.servicer`) runs them before any
read or write touches Redis.
"""

from __future__ import annotations

import re

from specrec_rpc.errors import require

MAX_ENTRIES = 10_000
MAX_ID_CHARS = 256
MAX_TEXT_CHARS = 10_000
DEFAULT_CHUNK = 5_000
MAX_CHUNK = 100_000


def check_count(field: str, n: int) -> None:
    require(n <= MAX_ENTRIES, field, f"{n} entries, at most {MAX_ENTRIES:,} per call")


def check_item_id(field: str, s: str) -> None:
    require(len(s) > 0, field, "empty")
    require(len(s) <= MAX_ID_CHARS, field, f"{len(s)} characters, at most {MAX_ID_CHARS}")
    require(s.isprintable(), field, "non-printable characters")


def check_text(field: str, s: str) -> None:
    require(len(s) <= MAX_TEXT_CHARS, field, f"{len(s)} characters, at most {MAX_TEXT_CHARS:,}")


# <epoch>.<counter>; a bare counter is a well-formed name too
VERSION_RE = re.compile(r"(?:[0-9a-z]{1,32}\.)?[0-9]{1,19}")


def check_version(field: str, s: str) -> str:
    require(s == "" or VERSION_RE.fullmatch(s) is not None, field,
            f"{s[:40]!r} is not a catalogue version ('<epoch>.<counter>' as Version returns, or empty for the "
            "current one)")
    return s


def check_sid(field: str, codes, level_sizes: list[int], prefix: bool = False) -> list[int]:
    codes = list(codes)
    L = len(level_sizes)
    if prefix:
        require(len(codes) < L, field, f"{len(codes)} codes; a prefix has at most {L - 1} (shorter than a full SID)")
    else:
        require(len(codes) == L, field, f"expected {L} codes, got {len(codes)}")
    for lvl, c in enumerate(codes):
        require(0 <= c < level_sizes[lvl], f"{field}[{lvl}]", f"code {c} out of range [0, {level_sizes[lvl]})")
    return codes
