"""Semantic IDs for data with ids only: where items have no text, the IDs quantise the item embeddings a SASRec
learns from the interactions (``sid_source`` "sasrec"), not the text model's reading of ``item <id>``; the same
command and defaults decide it for any dataset (:func:`specrec.pipeline.resolve_sid_source`)."""

from __future__ import annotations

import json

import numpy as np
import pytest

from specrec.data import synthetic_dataset
from specrec.data.dataset import load_dataset
from specrec.data.splits import leave_one_out
from specrec.pipeline import fit_semantic_ids, resolve_sid_source, sasrec_item_embeddings

NOUNS = ("lipstick", "shampoo", "nail polish", "moisturiser", "perfume", "mascara", "sunscreen", "hair dryer",
         "face mask", "razor", "eyeliner", "conditioner")


def ids_only(tmp_path, n_items: int = 200, n_users: int = 400, seed: int = 4):
    """A synthetic dataset written with opaque item ids (random hex, no order that tells the content clusters)
    and no item text at all; -> (the dataset as loaded, each item's content cluster)."""
    ds = synthetic_dataset(n_items=n_items, n_users=n_users, seed=seed)
    rng = np.random.default_rng(0)
    opaque = {i: f"{int(rng.integers(1 << 40)):x}" for i in ds.catalogue.ids}
    (tmp_path / "items.jsonl").write_text("".join(json.dumps({"item_id": opaque[i]}) + "\n" for i in ds.catalogue.ids))
    (tmp_path / "sequences.jsonl").write_text("".join(
        json.dumps({"user_id": s.user, "items": [opaque[ds.catalogue.ids[i]] for i in s.items]}) + "\n"
        for s in ds.sequences))
    cluster = np.array([next(n for n in NOUNS if n in t) for t in ds.catalogue.titles])
    return load_dataset(tmp_path), cluster


def test_the_source_is_the_text_where_items_have_one_and_the_interactions_where_they_do_not(tmp_path):
    data, _ = ids_only(tmp_path)
    assert data.catalogue.described_share() == 0.0 and data.catalogue.texts[0].startswith("item ")
    assert resolve_sid_source(data) == "sasrec" and resolve_sid_source(data, "text") == "text"
    assert resolve_sid_source(synthetic_dataset(n_items=40, n_users=20, seed=1)) == "text"
    described = tmp_path / "mixed"
    described.mkdir()
    rows = [json.loads(x) for x in (tmp_path / "items.jsonl").read_text().splitlines()]
    rows = [{**r, "title": f"thing {k}"} if k % 4 else r for k, r in enumerate(rows)]  # 3 in 4 with a title
    (described / "items.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (described / "sequences.jsonl").write_text((tmp_path / "sequences.jsonl").read_text())
    assert resolve_sid_source(load_dataset(described)) == "text"
    with pytest.raises(ValueError, match="sid source"):
        resolve_sid_source(data, "titles")


@pytest.mark.slow
def test_ids_only_semantic_ids_group_the_items_the_interactions_group(tmp_path):
    """The items' content clusters are nowhere in the data but in who takes what after what: IDs from SASRec's
    item embeddings put items of one cluster under one first code far more often than chance, and no text model
    is asked (it would read ``item <hex>``, which says nothing)."""
    data, cluster = ids_only(tmp_path)
    split = leave_one_out(data, 8)
    emb, info = sasrec_item_embeddings(data, split, epochs=6, progress=False, log=lambda s: None)
    assert emb.shape == (data.n_items, info["d_model"]) and np.allclose(np.linalg.norm(emb, axis=1), 1.0, atol=1e-4)

    def no_text(texts):
        raise AssertionError("the text model was asked for ids-only items")

    _, sids, _ = fit_semantic_ids(data, split, no_text, n_levels=2, codebook_size=8, collision_size=64, emb=emb)
    same_code = sids[:, 0][:, None] == sids[:, 0][None, :]
    same_cluster = cluster[:, None] == cluster[None, :]
    off = ~np.eye(len(sids), dtype=bool)
    chance = same_cluster[off].mean()
    assert same_cluster[same_code & off].mean() > 1.5 * chance


@pytest.mark.slow
def test_specrec_train_on_ids_only_data_says_its_ids_came_from_sasrec(tmp_path):
    from specrec.bundle import read_meta
    from specrec.cli import main

    from .test_build_bundle import TINY_GR

    (tmp_path / "data").mkdir()
    ids_only(tmp_path / "data", n_users=150)
    assert main(["train", "--data", str(tmp_path / "data"), "--out", str(tmp_path / "run"), "--sid-sasrec-epochs",
                 "2", *TINY_GR]) == 0
    meta = read_meta(tmp_path / "run" / "bundle")
    assert meta["sid_source"] == "sasrec" and meta["sid_source_info"]["model"] == "sasrec"
    texts = [json.loads(x)["text"] for x in (tmp_path / "run" / "bundle" / "items.jsonl").read_text().splitlines()]
    assert all(t.startswith("item ") for t in texts)  # what a text model would have read


def test_an_ids_only_copy_keeps_the_sequences_and_no_text(tmp_path):
    from bench.ids_only import write_ids_only
    from tests.conftest import beauty_dir

    n = write_ids_only(beauty_dir(), tmp_path / "ids")
    copy, real = load_dataset(tmp_path / "ids"), load_dataset(beauty_dir())
    assert n == real.n_items and copy.catalogue.ids == real.catalogue.ids
    assert copy.catalogue.described_share() == 0.0 and real.catalogue.described_share() > 0.99
    assert all(np.array_equal(a.items, b.items) for a, b in zip(copy.sequences, real.sequences))
    assert resolve_sid_source(copy) == "sasrec" and resolve_sid_source(real) == "text"
