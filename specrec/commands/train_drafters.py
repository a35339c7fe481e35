"""``specrec train-drafters``: train a bundle's drafters on its own split, the GR model frozen
(:func:`specrec.pipeline.train_drafters`).
"""

from __future__ import annotations

import argparse

from .options import add_device_args, training_device


def add_parser(sub: argparse._SubParsersAction) -> None:
    d = sub.add_parser("train-drafters", help="train the retrieval drafter, self-draft head and NEZHA head of a bundle",
                       description="Train the drafters on the bundle's own split (the GR model stays frozen) and "
                       "write them into the bundle directory (or --out).")
    d.add_argument("--bundle", required=True)
    d.add_argument("--out", help="write the bundle here instead of in place")
    d.add_argument("--data", help="dataset directory (default: the one the bundle was trained on)")
    d.add_argument("--which", default="retrieval,self,nezha",
                   help="comma-separated: retrieval, self, nezha, distill (the SID-MLP drafter distilled from the GR "
                   "model, which strict, nezha and specgr draft with)")
    d.add_argument("--retrieval-epochs", type=int, default=30)
    d.add_argument("--self-epochs", type=int, default=8)
    d.add_argument("--nezha-epochs", type=int, default=5)
    d.add_argument("--align", choices=["none", "strict", "relaxed"], default="none",
                   help="align the NEZHA head and the self-drafter to the GR model's own top-K (AtSpeed-S / -R)")
    d.add_argument("--align-alpha", type=float, default=0.3, help="weight of the recommendation loss when aligning")
    d.add_argument("--align-top-k", type=int, default=10, help="target beams distilled per history")
    d.add_argument("--align-examples", type=int, default=30_000,
                   help="training histories whose target beams are computed once (cached under $SPECREC_CACHE/beams)")
    d.add_argument(
        "--distill-examples",
        type=int,
        default=60_000,
        help="training histories whose target frontier is computed once (cached under $SPECREC_CACHE/frontier)",
    )
    d.add_argument("--distill-epochs", type=int, default=6)
    d.add_argument("--distill-width", type=int, default=32, help="target beam width whose frontier is distilled")
    add_device_args(d)
    d.set_defaults(func=run)


def run(a: argparse.Namespace) -> int:
    from ..bundle import Bundle
    from ..pipeline import train_drafters

    bundle = Bundle.load(a.bundle)
    which = tuple(w.strip() for w in a.which.split(","))
    from ..train.align import AlignConfig

    epochs = {"retrieval": a.retrieval_epochs, "self": a.self_epochs, "nezha": a.nezha_epochs}
    align = AlignConfig(mode=a.align, alpha=a.align_alpha, top_k=a.align_top_k, examples=a.align_examples)
    from ..train.distill import DistillConfig

    distill = DistillConfig(examples=a.distill_examples, epochs=a.distill_epochs, width=a.distill_width)
    train_drafters(bundle, a.out or a.bundle, which, a.data, epochs, align=align, distill=distill,
                   device=training_device(a), batch_scale=a.batch_scale)
    return 0
