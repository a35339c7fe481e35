import numpy as np
import pytest

from specrec.ids import CollisionOverflow, SemanticIds, SidTrie

from ..conftest import clustered_embeddings


def test_fit_is_deterministic_given_seed():
    emb = clustered_embeddings(500)
    a = SemanticIds.fit(emb, n_levels=3, codebook_size=16, collision_size=64, seed=3)
    b = SemanticIds.fit(emb, n_levels=3, codebook_size=16, collision_size=64, seed=3)
    assert np.array_equal(a.codebooks, b.codebooks)
    assert np.array_equal(a.assign_all(emb), b.assign_all(emb))
    c = SemanticIds.fit(emb, n_levels=3, codebook_size=16, collision_size=64, seed=4)
    assert not np.array_equal(a.codebooks, c.codebooks)


def test_sids_unique_and_report():
    emb = clustered_embeddings(400)
    sem = SemanticIds.fit(emb, n_levels=2, codebook_size=8, collision_size=64, seed=0)
    sids = sem.assign_all(emb)
    assert sids.shape == (400, 3)
    assert len(np.unique(sids, axis=0)) == 400
    rep = sem.report(sids)
    assert rep.n_items == 400
    assert rep.levels[0]["used"] == len(np.unique(sids[:, 0]))
    assert rep.items_with_collision == int((sids[:, -1] > 0).sum()) > 0
    assert rep.max_collision_digit == sids[:, -1].max()


def test_inductive_assignment_without_refit():
    emb = clustered_embeddings(600, seed=1)
    old, new = emb[:500], emb[500:]
    sem = SemanticIds.fit(old, n_levels=3, codebook_size=16, collision_size=64, seed=0)
    books = sem.codebooks.copy()
    existing = sem.assign_all(old)
    a = sem.assign(new, existing)
    assert np.array_equal(sem.codebooks, books)  # nothing refitted
    assert np.array_equal(a.sids[:, :-1], sem.encode(new))  # codes come from the text embedding alone
    allsids = np.concatenate([existing, a.sids])
    assert len(np.unique(allsids, axis=0)) == len(allsids)
    # an item is reported as colliding exactly when its code prefix was already taken
    prefixes = {tuple(r) for r in existing[:, :-1]}
    seen_new = set()
    for row, col in zip(a.sids, a.collided):
        key = tuple(row[:-1])
        assert col == (key in prefixes or key in seen_new)
        seen_new.add(key)
    assert a.report["collided"] == int(a.collided.sum())
    # and the new SIDs are immediately valid in a trie of the whole catalogue
    trie = SidTrie(allsids, sem.level_sizes)
    assert trie.contains(a.sids).all()


def test_collision_digit_never_overflows_silently():
    emb = np.repeat(clustered_embeddings(1), 5, axis=0)  # five identical items
    sem = SemanticIds.fit(clustered_embeddings(50), n_levels=2, codebook_size=4, collision_size=4, seed=0)
    with pytest.raises(CollisionOverflow, match="collision_size 4"):
        sem.assign_all(emb)
    sem_ok = SemanticIds(sem.codebooks, collision_size=5)
    assert sorted(sem_ok.assign_all(emb)[:, -1].tolist()) == [0, 1, 2, 3, 4]


def test_text_embeddings_real_model_and_cache(tmp_path, monkeypatch, synth):
    from specrec.ids.embed import TextEmbedder

    monkeypatch.setenv("SPECREC_CACHE", str(tmp_path))
    texts = synth.catalogue.texts[:40]
    e1 = TextEmbedder()(texts)
    assert e1.shape == (40, 384)
    assert np.allclose(np.linalg.norm(e1, axis=1), 1.0, atol=1e-4)
    assert len(list((tmp_path / "embeddings").glob("*.npy"))) == 1
    e2 = TextEmbedder()(texts)
    assert np.array_equal(e1, e2)
    # similar texts are closer than unrelated ones
    a, b, c = TextEmbedder(cache=False)(["red matte lipstick", "nude matte lipstick", "ionic hair dryer 1875 watt"])
    assert a @ b > a @ c
