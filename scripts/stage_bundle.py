"""A retrained GR model's bundle, completed from an earlier bundle of the same catalogue and semantic IDs:
its retrieval drafter and SASRec baseline (neither reads the GR model) are copied in; the drafters that do
read it (``specrec train-drafters --which distill,nezha,self``) are trained on the result afterwards.

    python scripts/stage_bundle.py --run-bundle runs/beauty-loo-r3/bundle --base bundles/beauty-loo \\
        --out runs/beauty-loo-r3/final
"""

from __future__ import annotations

import argparse
import shutil
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from specrec.bundle import Bundle  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--run-bundle", type=Path, required=True, help="the bundle `specrec train` wrote")
    p.add_argument("--base", type=Path, required=True, help="the bundle to take the GR-independent parts from")
    p.add_argument("--out", type=Path, required=True)
    a = p.parse_args(argv)
    base, new = Bundle.load(a.base), Bundle.load(a.run_bundle)
    if base.catalogue.ids != new.catalogue.ids or not (base.sids == new.sids).all():
        raise SystemExit("the two bundles differ in catalogue or semantic IDs (train with --sids-from BASE)")
    new.retrieval, new.sasrec = base.retrieval, base.sasrec
    if "retrieval" in base.meta.get("drafters", {}):
        new.meta.setdefault("drafters", {})["retrieval"] = base.meta["drafters"]["retrieval"]
    if "baselines" in base.meta:
        new.meta["baselines"] = base.meta["baselines"]
    out = new.save(a.out)
    if (a.base / "demo_histories.json").exists() and not (out / "demo_histories.json").exists():
        shutil.copy(a.base / "demo_histories.json", out / "demo_histories.json")
    print(out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
