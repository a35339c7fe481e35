"""``specrec tune-fusion``: choose on validation users how ``fused`` ranks by both models
(:func:`specrec.train.fusion.tune_fusion`), written into the bundle.
"""

from __future__ import annotations

import argparse

from .options import add_device_args, training_device


def add_parser(sub: argparse._SubParsersAction) -> None:
    tf = sub.add_parser(
        "tune-fusion",
        help="choose on validation users how `fused` ranks by both models (GR + SASRec), into the bundle",
        description="Score the SASRec drafter's best items of random validation users (history excluded) with "
        "both models and choose the weight, normalisation and number of candidates of the fused score with the "
        "best recall@10 (specrec.fusion); measure on the same users the recall@10 of every list a policy serves "
        "(fused, the drafter's own, beam's, nezha's: the order auto tries them in); written into bundle.json under "
        "`fusion`, where the fused policy, the drafter service and auto read it. Test users are never read.",
    )
    tf.add_argument("--bundle", required=True)
    tf.add_argument("--users", type=int, default=None, help="validation users, a seeded random sample (default: all)")
    tf.add_argument("--seed", type=int, default=0)
    tf.add_argument("--drafts", default="30,40,50", help="candidate counts to choose from (comma-separated)")
    tf.add_argument("--tolerance", type=float, default=0.005, help="take the fewest candidates whose best validation "
                    "recall@10 is within this share of the best of all (the scoring pass costs in proportion to them)")
    tf.add_argument("--combiner-hidden", type=int, default=16, help="hidden units of the learned combiner trained "
                    "on half of the users and kept only where it beats the weighted mix on the other half; 0: none")
    add_device_args(tf, scale=False)
    tf.set_defaults(func=run)


def run(a: argparse.Namespace) -> int:
    from ..train.fusion import tune_fusion

    drafts = tuple(int(x) for x in a.drafts.split(",") if x.strip())
    fusion, entry = tune_fusion(a.bundle, a.users, a.seed, drafts, tolerance=a.tolerance,
                                combiner_hidden=a.combiner_hidden, device=training_device(a))
    lists = ", ".join(f"{n} {v['recall@10']:.4f}" for n, v in entry["valid"].items())
    print(f"fusion: GR weight {fusion.weight:g}, {fusion.norm} scores, {fusion.drafts} SASRec candidates "
          f"({entry['chosen_on']}); validation R@10 of the lists: {lists}; written into {a.bundle}/bundle.json")
    if "combiner_choice" in entry:
        c = entry["combiner_choice"]
        print(f"learned combiner ({c['hidden']} hidden units) {'kept' if c['kept'] else 'not kept'}: on the half "
              f"it was not trained on, R@10 {c['b.combiner.recall@10']:.4f} against the mix's "
              f"{c['b.mix.recall@10']:.4f} ({c['split']})")
    return 0
