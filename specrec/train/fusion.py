"""Choose how ``specgr`` ranks by both models (:mod:`specrec.fusion`) on validation users, and keep it in the
bundle (``specrec tune-fusion``).

For a seeded sample of the bundle's *validation* users (never test), requests that exclude their history: the
SASRec drafter's best ``max(drafts)`` items with its log-probabilities, and the GR model's log-probability of
each of their SIDs (teacher forced, one ``rank`` pass per batch of users over their prefix tree); then the weight,
normalisation and candidate count with the best recall@10 (:func:`specrec.fusion.choose`). The choice and the
validation figures go into ``bundle.json`` under ``fusion``.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import numpy as np
import torch
from tqdm.auto import tqdm

from ..bundle import Bundle
from ..data.splits import sample_examples
from ..drafters.base import DraftRequest
from ..fusion import Fusion, Scored, choose, recall_ndcg


def score_users(bundle: Bundle, ex, exclude: list[np.ndarray], n: int, batch_size: int = 32,
                progress: bool = True) -> list[Scored]:
    """Per user of ``ex``: the SASRec drafter's best ``n`` items (its history ``exclude`` d), both models'
    log-probabilities of them, and the target."""
    drafter = bundle.drafter("sasrec", unseen_share=0.0)
    backend = bundle.backend()
    hists = ex.histories()
    out: list[Scored] = []
    for s in tqdm(range(0, len(ex), batch_size), desc="scoring validation users", disable=not progress):
        idx = range(s, min(len(ex), s + batch_size))
        drafts = drafter.draft([DraftRequest(np.asarray(hists[i], np.int64), n, None,
                                             frozenset(np.asarray(exclude[i]).tolist())) for i in idx])
        m = max(len(d.items) for d in drafts)
        sids = np.zeros((len(drafts), m, bundle.cfg.sid_len), dtype=np.int64)
        for j, d in enumerate(drafts):
            sids[j, : len(d.items)] = bundle.sids[d.items]
            sids[j, len(d.items):] = bundle.sids[d.items[0]]
        with torch.inference_mode():
            enc = backend.encode(bundle.history_sids([hists[i] for i in idx]))
            gr = backend.rank(enc, torch.from_numpy(sids)).sum(-1).numpy()
        for j, i in enumerate(idx):
            k = len(drafts[j].items)
            out.append(Scored(drafts[j].items, drafts[j].scores.astype(np.float64), gr[j, :k].astype(np.float64),
                              int(ex.target[i])))
    return out


def tune_fusion(bundle_dir: str | Path, users: int | None = 3000, seed: int = 0, drafts: tuple[int, ...] = (50,),
                progress: bool = True) -> tuple[Fusion, dict]:
    """Choose the fusion of the bundle at ``bundle_dir`` on ``users`` random validation users (None: all) and
    write it into its ``bundle.json``. -> (the choice, what was written)."""
    from ..pipeline import bundle_split

    t0 = time.time()
    bundle = Bundle.load(bundle_dir)
    if bundle.sasrec is None:
        raise SystemExit(f"bundle {bundle_dir} has no SASRec: run `specrec train-baseline --bundle {bundle_dir}` first")
    ds, split = bundle_split(bundle)
    ex = sample_examples(split.valid, users, seed) if users is not None else split.valid
    scored = score_users(bundle, ex, ex.full_histories(ds.sequences), max(drafts), progress=progress)
    fusion, grid = choose(scored, drafts)
    rec, ndcg = recall_ndcg(scored, fusion)
    sas = recall_ndcg(scored, Fusion(0.0, "raw", fusion.drafts))
    gr = recall_ndcg(scored, Fusion(1.0, "raw", fusion.drafts))
    entry = {**fusion.as_dict(), "chosen_on": f"{len(scored)} validation users (seed {seed}), history excluded",
             "valid": {"fused": {"recall@10": rec, "ndcg@10": ndcg}, "sasrec": {"recall@10": sas[0], "ndcg@10": sas[1]},
                       "gr_alone": {"recall@10": gr[0], "ndcg@10": gr[1]}},
             "grid": grid, "minutes": round((time.time() - t0) / 60, 1)}
    path = Path(bundle_dir) / "bundle.json"
    text = path.read_text()
    meta = json.loads(text)
    meta["fusion"] = entry
    lines = text.splitlines()
    indent = len(lines[1]) - len(lines[1].lstrip()) if len(lines) > 1 else 2  # the file's own: a diff shows the change
    path.write_text(json.dumps(meta, indent=indent or 2) + "\n")
    return fusion, entry
