"""``specrec sids``: fit semantic IDs on a dataset and print the codebook usage and collisions report."""

from __future__ import annotations

import argparse
import json


def add_parser(sub: argparse._SubParsersAction) -> None:
    s = sub.add_parser("sids", help="fit semantic IDs on a dataset and report codebook usage and collisions")
    s.add_argument("--data", default="synthetic")
    s.add_argument("--protocol", choices=["loo", "temporal"], default="loo")
    s.add_argument("--levels", type=int, default=3)
    s.add_argument("--codebook-size", type=int, default=256)
    s.add_argument("--collision-size", type=int, default=256)
    s.add_argument("--seed", type=int, default=0)
    s.set_defaults(func=run)


def run(a: argparse.Namespace) -> int:
    from ..data.open import open_dataset
    from ..data.splits import make_split
    from ..pipeline import fit_semantic_ids

    ds = open_dataset(a.data)
    split = make_split(ds, a.protocol)
    _, _, report = fit_semantic_ids(ds, split, seed=a.seed, n_levels=a.levels, codebook_size=a.codebook_size,
                                    collision_size=a.collision_size)
    print(json.dumps(report, indent=2))
    return 0
