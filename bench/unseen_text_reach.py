"""How far text similarity reaches unseen targets on the temporal split (quality only, no timing): for
random test users whose target is unseen, is it among the top N by cosine to the mean text embedding
of the history's last items, ranked over all items or over the unseen items alone.

    python bench/unseen_text_reach.py
"""

import sys

import numpy as np

sys.path.insert(0, str(__import__("pathlib").Path(__file__).resolve().parents[1]))
from specrec.data.splits import make_split, sample_examples
from specrec.pipeline import open_dataset

ds = open_dataset("../shared/data/beauty")
sp = make_split(ds, "temporal", 20)
emb = np.load("bundles/beauty-loo/text_emb.npy").astype(np.float32)
print("items", ds.n_items, "emb", emb.shape, "unseen items", int((~sp.seen).sum()))
emb /= np.linalg.norm(emb, axis=1, keepdims=True).clip(min=1e-9)
te = sample_examples(sp.test, 3000, 1)
unseen = ~sp.seen
tgt_unseen = unseen[te.target]
print("test", len(te), "unseen targets", int(tgt_unseen.sum()))
idx_unseen = np.nonzero(unseen)[0]
for win in (1, 3):
    hits = {"all50": 0, "unseen10": 0, "unseen20": 0, "unseen50": 0}
    for h, t in zip(te.history[tgt_unseen], te.target[tgt_unseen]):
        h = h[h >= 0][-win:]
        q = emb[h].mean(0)
        q /= np.linalg.norm(q) + 1e-9
        s = emb @ q
        s[h] = -9
        hits["all50"] += t in np.argpartition(-s, 50)[:50]
        su = s[idx_unseen]
        o = idx_unseen[np.argsort(-su)]
        for n in (10, 20, 50):
            hits[f"unseen{n}"] += t in o[:n]
    n = int(tgt_unseen.sum())
    print("window", win, {k: round(v / n, 3) for k, v in hits.items()})
