"""Committed benchmark results: JSON, the results README's sections and the flat summary (their Markdown
tables: :func:`specrec.terminal.markdown_table`).

``bench/results/summary.json`` is one flat JSON object of headline figures
with dotted keys; every benchmark updates only its own keys.
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path

RESULTS_DIR = Path(os.environ.get("SPECREC_RESULTS", Path(__file__).resolve().parents[2] / "bench" / "results"))


def _clean(v):
    if isinstance(v, float):
        return None if math.isnan(v) else round(v, 6)
    return v


def update_summary(keys: dict, path: Path | None = None, retire: tuple[str, ...] = ()) -> Path:
    """Set ``keys`` (a value None is kept as null: "measured, none"), and remove the ``retire`` keys."""
    path = path or RESULTS_DIR / "summary.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    data = json.loads(path.read_text()) if path.exists() else {}
    data.update({k: _clean(v) for k, v in keys.items()})
    for k in retire:
        data.pop(k, None)
    path.write_text(json.dumps(dict(sorted(data.items())), indent=2) + "\n")
    return path


def write_json(name: str, obj: dict, directory: Path | None = None) -> Path:
    directory = directory or RESULTS_DIR
    directory.mkdir(parents=True, exist_ok=True)
    p = directory / f"{name}.json"
    p.write_text(json.dumps(obj, indent=2, default=_clean) + "\n")
    return p


def readme_section(path: Path, owner: str, body: str, retire: tuple[str, ...] = ()) -> None:
    """Write ``body`` as ``owner``'s section of a results README (between ``<!-- owner: begin -->`` and
    ``<!-- owner: end -->``, replaced in place, else appended), and drop the sections of ``retire``."""
    import re

    def marks(name: str) -> tuple[str, str]:
        return f"<!-- {name}: begin -->", f"<!-- {name}: end -->"

    begin, end = marks(owner)
    section = f"{begin}\n{body.rstrip()}\n{end}\n"
    text = path.read_text() if path.exists() else "# Measured results\n\n"
    for old in retire:
        b, e = marks(old)
        text = re.sub(re.escape(b) + r".*?" + re.escape(e) + r"\n?", "", text, flags=re.S)
    if begin in text and end in text:
        text = re.sub(re.escape(begin) + r".*?" + re.escape(end) + r"\n?", lambda _: section, text, flags=re.S)
    else:
        text = text.rstrip("\n") + "\n\n" + section
    path.write_text(text)


def paragraph(*parts: str, width: int = 200) -> str:
    """Sentences as one Markdown paragraph over lines of about ``width`` characters (a README section's prose:
    the results page keeps every line short, ``tests/unit/test_bench_package.py``). A word that Markdown would
    read at the start of a line as a list, heading, rule, quote or table row stays at the end of the line before."""
    import re

    lines: list[str] = []
    for word in " ".join(p.strip() for p in parts if p.strip()).split():
        if lines and (len(lines[-1]) + 1 + len(word) <= width or re.fullmatch(r"[-+*#=_]+|\d+[.)]|[>|<].*", word)):
            lines[-1] += " " + word
        else:
            lines.append(word)
    return "\n".join(lines) + "\n"
