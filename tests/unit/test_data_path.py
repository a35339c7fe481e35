"""Where a bundle's dataset is: the repository's copy (data/), named relative to the bundle's own directory, so
evaluation, tuning, the precision choice and the benchmarks find it from any working directory; bundles written
before that rule (a path relative to the directory they were built from) still resolve from there."""

from __future__ import annotations

import json
import shutil

import pytest

from specrec.bundle import Bundle, bundle_split, data_path_for, data_path_of, read_meta
from specrec.data import leave_one_out, load_dataset
from specrec.ids import SemanticIds
from specrec.models.tiger import Tiger

from ..conftest import DATA, ROOT, clustered_embeddings, tiny_config


@pytest.mark.parametrize("name", ["beauty-loo", "beauty-temporal"])
def test_the_committed_bundles_find_the_repositorys_data_from_any_working_directory(name, tmp_path, monkeypatch):
    bundle_dir = ROOT / "bundles" / name
    meta = read_meta(bundle_dir)
    assert meta["data_path"] == "../../data/beauty"  # relative to the bundle, not to a working directory
    monkeypatch.chdir(tmp_path)  # nothing called data/ or ../shared here
    found = data_path_of(meta["data_path"], bundle_dir)
    assert found is not None
    assert (tmp_path / found).resolve() == (DATA / "beauty").resolve()
    with open(bundle_dir / "items.jsonl", encoding="utf-8") as fh:
        ids = [json.loads(line)["item_id"] for line in fh]
    assert load_dataset(found).catalogue.ids == ids  # the bundle's catalogue, item for item


@pytest.fixture
def small(tmp_path, synth):
    """A small dataset written as files (data/small) and an untrained bundle of it, in memory."""
    data = tmp_path / "repo" / "data" / "small"
    synth.to_dir(data)
    ds = load_dataset(data)
    split = leave_one_out(ds, max_history=6)
    emb = clustered_embeddings(ds.n_items, seed=2)
    sem = SemanticIds.fit(emb, n_levels=3, codebook_size=8, collision_size=64, seed=0)
    cfg = tiny_config(level_sizes=[8, 8, 8, 64])
    return data, Bundle("small", ds.catalogue, sem, sem.assign_all(emb), split.seen, Tiger(cfg), {"protocol": "loo"})


def test_a_bundle_records_its_data_relative_to_itself_and_finds_it_wherever_it_is_read_from(small, monkeypatch):
    data, b = small
    repo = data.parents[1]
    monkeypatch.chdir(repo)
    out = repo / "runs" / "small" / "bundle"
    b.meta["data_path"] = data_path_for("data/small", out)  # as `specrec train --data data/small` gives it
    b.save(out)
    assert read_meta(out)["data_path"] == "../../../data/small"
    monkeypatch.chdir(repo.parent)  # elsewhere: the same data
    loaded = Bundle.load("repo/runs/small/bundle")
    ds, split = bundle_split(loaded)
    assert ds.catalogue.ids == b.catalogue.ids and split.protocol == "loo"
    # the repository moved as a whole (a fresh clone somewhere else): still found
    moved = repo.parent / "clone"
    shutil.copytree(repo, moved)
    shutil.rmtree(repo)
    again = Bundle.load(moved / "runs" / "small" / "bundle")
    assert bundle_split(again)[0].catalogue.ids == b.catalogue.ids
    # saved somewhere else, the path is rewritten relative to the new place
    copy = again.save(moved / "bundles" / "small")
    assert read_meta(copy)["data_path"] == "../../data/small"
    assert bundle_split(Bundle.load(copy))[0].catalogue.ids == b.catalogue.ids


def test_an_older_bundles_path_relative_to_the_working_directory_still_resolves(small, monkeypatch):
    data, b = small
    repo = data.parents[1]
    monkeypatch.chdir(repo)
    b.meta["data_path"] = "data/small"  # how bundles were written before: relative to where they were built from
    b.save(repo / "bundles" / "old")
    loaded = Bundle.load("bundles/old")
    assert loaded.data_path == "data/small"
    assert bundle_split(loaded)[0].catalogue.ids == b.catalogue.ids
    loaded.save("bundles/old")  # saved again: now relative to the bundle
    assert read_meta(repo / "bundles" / "old")["data_path"] == "../../data/small"


def test_a_bundle_whose_data_is_gone_says_where_it_looked(small, monkeypatch):
    data, b = small
    repo = data.parents[1]
    monkeypatch.chdir(repo)
    b.meta["data_path"] = data_path_for("data/small", repo / "bundles" / "small")
    b.save(repo / "bundles" / "small")
    shutil.rmtree(data)
    with pytest.raises(SystemExit, match=r"dataset directory not found: .*bundles/small/\.\./\.\./data/small.*--data"):
        bundle_split(Bundle.load(repo / "bundles" / "small"))


def test_absolute_and_synthetic_data_paths_are_kept_as_they_are(tmp_path):
    assert data_path_for(tmp_path, tmp_path / "b") == str(tmp_path)
    assert data_path_for("synthetic", tmp_path) == "synthetic" and data_path_for(None, tmp_path) is None
    assert data_path_of(str(tmp_path), "elsewhere") == str(tmp_path)
    assert data_path_of("synthetic", "elsewhere") == "synthetic" and data_path_of(None, "elsewhere") is None
    assert data_path_of("x", None) == "x"  # a bundle held in memory: as recorded
