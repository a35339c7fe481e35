"""Where the GR model loses to SASRec between validation and test: both models' loss on the users' last training
target, their validation target and their test target, and the GR ranking SASRec's candidates by history length.

    python -m bench.generalisation --bundle bundles/beauty-loo [--gr-weights CANDIDATE.safetensors]

The same seeded sample of users per split (``--users``, seed ``--seed``): the last training example of each
sampled user (the target the model was taught with the most context), the validation example and the test
example. For each, the mean negative log-likelihood of the target item, in nats: the GR's is the sum over the
codes of its semantic ID (teacher forced, float32), SASRec's is over its whole catalogue. A model that learns its
training users by heart has a low training loss and a large step to validation; the step from validation to
test is the part that validation cannot show when it chooses weights.

Then, as ``tune-fusion`` scores users (:func:`specrec.train.fusion.score_users`: SASRec's best candidates,
history excluded, the GR's log-probability of each), for the users whose target is among the candidates: the
share that each model alone places in its top 10, by history length; and again with each history's most recent
item dropped (both models read one item less), which separates how each model reads the last item from the
rest. ``--gr-weights`` scores another GR with the bundle's semantic IDs (a candidate's ``model.safetensors``) in
place of the bundle's.

Keys (``<dataset>.<protocol>.``, the bundle's own GR only): ``gr.nll_step_valid_to_test`` and
``sasrec.nll_step_valid_to_test`` (nats per target), ``gr_reranked.top10_share_ratio_vs_sasrec.valid`` and
``.test`` (the GR's top-10 share over SASRec's, among targets in the candidates) and ``.test_without_last_item``
(the same with each history's most recent item dropped: what the GR makes of the rest of the history). Writes
``<dataset>_<protocol>_generalisation.{json,md,png}``.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np
import torch

from bench.harness import RESULTS_DIR, publish

#: history lengths (items, before the window cut) the top-10 shares are split by: [lo, hi)
LENGTHS = ((0, 5), (5, 8), (8, 12), (12, 20), (20, 10**6))


def span(lo: int, hi: int) -> str:
    return f"{lo}-{hi - 1}" if hi < 10**6 else f"{lo}+"


def last_training_examples(split):
    """Each user's training example with the latest target."""
    last: dict[int, tuple[int, int]] = {}
    for i, (u, p) in enumerate(zip(split.train.user.tolist(), split.train.position.tolist())):
        if p > last.get(u, (-1, 0))[0]:
            last[u] = (p, i)
    return split.train.take(np.array(sorted(i for _, i in last.values())))


@torch.inference_mode()
def gr_nll(bundle, backend, ex, batch: int = 128) -> float:
    hists, out = ex.histories(), []
    for s in range(0, len(ex), batch):
        idx = list(range(s, min(len(ex), s + batch)))
        enc = backend.encode(bundle.history_sids([hists[i] for i in idx]))
        codes = torch.from_numpy(bundle.sids[ex.target[idx]][:, None, :])
        out.append(-backend.search("rank", enc, None, (), {"sids": codes}).numpy()[:, 0, :].sum(1))
    return float(np.concatenate(out).mean())


@torch.inference_mode()
def sasrec_nll(sasrec, ex, batch: int = 512) -> float:
    out = []
    for s in range(0, len(ex), batch):
        x = torch.from_numpy(ex.history[s : s + batch])
        logp = torch.log_softmax(sasrec.scores(sasrec.sequence(x)[:, -1]).float(), -1)
        out.append(-logp[torch.arange(len(x)), torch.from_numpy(ex.target[s : s + batch])].numpy())
    return float(np.concatenate(out).mean())


def top10_by_length(scored, lengths) -> dict:
    """Among users whose target is a candidate: each model's share of targets in its own top 10, per length."""
    from specrec.fusion import gr_logp

    rows = []
    for s, n in zip(scored, lengths):
        where = np.flatnonzero(s.items == s.target)
        if not len(where):
            continue
        j = int(where[0])
        gr = gr_logp(s.token_logp, s.unseen)  # the GR's score of each candidate, as the fused list reads it
        rows.append((n, int((gr > gr[j]).sum()) < 10, j < 10))
    a = np.array(rows, dtype=np.int64).reshape(-1, 3)
    by_length = []
    for lo, hi in LENGTHS:
        m = (a[:, 0] >= lo) & (a[:, 0] < hi)
        by_length.append({"lo": lo, "hi": hi, "users": int(m.sum()),
                                 "gr": float(a[m, 1].mean()) if m.any() else None,
                                 "sasrec": float(a[m, 2].mean()) if m.any() else None})
    return {"in_candidates": len(a), "gr": float(a[:, 1].mean()), "sasrec": float(a[:, 2].mean()),
            "by_length": by_length}


def measure(bundle_dir: Path, users: int, seed: int, gr_weights: str | None = None) -> dict:
    from specrec.bundle import Bundle, bundle_split, load_weights
    from specrec.data.splits import sample_examples
    from specrec.fusion import recall_ndcg
    from specrec.train.fusion import drafter_recall, score_users

    b = Bundle.load(bundle_dir)
    if b.sasrec is None or b.fusion is None:
        raise SystemExit(f"{bundle_dir}: needs its SASRec and fusion (train-baseline, tune-fusion)")
    if gr_weights:
        load_weights(b.model, Path(gr_weights))
    ds, split = bundle_split(b)
    backend = b.backend(precision="float32")
    share = float(b.meta.get("drafters", {}).get("unseen_share", 0.0))
    sets = {"train_last": last_training_examples(split), "valid": split.valid, "test": split.test}
    res: dict = {"bundle": str(bundle_dir), "gr_weights": gr_weights, "users": users, "seed": seed,
                 "dataset": b.meta.get("dataset", "beauty"), "protocol": b.meta.get("protocol", "loo"),
                 "drafts": b.fusion.drafts, "fusion": f"{b.fusion.norm} {b.fusion.weight:g}",
                 "nll": {}, "top10": {}, "recall@10": {}, "top10_without_last_item": {}}
    for name, ex in sets.items():
        ex = sample_examples(ex, users, seed)
        res["nll"][name] = {"gr": gr_nll(b, backend, ex), "sasrec": sasrec_nll(b.sasrec.eval(), ex)}
        print(f"{name}: NLL per target GR {res['nll'][name]['gr']:.3f}, SASRec {res['nll'][name]['sasrec']:.3f}",
              flush=True)
        if name != "train_last":
            full = ex.full_histories(ds.sequences)
            scored = score_users(b, ex, full, b.fusion.drafts, backend=backend)
            res["top10"][name] = top10_by_length(scored, [len(h) for h in full])
            own = drafter_recall(scored, int(round(share * 10)))[0]
            fused = recall_ndcg(scored, b.fusion, 10, share)[0]
            res["recall@10"][name] = {"sasrec": own, "fused": fused, "fused_ratio_vs_sasrec": fused / own}
            short = without_last_item(ex, full, split.max_history)  # both models read one item less, same exclusion
            t = top10_by_length(score_users(b, short, full, b.fusion.drafts, backend=backend),
                                [len(h) - 1 for h in full])
            res["top10_without_last_item"][name] = {k: t[k] for k in ("in_candidates", "gr", "sasrec")}
    return res


def without_last_item(ex, full: list[np.ndarray], max_history: int):
    """The same users and targets, each history (``full``: the whole of it, oldest first) without its most recent
    item, cut to the model's window."""
    from specrec.data.splits import PAD, Examples

    hist = np.full_like(ex.history, PAD)
    for i, h in enumerate(full):
        kept = np.asarray(h[:-1][-max_history:], dtype=np.int64)
        if len(kept):
            hist[i, max_history - len(kept):] = kept
    return Examples(hist, ex.target, ex.user, ex.position)


def plot(res: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a0, a1) = plt.subplots(1, 2, figsize=(11, 4))
    names = list(res["nll"])
    x = np.arange(len(names))
    for off, model in ((-0.2, "gr"), (0.2, "sasrec")):
        a0.bar(x + off, [res["nll"][n][model] for n in names], 0.4, label=model.upper() if model == "gr" else "SASRec")
    a0.set_xticks(x, names)
    a0.set_ylabel("NLL of the target (nats)")
    a0.set_title("loss on the users' training, validation and test targets")
    a0.legend()
    labels = [span(lo, hi) for lo, hi in LENGTHS]
    for split, style in (("valid", "--"), ("test", "-")):
        rows = res["top10"][split]["by_length"]
        ratio = [None if not r["sasrec"] else r["gr"] / r["sasrec"] for r in rows]
        a1.plot(labels, ratio, style, marker="o", label=split)
    a1.axhline(1.0, color="grey", lw=0.8)
    a1.set_xlabel("history length (items)")
    a1.set_ylabel("GR top-10 share / SASRec's")
    a1.set_title(f"ranking SASRec's {res['drafts']} candidates, targets among them")
    a1.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--bundle", default="bundles/beauty-loo")
    ap.add_argument("--gr-weights", default=None, help="a candidate GR's model.safetensors (same semantic IDs)")
    ap.add_argument("--users", type=int, default=3000, help="seeded sample of users per split")
    ap.add_argument("--seed", type=int, default=5)
    ap.add_argument("--out", default=str(RESULTS_DIR))
    a = ap.parse_args(argv)
    res = measure(Path(a.bundle), a.users, a.seed, a.gr_weights)
    res["command"] = (f"python -m bench.generalisation --bundle {a.bundle} --users {a.users} --seed {a.seed}"
                      + (f" --gr-weights {a.gr_weights}" if a.gr_weights else ""))
    nll, top = res["nll"], res["top10"]
    p = f"{res['dataset']}.{res['protocol']}"
    keys = {f"{p}.gr.nll_step_valid_to_test": nll["test"]["gr"] - nll["valid"]["gr"],
            f"{p}.sasrec.nll_step_valid_to_test": nll["test"]["sasrec"] - nll["valid"]["sasrec"],
            f"{p}.gr_reranked.top10_share_ratio_vs_sasrec.valid": top["valid"]["gr"] / top["valid"]["sasrec"],
            f"{p}.gr_reranked.top10_share_ratio_vs_sasrec.test": top["test"]["gr"] / top["test"]["sasrec"],
            f"{p}.gr_reranked.top10_share_ratio_vs_sasrec.test_without_last_item":
                res["top10_without_last_item"]["test"]["gr"] / res["top10_without_last_item"]["test"]["sasrec"]}
    name = f"{res['dataset']}_{res['protocol']}_generalisation"
    if a.gr_weights:  # a candidate's figures are for the record, not the bundle's keys
        name, keys = name + "_candidate", {}
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    plot(res, out / f"{name}.png")
    md = [f"# Where the GR loses to SASRec between validation and test\n\n`{res['command']}`: {a.users} users "
          f"per split (seed {a.seed}).\n", "| targets | GR NLL (nats) | SASRec NLL (nats) |", "|---|---|---|"]
    md += [f"| {n} | {v['gr']:.3f} | {v['sasrec']:.3f} |" for n, v in nll.items()]
    md += ["", f"Among targets in SASRec's {res['drafts']} candidates (history excluded): the share each model "
           "alone ranks in its top 10.", "", "| split | history | users | GR | SASRec | GR / SASRec |",
           "|---|---|---|---|---|---|"]
    for split, t in top.items():
        md.append(f"| {split} | all | {t['in_candidates']} | {t['gr']:.3f} | {t['sasrec']:.3f} | "
                  f"{t['gr'] / t['sasrec']:.3f} |")
        for r in t["by_length"]:
            if r["users"]:
                md.append(f"| {split} | {span(r['lo'], r['hi'])} | {r['users']} | {r['gr']:.3f} | {r['sasrec']:.3f} | "
                          f"{r['gr'] / r['sasrec'] if r['sasrec'] else float('nan'):.3f} |")
    md += ["", "The same users with each history's most recent item dropped (both models read one item less; "
           "the candidates still exclude the whole history):", "", "| split | users | GR | SASRec | GR / SASRec |",
           "|---|---|---|---|---|"]
    md += [f"| {n} | {t['in_candidates']} | {t['gr']:.3f} | {t['sasrec']:.3f} | {t['gr'] / t['sasrec']:.3f} |"
           for n, t in res["top10_without_last_item"].items()]
    md += ["", f"The fused list at the bundle's weight ({res['fusion']}) on the same users, history excluded:", "",
           "| split | SASRec R@10 | fused R@10 | ratio |", "|---|---|---|---|"]
    md += [f"| {n} | {r['sasrec']:.4f} | {r['fused']:.4f} | {r['fused_ratio_vs_sasrec']:.3f} |"
           for n, r in res["recall@10"].items()]
    md.append(f"\n![generalisation]({name}.png)\n")
    publish(out, name, res, "\n".join(md) + "\n", keys)
    for k, v in keys.items():
        print(f"{k} = {v:.4f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
