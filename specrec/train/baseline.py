"""Training the SASRec baseline on a bundle's own split (see :mod:`specrec.models.sasrec`).

Every training sequence (a user's items up to their last training target,
the last ``max_history``) predicts the next item at every position; full
softmax over the catalogue; AdamW; the best epoch by validation NDCG@10 on a
seeded sample of validation users is kept (early stopping). On
``tcfg.device`` (:mod:`specrec.train.device`): the model, the sequences and
validation there; the model comes back on the CPU.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch

from ..data.splits import PAD, Split, sample_examples
from ..eval.metrics import ndcg_at_k, target_ranks
from ..models.sasrec import SASRec, SASRecConfig
from .device import resolve_device, to_device
from .drafters import DrafterTrainConfig, train_loop, user_sequences


def train_sasrec(split: Split, sequences: list[np.ndarray], n_items: int, cfg: SASRecConfig | None = None,
                 tcfg: DrafterTrainConfig | None = None, log: Callable[[str], None] = print,
                 progress: bool = True, init: SASRec | None = None) -> tuple[SASRec, dict]:
    """``init``: start from these weights (a refit's continued training) instead of fresh ones. A split with no
    validation examples (:func:`specrec.data.splits.refit_split`) trains ``tcfg.epochs`` and keeps the last."""
    cfg = cfg or (init.cfg if init is not None else SASRecConfig(n_items=n_items, max_history=split.max_history))
    tcfg = tcfg or DrafterTrainConfig(epochs=60, batch_size=128, lr=1e-3, patience=5, weight_decay=0.0)
    dev = resolve_device(tcfg.device)
    torch.manual_seed(tcfg.seed)
    model = SASRec(cfg)
    if init is not None:
        model.load_state_dict(init.state_dict())
    model = model.to(dev)
    H = cfg.max_history
    seqs = [s for s in (sequences[u][: p + 1][-(H + 1):] for u, p in user_sequences(split)) if len(s) >= 2]
    inp = np.full((len(seqs), H), PAD, dtype=np.int64)
    tgt = np.full((len(seqs), H), PAD, dtype=np.int64)
    for i, s in enumerate(seqs):
        inp[i, H - (len(s) - 1):] = s[:-1]
        tgt[i, H - (len(s) - 1):] = s[1:]
    lengths = (inp != PAD).sum(1)
    inp_t, tgt_t = to_device(inp, dev), to_device(tgt, dev)  # once: a step sends only its rows' indices
    valid = sample_examples(split.valid, tcfg.valid_limit, tcfg.seed)
    valid_hist = to_device(valid.history, dev)
    log(f"sasrec: {len(seqs)} training sequences, {n_items} items, d={cfg.d_model}, {cfg.n_layers} layers, on {dev}")

    def step(idx):
        model.train()
        t = int(lengths[idx].max())
        rows = to_device(idx, dev)
        return model.loss(inp_t[rows][:, H - t:], tgt_t[rows][:, H - t:])

    def validate():
        top = model.rank(valid_hist, 10)
        return ndcg_at_k(target_ranks(top.cpu().numpy(), valid.target), 10)

    best, state, hist = train_loop(
        list(model.parameters()),
        tcfg,
        len(seqs),
        lengths,
        step,
        validate if len(valid) else None,
        "sasrec",
        log,
        progress,
        lambda: {k: v.clone() for k, v in model.state_dict().items()},
    )
    model.load_state_dict(state)
    return model.cpu().eval(), {"best_valid_ndcg@10": best, "epochs": hist, "device": str(dev)}
