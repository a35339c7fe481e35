"""``specrec train``: fit semantic IDs and train the GR model of a run directory (:func:`specrec.pipeline.build`)."""

from __future__ import annotations

import argparse

from .options import add_model_args, add_train_args, training_device


def add_parser(sub: argparse._SubParsersAction) -> None:
    t = sub.add_parser("train", help="fit semantic IDs and train the GR model; writes OUT/bundle",
                       description="Embed item texts (all-MiniLM-L6-v2), fit RQ-KMeans semantic IDs, split the data "
                       "by PROTOCOL and train the encoder-decoder GR model with early stopping on validation "
                       "NDCG@10. Re-running with the same --out resumes from OUT/checkpoint.pt, on either --device.")
    t.add_argument(
        "--data", default="synthetic", help="dataset directory (items.jsonl[.gz], sequences.jsonl[.gz]) or 'synthetic'"
    )
    t.add_argument("--protocol", choices=["loo", "temporal"], default="loo")
    t.add_argument("--quantile", type=float, default=0.8, help="temporal cut-off as a quantile of interaction times")
    t.add_argument("--out", required=True, help="run directory (checkpoints, logs, bundle/)")
    t.add_argument("--no-resume", action="store_true", help="ignore an existing checkpoint in --out")
    t.add_argument("--sids-from", default=None, metavar="BUNDLE",
                   help="reuse this bundle's semantic IDs (and text embeddings) instead of fitting new ones")
    t.add_argument("--sid-source", choices=["auto", "text", "sasrec"], default="auto",
                   help="what the semantic IDs quantise: the items' texts (all-MiniLM-L6-v2), or the item "
                   "embeddings a SASRec learns from the training interactions (for data without item texts); auto "
                   "(default): the texts where at least half the items have one, else SASRec's")
    t.add_argument("--sid-sasrec-epochs", type=int, default=20,
                   help="with the sasrec source: the most epochs of the SASRec whose item embeddings are quantised "
                   "(its best by validation NDCG@10 is kept)")
    add_model_args(t)
    add_train_args(t)
    t.set_defaults(func=run)


#: checkpoint interval on a GPU, where an epoch takes seconds (a run there may be cut at 10 minutes)
GPU_CHECKPOINT_MINUTES = 2.0


def run(a: argparse.Namespace) -> int:
    from ..models.tiger import TigerConfig
    from ..pipeline import build
    from ..train.device import scale_batch
    from ..train.trainer import TrainConfig

    device = training_device(a)
    gpu = device.startswith("cuda")
    if gpu and a.workers > 1:
        raise SystemExit("--workers is the CPU's data-parallel path: on a GPU one process trains (--batch-scale)")
    batch_size, lr, warmup_steps = scale_batch(a.batch_size, a.lr, a.batch_scale, a.warmup_steps)
    every = a.checkpoint_minutes if a.checkpoint_minutes is not None else (GPU_CHECKPOINT_MINUTES if gpu else None)
    mcfg = TigerConfig(
        level_sizes=[a.codebook_size] * a.levels + [a.collision_size], d_model=a.d_model, n_heads=a.heads,
        d_kv=a.d_kv, d_ff=a.d_ff, n_enc_layers=a.enc_layers, n_dec_layers=a.dec_layers, dropout=a.dropout,
        max_history=a.max_history, encoder_input=a.encoder_input, causal_encoder=a.causal_encoder,
        tie_output=a.tie_output, label_smoothing=a.label_smoothing,
    )
    tcfg = TrainConfig(epochs=a.epochs, batch_size=batch_size, lr=lr, weight_decay=a.weight_decay,
                       warmup_steps=warmup_steps or a.warmup_steps, patience=a.patience,
                       valid_limit=a.valid_limit or None, seed=a.seed, bf16=gpu if a.bf16 is None else a.bf16,
                       ema=a.ema, valid_every=a.valid_every, workers=a.workers, threads=a.threads,
                       window_stride=a.window_stride, history_dropout=a.history_dropout,
                       budget_minutes=a.budget_minutes, curve_limit=a.curve_limit,
                       init_from=a.init_from, teacher=a.teacher, distill_weight=a.distill_weight,
                       distill_temp=a.distill_temp, device=device, batch_scale=a.batch_scale,
                       checkpoint_minutes=every, checkpoint_part_mib=a.checkpoint_part_mib)
    build(a.data, a.out, a.protocol, mcfg, tcfg, quantile=a.quantile, seed=a.seed, resume=not a.no_resume,
          sids_from=a.sids_from, sid_source=a.sid_source, sid_sasrec_epochs=a.sid_sasrec_epochs)
    return 0
