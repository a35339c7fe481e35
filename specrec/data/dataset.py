"""Items and interaction sequences: the JSONL format and its loaders.

Format (one JSON object a line, plain or gzipped):

``items.jsonl[.gz]``
    ``{"item_id": 1, "title": "...", ...}``. ``item_id`` (int or str) is
    required. The item's text is the ``text`` field when present, otherwise
    ``title``/``name``, ``brand`` and ``categories`` (whichever exist) joined
    with " | ". Any other field is kept but unused.

``sequences.jsonl[.gz]``
    ``{"user_id": 1, "items": [1, 2, ...], "timestamps": [t1, t2, ...]}``.
    ``items`` are item ids in chronological order; ``timestamps`` (Unix
    seconds, non-decreasing, same length) are optional and needed only by the
    temporal protocol.

Inside the library an item is a dense index ``0..n_items-1``; external ids are
kept as strings.
"""

from __future__ import annotations

import gzip
import json
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

TEXT_FIELDS = ("title", "name", "brand", "categories")


class DataFormatError(ValueError):
    """A data file does not follow the documented format."""


def _open(path: Path):
    return gzip.open(path, "rt", encoding="utf-8") if path.suffix == ".gz" else open(path, encoding="utf-8")


def iter_jsonl(path: str | Path) -> Iterator[tuple[int, dict]]:
    path = Path(path)
    with _open(path) as fh:
        for lineno, line in enumerate(fh, 1):
            line = line.strip()
            if not line:
                continue
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as exc:
                raise DataFormatError(f"{path}:{lineno}: not JSON ({exc.msg})") from None
            if not isinstance(obj, dict):
                raise DataFormatError(f"{path}:{lineno}: expected a JSON object")
            yield lineno, obj


def item_text(obj: dict) -> str:
    if obj.get("text"):
        return str(obj["text"])
    parts = [str(obj[f]).strip() for f in TEXT_FIELDS if obj.get(f)]
    return " | ".join(p for p in parts if p)


@dataclass
class Catalogue:
    """Items by dense index: external id, display title and embedding text."""

    ids: list[str]
    titles: list[str]
    texts: list[str]
    index: dict[str, int] = field(default_factory=dict)
    # per item, whether its data gave it a text (a catalogue read from items.jsonl); None: not known (every item
    # counts as described). An item without one is embedded as ``item <id>``, which says nothing about it
    described: list[bool] | None = None

    def __post_init__(self) -> None:
        if not (len(self.ids) == len(self.titles) == len(self.texts)):
            raise ValueError("ids, titles and texts must have the same length")
        if not self.index:
            self.index = {i: k for k, i in enumerate(self.ids)}
        if len(self.index) != len(self.ids):
            raise DataFormatError("duplicate item ids in catalogue")

    def __len__(self) -> int:
        return len(self.ids)

    def lookup(self, item_id) -> int:
        return self.index[str(item_id)]

    @classmethod
    def from_jsonl(cls, path: str | Path) -> Catalogue:
        ids, titles, texts, described = [], [], [], []
        for lineno, obj in iter_jsonl(path):
            if "item_id" not in obj:
                raise DataFormatError(f"{path}:{lineno}: missing 'item_id'")
            ids.append(str(obj["item_id"]))
            title = obj.get("title") or obj.get("name") or ""
            titles.append(str(title))
            text = item_text(obj)
            described.append(bool(text))
            texts.append(text or f"item {obj['item_id']}")
        if not ids:
            raise DataFormatError(f"{path}: no items")
        return cls(ids=ids, titles=titles, texts=texts, described=described)

    def described_share(self) -> float:
        """The share of items whose data gave them a text (1.0 where not known)."""
        return 1.0 if self.described is None or not self.described else sum(self.described) / len(self.described)

    def to_jsonl(self, path: str | Path) -> None:
        with open(path, "w", encoding="utf-8") as fh:
            for i, t, x in zip(self.ids, self.titles, self.texts):
                fh.write(json.dumps({"item_id": i, "title": t, "text": x}) + "\n")


@dataclass
class Sequence:
    user: str
    items: np.ndarray  # int64 dense item indices, chronological
    timestamps: np.ndarray | None = None  # int64 Unix seconds, same length


@dataclass
class Dataset:
    name: str
    catalogue: Catalogue
    sequences: list[Sequence]

    @property
    def n_items(self) -> int:
        return len(self.catalogue)

    @property
    def has_timestamps(self) -> bool:
        return all(s.timestamps is not None for s in self.sequences)

    def n_interactions(self) -> int:
        return int(sum(len(s.items) for s in self.sequences))

    def to_dir(self, path: str | Path) -> None:
        path = Path(path)
        path.mkdir(parents=True, exist_ok=True)
        self.catalogue.to_jsonl(path / "items.jsonl")
        with open(path / "sequences.jsonl", "w", encoding="utf-8") as fh:
            for s in self.sequences:
                obj = {"user_id": s.user, "items": [self.catalogue.ids[i] for i in s.items]}
                if s.timestamps is not None:
                    obj["timestamps"] = [int(t) for t in s.timestamps]
                fh.write(json.dumps(obj) + "\n")


def _find(path: Path, stem: str) -> Path:
    for cand in (path / f"{stem}.jsonl.gz", path / f"{stem}.jsonl"):
        if cand.exists():
            return cand
    raise FileNotFoundError(f"{path}: no {stem}.jsonl or {stem}.jsonl.gz")


def load_sequences(path: str | Path, catalogue: Catalogue) -> list[Sequence]:
    seqs: list[Sequence] = []
    for lineno, obj in iter_jsonl(path):
        where = f"{path}:{lineno}"
        if "items" not in obj or not isinstance(obj["items"], list):
            raise DataFormatError(f"{where}: missing list 'items'")
        try:
            items = np.array([catalogue.lookup(i) for i in obj["items"]], dtype=np.int64)
        except KeyError as exc:
            raise DataFormatError(f"{where}: unknown item id {exc.args[0]!r}") from None
        ts = obj.get("timestamps")
        if ts is not None:
            if len(ts) != len(items):
                raise DataFormatError(f"{where}: 'timestamps' and 'items' differ in length")
            ts = np.asarray(ts, dtype=np.int64)
            if len(ts) > 1 and np.any(np.diff(ts) < 0):
                raise DataFormatError(f"{where}: timestamps must be non-decreasing")
        seqs.append(Sequence(user=str(obj.get("user_id", lineno)), items=items, timestamps=ts))
    if not seqs:
        raise DataFormatError(f"{path}: no sequences")
    return seqs


def load_dataset(path: str | Path, name: str | None = None) -> Dataset:
    """Load ``items.jsonl[.gz]`` and ``sequences.jsonl[.gz]`` from a directory."""
    path = Path(path)
    if not path.is_dir():
        raise FileNotFoundError(f"dataset directory not found: {path}")
    catalogue = Catalogue.from_jsonl(_find(path, "items"))
    sequences = load_sequences(_find(path, "sequences"), catalogue)
    return Dataset(name=name or path.name, catalogue=catalogue, sequences=sequences)
