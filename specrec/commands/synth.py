"""``specrec synth``: write a synthetic catalogue in the dataset format."""

from __future__ import annotations

import argparse


def add_parser(sub: argparse._SubParsersAction) -> None:
    y = sub.add_parser("synth", help="write a synthetic catalogue in the dataset format")
    y.add_argument("--out", required=True)
    y.add_argument("--items", type=int, default=600)
    y.add_argument("--users", type=int, default=800)
    y.add_argument("--seed", type=int, default=0)
    y.set_defaults(func=run)


def run(a: argparse.Namespace) -> int:
    from ..data.synthetic import synthetic_dataset

    ds = synthetic_dataset(n_items=a.items, n_users=a.users, seed=a.seed)
    ds.to_dir(a.out)
    print(f"wrote {ds.n_items} items and {len(ds.sequences)} sequences to {a.out}")
    return 0
