"""Does validation predict test? The same lists measured on validation users and on test users, side by side.

    python -m bench.valid_test --bundle runs/exp/beauty-e0/bundle --name beauty.quick.e0
    python -m bench.valid_test --bundle CHOSEN/bundle --served REFIT/bundle --name beauty.quick.refit

Validation users are scored with ``--bundle`` (the models every choice was made with: trained without any
validation target); test users with ``--served`` (default: the same bundle), e.g. the same models refit on
every interaction but the test ones (``specrec refit``), with the choices of ``--bundle`` kept. Every user of
each split (or a seeded ``--users`` sample), history excluded, scored as ``tune-fusion`` scores them
(:func:`specrec.train.fusion.score_users`: the SASRec drafter's best candidates, the GR's log-probability of each
code of their SIDs, float32): SASRec's own list (the ``drafter`` policy's), the fused list as the bundle serves it
(its weight, normalisation, candidates, combiner), the GR alone ranking the same candidates, and the fused/SASRec
R@10 ratio at every weight of the grid (reported, never chosen here); the GR's own beam search (width 10) on a
seeded sample of ``--beam-users``. With ``--without-last`` the test users again, scored by ``--bundle``, each history
without its most recent item (the validation target), which separates what the chosen models make of that item
from the rest.

The ratios come with a paired bootstrap interval over users (:func:`specrec.eval.metrics.paired_bootstrap`).
With ``--served`` the test users are also scored by ``--bundle`` (``test_chosen``: what the refit changed).

Keys (``NAME.<protocol>.``): ``{fused,sasrec,gr_reranked,beam}.excl.<split>.{recall,ndcg}@10`` and
``fused.excl.<split>.recall_ratio_vs_sasrec`` for each split measured (``valid``, ``test``, ``test_chosen``,
``test_without_last``), ``fused.excl.valid_test_gap`` (|test ratio - validation ratio|). Writes
``valid_test_<NAME>.{json,md,png}``.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

from bench.harness import RESULTS_DIR, command_line, fmt, machine_line, publish, run_line, sayer

say = sayer("valid_test", clock=True)
K = 10
WEIGHTS = tuple(float(w) for w in np.round(np.arange(0.0, 1.0001, 0.05), 2))


def drafter_places(scored, reserved: int) -> np.ndarray:
    """Per user, the target's place in the item drafter's own list of K (-1: missed)."""
    from specrec.drafters.base import Draft

    out = np.full(len(scored), -1, dtype=np.int64)
    for j, u in enumerate(scored):
        own = Draft(u.items, u.item_scores).top(K, reserved, u.unseen).items
        hit = np.flatnonzero(own == u.target)
        if len(hit):
            out[j] = hit[0]
    return out


def beam_places(bundle, ex, full) -> np.ndarray:
    from specrec.eval.evaluate import beam_ranker, run_ranker
    from specrec.eval.metrics import target_ranks

    ranked, _ = run_ranker(beam_ranker(bundle, K, bundle.backend(precision="float32")), ex, K, batch_size=32,
                           progress=True, desc="beam", exclude=full)
    return target_ranks(ranked, ex.target)


def measure_split(bundle, fusion, ex, full, share: float, beam_users: int, seed: int) -> dict:
    """Every list's per-user places on ``ex`` (histories as they are; ``full``: what each request excludes)."""
    from specrec.data.splits import sample_examples
    from specrec.eval.metrics import gains, paired_bootstrap
    from specrec.fusion import Fusion, hit_places
    from specrec.train.fusion import score_users

    scored = score_users(bundle, ex, full, fusion.drafts, backend=bundle.backend(precision="float32"))
    reserved = int(round(share * K))
    places = {"sasrec": drafter_places(scored, reserved), "fused": hit_places(scored, fusion, K, share),
              "gr_reranked": hit_places(scored, Fusion(1.0, fusion.norm, fusion.drafts), K, share)}
    figs: dict = {}
    for name, p in places.items():
        r, n = gains(p, K)
        figs[name] = {"recall@10": float(r.mean()), "ndcg@10": float(n.mean()), "users": len(p)}
    s_r, s_n = gains(places["sasrec"], K)
    f_r, f_n = gains(places["fused"], K)
    figs["fused"]["recall_vs_sasrec"] = paired_bootstrap(f_r, s_r, seed=seed)
    figs["fused"]["ndcg_vs_sasrec"] = paired_bootstrap(f_n, s_n, seed=seed)
    curve = []
    for w in WEIGHTS:
        r, n = gains(hit_places(scored, Fusion(w, fusion.norm, fusion.drafts), K, share), K)
        curve.append({"weight": w, "recall_ratio": float(r.mean() / max(s_r.mean(), 1e-12)),
                      "ndcg_ratio": float(n.mean() / max(s_n.mean(), 1e-12))})
    figs["curve"] = curve
    if beam_users:
        idx_ex = sample_examples(ex, beam_users, seed)
        keep = {int(u): i for i, u in enumerate(ex.user.tolist())}
        sub_full = [full[keep[int(u)]] for u in idx_ex.user.tolist()]
        r, n = gains(beam_places(bundle, idx_ex, sub_full), K)
        figs["beam"] = {"recall@10": float(r.mean()), "ndcg@10": float(n.mean()), "users": len(idx_ex)}
    return figs


def measure(a) -> dict:
    from bench.generalisation import without_last_item
    from specrec.bundle import Bundle, bundle_split
    from specrec.data.splits import sample_examples

    chosen = Bundle.load(a.bundle)
    served = Bundle.load(a.served) if a.served else chosen
    fusion = chosen.fusion
    if fusion is None:
        raise SystemExit(f"{a.bundle}: no fusion (specrec tune-fusion)")
    ds, split = bundle_split(chosen)
    share = float(chosen.meta.get("drafters", {}).get("unseen_share", 0.0))
    res: dict = {"bundle": a.bundle, "served": a.served or a.bundle, "name": a.name,
                 "dataset": chosen.meta.get("dataset"), "protocol": split.protocol,
                 "fusion": fusion.as_dict() | {"combiner": fusion.combiner is not None},
                 "default": chosen.meta.get("fusion", {}).get("default"), "refit": served.meta.get("refit"),
                 "users": a.users, "seed": a.seed, "beam_users": a.beam_users, "splits": {}}
    todo = [("valid", chosen, split.valid, False), ("test", served, split.test, False)]
    if a.served and served is not chosen:  # what test users say of the chosen models, not refit
        todo.append(("test_chosen", chosen, split.test, False))
    if a.without_last:  # the chosen models' test users again, each history without the validation target
        todo.append(("test_without_last", chosen, split.test, True))
    for name, bundle, ex, drop in todo:
        ex = sample_examples(ex, a.users, a.seed)
        full = ex.full_histories(ds.sequences)
        hist_ex = without_last_item(ex, full, split.max_history) if drop else ex
        say(f"{name}: {len(ex)} users, scored by {bundle.path}")
        res["splits"][name] = measure_split(bundle, fusion, hist_ex, full, share, a.beam_users, a.seed)
        f = res["splits"][name]["fused"]
        say(f"{name}: fused R@10 {f['recall@10']:.4f}, SASRec {res['splits'][name]['sasrec']['recall@10']:.4f}, "
            f"ratio {f['recall_vs_sasrec']['ratio']:.3f} [{f['recall_vs_sasrec']['ratio_lo']:.3f}, "
            f"{f['recall_vs_sasrec']['ratio_hi']:.3f}]")
    v, t = (res["splits"][s]["fused"]["recall_vs_sasrec"]["ratio"] for s in ("valid", "test"))
    res["valid_test_gap"] = abs(t - v)
    return res


def keys_of(res: dict) -> dict:
    pre = f"{res['name']}.{res['protocol']}"
    keys: dict = {}
    for split, figs in res["splits"].items():
        for lst in ("fused", "sasrec", "gr_reranked", "beam"):
            for m in ("recall@10", "ndcg@10"):
                if lst in figs:
                    keys[f"{pre}.{lst}.excl.{split}.{m}"] = figs[lst][m]
        keys[f"{pre}.fused.excl.{split}.recall_ratio_vs_sasrec"] = figs["fused"]["recall_vs_sasrec"]["ratio"]
    keys[f"{pre}.fused.excl.valid_test_gap"] = res["valid_test_gap"]
    return keys


def markdown(res: dict, argv) -> str:
    lines = [f"# {res['name']}: validation against test", "", f"`{command_line('bench.valid_test', argv)}`", "",
             f"{run_line()}; {machine_line(in_process=True)}.", "",
             f"Validation scored by `{res['bundle']}`, test by `{res['served']}`"
             + (f" (refit: {res['refit'].get('mode')}, {res['refit'].get('summary', '')})" if res["refit"] else "")
             + f"; fusion {res['fusion']}; default list recorded: "
             + (f"`{res['default']['list']}`" if res["default"] else "none") + ".", "",
             "| split | users | SASRec R@10 | fused R@10 | fused/SASRec R@10 [95%] | SASRec N@10 | fused N@10 "
             "| fused/SASRec N@10 | GR re-ranking R@10 | beam R@10 (users) |", "|---" * 10 + "|"]
    for name, f in res["splits"].items():
        rr, nr = f["fused"]["recall_vs_sasrec"], f["fused"]["ndcg_vs_sasrec"]
        beam = f.get("beam")
        lines.append(
            f"| {name} | {f['sasrec']['users']} | {f['sasrec']['recall@10']:.4f} | {f['fused']['recall@10']:.4f} | "
            f"{rr['ratio']:.3f} [{rr['ratio_lo']:.3f}, {rr['ratio_hi']:.3f}] | {f['sasrec']['ndcg@10']:.4f} | "
            f"{f['fused']['ndcg@10']:.4f} | {nr['ratio']:.3f} | {f['gr_reranked']['recall@10']:.4f} | "
            + (f"{beam['recall@10']:.4f} ({beam['users']})" if beam else "") + " |")
    lines += ["", f"valid_test_gap (|test ratio - validation ratio|): **{fmt(res['valid_test_gap'], '.3f')}**", "",
              f"![fused/SASRec R@10 by weight]({'valid_test_' + res['name'].replace('.', '_')}.png)", ""]
    return "\n".join(lines)


def plot(res: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7.5, 4.2))
    styles = {"valid": ("tab:blue", "--"), "test": ("tab:red", "-"), "test_chosen": ("tab:orange", "-."),
              "test_without_last": ("tab:grey", ":")}
    for name, f in res["splits"].items():
        color, ls = styles.get(name, ("black", "-"))
        ax.plot([c["weight"] for c in f["curve"]], [c["recall_ratio"] for c in f["curve"]], ls, color=color,
                marker="o", ms=2.5, label=name)
    ax.axvline(res["fusion"]["weight"], color="grey", lw=1, ls=":", label=f"chosen weight {res['fusion']['weight']:g}")
    ax.axhline(1.0, color="black", lw=0.8)
    ax.set_xlabel(f"GR weight ({res['fusion']['norm']} scores; 0: SASRec's own list)")
    ax.set_ylabel("fused R@10 / SASRec's R@10")
    ax.set_title(f"{res['name']}: validation against test (gap {res['valid_test_gap']:.3f})")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--bundle", required=True, help="the bundle every choice was made with (validation users)")
    ap.add_argument("--served", help="the bundle that serves test users (default: --bundle), e.g. its refit")
    ap.add_argument("--name", required=True, help="key prefix, e.g. beauty.quick.e0")
    ap.add_argument("--users", type=int, default=None, help="a seeded sample of users per split (default: all)")
    ap.add_argument("--beam-users", type=int, default=3000, help="users of the GR's beam search per split (0: none)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--without-last", action="store_true", help="also test users without their last history item")
    ap.add_argument("--results", default=str(RESULTS_DIR))
    a = ap.parse_args(argv)
    import torch

    torch.set_num_threads(2)
    res = measure(a)
    name = "valid_test_" + a.name.replace(".", "_")
    out = Path(a.results)
    md = markdown(res, argv if argv is not None else sys.argv[1:])
    publish(out, name, res, md, keys_of(res))
    plot(res, out / f"{name}.png")
    print(md)
    return 0


if __name__ == "__main__":
    sys.exit(main())
