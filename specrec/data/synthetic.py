"""A synthetic catalogue with the structure real data has, for tests (fast, no
files) and for trying the pipeline without a dataset (``--data synthetic``).

- Items belong to content clusters; an item's text is built from its
  cluster's words, so text embeddings (and hence semantic IDs) cluster.
- Popularity is Zipf-skewed within each cluster.
- Sequences follow patterns: every item has a few "successor" items in its
  cluster that users tend to take next; users stick to a few clusters.
- A fraction of items is released late (after the 80% time quantile by
  default): they have no interactions before release, so they are unseen under
  the temporal protocol.

Everything is a deterministic function of the arguments (including ``seed``).
"""

from __future__ import annotations

import numpy as np

from .dataset import Catalogue, Dataset, Sequence

_CATEGORIES = [
    ("lipstick", ["matte", "gloss", "red", "nude", "velvet", "long-wear"]),
    ("shampoo", ["argan", "repair", "volume", "sulfate-free", "keratin", "dandruff"]),
    ("nail polish", ["lacquer", "shimmer", "top coat", "gel", "crackle", "pastel"]),
    ("moisturiser", ["hydrating", "spf 30", "night", "ceramide", "oil-free", "sensitive"]),
    ("perfume", ["eau de parfum", "floral", "citrus", "musk", "vanilla", "woody"]),
    ("mascara", ["waterproof", "lengthening", "volumising", "black", "curl", "brown"]),
    ("sunscreen", ["spf 50", "mineral", "sport", "tinted", "broad spectrum", "reef-safe"]),
    ("hair dryer", ["ionic", "ceramic", "travel", "diffuser", "1875 watt", "compact"]),
    ("face mask", ["clay", "charcoal", "sheet", "peel-off", "brightening", "detox"]),
    ("razor", ["5-blade", "sensitive", "disposable", "cartridge", "precision", "trimmer"]),
    ("eyeliner", ["liquid", "kohl", "gel", "felt tip", "smudge-proof", "brown"]),
    ("conditioner", ["leave-in", "deep", "coconut", "colour-safe", "detangling", "silk"]),
]
_BRANDS = ["Aurel", "Belmont", "Corra", "Dune", "Elara", "Fenn", "Gala", "Halo", "Iris", "Juno", "Kova", "Lumi"]
_SIZES = ["0.5 oz", "1 oz", "1.7 oz", "3.4 oz", "8 oz", "travel size", "value pack", "set of 2"]


def synthetic_dataset(
    n_items: int = 600,
    n_users: int = 800,
    min_len: int = 5,
    max_len: int = 25,
    late_fraction: float = 0.05,
    late_quantile: float = 0.8,
    p_successor: float = 0.6,
    seed: int = 0,
    name: str = "synthetic",
) -> Dataset:
    if n_items < 20 or n_users < 1 or not (1 <= min_len <= max_len):
        raise ValueError("synthetic_dataset needs n_items >= 20, n_users >= 1, 1 <= min_len <= max_len")
    rng = np.random.default_rng(seed)
    n_cat = min(len(_CATEGORIES), max(2, n_items // 20))
    cluster = np.sort(rng.integers(0, n_cat, size=n_items))
    ids, titles = [], []
    for i in range(n_items):
        noun, words = _CATEGORIES[cluster[i]]
        w = rng.choice(words, size=2, replace=False)
        title = f"{rng.choice(_BRANDS)} {w[0]} {noun}, {w[1]}, {rng.choice(_SIZES)} #{i + 1}"
        ids.append(str(i + 1))
        titles.append(title)
    catalogue = Catalogue(ids=ids, titles=titles, texts=list(titles))

    # Zipf popularity within each cluster; a few successors per item.
    pop = 1.0 / np.arange(1, n_items + 1) ** 1.1
    pop = pop[rng.permutation(n_items)]
    members = [np.nonzero(cluster == c)[0] for c in range(n_cat)]
    successors = [
        rng.choice(members[cluster[i]], size=min(3, len(members[cluster[i]])), replace=False) for i in range(n_items)
    ]

    # Release times: late items appear only after the late quantile of time.
    horizon = 1_000_000
    release = np.zeros(n_items, dtype=np.int64)
    late = rng.random(n_items) < late_fraction
    late_t = int(horizon * late_quantile)
    release[late] = rng.integers(late_t, horizon, size=int(late.sum()))

    sequences = []
    for u in range(n_users):
        length = int(rng.integers(min_len, max_len + 1))
        prefs = rng.choice(n_cat, size=min(n_cat, int(rng.integers(1, 4))), replace=False)
        start = int(rng.integers(0, horizon // 2))
        times = np.sort(rng.integers(start, horizon, size=length))
        items: list[int] = []
        for t in times:
            avail = release <= t
            cand = None
            if items and rng.random() < p_successor:
                succ = successors[items[-1]]
                succ = succ[avail[succ]]
                if len(succ):
                    cand = int(rng.choice(succ))
            if cand is None:
                pool = np.concatenate([members[c] for c in prefs])
                pool = pool[avail[pool]]
                if not len(pool):
                    pool = np.nonzero(avail)[0]
                w = pop[pool]
                cand = int(rng.choice(pool, p=w / w.sum()))
            items.append(cand)
        sequences.append(
            Sequence(user=str(u + 1), items=np.asarray(items, np.int64), timestamps=times.astype(np.int64))
        )
    return Dataset(name=name, catalogue=catalogue, sequences=sequences)
