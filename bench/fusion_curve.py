"""How much the GR model adds to SASRec's list at every fusion weight, on validation users (where ``tune-fusion``
chose it) and on test users (reported only, never a choice).

    python -m bench.fusion_curve --bundle bundles/beauty-loo

Every test user of the bundle's split (history excluded, as served), scored as ``tune-fusion`` scores validation
users (:func:`specrec.train.fusion.score_users`: SASRec's best candidates, the GR's log-probability of each code
of their SIDs, float32); then the fused list's recall@10 and NDCG@10 (:meth:`specrec.fusion.Fusion.rank`) at
every weight of the validation grid, both normalisations, the bundle's candidate count, as a ratio to SASRec's own
list of the same users. The validation curve is the grid ``tune-fusion`` kept in ``bundle.json``. A weight of 1 is
the GR alone ranking SASRec's candidates.

Keys (``<dataset>.<protocol>.``): ``gr_reranked.excl.recall@10`` and ``.recall_ratio_vs_sasrec`` (the GR alone
ranking SASRec's candidates, test), ``fused.excl.best_recall_ratio_any_weight`` (the highest test ratio over
the grid: what no choice of the two-parameter mix can exceed, reported, not chosen). Writes
``<dataset>_<protocol>_fusion_curve.{json,md,png}``.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np

from bench.harness import RESULTS_DIR, publish


def curve(bundle_dir: Path) -> dict:
    from specrec.bundle import Bundle, bundle_split
    from specrec.fusion import Fusion, recall_ndcg
    from specrec.train.fusion import drafter_recall, score_users

    b = Bundle.load(bundle_dir)
    fusion = b.fusion
    if fusion is None:
        raise SystemExit(f"{bundle_dir}: no fusion (run specrec tune-fusion)")
    ds, split = bundle_split(b)
    ex = split.test
    scored = score_users(b, ex, ex.full_histories(ds.sequences), fusion.drafts)
    share = float(b.meta.get("drafters", {}).get("unseen_share", 0.0))
    own = drafter_recall(scored, int(round(share * 10)))  # SASRec's own list, its unseen places as served
    rows = []
    valid = {(g["norm"], round(g["weight"], 2)): g for g in b.meta["fusion"]["grid"] if g["drafts"] == fusion.drafts}
    valid_own = b.meta["fusion"]["valid"]["drafter"]["recall@10"]
    for norm in ("raw", "z"):
        for w in np.round(np.arange(0.0, 1.0001, 0.05), 2):
            r, n = recall_ndcg(scored, Fusion(float(w), norm, fusion.drafts), 10, share)
            v = valid.get((norm, float(w)), {})
            rows.append({"norm": norm, "weight": float(w), "test.recall@10": r, "test.ndcg@10": n,
                         "test.recall_ratio": r / own[0], "test.ndcg_ratio": n / own[1],
                         "valid.recall@10": v.get("recall@10"),
                         "valid.recall_ratio": None if "recall@10" not in v else v["recall@10"] / valid_own})
    alone = next(x for x in rows if x["weight"] == 1.0)
    return {"bundle": str(bundle_dir), "users": len(scored), "drafts": fusion.drafts,
            "chosen": {"weight": fusion.weight, "norm": fusion.norm},
            "sasrec.test.recall@10": own[0], "sasrec.test.ndcg@10": own[1], "sasrec.valid.recall@10": valid_own,
            "gr_reranked.test.recall@10": alone["test.recall@10"], "rows": rows,
            "dataset": b.meta.get("dataset", "beauty"), "protocol": b.meta.get("protocol", "loo")}


def plot(res: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7.5, 4.2))
    for norm, color in (("raw", "tab:blue"), ("z", "tab:orange")):
        pts = [r for r in res["rows"] if r["norm"] == norm]
        ax.plot([r["weight"] for r in pts], [r["valid.recall_ratio"] for r in pts], "--", color=color,
                label=f"validation ({norm}): chooses")
        ax.plot([r["weight"] for r in pts], [r["test.recall_ratio"] for r in pts], "o-", ms=3, color=color,
                label=f"test ({norm}): reported only")
    c = res["chosen"]
    ax.axvline(c["weight"], color="grey", lw=1, ls=":", label=f"chosen: {c['weight']:g} {c['norm']}")
    ax.axhline(1.0, color="black", lw=0.8)
    ax.axhline(1.10, color="red", lw=1, ls="--", label="issue bar 1.10x")
    ax.set_xlabel("GR weight (0: SASRec's own list, 1: the GR alone ranking SASRec's candidates)")
    ax.set_ylabel("fused R@10 / SASRec's R@10")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7, loc="lower left")
    ax.set_title(f"{res['dataset']} {res['protocol']}: the fused list over SASRec's, {res['users']} test users, "
                 f"{res['drafts']} candidates, history excluded", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--bundle", default="bundles/beauty-loo")
    ap.add_argument("--out", default=str(RESULTS_DIR))
    a = ap.parse_args(argv)
    res = curve(Path(a.bundle))
    res["command"] = f"python -m bench.fusion_curve --bundle {a.bundle}"
    out = Path(a.out)
    name = f"{res['dataset']}_{res['protocol']}_fusion_curve"
    plot(res, out / f"{name}.png")
    p = f"{res['dataset']}.{res['protocol']}"
    best = max(res["rows"], key=lambda r: r["test.recall_ratio"])
    keys = {f"{p}.gr_reranked.excl.recall@10": res["gr_reranked.test.recall@10"],
            f"{p}.gr_reranked.excl.recall_ratio_vs_sasrec": res["gr_reranked.test.recall@10"]
            / res["sasrec.test.recall@10"],
            f"{p}.fused.excl.best_recall_ratio_any_weight": best["test.recall_ratio"]}
    md = [f"# The fused list over SASRec's at every weight\n\n`{res['command']}`: {res['users']} test users, "
          f"{res['drafts']} candidates, history excluded; chosen on validation: {res['chosen']}.\n",
          "| norm | weight | valid R@10 ratio | test R@10 | test R@10 ratio | test N@10 ratio |",
          "|---|---|---|---|---|---|"]
    for r in res["rows"]:
        vr = "" if r["valid.recall_ratio"] is None else f"{r['valid.recall_ratio']:.3f}"
        md.append(f"| {r['norm']} | {r['weight']:.2f} | {vr} | {r['test.recall@10']:.4f} | "
                  f"{r['test.recall_ratio']:.3f} | {r['test.ndcg_ratio']:.3f} |")
    md.append(f"\n![fusion curve]({name}.png)\n")
    publish(out, name, res, "\n".join(md) + "\n", keys)
    for k, v in keys.items():
        print(f"{k} = {v:.4f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
