"""One copy of the weights for every graph of a directory: a content-addressed external data file.

Each exported graph traces the model's weights as its own constants, so a directory of graphs held a full copy
of them per graph: the verifier's 40 graphs of the Beauty model took 404 MB, of which 25 MB were distinct
tensors. :func:`share_weights` moves every large initializer of a saved graph into the directory's one data file
(:data:`STORE`, ``weights.bin``), once per distinct content (sha256 of its bytes): the graph's ``TensorProto``
keeps its name, type and shape and points at ``location`` / ``offset`` / ``length`` there (ONNX's external data,
which ONNX Runtime reads relative to the graph's own directory). Offsets of tensors of a page or more are
aligned to :data:`ALIGN` (4096) bytes, so ONNX Runtime maps them instead of reading them (on the CPU), and the
processes that load the same weights share their pages.

The file only grows: a graph exported later (a new width) appends what is new under an exclusive lock
(``weights.lock``; several processes may export into one directory at once), the index of what it holds
(:data:`INDEX`, ``weights.json``: sha256 -> [offset, length]) is replaced after the bytes are written, and the
graph after that, so a graph never points at bytes that are not there. A directory of other weights is removed
whole (:func:`remove_store`, by the backend's stale-directory check); a process that still has the old file
mapped keeps its copy (the file is unlinked, never rewritten in place).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
from collections.abc import Iterator
from pathlib import Path

#: the directory's shared data file, its index and its lock
STORE, INDEX, LOCK = "weights.bin", "weights.json", "weights.lock"
#: tensors of at least this many bytes move to the data file (smaller ones stay in the graph)
MIN_BYTES = 1024
#: offset alignment of tensors of at least this size (a page: mapped, not read)
ALIGN = 4096


@contextlib.contextmanager
def _locked(d: Path) -> Iterator[None]:
    """An exclusive lock on ``d``'s data file across processes (none where the platform has no ``fcntl``)."""
    try:
        import fcntl
    except ImportError:  # pragma: no cover - not POSIX: one writer at a time is the caller's business
        yield
        return
    with open(d / LOCK, "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def _read_index(d: Path) -> dict[str, list[int]]:
    try:
        return json.loads((d / INDEX).read_text())
    except (FileNotFoundError, json.JSONDecodeError):
        return {}


def store_blobs(d: Path, blobs: dict[str, bytes]) -> dict[str, tuple[int, int]]:
    """Put ``blobs`` (sha256 hex -> bytes) into ``d``'s data file, each once -> sha256 -> (offset, length)."""
    with _locked(d):
        index = _read_index(d)
        new = {k: b for k, b in blobs.items() if k not in index}
        if new:
            with open(d / STORE, "ab") as f:
                end = f.seek(0, os.SEEK_END)  # the file's end, whatever a writer that died left there
                for key, b in new.items():
                    pad = (-end) % (ALIGN if len(b) >= ALIGN else 64)
                    f.write(b"\0" * pad)
                    index[key] = [end + pad, len(b)]
                    f.write(b)
                    end += pad + len(b)
            tmp = d / f"{INDEX}.{os.getpid()}.tmp"
            tmp.write_text(json.dumps(index))
            tmp.replace(d / INDEX)
        return {k: (index[k][0], index[k][1]) for k in blobs}


def _graphs(g) -> Iterator:
    """``g`` and every subgraph in it."""
    import onnx

    yield g
    for n in g.node:
        for a in n.attribute:
            subs = [a.g] if a.type == onnx.AttributeProto.GRAPH else list(a.graphs)
            for s in subs:
                yield from _graphs(s)


def share_weights(path: Path, min_bytes: int = MIN_BYTES) -> int:
    """Move every initializer of at least ``min_bytes`` held in the graph at ``path`` into its directory's shared
    data file (each distinct content once), the graph pointing at it. Returns the number of tensors moved."""
    import onnx
    from onnx import numpy_helper

    path = Path(path)
    model = onnx.load(str(path), load_external_data=False)
    inline = []
    for g in _graphs(model.graph):
        for t in g.initializer:
            if t.data_location == onnx.TensorProto.EXTERNAL:
                continue
            raw = t.raw_data if t.HasField("raw_data") else numpy_helper.to_array(t).tobytes()
            if len(raw) >= min_bytes and t.data_type != onnx.TensorProto.STRING:
                inline.append((t, raw, hashlib.sha256(raw).hexdigest()))
    if not inline:
        return 0
    where = store_blobs(path.parent, {key: raw for _, raw, key in inline})
    for t, _, key in inline:
        offset, length = where[key]
        dims, dtype, name = list(t.dims), t.data_type, t.name
        t.Clear()
        t.name, t.data_type = name, dtype
        t.dims.extend(dims)
        t.data_location = onnx.TensorProto.EXTERNAL
        for k, v in (("location", STORE), ("offset", str(offset)), ("length", str(length))):
            e = t.external_data.add()
            e.key, e.value = k, v
    tmp = path.with_name(f"{path.name}.{os.getpid()}.share")
    tmp.write_bytes(model.SerializeToString())
    tmp.replace(path)
    return len(inline)


def reads_shared_weights(path: Path) -> bool:
    """Whether the graph at ``path`` reads tensors from its directory's shared data file."""
    import onnx

    model = onnx.load(str(path), load_external_data=False)
    return any(t.data_location == onnx.TensorProto.EXTERNAL for g in _graphs(model.graph) for t in g.initializer)


def remove_store(d: Path) -> None:
    """Remove ``d``'s shared data file and its index (a directory of other weights)."""
    for name in (STORE, INDEX):
        (d / name).unlink(missing_ok=True)


def dir_mb(d: Path) -> float:
    """The size of the files in ``d`` in MB (10^6 bytes)."""
    return sum(p.stat().st_size for p in Path(d).iterdir() if p.is_file()) / 1e6
