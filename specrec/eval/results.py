"""Committed benchmark results: JSON + markdown tables and the flat summary.

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


def update_summary(keys: dict, path: Path | None = None) -> Path:
    path = path or RESULTS_DIR / "summary.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    data = json.loads(path.read_text()) if path.exists() else {}
    data.update({k: _clean(v) for k, v in keys.items()})
    path.write_text(json.dumps(dict(sorted(data.items())), indent=2) + "\n")
    return path


def write_json(name: str, obj: dict, directory: Path | None = None) -> Path:
    directory = directory or RESULTS_DIR
    directory.mkdir(parents=True, exist_ok=True)
    p = directory / f"{name}.json"
    p.write_text(json.dumps(obj, indent=2, default=_clean) + "\n")
    return p


def markdown_table(rows: list[dict], columns: list[str], fmt: str = "{:.4f}") -> str:
    def cell(v):
        if isinstance(v, float):
            return "n/a" if math.isnan(v) else fmt.format(v)
        return str(v)

    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    for r in rows:
        lines.append("| " + " | ".join(cell(r.get(c, "")) for c in columns) + " |")
    return "\n".join(lines) + "\n"
