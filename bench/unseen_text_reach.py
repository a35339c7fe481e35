"""How far text similarity reaches unseen targets on the temporal split (quality only, no timing): for
random test users whose target is unseen, is it among the top N by cosine to the mean text embedding
of the history's last items, ranked over all items or over the unseen items alone.

    python -m bench.unseen_text_reach --data data/beauty --emb bundles/beauty-loo/text_emb.npy

Prints, per window of last items (1 and 3), the share of those users whose target is among the top 50 of
all items (``all50``) and among the top 10 / 20 / 50 of the unseen items (``unseenN``). Writes nothing.
"""

from __future__ import annotations

import argparse
import json

import numpy as np

from bench.harness import ROOT, command_line


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--data", default=str(ROOT / "data" / "beauty"), help="dataset directory (the repository's Beauty)")
    ap.add_argument("--emb", default=str(ROOT / "bundles" / "beauty-loo" / "text_emb.npy"),
                    help="the items' text embeddings (a bundle's)")
    ap.add_argument("--max-history", type=int, default=20)
    ap.add_argument("--users", type=int, default=3000, help="random test users sampled")
    ap.add_argument("--seed", type=int, default=1)
    a = ap.parse_args(argv)
    from specrec.data.open import open_dataset
    from specrec.data.splits import make_split, sample_examples

    print(command_line("bench.unseen_text_reach", argv))
    ds = open_dataset(a.data)
    sp = make_split(ds, "temporal", a.max_history)
    emb = np.load(a.emb).astype(np.float32)
    print("items", ds.n_items, "emb", emb.shape, "unseen items", int((~sp.seen).sum()))
    emb /= np.linalg.norm(emb, axis=1, keepdims=True).clip(min=1e-9)
    te = sample_examples(sp.test, a.users, a.seed)
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
            o = idx_unseen[np.argsort(-s[idx_unseen])]
            for n in (10, 20, 50):
                hits[f"unseen{n}"] += t in o[:n]
        n = int(tgt_unseen.sum())
        print("window", win, json.dumps({k: round(v / n, 3) for k, v in hits.items()}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
