"""A copy of a dataset with ids only: every item's text removed (its name, title, brand, categories and text
fields blanked), the sequences as they are; for measuring what a bundle does on data without item texts.

    python -m bench.ids_only --data data/yelp --out /tmp/specrec-yelp-ids

The copy is scratch (not committed): ``specrec build-bundle --data /tmp/specrec-yelp-ids ...`` then finds no item
text and builds its semantic IDs from the interactions (``sid_source`` "sasrec" in bundle.json).
"""

from __future__ import annotations

import argparse
import gzip
import json
import shutil
import sys
from pathlib import Path

from specrec.data.dataset import TEXT_FIELDS, iter_jsonl

#: the fields an item's text is made of (:func:`specrec.data.dataset.item_text`), all blanked
BLANKED = ("text", *TEXT_FIELDS)


def write_ids_only(data: Path, out: Path) -> int:
    """Write ``data``'s items without text and its sequences into ``out``. -> the number of items."""
    out.mkdir(parents=True, exist_ok=True)
    items = next(p for p in (data / "items.jsonl.gz", data / "items.jsonl") if p.exists())
    n = 0
    with gzip.open(out / "items.jsonl.gz", "wt", encoding="utf-8") as fh:
        for _, obj in iter_jsonl(items):
            fh.write(json.dumps({k: v for k, v in obj.items() if k not in BLANKED}) + "\n")
            n += 1
    for name in ("sequences.jsonl.gz", "sequences.jsonl"):
        if (data / name).exists():
            shutil.copyfile(data / name, out / name)
            break
    return n


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--data", required=True)
    ap.add_argument("--out", required=True)
    a = ap.parse_args(argv)
    n = write_ids_only(Path(a.data), Path(a.out))
    print(f"{n} items without text, and the sequences, in {a.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
