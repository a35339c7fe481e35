"""``specrec eval``: Recall/NDCG@K and latency of a bundle's beam search (or its SASRec baseline) on the test or
validation split of its protocol; with ``--policies``, the side-by-side comparison of
:mod:`specrec.commands.eval_policies`.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from .eval_policies import run_policies
from .options import hot_path_backend

DEFAULT_RESULTS = Path(__file__).resolve().parents[2] / "bench" / "results"


def add_parser(sub: argparse._SubParsersAction) -> None:
    e = sub.add_parser("eval", help="Recall/NDCG@K and latency of beam search on a bundle",
                       description="Evaluate a trained bundle on the test (or validation) split of its protocol: "
                       "Recall@K and NDCG@K, per-request latency p50/p99; under the temporal protocol also for "
                       "in-sample and unseen targets.")
    e.add_argument("--bundle", required=True)
    e.add_argument("--ranker", choices=["beam", "sasrec"], default="beam",
                   help="the GR model's beam search, or the bundle's SASRec baseline (specrec train-baseline)")
    e.add_argument("--backend", choices=["onnx", "eager", "cuda"],
                   help="hot-path backend: ONNX Runtime (default), eager PyTorch (the reference), or cuda (the "
                   "searches captured as CUDA graphs)")
    e.add_argument("--device", help="device of the eager and cuda backends (default: cuda for --backend cuda, "
                   "else cpu; cuda:1 for another GPU; cpu with --backend cuda runs its stand-in, uncaptured)")
    e.add_argument("--batch-sizes", type=lambda v: tuple(int(x) for x in v.split(",")),
                   help="--backend cuda: the row buckets whose graphs it captures (default 1,2,4,8,16,32,64)")
    e.add_argument("--data", help="dataset directory (default: the one the bundle was trained on)")
    e.add_argument("--protocol", choices=["loo", "temporal"], help="default: the bundle's")
    e.add_argument("--split", choices=["test", "valid"], default="test")
    e.add_argument("--ks", default="5,10,50", help="comma-separated cut-offs")
    e.add_argument("--width", type=int, help="beam width (default: the largest K)")
    e.add_argument("--sample", type=int, help="evaluate a seeded random sample of N users (see --seed)")
    e.add_argument("--seed", type=int, default=0, help="seed of --sample")
    e.add_argument("--limit", type=int, help="evaluate the first N users only (not typical users: prefer --sample)")
    e.add_argument("--batch-size", type=int, default=1, help="requests per call (1 = per-request latency)")
    e.add_argument("--exclude-history", action="store_true",
                   help="never recommend an item of the user's history (masked inside the trie constraint); "
                        "results get their own keys (...excl...), apart from the TIGER-protocol figures")
    e.add_argument("--threads", type=int, default=2, help="torch intra-op threads (the eager backend's)")
    e.add_argument("--ort-threads", type=int, default=1,
                   help="ONNX Runtime intra-op threads (1: measured best at batch 1, see OrtBackend)")
    e.add_argument("--float-drafter", action="store_true",
                   help="ONNX backend: the distilled drafter's weights in float32 (default on the CPU: 8-bit; the "
                   "target's are float32 either way)")
    e.add_argument("--json", action="store_true", help="print JSON instead of a table")
    e.add_argument("--save", action="store_true", help="write results JSON/markdown and update summary.json")
    e.add_argument("--results-dir", default=str(DEFAULT_RESULTS))
    g = e.add_argument_group("policy comparison (with --policies)")
    g.add_argument("--policies", help="comma-separated policies to compare side by side on the same requests, "
                   "e.g. beam,specgr,nezha,strict,relaxed,sample (beam is always included as the reference)")
    g.add_argument("--k", type=int, default=10, help="list length K")
    g.add_argument("--drafter", choices=["default", "retrieval", "self", "sasrec"], default="default",
                   help="the engine's item drafter (specgr's later rounds, its whole list where it ranks by both "
                   "models with sasrec, and the drafter policy's); default: the bundle's best (sasrec where it has "
                   "one with a fusion, else retrieval)")
    g.add_argument("--text-share", type=float, default=None,
                   help="the retrieval drafter's share of drafts by text similarity among all items (default: the "
                   "bundle's drafters.text_share, else 0)")
    g.add_argument("--unseen-share", type=float, default=None,
                   help="its share of drafts by text similarity among the unseen items (no training interactions; "
                   "default: the bundle's drafters.unseen_share, else 0)")
    g.add_argument("--compare-eager", action="store_true",
                   help="also run beam search on the eager (reference) backend on the same device: speedup_vs_eager "
                   "of the default beam")
    g.add_argument("--set", action="append", metavar="POLICY.FIELD=VALUE",
                   help="policy parameter, e.g. --set specgr.gamma=-1.2 (repeatable)")
    e.set_defaults(func=run)


def run(a: argparse.Namespace) -> int:
    import torch

    from ..bundle import Bundle, bundle_split
    from ..data.splits import sample_examples

    torch.set_num_threads(a.threads)
    bundle = Bundle.load(a.bundle)
    ds, split = bundle_split(bundle, a.data, a.protocol)
    if a.split == "valid" and bundle.meta.get("refit"):
        raise SystemExit(f"{a.bundle}: its models were refit on the validation targets "
                         f"({bundle.meta['refit'].get('summary')}): validation users cannot judge them; their "
                         "figures with the chosen models are in bundle.json (fusion.valid, fusion.default)")
    ex = getattr(split, a.split)
    if a.sample is not None and a.limit is not None:
        raise SystemExit("--sample and --limit are exclusive: a seeded random sample, or the first N users")
    ex = sample_examples(ex, a.sample, a.seed) if a.sample is not None else ex.head(a.limit)
    # with --exclude-history: each user's whole history before the target, never recommended
    exclude = ex.full_histories(ds.sequences) if a.exclude_history else None
    if a.policies:
        return run_policies(a, bundle, split, ex, exclude)
    from ..eval.evaluate import beam_ranker, run_ranker, sasrec_ranker, summarise
    from ..eval.results import update_summary, write_json
    from ..terminal import markdown_table

    ks = sorted({int(k) for k in a.ks.split(",")})
    width = a.width or max(ks)
    ranker = beam_ranker(bundle, width, hot_path_backend(bundle, a)) if a.ranker == "beam" else sasrec_ranker(bundle)
    ranked, secs = run_ranker(ranker, ex, max(ks), a.batch_size, progress=not a.json, desc=a.ranker, exclude=exclude)
    res = summarise(a.ranker, ranked, secs, ex, split, ks)
    res.extra.update(protocol=split.protocol, split=a.split, batch_size=a.batch_size, threads=a.threads,
                     dataset=bundle.meta.get("dataset"), sample=a.sample, seed=a.seed if a.sample else None,
                     exclude_history=bool(a.exclude_history))
    if exclude is not None:
        res.extra["history_items_excluded_mean"] = sum(len(set(h.tolist())) for h in exclude) / max(1, len(exclude))
    if a.ranker == "beam":
        res.extra.update(beam_width=width, backend=a.backend or "onnx")
    out = res.as_dict()
    if a.json:
        print(json.dumps(out, indent=2))
    else:
        _print_table(res, ks)
        if bundle.meta.get("fusion"):
            from ..eval.compare import default_line

            print(default_line(bundle.meta["fusion"].get("default")))
    if a.save:
        ds_name = bundle.meta.get("dataset", bundle.name)
        tag = "_excl" if a.exclude_history else ""  # never mixed with the TIGER-protocol figures
        name = f"{ds_name}_{split.protocol}_{a.ranker}{tag}"
        write_json(name, out, Path(a.results_dir))
        cols = ["group", *[f"recall@{k}" for k in ks], *[f"ndcg@{k}" for k in ks]]
        rows = [{"group": "overall", **res.overall}] + [{"group": g, **m} for g, m in res.groups.items()]
        md = f"# {name}\n\nCommand: `{' '.join(['specrec', *sys.argv[1:]])}`\n\n" + markdown_table(rows, cols)
        md += (
            f"\nLatency per request (batch {a.batch_size}, {a.threads} threads): p50 {res.latency['p50_ms']:.1f} ms, "
            f"p99 {res.latency['p99_ms']:.1f} ms; n = {res.n}\n"
        )
        (Path(a.results_dir) / f"{name}.md").write_text(md)
        pre = f"{ds_name}.{split.protocol}.{a.ranker}{tag.replace('_', '.')}"
        keys = {f"{pre}.{k}": v for k, v in res.overall.items() if k.split("@")[1] in ("5", "10")}
        keys[f"{pre}.users"] = res.n  # the sample these figures are of
        tr = bundle.meta.get("training", {})
        if split.protocol == "loo" and a.ranker == "beam" and a.sample is None and a.limit is None:
            if "train_minutes" in tr:
                keys[f"{ds_name}.train.minutes"] = tr["train_minutes"]
            if "minutes" in bundle.meta.get("build", {}):  # built by specrec build-bundle: every stage
                keys[f"{ds_name}.build.minutes"] = bundle.meta["build"]["minutes"]
            keys[f"{ds_name}.model.params"] = bundle.model.n_params()
        update_summary(keys, Path(a.results_dir) / "summary.json")
    return 0


def _print_table(res, ks) -> None:
    """The figures per group (all of them whole, in a terminal or a pipe: :func:`specrec.terminal.print_table`)."""
    from ..terminal import print_table

    groups = [("overall", res.overall), *res.groups.items()]
    rows = [{"group": g, **{f"R@{k}": m[f"recall@{k}"] for k in ks}, **{f"N@{k}": m[f"ndcg@{k}"] for k in ks}}
            for g, m in groups]
    cols = ["group", *[f"R@{k}" for k in ks], *[f"N@{k}" for k in ks]]
    print_table(rows, cols, title=f"{res.name}: {res.n} requests")
    print(f"latency per request: p50 {res.latency['p50_ms']:.2f} ms  p99 {res.latency['p99_ms']:.2f} ms")
