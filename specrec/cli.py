"""The ``specrec`` command line.

    specrec train   --data DIR --protocol loo --out runs/beauty-loo
    specrec eval    --bundle runs/beauty-loo/bundle --limit 2000
    specrec sids    --data DIR
    specrec export-onnx --bundle DIR --out DIR
    specrec synth   --out DIR

Every subcommand has ``--help``.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

DEFAULT_RESULTS = Path(__file__).resolve().parents[1] / "bench" / "results"


def _add_model_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("model (defaults: TIGER's published size)")
    g.add_argument("--d-model", type=int, default=128)
    g.add_argument("--heads", type=int, default=6)
    g.add_argument("--d-kv", type=int, default=64, help="per-head dimension")
    g.add_argument("--d-ff", type=int, default=1024)
    g.add_argument("--enc-layers", type=int, default=4)
    g.add_argument("--dec-layers", type=int, default=4)
    g.add_argument("--dropout", type=float, default=0.1)
    g.add_argument("--max-history", type=int, default=20, help="items of history fed to the encoder")
    g.add_argument("--encoder-input", choices=["items", "tokens"], default="items",
                   help="one encoder position per item (sum of its code embeddings) or per SID token (TIGER)")
    g.add_argument("--codebook-size", type=int, default=256, help="codes per RQ level")
    g.add_argument("--levels", type=int, default=3, help="RQ levels (the collision digit comes on top)")
    g.add_argument("--collision-size", type=int, default=256, help="largest collision digit + 1")


def _add_train_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("training")
    g.add_argument("--epochs", type=int, default=40)
    g.add_argument("--batch-size", type=int, default=256)
    g.add_argument("--lr", type=float, default=2e-3)
    g.add_argument("--weight-decay", type=float, default=0.05)
    g.add_argument("--warmup-steps", type=int, default=500)
    g.add_argument("--patience", type=int, default=6, help="epochs without a better validation metric before stopping")
    g.add_argument("--valid-limit", type=int, default=4000, help="validation users per epoch (0 = all)")
    g.add_argument("--seed", type=int, default=0)


def cmd_train(a: argparse.Namespace) -> int:
    from .models.tiger import TigerConfig
    from .pipeline import build
    from .train.trainer import TrainConfig

    mcfg = TigerConfig(
        level_sizes=[a.codebook_size] * a.levels + [a.collision_size], d_model=a.d_model, n_heads=a.heads,
        d_kv=a.d_kv, d_ff=a.d_ff, n_enc_layers=a.enc_layers, n_dec_layers=a.dec_layers, dropout=a.dropout,
        max_history=a.max_history, encoder_input=a.encoder_input,
    )
    tcfg = TrainConfig(epochs=a.epochs, batch_size=a.batch_size, lr=a.lr, weight_decay=a.weight_decay,
                       warmup_steps=a.warmup_steps, patience=a.patience, valid_limit=a.valid_limit or None, seed=a.seed)
    build(a.data, a.out, a.protocol, mcfg, tcfg, quantile=a.quantile, seed=a.seed, resume=not a.no_resume)
    return 0


def _load_eval_split(bundle, data: str | None, protocol: str | None):
    from .data.splits import make_split, temporal
    from .pipeline import open_dataset

    data = data or bundle.meta.get("data_path")
    ds = open_dataset(data)
    if ds.catalogue.ids != bundle.catalogue.ids:
        raise SystemExit(f"the dataset at {data} does not have the bundle's catalogue")
    protocol = protocol or bundle.meta.get("protocol", "loo")
    if protocol == "temporal" and bundle.meta.get("cutoff") is not None:
        return temporal(ds, bundle.cfg.max_history, cutoff=int(bundle.meta["cutoff"]))
    return make_split(ds, protocol, bundle.cfg.max_history, bundle.meta.get("quantile") or 0.8)


def cmd_eval(a: argparse.Namespace) -> int:
    import torch

    from .bundle import Bundle
    from .eval.evaluate import beam_ranker, run_ranker, summarise
    from .eval.results import markdown_table, update_summary, write_json

    torch.set_num_threads(a.threads)
    bundle = Bundle.load(a.bundle)
    split = _load_eval_split(bundle, a.data, a.protocol)
    ex = getattr(split, a.split).head(a.limit)
    ks = sorted({int(k) for k in a.ks.split(",")})
    width = a.width or max(ks)
    ranked, secs = run_ranker(beam_ranker(bundle, width), ex, max(ks), a.batch_size, progress=not a.json, desc="beam")
    res = summarise("beam", ranked, secs, ex, split, ks)
    res.extra.update(protocol=split.protocol, split=a.split, beam_width=width, batch_size=a.batch_size,
                     threads=a.threads, dataset=bundle.meta.get("dataset"))
    out = res.as_dict()
    if a.json:
        print(json.dumps(out, indent=2))
    else:
        _print_table(res, ks)
    if a.save:
        name = f"{bundle.meta.get('dataset', bundle.name)}_{split.protocol}_beam"
        write_json(name, out, Path(a.results_dir))
        cols = ["group", *[f"recall@{k}" for k in ks], *[f"ndcg@{k}" for k in ks]]
        rows = [{"group": "overall", **res.overall}] + [{"group": g, **m} for g, m in res.groups.items()]
        md = f"# {name}\n\nCommand: `{' '.join(['specrec', *sys.argv[1:]])}`\n\n" + markdown_table(rows, cols)
        md += f"\nLatency per request (batch {a.batch_size}, {a.threads} threads): p50 {res.latency['p50_ms']:.1f} ms, p99 {res.latency['p99_ms']:.1f} ms; n = {res.n}\n"
        (Path(a.results_dir) / f"{name}.md").write_text(md)
        prefix = f"{bundle.meta.get('dataset', bundle.name)}.{split.protocol}.beam"
        keys = {f"{prefix}.{k}": v for k, v in res.overall.items()}
        tr = bundle.meta.get("training", {})
        if "train_minutes" in tr:
            keys[f"{bundle.meta.get('dataset', bundle.name)}.train.minutes"] = tr["train_minutes"]
        keys[f"{bundle.meta.get('dataset', bundle.name)}.model.params"] = bundle.model.n_params()
        update_summary(keys, Path(a.results_dir) / "summary.json")
    return 0


def _print_table(res, ks) -> None:
    from rich.console import Console
    from rich.table import Table

    t = Table(title=f"{res.name}: {res.n} requests")
    t.add_column("group")
    for k in ks:
        t.add_column(f"R@{k}", justify="right")
    for k in ks:
        t.add_column(f"N@{k}", justify="right")
    groups = [("overall", res.overall), *res.groups.items()]
    for g, m in groups:
        t.add_row(g, *[f"{m[f'recall@{k}']:.4f}" for k in ks], *[f"{m[f'ndcg@{k}']:.4f}" for k in ks])
    c = Console()
    c.print(t)
    c.print(f"latency per request: p50 {res.latency['p50_ms']:.2f} ms  p99 {res.latency['p99_ms']:.2f} ms")


def cmd_sids(a: argparse.Namespace) -> int:
    from .data.splits import make_split
    from .pipeline import fit_semantic_ids, open_dataset

    ds = open_dataset(a.data)
    split = make_split(ds, a.protocol)
    _, _, report = fit_semantic_ids(ds, split, seed=a.seed, n_levels=a.levels, codebook_size=a.codebook_size,
                                    collision_size=a.collision_size)
    print(json.dumps(report, indent=2))
    return 0


def cmd_export(a: argparse.Namespace) -> int:
    import torch

    from .bundle import Bundle
    from .export.onnx import OrtTiger, export_onnx

    bundle = Bundle.load(a.bundle)
    out = export_onnx(bundle.model, a.out)
    ort_model = OrtTiger(out)
    hist = bundle.history_sids([bundle.sids_t.new_tensor([0, 1, 2]).numpy()])
    with torch.inference_mode():
        e1, e2 = bundle.model.encode(hist), ort_model.encode(hist)
        diff = max(float((x - y).abs().max()) for (x, _), (y, _) in zip(e1.cross_kv, e2.cross_kv))
    print(f"exported to {out} (providers {ort_model.providers}); encoder max |torch - ort| = {diff:.2e}")
    return 0


def cmd_synth(a: argparse.Namespace) -> int:
    from .data.synthetic import synthetic_dataset

    ds = synthetic_dataset(n_items=a.items, n_users=a.users, seed=a.seed)
    ds.to_dir(a.out)
    print(f"wrote {ds.n_items} items and {len(ds.sequences)} sequences to {a.out}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="specrec", description="SpecRec: speculative decoding for generative recommendation.")
    sub = p.add_subparsers(dest="cmd", required=True, metavar="COMMAND")

    t = sub.add_parser("train", help="fit semantic IDs and train the GR model; writes OUT/bundle",
                       description="Embed item texts (all-MiniLM-L6-v2), fit RQ-KMeans semantic IDs, split the data "
                       "by PROTOCOL and train the encoder-decoder GR model with early stopping on validation "
                       "NDCG@10. Re-running with the same --out resumes from OUT/checkpoint.pt.")
    t.add_argument("--data", default="synthetic", help="dataset directory (items.jsonl[.gz], sequences.jsonl[.gz]) or 'synthetic'")
    t.add_argument("--protocol", choices=["loo", "temporal"], default="loo")
    t.add_argument("--quantile", type=float, default=0.8, help="temporal cut-off as a quantile of interaction times")
    t.add_argument("--out", required=True, help="run directory (checkpoints, logs, bundle/)")
    t.add_argument("--no-resume", action="store_true", help="ignore an existing checkpoint in --out")
    _add_model_args(t)
    _add_train_args(t)
    t.set_defaults(func=cmd_train)

    e = sub.add_parser("eval", help="Recall/NDCG@K and latency of beam search on a bundle",
                       description="Evaluate a trained bundle on the test (or validation) split of its protocol: "
                       "Recall@K and NDCG@K, per-request latency p50/p99; under the temporal protocol also for "
                       "in-sample and unseen targets.")
    e.add_argument("--bundle", required=True)
    e.add_argument("--data", help="dataset directory (default: the one the bundle was trained on)")
    e.add_argument("--protocol", choices=["loo", "temporal"], help="default: the bundle's")
    e.add_argument("--split", choices=["test", "valid"], default="test")
    e.add_argument("--ks", default="5,10,50", help="comma-separated cut-offs")
    e.add_argument("--width", type=int, help="beam width (default: the largest K)")
    e.add_argument("--limit", type=int, help="evaluate the first N users only")
    e.add_argument("--batch-size", type=int, default=1, help="requests per call (1 = per-request latency)")
    e.add_argument("--threads", type=int, default=2, help="torch intra-op threads")
    e.add_argument("--json", action="store_true", help="print JSON instead of a table")
    e.add_argument("--save", action="store_true", help="write results JSON/markdown and update summary.json")
    e.add_argument("--results-dir", default=str(DEFAULT_RESULTS))
    e.set_defaults(func=cmd_eval)

    s = sub.add_parser("sids", help="fit semantic IDs on a dataset and report codebook usage and collisions")
    s.add_argument("--data", default="synthetic")
    s.add_argument("--protocol", choices=["loo", "temporal"], default="loo")
    s.add_argument("--levels", type=int, default=3)
    s.add_argument("--codebook-size", type=int, default=256)
    s.add_argument("--collision-size", type=int, default=256)
    s.add_argument("--seed", type=int, default=0)
    s.set_defaults(func=cmd_sids)

    x = sub.add_parser("export-onnx", help="export a bundle's model to ONNX (encoder + decoder step) and check it")
    x.add_argument("--bundle", required=True)
    x.add_argument("--out", required=True)
    x.set_defaults(func=cmd_export)

    y = sub.add_parser("synth", help="write a synthetic catalogue in the dataset format")
    y.add_argument("--out", required=True)
    y.add_argument("--items", type=int, default=600)
    y.add_argument("--users", type=int, default=800)
    y.add_argument("--seed", type=int, default=0)
    y.set_defaults(func=cmd_synth)
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
