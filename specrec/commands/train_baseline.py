"""``specrec train-baseline``: train the SASRec baseline on a bundle's split and save it into the bundle."""

from __future__ import annotations

import argparse

from .options import add_device_args, training_device


def add_parser(sub: argparse._SubParsersAction) -> None:
    tb = sub.add_parser(
        "train-baseline",
        help="train the SASRec baseline on a bundle's split (same histories and metrics)",
        description="Train SASRec (item-id embeddings, causal transformer, full-softmax cross-entropy) "
        "on the bundle's own split and save it into the bundle; `specrec eval --ranker sasrec` "
        "evaluates it by the same code path as the GR model.",
    )
    tb.add_argument("--bundle", required=True)
    tb.add_argument("--model", choices=["sasrec"], default="sasrec")
    tb.add_argument("--out", help="write the bundle here instead of in place")
    tb.add_argument("--data", help="dataset directory (default: the one the bundle was trained on)")
    tb.add_argument("--d-model", type=int, default=64)
    tb.add_argument("--layers", type=int, default=2)
    tb.add_argument("--heads", type=int, default=2)
    tb.add_argument("--dropout", type=float, default=0.3)
    tb.add_argument("--epochs", type=int, default=60)
    tb.add_argument("--batch-size", type=int, default=128)
    tb.add_argument("--lr", type=float, default=1e-3)
    tb.add_argument("--patience", type=int, default=5)
    tb.add_argument("--valid-limit", type=int, default=4000, help="validation users (a seeded random sample)")
    add_device_args(tb)
    tb.set_defaults(func=run)


def run(a: argparse.Namespace) -> int:
    import time

    from ..bundle import Bundle, round_to_half
    from ..data.open import open_dataset
    from ..data.splits import make_split, temporal
    from ..models.sasrec import SASRecConfig
    from ..train.baseline import train_sasrec
    from ..train.device import scale_batch
    from ..train.drafters import DrafterTrainConfig

    device = training_device(a)
    batch_size, lr, _ = scale_batch(a.batch_size, a.lr, a.batch_scale)
    bundle = Bundle.load(a.bundle)
    ds = open_dataset(a.data or bundle.data_path)
    if ds.catalogue.ids != bundle.catalogue.ids:
        raise SystemExit("the dataset does not have the bundle's catalogue")
    h = bundle.cfg.max_history
    split = (temporal(ds, h, cutoff=int(bundle.meta["cutoff"])) if bundle.meta.get("protocol") == "temporal"
             else make_split(ds, bundle.meta.get("protocol", "loo"), h))
    t0 = time.time()
    cfg = SASRecConfig(n_items=len(bundle.catalogue), d_model=a.d_model, n_layers=a.layers, n_heads=a.heads,
                       d_ff=4 * a.d_model, dropout=a.dropout, max_history=h)
    tcfg = DrafterTrainConfig(epochs=a.epochs, batch_size=batch_size, lr=lr, patience=a.patience,
                              valid_limit=a.valid_limit, device=device)
    model, rep = train_sasrec(split, [s.items for s in ds.sequences], len(bundle.catalogue), cfg, tcfg)
    bundle.sasrec = round_to_half(model)
    bundle.meta.setdefault("baselines", {})["sasrec"] = {**rep, "minutes": round((time.time() - t0) / 60, 1),
                                                         "batch_size": batch_size, "lr": lr}
    bundle.save(a.out or a.bundle)
    print(f"SASRec trained in {(time.time() - t0) / 60:.1f} min (best valid NDCG@10 {rep['best_valid_ndcg@10']:.4f}); "
          f"evaluate with: specrec eval --bundle {a.out or a.bundle} --ranker sasrec")
    return 0
