"""``bench.catalogue_scale``: the synthetic catalogues it measures (the real items first, distinct random SIDs
after them, seeded), the sizes' names, the tables' figures, the parts it knows (the item-set part runs against a
real Redis in tests/integration/test_itemset_scale.py)."""

from __future__ import annotations

import numpy as np
import pytest

from bench import catalogue_scale as cs
from specrec.ids import tables
from specrec.ids.trie import mixed_radix

from ..conftest import random_sids

SIZES = [6, 5, 4, 3]


def test_sizes_and_their_names():
    assert [cs.parse_size(s) for s in ("12k", "100K", "1m", "10m", "2.5k", "250000")] == [
        12_000, 100_000, 1_000_000, 10_000_000, 2_500, 250_000]
    assert [cs.label_of(n, 12_101) for n in (12_000, 12_101, 100_000, 1_000_000, 10_000_000, 250_000)] == [
        "12k", "12k", "100k", "1m", "10m", "250k"]


def test_a_synthetic_catalogue_is_the_real_one_then_distinct_new_sids():
    real = random_sids(40, SIZES, 1)
    out = cs.synthetic_sids(real, SIZES, 300, seed=4)
    assert out.shape == (300, 4) and (out[:40] == real).all()
    keys = mixed_radix(out, SIZES)
    assert len(np.unique(keys)) == 300  # no duplicate, none of the new ones a real item's
    assert ((out >= 0) & (out < np.asarray(SIZES))).all()
    assert (cs.synthetic_sids(real, SIZES, 300, seed=4) == out).all()
    assert not (cs.synthetic_sids(real, SIZES, 300, seed=5) == out).all()
    assert cs.synthetic_sids(real, SIZES, 30, seed=4) is real  # the real catalogue is never cut
    with pytest.raises(SystemExit, match="cannot hold"):
        cs.synthetic_sids(real, SIZES, 361, seed=4)  # the code space holds 360


def test_the_tables_figures(monkeypatch):
    monkeypatch.setattr(tables, "DENSE_CELLS", 50)
    sids = cs.synthetic_sids(random_sids(40, SIZES, 1), SIZES, 200, seed=0)
    itemset, fig = cs.build_tables(sids, np.zeros(len(sids), bool), SIZES, max(SIZES))
    assert len(itemset) == 200 and fig["items"] == 200 and fig["forms"] == "ddcc"
    assert fig["nodes"][0] == 1 and fig["edges"][-1] == 200 and fig["build_s"] > 0
    assert 0 < fig["tables_mb"] < fig["trie_mb"]


def test_unknown_parts_are_refused():
    with pytest.raises(SystemExit, match="--parts"):
        cs.main(["--parts", "inprocess,gpu"])


def test_the_stack_drafter_loads_the_modes_that_fit_the_size():
    assert cs.drafter_modes("auto", 100_000, "sasrec") == ""  # every mode the bundle has
    assert cs.drafter_modes("auto", 1_000_000, "sasrec") == "sasrec"  # the one auto drafts with
    assert cs.drafter_modes("self", 10_000_000, "sasrec") == "self"  # as asked
    assert cs.drafter_modes("", 10_000_000, "sasrec") == ""


def test_sizes_and_policies_are_timed_in_turn_per_request(monkeypatch):
    """Every history goes to each catalogue's engine and each policy in turn, round after round (a drifting machine
    moves every size alike); the warm round's lists are kept, and only the later rounds timed."""
    import types

    import specrec.policies

    calls = []

    def make_policy(name, engine):
        def run(reqs):
            calls.append((int(reqs[0].history[0]), engine, name))
            return [types.SimpleNamespace(items=np.asarray([engine == "10m", 7]))]
        return types.SimpleNamespace(run=run)

    monkeypatch.setattr(specrec.policies, "make_policy", make_policy)
    rows = [np.asarray([3]), np.asarray([5])]
    out = cs.time_policies({"12k": "12k", "10m": "10m"}, rows, ["beam", "fused"], 2, 2, False)
    one_round = [(h, size, p) for h in (3, 5) for size in ("12k", "10m") for p in ("beam", "fused")]
    assert calls == one_round * 3  # the warm round, then two timed ones
    assert out["12k"]["beam"]["n"] == 4 and out["10m"]["fused"]["n"] == 4
    assert out["10m"]["beam"]["lists"] == [[1, 7], [1, 7]] and out["12k"]["fused"]["lists"] == [[0, 7], [0, 7]]
