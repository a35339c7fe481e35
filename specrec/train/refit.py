"""Refit a bundle's models on every interaction but the test ones, once every choice was made on validation
users: the production protocol (``specrec refit``, the build's ``refit`` stage).

Under leave-one-out the models are trained on each user's items up to the third-to-last, every choice (the GR's
epoch, SASRec's, the fusion's weight, the list ``auto`` serves by default) is made on the second-to-last, and the
test target is the last. A test history then ends with the validation target: an interaction the models never
saw, neither as a target nor in a history, while every validation history ends with one they were trained on.
The GR reads its history's last item more than SASRec does, so it loses more from validation to test, and every
choice made on validation overrates it. A served model is trained on everything up to now, and so is the
refit: the validation targets join the training targets (:func:`specrec.data.splits.refit_split`) and the
models are trained again with every choice kept, so that test meets the refit models as validation met the
chosen ones.

Two ways, ``mode``:

- ``retrain``: each model trained again from its initial weights with the run it mirrors (the same options,
  the same number of epochs: the GR's schedule planned for the epochs that run planned, ended at the epoch
  validation chose, with the raw weights or their moving average as it chose; SASRec for the epochs of its best
  validation). As long as the first training.
- ``continue``: each model goes on from its chosen weights for a few epochs (``gr_epochs``, ``sasrec_epochs``)
  at ``lr_scale`` times its learning rate, warm-up then cosine. Minutes.

Validation users cannot judge a refit model (their targets are its training targets): the bundle keeps what
they said of the chosen models (``fusion.valid``, ``fusion.default``), and ``refit`` in ``bundle.json`` says
how the models were refit. The drafters trained on the chosen GR (self-draft, NEZHA head, the distilled drafter)
are kept as they are: they propose, the refit GR verifies.
"""

from __future__ import annotations

import shutil
import time
from collections.abc import Callable
from pathlib import Path
from typing import Literal

import numpy as np

Mode = Literal["retrain", "continue"]


def gr_choice(meta: dict) -> tuple[int, str]:
    """The epoch validation chose for the bundle's GR and which of its weights (``raw`` or ``ema``)."""
    tr = meta.get("training", {})
    best = int(tr.get("best_epoch", tr.get("epochs", 1)))
    row: dict = next((r for r in tr.get("curve", []) if r.get("epoch") == best), {})
    raw, ema = row.get("valid.ndcg@10"), row.get("valid_ema.ndcg@10")
    return max(1, best), ("ema" if ema is not None and raw is not None and ema > raw else "raw")


def sasrec_choice(meta: dict) -> int:
    """The epoch of the SASRec's best validation NDCG@10 (its training's record; 1 when it has none)."""
    epochs = meta.get("baselines", {}).get("sasrec", {}).get("epochs", [])
    scored = [(e["valid"], e["epoch"]) for e in epochs if "valid" in e]
    return max(scored, key=lambda x: (x[0], -x[1]))[1] if scored else 1


def refit(bundle_dir: str | Path, run_dir: str | Path, mode: Mode = "retrain", gr_epochs: int = 2,
          sasrec_epochs: int = 2, lr_scale: float = 0.3, device: str = "cpu", progress: bool = True,
          log: Callable[[str], None] = print, keep_chosen: str | Path | None = None) -> dict:
    """Refit the GR model and the SASRec of the bundle at ``bundle_dir`` on every interaction but the test ones
    (GR checkpoints in ``run_dir``: a re-run goes on from them) and save it in place; ``keep_chosen``: first copy
    the bundle as it is (the chosen models, ONNX graphs apart) there, so that test users can be asked what the
    refit changed (``python -m bench.valid_test``). -> its ``refit`` record."""
    from ..bundle import Bundle, bundle_split, round_to_half
    from ..data.splits import refit_split
    from ..train.baseline import train_sasrec
    from ..train.drafters import DrafterTrainConfig
    from .trainer import TrainConfig, Trainer

    if mode not in ("retrain", "continue"):
        raise ValueError(f"refit mode {mode!r}: 'retrain' or 'continue'")
    t0 = time.time()
    bundle = Bundle.load(bundle_dir)
    if bundle.meta.get("refit"):
        raise SystemExit(f"{bundle_dir}: its models were refit already ({bundle.meta['refit'].get('summary')})")
    if "train" not in bundle.meta:
        raise SystemExit(f"{bundle_dir}: no record of the GR's training (bundle.json `train`) to mirror")
    ds, split = bundle_split(bundle)
    full = refit_split(split)
    if keep_chosen is not None:
        keep = Path(keep_chosen)
        shutil.rmtree(keep, ignore_errors=True)
        bundle.save(keep)  # the chosen models as they are, a bundle of their own (its data path from there)
    log(f"refit ({mode}): {len(split.train)} training targets + {len(split.valid)} validation targets = "
        f"{len(full.train)}; test unchanged ({len(split.test)})")
    orig = TrainConfig(**bundle.meta["train"])
    best_epoch, weights = gr_choice(bundle.meta)
    common = dict(budget_minutes=None, select="last", last_weights=weights, curve_limit=0, device=device,
                  checkpoint_minutes=orig.checkpoint_minutes if device == "cpu" else 2.0)
    if mode == "retrain":
        planned = int(bundle.meta.get("training", {}).get("planned_epochs") or orig.epochs)
        tcfg = orig.model_copy(update={**common, "epochs": planned, "stop_after": best_epoch, "init_from": None})
        what = f"GR trained again for {best_epoch} of {planned} planned epochs, {weights} weights"
    else:
        tcfg = orig.model_copy(update={**common, "epochs": gr_epochs, "stop_after": None, "lr": orig.lr * lr_scale,
                                       "warmup_steps": min(orig.warmup_steps, 100), "init_from": str(bundle_dir)})
        what = f"GR {gr_epochs} more epochs at {lr_scale:g}x its learning rate, {weights} weights"
    run_dir = Path(run_dir)
    trainer = Trainer(bundle.cfg, tcfg, bundle.sids, full.train, full.valid, run_dir, log=log)
    trainer.resume()
    gr_summary = trainer.fit(progress=progress)
    bundle.model.load_state_dict(round_to_half(trainer.model).state_dict())  # in place: the heads hold it
    gr_minutes = round((time.time() - t0) / 60.0, 1)
    record: dict = {"mode": mode, "targets": len(full.train), "added_validation_targets": len(split.valid),
                    "gr": {"epochs": gr_summary["epochs"], "weights": weights, "lr": tcfg.lr,
                           "mirrors_epoch": best_epoch if mode == "retrain" else None, "minutes": gr_minutes,
                           "device": device}}
    if bundle.sasrec is not None:
        t1 = time.time()
        rep = bundle.meta.get("baselines", {}).get("sasrec", {})
        lr, batch = float(rep.get("lr", 1e-3)), int(rep.get("batch_size", 128))
        if mode == "retrain":
            epochs, init, rate = sasrec_choice(bundle.meta), None, lr
        else:
            epochs, init, rate = sasrec_epochs, bundle.sasrec, lr * lr_scale
        model, _ = train_sasrec(full, [s.items for s in ds.sequences], len(bundle.catalogue), bundle.sasrec.cfg,
                                   DrafterTrainConfig(epochs=epochs, batch_size=batch, lr=rate, device=device),
                                   log=log, progress=progress, init=init)
        bundle.sasrec = round_to_half(model)
        record["sasrec"] = {"epochs": epochs, "lr": rate, "minutes": round((time.time() - t1) / 60.0, 1)}
        what += f"; SASRec {'trained again for' if mode == 'retrain' else 'on for'} {epochs} epochs"
    bundle.seen = np.asarray(full.seen, dtype=bool).copy()  # the items the refit models were trained on
    record["minutes"] = round((time.time() - t0) / 60.0, 1)
    record["summary"] = what
    bundle.meta["refit"] = record
    bundle.save(bundle_dir)
    shutil.rmtree(run_dir, ignore_errors=True)  # its weights are in the bundle: the checkpoints go
    log(f"refit: {what} in {record['minutes']} min; written into {bundle_dir}")
    return record
