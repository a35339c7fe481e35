"""Bulk-load a bundle's whole catalogue into Redis as a new version and make it current.

    python -m itemset_svc.load --bundle runs/beauty/bundle [--redis-url URL] [--namespace NS]

Rows are 0..N-1 in bundle order (the order the model's and drafters' arrays
use); SIDs and seen flags come from the bundle. Loading into a namespace
whose current version gives some row to a different item, or uses other level
sizes, is refused unless ``--force``. The write is pipelined in chunks and
built as a fresh, unpublished version; readers switch to it atomically.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
from pathlib import Path

import numpy as np

from specrec.bundle import read_meta

from .bulk import CatalogueArrays
from .store import RedisCatalogue


def bundle_arrays(path: str | Path) -> tuple[CatalogueArrays, list[int]]:
    """The bundle's catalogue as arrays (row = bundle order; no object per item) and its level sizes."""
    path = Path(path)
    meta = read_meta(path)
    level_sizes = [int(x) for x in meta["model"]["level_sizes"]]
    ids, sids, seen, titles, texts = [], [], [], [], []
    with open(path / "items.jsonl", encoding="utf-8") as fh:
        for line in fh:
            o = json.loads(line)
            ids.append(str(o["item_id"]))
            sids.append(o["sid"])
            seen.append(bool(o["seen"]))
            titles.append(o.get("title", ""))
            texts.append(o.get("text", ""))
    codes = np.asarray(sids, dtype=np.int64).reshape(len(ids), len(level_sizes) if not sids else -1)
    return CatalogueArrays(ids, codes, ~np.asarray(seen, dtype=bool), titles=titles, texts=texts), level_sizes


async def load_bundle(bundle: str | Path, store: RedisCatalogue | None = None, *, redis_url: str | None = None,
                      namespace: str = "specrec", keep_versions: int = 3, force: bool = False,
                      progress: bool = False, timeout_s: float = 30.0, chunk: int = 5000, settings=None) -> str:
    """Load ``bundle``'s catalogue as a new current version; returns the version.
    Uses ``store`` when given, else connects to ``redis_url`` (and closes it), with the passwords and
    durability of ``settings`` (:class:`~.settings.ItemSetSettings`, default: from the environment)."""
    from specrec.bundle import sid_space_fingerprint

    cat, level_sizes = await asyncio.to_thread(bundle_arrays, bundle)
    fingerprint = sid_space_fingerprint(bundle)
    own = store is None
    if store is None:
        from .settings import ItemSetSettings

        s = settings if settings is not None else ItemSetSettings()
        store = RedisCatalogue.from_settings(s, namespace, url=redis_url or s.redis_url, timeout_s=timeout_s,
                                             keep_versions=keep_versions)
    try:
        return await store.bulk_load(
            cat, level_sizes, force=force, chunk=chunk, progress=progress, bundle=fingerprint
        )
    finally:
        if own:
            await store.close()


def main(argv=None) -> int:
    from .settings import ItemSetSettings

    defaults = ItemSetSettings()  # SPECREC_ITEMSET_* from the environment
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--bundle", required=True, help="bundle directory (bundle.json, items.jsonl)")
    ap.add_argument(
        "--redis-url", default=defaults.redis_url, help="default: $SPECREC_ITEMSET_REDIS_URL or %(default)s"
    )
    ap.add_argument(
        "--namespace", default=defaults.namespace, help="default: $SPECREC_ITEMSET_NAMESPACE or %(default)s"
    )
    ap.add_argument("--keep-versions", type=int, default=defaults.keep_versions, help="versions kept (older deleted)")
    ap.add_argument("--timeout", type=float, default=30.0, help="Redis timeout per command, seconds")
    ap.add_argument("--chunk", type=int, default=5000, help="items per HSET (20,000 per pipelined round trip)")
    ap.add_argument("--force", action="store_true", help="replace a catalogue with other rows or level sizes")
    ap.add_argument("--no-progress", action="store_true", help="no progress bar")
    a = ap.parse_args(argv)
    try:
        version = asyncio.run(load_bundle(a.bundle, redis_url=a.redis_url, namespace=a.namespace,
                                          keep_versions=a.keep_versions, force=a.force, progress=not a.no_progress,
                                          timeout_s=a.timeout, chunk=a.chunk, settings=defaults))
    except (ValueError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except Exception as e:  # noqa: BLE001 - a CLI: one clear line, not a traceback
        print(f"error: {type(e).__name__}: {e}", file=sys.stderr)
        return 1
    print(json.dumps({"namespace": a.namespace, "version": version}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
