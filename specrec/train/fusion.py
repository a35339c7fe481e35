"""Choose how ``fused`` ranks by both models (:mod:`specrec.fusion`) on validation users, measure the lists the
policies serve, and keep both in the bundle (``specrec tune-fusion``).

For a seeded sample of the bundle's *validation* users (never test), requests that exclude their history, as
served: the bundle's SASRec drafter (with its unseen share) drafts its best ``max(drafts)`` items with its
log-probabilities, and the GR model gives the log-probability of every code of their SIDs (teacher forced, one
``rank`` pass per batch of users over their prefix tree, in float32); then the weight, normalisation and
candidate count with the best recall@10 of the fused list, :meth:`specrec.fusion.Fusion.rank` (the one
definition the policy serves, the item drafter's unseen places kept), :func:`specrec.fusion.choose`.

On the same users it measures the recall@10 of each list a policy serves, the labels ``auto`` orders its tiers
by (:attr:`specrec.fusion.Fusion.valid`): ``fused`` (the choice), ``drafter`` (the item drafter's own list of
K, :meth:`~specrec.drafters.base.Draft.top`), ``beam`` (the GR's own constrained beam search, width K) and
``nezha`` (the draft head's list, where the bundle has a SID drafter). The GR re-ranking the item drafter's
candidates alone is kept as ``gr_reranked``, for the record: no policy serves it. Everything goes into
``bundle.json`` under ``fusion``.
"""

from __future__ import annotations

import json
import time
from dataclasses import replace
from pathlib import Path

import numpy as np
import torch

from ..bundle import Bundle
from ..data.splits import sample_examples
from ..drafters.base import DraftRequest
from ..fusion import Fusion, Scored, choose, hit_places, recall_ndcg, recall_ndcg_of
from ..terminal import progress_bar

#: the list length the choice and the labels are measured at
K = 10


def score_users(bundle: Bundle, ex, exclude: list[np.ndarray], n: int, backend=None, batch_size: int = 32,
                progress: bool = True) -> list[Scored]:
    """Per user of ``ex``: the bundle's SASRec drafter's best ``n`` items (its history ``exclude`` d, its unseen
    share drafted by text), both models' log-probabilities of them (the GR's per code, on ``backend``, default the
    bundle's float32 one), which are unseen, and the target."""
    drafter = bundle.drafter("sasrec")
    backend = backend or bundle.backend(precision="float32")
    itemset = bundle.itemset
    hists = ex.histories()
    out: list[Scored] = []
    for s in progress_bar(range(0, len(ex), batch_size), desc="scoring validation users", disable=not progress):
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
            token = backend.search("rank", enc, None, (), {"sids": torch.from_numpy(sids)}).numpy().astype(np.float64)
        for j, i in enumerate(idx):
            d, k = drafts[j], len(drafts[j].items)
            out.append(Scored(d.items, d.scores.astype(np.float64), token[j, :k], itemset.is_unseen(d.items),
                              int(ex.target[i])))
    return out


def served_recall(bundle: Bundle, policy: str, ex, exclude: list[np.ndarray], progress: bool = True,
                  backend=None) -> float:
    """Recall@K of the list ``policy`` serves (history excluded, no budget) on the users of ``ex``, the GR's
    passes on ``backend`` (default: the bundle's default)."""
    from ..policies import RecRequest, make_policy

    eng = bundle.engine(drafter=None, backend=backend)
    pol = make_policy(policy, eng)
    hits = 0
    for i in progress_bar(range(len(ex)), desc=f"{policy} on validation users", disable=not progress, leave=False):
        res = pol.run([RecRequest(np.asarray(exclude[i], np.int64), K, exclude_history=True)])[0]
        hits += int(int(ex.target[i]) in res.items[:K].tolist())
    return hits / max(1, len(ex))


def drafter_places(users: list[Scored], reserved: int) -> np.ndarray:
    """Per user, the place (0: first) of the target in the item drafter's own list of K
    (:meth:`~specrec.drafters.base.Draft.top`), -1 where it misses."""
    from ..drafters.base import Draft

    out = np.full(len(users), -1, dtype=np.int64)
    for j, u in enumerate(users):
        own = Draft(u.items, u.item_scores).top(K, reserved, u.unseen).items
        hit = np.nonzero(own == u.target)[0]
        if len(hit):
            out[j] = hit[0]
    return out


def drafter_recall(users: list[Scored], reserved: int) -> tuple[float, float]:
    """Recall@K and NDCG@K of the item drafter's own list of K (:meth:`~specrec.drafters.base.Draft.top`)."""
    return recall_ndcg_of(drafter_places(users, reserved))


#: resamples and level of the interval that decides the default list (:func:`default_list`)
RESAMPLES, LEVEL = 1000, 0.95


def cross_fitted_places(users: list[Scored], halves: tuple[np.ndarray, np.ndarray], drafts: tuple[int, ...],
                        share: float, tolerance: float) -> np.ndarray:
    """Per user, the target's place in the fused list made by the fusion chosen on the *other* half of the users
    (:func:`~specrec.fusion.choose` with the same grid, each half in turn): every user judges a choice it took no
    part in, so the figures carry no optimism from the choice."""
    out = np.full(len(users), -1, dtype=np.int64)
    for judge, learn in (halves, halves[::-1]):
        chosen, _ = choose([users[i] for i in learn], drafts, K, unseen_share=share, tolerance=tolerance)
        out[judge] = hit_places([users[i] for i in judge], chosen, K, share)
    return out


def default_list(fused: np.ndarray, drafter: np.ndarray, judged_on: str, seed: int = 0) -> dict:
    """Which list ``auto`` serves by default, from the places of the targets (:func:`~specrec.fusion.hit_places`)
    in the fused list and in the item drafter's own list of the same validation users: ``fused`` only where a
    paired bootstrap over the users (:func:`specrec.eval.metrics.paired_bootstrap`, :data:`RESAMPLES` resamples)
    puts the lower end of the :data:`LEVEL` interval of the per-user recall@K difference above 0, else the item
    drafter's own list (``drafter``): the fused list is served only where validation shows it beating the list it
    re-ranks, not where it wins by chance. -> the record ``bundle.json`` keeps (``fusion.default``)."""
    from ..eval.metrics import gains, paired_bootstrap

    f_r, f_n = gains(fused, K)
    d_r, d_n = gains(drafter, K)
    rec = paired_bootstrap(f_r, d_r, RESAMPLES, seed, LEVEL)
    ndcg = paired_bootstrap(f_n, d_n, RESAMPLES, seed, LEVEL)
    wins = rec["diff_lo"] > 0
    pct = f"{LEVEL:.0%}"
    why = (f"on {rec['n']} validation users the fused list's recall@{K} is {f_r.mean():.4f} against the drafter's "
           f"{d_r.mean():.4f} ({rec['ratio']:.3f}x; difference {rec['diff']:+.4f}, {pct} interval "
           f"[{rec['diff_lo']:+.4f}, {rec['diff_hi']:+.4f}] by a paired bootstrap of {RESAMPLES} resamples): "
           + ("above 0, so the fused list" if wins else "not above 0, so the drafter's own list"))
    return {"list": "fused" if wins else "drafter", "why": why, "judged_on": judged_on, "users": rec["n"],
            f"recall@{K}": {"fused": float(f_r.mean()), "drafter": float(d_r.mean()), **rec},
            f"ndcg@{K}": {"fused": float(f_n.mean()), "drafter": float(d_n.mean()), **ndcg}}


def _halves(n: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """Two halves of ``n`` users, a seeded split (the same as :func:`specrec.train.combiner.compare`'s)."""
    perm = np.random.default_rng(seed).permutation(n)
    return perm[: n // 2], perm[n // 2:]


def tune_fusion(bundle_dir: str | Path, users: int | None = 3000, seed: int = 0, drafts: tuple[int, ...] = (50,),
                progress: bool = True, tolerance: float = 0.0, combiner_hidden: int = 16,
                device: str = "cpu") -> tuple[Fusion, dict]:
    """Choose the fusion of the bundle at ``bundle_dir`` on ``users`` random validation users (None: all) (the
    fewest of ``drafts`` candidates within ``tolerance`` of the best recall, :func:`~specrec.fusion.choose`),
    with ``combiner_hidden`` > 0 a learned combiner where it beats the mix on half of them
    (:func:`specrec.train.combiner.compare`), measure the served lists' recall@10 on them, and write all into its
    ``bundle.json``. On a GPU (``device``) the GR's passes run there on the eager backend, in float32.
    -> (the choice, what was written)."""
    from ..bundle import bundle_split
    from .combiner import compare

    t0 = time.time()
    bundle = Bundle.load(bundle_dir)
    if bundle.meta.get("refit"):
        raise SystemExit(f"bundle {bundle_dir}: its models were refit on the validation targets (bundle.json "
                         "`refit`): no validation user can judge a choice made with them")
    if bundle.sasrec is None:
        raise SystemExit(f"bundle {bundle_dir} has no SASRec: run `specrec train-baseline --bundle {bundle_dir}` first")
    ds, split = bundle_split(bundle)
    ex = sample_examples(split.valid, users, seed) if users is not None else split.valid
    full = ex.full_histories(ds.sequences)
    share = float(bundle.meta.get("drafters", {}).get("unseen_share", 0.0))
    reserved = int(round(share * K))
    # the GR's passes: on the CPU the bundle's default (ONNX Runtime), on a GPU the eager backend there
    gr_backend = None if device == "cpu" else bundle.backend("eager", device=device)
    scored = score_users(bundle, ex, full, max(drafts), backend=gr_backend, progress=progress)
    fusion, grid = choose(scored, drafts, K, unseen_share=share, tolerance=tolerance)
    halves = _halves(len(scored), seed)
    own_places = drafter_places(scored, reserved)
    # the fused list's figures and the default list from users that judge a choice they took no part in
    places = cross_fitted_places(scored, halves, drafts, share, tolerance)
    judged, on = places, (f"all {len(scored)} users, each by the fusion chosen on the other half of them (seed "
                          f"{seed}): no user judges a choice it made")
    learned: dict | None = None
    if combiner_hidden > 0:
        comb, learned = compare(scored, fusion.drafts, share, K, seed, hidden=combiner_hidden)
        if comb is not None:  # its figures from the half it was not trained on
            fusion = replace(fusion, combiner=comb)
            judged = np.asarray(learned.pop("b.combiner.places"), dtype=np.int64)
            on = f"the {len(judged)} users the combiner was not trained on (seed {seed})"
        learned.pop("b.combiner.places", None)
    judged_own = own_places if len(judged) == len(scored) else own_places[halves[1]]
    decision = default_list(judged, judged_own, on, seed)
    rec, ndcg = recall_ndcg_of(judged)
    own = recall_ndcg_of(judged_own)  # on the users the fused list is judged on: their ratio compares like with like
    gr = recall_ndcg(scored, Fusion(1.0, "raw", fusion.drafts), K, share)
    valid = {"fused": {"recall@10": rec, "ndcg@10": ndcg}, "drafter": {"recall@10": own[0], "ndcg@10": own[1]}}
    # the GR's own lists: written once the fusion is in the bundle (the engine's drafter tells it)
    for policy in ("beam", "nezha"):
        if policy == "nezha" and bundle.sid_mlp is None and bundle.nezha_head is None:
            continue
        valid[policy] = {"recall@10": served_recall(bundle, policy, ex, full, progress, backend=gr_backend)}
    valid["gr_reranked"] = {"recall@10": gr[0], "ndcg@10": gr[1]}  # no policy serves it: for the record
    entry = {**fusion.as_dict(), "chosen_on": f"{len(scored)} validation users (seed {seed}), history excluded, "
             f"{reserved} of {K} places kept for unseen candidates, the fewest of {list(drafts)} candidates within "
             f"{tolerance:.1%} of the best recall@10; the fused and drafter lists' validation figures from {on}",
             "default": decision, "valid": valid, "grid": grid, "device": device,
             **({"combiner_choice": learned} if learned else {}), "minutes": round((time.time() - t0) / 60, 1)}
    path = Path(bundle_dir) / "bundle.json"
    text = path.read_text()
    meta = json.loads(text)
    meta["fusion"] = entry
    lines = text.splitlines()
    indent = len(lines[1]) - len(lines[1].lstrip()) if len(lines) > 1 else 2  # the file's own: a diff shows the change
    path.write_text(json.dumps(meta, indent=indent or 2) + "\n")
    return Fusion.of(entry) or fusion, entry
