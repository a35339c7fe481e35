"""At the committed bundle's 12,101 items every list is the one the searches gave before the item set's search
tables could be CSR (issue 53): beam, nezha, strict and fused, K = 10, for 50 seeded random test users, each with
its history kept and excluded (a request's view of the item set), on the default backend (ONNX Runtime) in float32
(the lists of a clean clone: where `specrec export-onnx` chose 8-bit graphs for this machine, nezha's differ, as they
may), with the tables in the forms the rule picks at this size (all dense) and with every level forced to CSR.

``data/beauty_loo_lists.json`` holds the lists of the code before (commit 7e5aa53: dense child tables only, a
view's levels copied), written by ``python -m tests.unit.test_bundle_lists`` on that commit."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from ..conftest import beauty_dir

ROOT = Path(__file__).resolve().parents[2]
BUNDLE = ROOT / "bundles" / "beauty-loo"
LISTS = Path(__file__).parent / "data" / "beauty_loo_lists.json"
POLICIES = ("beam", "nezha", "strict", "fused")
USERS, SEED, K = 50, 3, 10

pytestmark = pytest.mark.skipif(not (BUNDLE / "bundle.json").exists() or not beauty_dir().exists(),
                                reason="needs the committed bundle and its dataset")


def lists(rec) -> dict[str, list[list[str]]]:
    """Each policy's top-K item ids for the seeded test users, history kept (``policy``) and excluded
    (``policy/excluded``); written to run on the code before as well as now."""
    from specrec.bundle import bundle_split
    from specrec.data.splits import sample_examples

    _, split = bundle_split(rec.bundle)
    ids = rec.bundle.catalogue.ids
    histories = [[ids[r] for r in h] for h in sample_examples(split.test, USERS, SEED).histories()]
    return {f"{p}{'/excluded' if ex else ''}": [rec.recommend(h, k=K, policy=p, budget_ms=None, exclude_history=ex).ids
                                                for h in histories]
            for p in POLICIES for ex in (False, True)}


@pytest.mark.parametrize("dense_cells", [None, 0])
def test_lists_at_12101_items_are_the_ones_before(monkeypatch, dense_cells):
    from specrec import Recommender
    from specrec.ids import tables

    if dense_cells is not None:
        monkeypatch.setattr(tables, "DENSE_CELLS", dense_cells)
    rec = float32_recommender(Recommender)
    assert tables.form_tag(rec.itemset.trie.search_tables(256)) == ("dddd" if dense_cells is None else "cccc")
    want = json.loads(LISTS.read_text())
    got = lists(rec)
    assert set(got) == set(want["lists"])
    for name, rows in got.items():
        same = sum(a == b for a, b in zip(rows, want["lists"][name]))
        assert same == USERS, f"{name}: {USERS - same} of {USERS} lists differ from the code before"


def float32_recommender(cls):
    """The committed bundle's recommender on ONNX Runtime with every graph in float32, whatever this checkout's
    precision record chose."""
    from specrec.bundle import Bundle

    bundle = Bundle.load(BUNDLE)
    kind = bundle.default_drafter()
    return cls(bundle, bundle.engine(drafter=kind, backend=bundle.backend("onnx", precision="float32")), kind)


def write(path: Path, commit: str, got: dict[str, list[list[str]]]) -> None:
    """The lists as JSON, one user's list a line."""
    lines = [f'{{"commit": "{commit}", "users": {USERS}, "seed": {SEED}, "k": {K}, "lists": {{']
    for i, (name, rows) in enumerate(got.items()):
        lines += [f" {json.dumps(name)}: [", *(f"  {json.dumps(r)}," for r in rows[:-1]), f"  {json.dumps(rows[-1])}",
                  " ]" + ("," if i < len(got) - 1 else "")]
    path.write_text("\n".join([*lines, "}}"]) + "\n")


if __name__ == "__main__":  # write the lists of the code checked out (the code before: see the module's docstring)
    import subprocess

    from specrec import Recommender

    head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=ROOT).stdout
    write(LISTS, head.strip(), lists(float32_recommender(Recommender)))
    print(f"wrote {LISTS}")
