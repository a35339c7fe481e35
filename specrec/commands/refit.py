"""``specrec refit``: once every choice was made on validation users, train a bundle's GR model and SASRec again
on every interaction but the test ones, the choices kept (:mod:`specrec.train.refit`)."""

from __future__ import annotations

import argparse
from pathlib import Path

from ..train import refit as refit_module
from .options import add_device_args, training_device


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "refit", help="train the bundle's GR and SASRec again on every interaction but the test ones (after "
        "tune-fusion): the production protocol", description=(refit_module.__doc__ or "").split("\n\n", 1)[1],
        formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--bundle", required=True)
    p.add_argument("--run-dir", help="the GR's checkpoints while it trains (default: BUNDLE/../refit; removed "
                   "when done)")
    p.add_argument("--mode", choices=["retrain", "continue"], default="retrain",
                   help="retrain: each model trained again as its first run was, for the epochs validation chose "
                   "(default); continue: on from the chosen weights for a few epochs")
    p.add_argument("--gr-epochs", type=int, default=2, help="continue: the GR's epochs")
    p.add_argument("--sasrec-epochs", type=int, default=2, help="continue: SASRec's epochs")
    p.add_argument("--lr-scale", type=float, default=0.3, help="continue: times each model's learning rate")
    p.add_argument("--keep-chosen", metavar="DIR", help="first copy the bundle with its chosen models here (a bundle "
                   "of its own, ONNX graphs apart), to compare on test users with the refit ones")
    add_device_args(p, scale=False)
    p.set_defaults(func=run)


def run(a: argparse.Namespace) -> int:
    run_dir = a.run_dir or str(Path(a.bundle).resolve().parent / "refit")
    refit_module.refit(a.bundle, run_dir, a.mode, a.gr_epochs, a.sasrec_epochs, a.lr_scale,
                       device=training_device(a), keep_chosen=a.keep_chosen)
    return 0
