"""The settings tables of docs/settings.md, generated from the services' pydantic settings
(one place: the ``Field`` descriptions), so the document cannot drift from the code. A script, not a module of
``specrec_rpc``: it reads all four services' settings, so it sits above them.

    python scripts/settings_doc.py          # rewrite the tables in docs/settings.md
    python scripts/settings_doc.py --check  # exit 1 when they are out of date (tests run this)
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path

DOC = Path(__file__).resolve().parents[1] / "docs" / "settings.md"
BEGIN, END = "<!-- settings: begin (python scripts/settings_doc.py) -->", "<!-- settings: end -->"


def _classes():
    from drafter_svc.service import DrafterSettings
    from gateway.settings import GatewaySettings
    from itemset_svc.settings import ItemSetSettings
    from specrec_rpc.settings import ServiceSettings
    from verifier_svc.service import VerifierSettings

    return [("Shared by all four", ServiceSettings, None), ("Item set", ItemSetSettings, "SPECREC_ITEMSET_"),
            ("Drafter", DrafterSettings, "SPECREC_DRAFTER_"), ("Verifier", VerifierSettings, "SPECREC_VERIFIER_"),
            ("Gateway", GatewaySettings, "SPECREC_GATEWAY_")]


def _default(f) -> str:
    if f.default_factory is not None:
        v = f.default_factory()
    else:
        v = f.default
    if v is None:
        return "none"
    if isinstance(v, Path):
        v = str(v)
    return f"`{json.dumps(v) if isinstance(v, (list, dict, bool)) else v}`"


def tables() -> str:
    out = []
    shared = set(_classes()[0][1].model_fields)
    for title, cls, prefix in _classes():
        head = f"### {title}: `{cls.__name__}`" + (f", prefix `{prefix}`" if prefix else " (every service's prefix)")
        rows = ["| field | default | meaning |", "|---|---|---|"]
        for name, f in cls.model_fields.items():
            if prefix and name in shared and name not in ("port", "metrics_port"):
                continue
            desc = (f.description or "").replace("|", "\\|").replace("\n", " ")
            rows.append(f"| `{name}` | {_default(f)} | {desc} |")
        out.append(head + "\n\n" + "\n".join(rows))
    return "\n\n".join(out)


def render(text: str) -> str:
    block = f"{BEGIN}\n{tables()}\n{END}"
    if BEGIN not in text:
        raise SystemExit(f"{DOC} has no {BEGIN!r} marker")
    return re.sub(re.escape(BEGIN) + r".*?" + re.escape(END), lambda _: block, text, flags=re.S)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--check", action="store_true")
    a = ap.parse_args(argv)
    text = DOC.read_text()
    new = render(text)
    if a.check:
        if new != text:
            print(f"{DOC} settings tables are out of date: run python scripts/settings_doc.py", file=sys.stderr)
            return 1
        return 0
    DOC.write_text(new)
    return 0


if __name__ == "__main__":
    sys.exit(main())
