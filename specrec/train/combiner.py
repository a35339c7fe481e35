"""Train the learned combiner of the fused list (:class:`specrec.fusion.Combiner`) and decide whether to keep it.

:func:`fit` trains one on scored validation users (:class:`specrec.fusion.Scored`): each user's candidates are the
ones the served draft gives (:func:`specrec.fusion.served_candidates`), their :func:`specrec.fusion.features`
standardised, and the loss is listwise: the softmax cross-entropy of the true item over the user's candidates
(users whose target is not among them teach nothing and are left out). The last ``holdout`` share of the users it
is given chooses the epoch (recall@10 of the combiner's list, NDCG to break ties); the weights of that epoch are
kept, the standardisation folded into the first layer.

:func:`compare` is what ``specrec tune-fusion`` runs: the validation users split in two seeded halves; the
combiner trained on half A, the weighted mix chosen on A (:func:`specrec.fusion.choose`, the candidate count
given), both measured on half B. The combiner is kept only where B shows it beating the mix by more than chance
(the lower end of a paired bootstrap interval of the per-user recall@10 difference above 0); test users are never
read.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

import numpy as np
import torch

from ..eval.metrics import paired_bootstrap
from ..fusion import (
    Combiner,
    Fusion,
    Scored,
    choose,
    features,
    hit_places,
    recall_ndcg,
    recall_ndcg_of,
    served_candidates,
)


def _batch(users: Sequence[Scored], drafts: int, unseen_share: float) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(features [U, n, F], mask [U, n], target index [U]) of the users whose target is among their candidates."""
    rows, targets = [], []
    F = None
    for u in users:
        c = served_candidates(u, drafts, unseen_share)
        hit = np.flatnonzero(u.items[c] == u.target)
        if not len(hit):
            continue
        x = features(u.token_logp[c], u.item_scores[c], u.unseen[c])
        F = x.shape[1]
        rows.append(x)
        targets.append(int(hit[0]))
    if F is None:
        raise ValueError("no user's target is among its candidates: nothing to train a combiner on")
    n = max(len(r) for r in rows)
    X = np.zeros((len(rows), n, F))
    M = np.zeros((len(rows), n), dtype=bool)
    for i, r in enumerate(rows):
        X[i, : len(r)] = r
        M[i, : len(r)] = True
    return X, M, np.asarray(targets)


def fit(users: Sequence[Scored], drafts: int, unseen_share: float = 0.0, hidden: int = 16, epochs: int = 40,
        lr: float = 3e-3, weight_decay: float = 1e-4, batch_users: int = 256, holdout: float = 0.25, seed: int = 0,
        k: int = 10) -> tuple[Combiner, list[dict]]:
    """A combiner trained on the first ``1 - holdout`` of ``users`` (seeded order kept as given), its epoch chosen
    on the rest by recall@``k`` of its list. -> (the combiner, the curve: loss and holdout recall per epoch)."""
    if not 0.0 < holdout < 1.0:
        raise ValueError(f"holdout {holdout}: in (0, 1)")
    cut = int(round(len(users) * (1.0 - holdout)))
    train, held = list(users[:cut]), list(users[cut:])
    X, M, T = _batch(train, drafts, unseen_share)
    mu = X[M].mean(0)
    sd = X[M].std(0)
    sd[sd == 0] = 1.0
    Xs = torch.from_numpy(((X - mu) / sd) * M[..., None]).float()
    Mt, Tt = torch.from_numpy(M), torch.from_numpy(T)
    g = torch.Generator().manual_seed(seed)
    torch.manual_seed(seed)
    first, last = torch.nn.Linear(X.shape[-1], hidden), torch.nn.Linear(hidden, 1)
    net = torch.nn.Sequential(first, torch.nn.ReLU(), last)
    opt = torch.optim.AdamW(net.parameters(), lr=lr, weight_decay=weight_decay)

    def export() -> Combiner:
        w1 = first.weight.detach().double().numpy().T  # [F, H]
        b1 = first.bias.detach().double().numpy()
        return Combiner(w1 / sd[:, None], b1 - (mu / sd) @ w1, last.weight.detach().double().numpy()[0],
                        float(last.bias.detach().double().item()))

    curve: list[dict] = []
    best: tuple[tuple[float, float], Combiner, int] | None = None
    probe = Fusion(0.5, "raw", drafts)
    for epoch in range(1, epochs + 1):
        net.train()
        order = torch.randperm(len(Xs), generator=g)
        total = 0.0
        for s in range(0, len(order), batch_users):
            i = order[s: s + batch_users]
            logits = net(Xs[i]).squeeze(-1).masked_fill(~Mt[i], float("-inf"))
            loss = torch.nn.functional.cross_entropy(logits, Tt[i])
            opt.zero_grad()
            loss.backward()
            opt.step()
            total += float(loss.detach()) * len(i)
        comb = export()
        rec, ndcg = recall_ndcg(held, replace(probe, combiner=comb), k, unseen_share)
        curve.append({"epoch": epoch, "loss": total / len(Xs), f"holdout.recall@{k}": rec, f"holdout.ndcg@{k}": ndcg})
        if best is None or (rec, ndcg) > best[0]:
            best = ((rec, ndcg), comb, epoch)
    assert best is not None
    for row in curve:
        row["chosen"] = row["epoch"] == best[2]
    return best[1], curve


def compare(users: Sequence[Scored], drafts: int, unseen_share: float = 0.0, k: int = 10, seed: int = 0,
            hidden: int = 16, epochs: int = 40) -> tuple[Combiner | None, dict]:
    """Half A of ``users`` (a seeded split) trains a combiner and chooses a weighted mix (``drafts`` candidates);
    half B measures both. -> (the combiner if it beats the mix on B, else None; the record of the comparison)."""
    perm = np.random.default_rng(seed).permutation(len(users))
    half = len(users) // 2
    a = [users[i] for i in perm[:half]]
    b = [users[i] for i in perm[half:]]
    mix, _ = choose(a, (drafts,), k, unseen_share=unseen_share)
    comb, curve = fit(a, drafts, unseen_share, hidden=hidden, epochs=epochs, seed=seed, k=k)
    at_mix, at_comb = hit_places(b, mix, k, unseen_share), hit_places(b, replace(mix, combiner=comb), k, unseen_share)
    mix_b, comb_b = recall_ndcg_of(at_mix), recall_ndcg_of(at_comb)
    hits_mix, hits_comb = at_mix >= 0, at_comb >= 0
    # kept only where B says it beats the mix by more than chance: the lower end of a paired bootstrap interval
    # of the per-user recall@k difference above 0 (a better figure alone was often luck, and lost on test)
    sure = paired_bootstrap(hits_comb.astype(np.float64), hits_mix.astype(np.float64), seed=seed)
    keep = sure["diff_lo"] > 0
    record = {
        "kept": bool(keep),
        "b.combiner_vs_mix.recall": sure,
        "b.combiner.places": at_comb.tolist(),  # each user of B's target place in its list: the default list's
        "split": f"{len(a)} validation users train it (the last 25% of them choose its epoch) and choose the mix; "
                 f"{len(b)} others judge both (seed {seed})",
        "hidden": hidden,
        "mix_on_a": mix.as_dict(),
        f"b.mix.recall@{k}": mix_b[0], f"b.mix.ndcg@{k}": mix_b[1],
        f"b.combiner.recall@{k}": comb_b[0], f"b.combiner.ndcg@{k}": comb_b[1],
        # users of B the combiner's list holds the target for and the mix's not, and the other way round
        "b.only_combiner_hits": int((hits_comb & ~hits_mix).sum()),
        "b.only_mix_hits": int((hits_mix & ~hits_comb).sum()),
        "curve": curve,
    }
    return (comb if keep else None), record

