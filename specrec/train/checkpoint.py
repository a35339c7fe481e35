"""Training checkpoints on disk: device-independent, and in parts small enough to commit or carry.

A checkpoint is what ``torch.save`` writes of a state (every tensor on the CPU, :func:`specrec.train.device.cpu_copy`),
read back with ``map_location="cpu"``, so one written on a GPU loads on a machine without one and the reverse.
Its bytes are written either as one file (``checkpoint.pt``, as always) or, with ``part_bytes`` set and a
larger state, as numbered parts beside a small manifest: ``checkpoint.pt.parts.json`` names the parts
(``checkpoint.pt.<digest>.NN``, each at most ``part_bytes``) and the SHA-256 of their concatenation, which is
exactly the one file's bytes. A GPU machine returns files of at most 16 MiB and git hosts warn above 50 MB, so a
build folder that moves between machines keeps its checkpoints in parts.

Writes are atomic: parts first, the manifest last (renamed into place), then whatever the previous checkpoint
left is removed; a reader takes the newer of the one file and the manifest.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
from pathlib import Path
from typing import Any

import torch

MIB = 1 << 20


def _manifest(path: Path) -> Path:
    return path.with_name(path.name + ".parts.json")


def _parts(path: Path) -> list[Path]:
    """Every part file of ``path`` on disk, whichever checkpoint wrote it."""
    return sorted(p for p in path.parent.glob(path.name + ".*.[0-9][0-9]") if p.is_file())


def _replace(tmp: Path, dest: Path) -> None:
    with open(tmp, "rb+") as fh:
        fh.flush()
        os.fsync(fh.fileno())
    tmp.replace(dest)


def save(obj: Any, path: str | Path, part_bytes: int | None = None) -> list[Path]:
    """Write ``obj`` (``torch.save``) at ``path``: one file, or parts of at most ``part_bytes`` when it is
    larger. -> the files written."""
    path = Path(path)
    buf = io.BytesIO()
    torch.save(obj, buf)
    data = buf.getbuffer()
    old = _parts(path)
    if part_bytes is None or len(data) <= part_bytes:
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_bytes(data)
        _replace(tmp, path)
        _manifest(path).unlink(missing_ok=True)
        for p in old:
            p.unlink(missing_ok=True)
        return [path]
    if part_bytes < 1:
        raise ValueError(f"part_bytes {part_bytes}: must be >= 1")
    digest = hashlib.sha256(data).hexdigest()
    names = []
    for i, s in enumerate(range(0, len(data), part_bytes)):
        part = path.with_name(f"{path.name}.{digest[:12]}.{i:02d}")
        tmp = part.with_name(part.name + ".tmp")
        tmp.write_bytes(data[s : s + part_bytes])
        _replace(tmp, part)
        names.append(part.name)
    tmp = path.with_name(path.name + ".parts.tmp")
    tmp.write_text(json.dumps({"sha256": digest, "bytes": len(data), "parts": names}) + "\n")
    _replace(tmp, _manifest(path))
    path.unlink(missing_ok=True)
    for p in old:
        if p.name not in names:
            p.unlink(missing_ok=True)
    return [path.with_name(n) for n in names] + [_manifest(path)]


def exists(path: str | Path) -> bool:
    path = Path(path)
    return path.exists() or _manifest(path).exists()


def files(path: str | Path) -> list[Path]:
    """The files that hold the checkpoint at ``path`` now (none when there is none)."""
    path = Path(path)
    out = [path] if path.exists() else []
    if _manifest(path).exists():
        out += [path.with_name(n) for n in json.loads(_manifest(path).read_text())["parts"]] + [_manifest(path)]
    return out


def read_bytes(path: str | Path) -> bytes:
    """The checkpoint's bytes (its parts joined and checked against the manifest's digest)."""
    path, man = Path(path), _manifest(Path(path))
    if man.exists() and not (path.exists() and path.stat().st_mtime_ns > man.stat().st_mtime_ns):
        m = json.loads(man.read_text())
        data = b"".join(path.with_name(n).read_bytes() for n in m["parts"])
        if len(data) != m["bytes"] or hashlib.sha256(data).hexdigest() != m["sha256"]:
            raise ValueError(f"{path}: its parts do not match {man.name} (a part is missing, short or from "
                             "another checkpoint)")
        return data
    return path.read_bytes()


def load(path: str | Path, weights_only: bool = False) -> Any:
    """What :func:`save` wrote (or a plain ``torch.save`` file), every tensor on the CPU whatever device wrote it."""
    return torch.load(io.BytesIO(read_bytes(path)), map_location="cpu", weights_only=weights_only)


def remove(path: str | Path) -> list[Path]:
    """Delete the checkpoint at ``path`` (one file or parts) -> what was deleted."""
    path = Path(path)
    gone = [p for p in [path, _manifest(path), *_parts(path)] if p.exists()]
    for p in gone:
        p.unlink()
    return gone
