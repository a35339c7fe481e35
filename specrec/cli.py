"""The ``specrec`` command line.

    specrec train   --data DIR --protocol loo --out runs/beauty-loo
    specrec eval    --bundle runs/beauty-loo/bundle --limit 2000
    specrec sids    --data DIR
    specrec export-onnx --bundle DIR [--out DIR]
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
    g.add_argument("--causal-encoder", action="store_true",
                   help="causal encoder, trained on whole sequences at once (several times cheaper per epoch)")
    g.add_argument("--tie-output", action="store_true", help="tie output layers to the code embeddings (T5-style)")
    g.add_argument("--label-smoothing", type=float, default=0.0)
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
    g.add_argument("--valid-limit", type=int, default=4000,
                   help="validation users, a seeded random sample (0 = all)")
    g.add_argument(
        "--valid-every", type=int, default=1, help="epochs between validations (the last is always validated)"
    )
    g.add_argument(
        "--ema",
        type=float,
        default=0.0,
        help="decay of a moving average of the weights, e.g. 0.999 (0 = off); the better of raw and EMA is kept",
    )
    g.add_argument("--workers", type=int, default=1,
                   help="data-parallel training processes (2 on a 2-core CPU: about 1.6x the throughput of one)")
    g.add_argument("--threads", type=int, default=None, help="torch threads in all (default: every core)")
    g.add_argument(
        "--window-stride",
        type=int,
        default=None,
        help="causal encoder: a training chunk every this many targets, overlapping, so each target keeps at "
        "least max_history - stride + 1 items of context (default: max_history, no overlap)",
    )
    g.add_argument("--budget-minutes", type=float, default=None,
                   help="plan the epochs (at most --epochs) and the cosine decay to fill this much training time, "
                        "from the first epoch's measured cost")
    g.add_argument("--curve-limit", type=int, default=0,
                   help="test users (a seeded random sample) scored at each validation for the learning curve; "
                        "never used to choose a checkpoint")
    g.add_argument(
        "--bf16",
        action="store_true",
        help="bfloat16 autocast for training matmuls (only on CPUs with AMX/AVX-512 BF16; 10x slower without)",
    )
    g.add_argument("--init-from", metavar="BUNDLE", help="start from this bundle's GR weights (same model config)")
    g.add_argument("--teacher", metavar="BUNDLE",
                   help="a bundle whose SASRec gives soft targets on each SID level (with --distill-weight)")
    g.add_argument("--distill-weight", type=float, default=0.0, help="the soft targets' share of the loss (0 = off)")
    g.add_argument("--distill-temp", type=float, default=1.0, help="the teacher's softmax temperature")
    g.add_argument("--seed", type=int, default=0)


def cmd_train(a: argparse.Namespace) -> int:
    from .models.tiger import TigerConfig
    from .pipeline import build
    from .train.trainer import TrainConfig

    mcfg = TigerConfig(
        level_sizes=[a.codebook_size] * a.levels + [a.collision_size], d_model=a.d_model, n_heads=a.heads,
        d_kv=a.d_kv, d_ff=a.d_ff, n_enc_layers=a.enc_layers, n_dec_layers=a.dec_layers, dropout=a.dropout,
        max_history=a.max_history, encoder_input=a.encoder_input, causal_encoder=a.causal_encoder,
        tie_output=a.tie_output, label_smoothing=a.label_smoothing,
    )
    tcfg = TrainConfig(epochs=a.epochs, batch_size=a.batch_size, lr=a.lr, weight_decay=a.weight_decay,
                       warmup_steps=a.warmup_steps, patience=a.patience, valid_limit=a.valid_limit or None, seed=a.seed,
                       bf16=a.bf16, ema=a.ema, valid_every=a.valid_every, workers=a.workers, threads=a.threads,
                       window_stride=a.window_stride, budget_minutes=a.budget_minutes, curve_limit=a.curve_limit,
                       init_from=a.init_from, teacher=a.teacher, distill_weight=a.distill_weight,
                       distill_temp=a.distill_temp)
    build(a.data, a.out, a.protocol, mcfg, tcfg, quantile=a.quantile, seed=a.seed, resume=not a.no_resume,
          sids_from=a.sids_from)
    return 0


def _load_eval_split(bundle, data: str | None, protocol: str | None):
    return _load_eval_data(bundle, data, protocol)[1]


def _load_eval_data(bundle, data: str | None, protocol: str | None):
    """The dataset a bundle was trained on (or ``data``) and its split under ``protocol`` (default: the bundle's)."""
    from .bundle import bundle_split

    return bundle_split(bundle, data, protocol)


def _backend(bundle, a: argparse.Namespace):
    """The hot-path backend an eval asked for (--backend, --device, --ort-threads)."""
    name = a.backend or "onnx"
    if name == "eager":
        return bundle.backend("eager", device=a.device)
    if a.device != "cpu":
        raise SystemExit(
            "--device applies to --backend eager (ONNX Runtime picks CUDA itself when onnxruntime-gpu finds a GPU)"
        )
    kw = {"drafter_bits": None} if getattr(a, "float_drafter", False) else {}
    return bundle.backend(name, threads=a.ort_threads, **kw)


def _policy_params(items: list[str]) -> dict[str, dict]:
    """--set specgr.gamma=-1.2 --set strict.n_drafts=20 -> {"specgr": {"gamma": -1.2}, ...}"""
    out: dict[str, dict] = {}
    for it in items or []:
        key, _, val = it.partition("=")
        pol, _, field = key.partition(".")
        if not field or not _:
            raise SystemExit(f"--set expects POLICY.FIELD=VALUE, got {it!r}")
        out.setdefault(pol, {})[field] = json.loads(val) if val[:1] in "-0123456789[{tfn" else val
    return out


def cmd_eval(a: argparse.Namespace) -> int:
    import torch

    from .bundle import Bundle
    from .data.splits import sample_examples

    torch.set_num_threads(a.threads)
    bundle = Bundle.load(a.bundle)
    ds, split = _load_eval_data(bundle, a.data, a.protocol)
    ex = getattr(split, a.split)
    if a.sample is not None and a.limit is not None:
        raise SystemExit("--sample and --limit are exclusive: a seeded random sample, or the first N users")
    ex = sample_examples(ex, a.sample, a.seed) if a.sample is not None else ex.head(a.limit)
    # with --exclude-history: each user's whole history before the target, never recommended
    exclude = ex.full_histories(ds.sequences) if a.exclude_history else None
    if a.policies:
        return _eval_policies(a, bundle, split, ex, exclude)
    from .eval.evaluate import beam_ranker, run_ranker, sasrec_ranker, summarise
    from .eval.results import markdown_table, update_summary, write_json

    ks = sorted({int(k) for k in a.ks.split(",")})
    width = a.width or max(ks)
    ranker = beam_ranker(bundle, width, _backend(bundle, a)) if a.ranker == "beam" else sasrec_ranker(bundle)
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
            keys[f"{ds_name}.model.params"] = bundle.model.n_params()
        update_summary(keys, Path(a.results_dir) / "summary.json")
    return 0


def _eval_policies(a: argparse.Namespace, bundle, split, ex, exclude=None) -> int:
    """Side-by-side comparison of policies on the same requests (interleaved, batch 1)."""
    from .eval.compare import compare_policies, comparison_table, plot_stages, summary_keys
    from .eval.results import markdown_table, update_summary, write_json
    from .policies import make_policy

    names = [p.strip() for p in a.policies.split(",") if p.strip()]
    if "beam" not in names:
        names = ["beam", *names]
    params = _policy_params(a.set)
    kind = bundle.default_drafter() if a.drafter == "default" else a.drafter
    shares = ({"text_share": a.text_share, "unseen_share": a.unseen_share} if kind == "retrieval"
              else {"unseen_share": a.unseen_share} if kind == "sasrec" else {})
    engine = bundle.engine(drafter=kind, backend=_backend(bundle, a), **shares)
    policies = {n: make_policy(n, engine, **params.get(n, {})) for n in names}
    engine.verifier.backend.warmup(engine.itemset.trie, (a.k,), scored=bundle.scored_counts((a.k,)))  # none timed
    if a.compare_eager:
        policies["beam@eager"] = make_policy("beam", bundle.engine(drafter=None, backend=bundle.backend("eager")))
    k = a.k
    ks = sorted({10, 50, k} & set(range(1, k + 1))) or [k]
    runs = compare_policies(policies, ex, k, progress=not a.json, exclude=exclude)
    table, rows = comparison_table(runs, ex, split, ks, engine.metrics.snapshot())
    ds_name = bundle.meta.get("dataset", bundle.name)
    backend = engine.verifier.backend.describe()
    out = {"k": k, "n": len(ex), "protocol": split.protocol, "drafter": kind, "threads": a.threads,
           "ort_threads": a.ort_threads,
           "sample": a.sample, "seed": a.seed, "backend": backend, "exclude_history": exclude is not None,
           "drafter_shares": {k_: getattr(engine.drafter, k_, None) for k_ in ("text_share", "unseen_share")},
           "params": {n: p.config.model_dump() for n, p in policies.items()},
           "policies": {n: r.as_dict() for n, r in table.items()}}
    cols = ["policy", *[f"recall@{x}" for x in ks], *[f"ndcg@{x}" for x in ks]]
    if split.protocol == "temporal":
        cols += [f"unseen_recall@{max(ks)}", f"in_sample_recall@{max(ks)}"]
    cols += ["p50_ms", "p99_ms", "speedup", "equal_to_beam", "item_accept", "token_accept", "no_fallback"]
    if a.json:
        print(json.dumps(out, indent=2, default=str))
    else:
        from rich.console import Console
        from rich.markdown import Markdown

        Console().print(Markdown(markdown_table(rows, cols)))
    if a.save:
        tag = "_excl" if exclude is not None else ""  # never mixed with the TIGER-protocol figures
        # drafter shares other than the bundle's are an experiment: files and keys of their own
        tag += "".join(f"_{n}{v:g}" for n, v in (("text", a.text_share), ("unseen", a.unseen_share)) if v is not None)
        name = f"{ds_name}_{split.protocol}_policies_k{k}{tag}"
        results = Path(a.results_dir)
        write_json(name, out, results)
        users = (f"a random sample of {len(ex)} {a.split} users (seed {a.seed})" if a.sample is not None
                 else f"{len(ex)} {a.split} users")
        md = (f"# {name}\n\nCommand: `{' '.join(['specrec', *sys.argv[1:]])}`\n\n"
              f"{users}, K = {k}, batch 1, interleaved (order rotated per request), {a.threads} torch / "
              f"{a.ort_threads} ONNX Runtime threads, backend {backend}, drafter `{kind}`. "
              f"speedup = beam's mean time / the policy's; item_accept / token_accept: accepted / drafted items and "
              f"SID tokens; no_fallback: share of requests a level-wise policy served with no fallback pass.\n\n"
              + markdown_table(rows, cols) + f"\n![stage times]({name}_stages.png)\n")
        (results / f"{name}.md").write_text(md)
        plot_stages(table, results / f"{name}_stages.png",
                    f"{ds_name} {split.protocol}, K={k}: mean time per request by stage ({len(ex)} requests)")
        keys = summary_keys(table, ds_name, split.protocol, k, tag.replace("_", "."))
        if keys:  # frontier_coverage averaged in the target's own levels: drafted_level_coverage replaces it
            retire = tuple(x.replace(".drafted_level_coverage", ".frontier_coverage") for x in keys
                           if x.endswith(".drafted_level_coverage"))
            update_summary(keys, results / "summary.json", retire=retire)
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


def cmd_train_drafters(a: argparse.Namespace) -> int:
    from .bundle import Bundle
    from .pipeline import train_drafters

    bundle = Bundle.load(a.bundle)
    which = tuple(w.strip() for w in a.which.split(","))
    from .train.align import AlignConfig

    epochs = {"retrieval": a.retrieval_epochs, "self": a.self_epochs, "nezha": a.nezha_epochs}
    align = AlignConfig(mode=a.align, alpha=a.align_alpha, top_k=a.align_top_k, examples=a.align_examples)
    from .train.distill import DistillConfig

    distill = DistillConfig(examples=a.distill_examples, epochs=a.distill_epochs, width=a.distill_width)
    train_drafters(bundle, a.out or a.bundle, which, a.data, epochs, align=align, distill=distill)
    return 0


def cmd_train_baseline(a: argparse.Namespace) -> int:
    import time

    from .bundle import Bundle, round_to_half
    from .data.open import open_dataset
    from .data.splits import make_split, temporal
    from .models.sasrec import SASRecConfig
    from .train.baseline import train_sasrec
    from .train.drafters import DrafterTrainConfig

    bundle = Bundle.load(a.bundle)
    ds = open_dataset(a.data or bundle.meta.get("data_path"))
    if ds.catalogue.ids != bundle.catalogue.ids:
        raise SystemExit("the dataset does not have the bundle's catalogue")
    h = bundle.cfg.max_history
    split = (temporal(ds, h, cutoff=int(bundle.meta["cutoff"])) if bundle.meta.get("protocol") == "temporal"
             else make_split(ds, bundle.meta.get("protocol", "loo"), h))
    t0 = time.time()
    cfg = SASRecConfig(n_items=len(bundle.catalogue), d_model=a.d_model, n_layers=a.layers, n_heads=a.heads,
                       d_ff=4 * a.d_model, dropout=a.dropout, max_history=h)
    tcfg = DrafterTrainConfig(
        epochs=a.epochs, batch_size=a.batch_size, lr=a.lr, patience=a.patience, valid_limit=a.valid_limit
    )
    model, rep = train_sasrec(split, [s.items for s in ds.sequences], len(bundle.catalogue), cfg, tcfg)
    bundle.sasrec = round_to_half(model)
    bundle.meta.setdefault("baselines", {})["sasrec"] = {**rep, "minutes": round((time.time() - t0) / 60, 1)}
    bundle.save(a.out or a.bundle)
    print(f"SASRec trained in {(time.time() - t0) / 60:.1f} min (best valid NDCG@10 {rep['best_valid_ndcg@10']:.4f}); "
          f"evaluate with: specrec eval --bundle {a.out or a.bundle} --ranker sasrec")
    return 0


def cmd_tune_fusion(a: argparse.Namespace) -> int:
    from .train.fusion import tune_fusion

    drafts = tuple(int(x) for x in a.drafts.split(",") if x.strip())
    fusion, entry = tune_fusion(a.bundle, a.users, a.seed, drafts, tolerance=a.tolerance)
    lists = ", ".join(f"{n} {v['recall@10']:.4f}" for n, v in entry["valid"].items())
    print(f"fusion: GR weight {fusion.weight:g}, {fusion.norm} scores, {fusion.drafts} SASRec candidates "
          f"({entry['chosen_on']}); validation R@10 of the lists: {lists}; written into {a.bundle}/bundle.json")
    return 0


def cmd_sids(a: argparse.Namespace) -> int:
    from .data.open import open_dataset
    from .data.splits import make_split
    from .pipeline import fit_semantic_ids

    ds = open_dataset(a.data)
    split = make_split(ds, a.protocol)
    _, _, report = fit_semantic_ids(ds, split, seed=a.seed, n_levels=a.levels, codebook_size=a.codebook_size,
                                    collision_size=a.collision_size)
    print(json.dumps(report, indent=2))
    return 0


def cmd_export(a: argparse.Namespace) -> int:
    """Build every graph the verifier loads (the hot path's functions and the whole searches of each K, batch-1
    and dynamic) into ``--out`` (default: the bundle's ``onnx/``, which the backend then loads instead of
    exporting at start), their weights in one shared file; choose the precision of the scoring pass and of
    nezha's graphs on this machine, checked on validation users (:mod:`specrec.backends.precision`); and check
    one beam search against eager PyTorch."""
    import time

    import torch

    from .backends import Backend
    from .backends.onnx import OrtBackend
    from .backends.precision import choose_precisions, describe_record
    from .backends.weights import dir_mb
    from .bundle import Bundle
    from .decoding.beam import beam_search

    t0 = time.perf_counter()
    bundle = Bundle.load(a.bundle)
    out = Path(a.out) if a.out else Path(a.bundle) / "onnx"
    ks = [int(x) for x in a.k.split(",") if x.strip()]
    scored = bundle.scored_counts(ks)
    fp32 = OrtBackend(bundle.model, bundle.nezha_head, onnx_dir=out, drafter=bundle.sid_mlp, threads=a.threads,
                      precision="float32")
    fp32.warmup(bundle.trie, ks, scored=scored)
    t1 = time.perf_counter()
    record = choose_precisions(bundle, fp32, users=a.precision_users, seed=a.precision_seed, forced=a.precisions)
    t2 = time.perf_counter()
    ort_be = OrtBackend(bundle.model, bundle.nezha_head, onnx_dir=out, drafter=bundle.sid_mlp, threads=a.threads)
    ort_be.warmup(bundle.trie, ks, scored=scored)  # the chosen precisions' graphs of every width
    ref = Backend(bundle.model, bundle.nezha_head)
    hist = bundle.history_sids([bundle.sids_t.new_tensor([0, 1, 2]).numpy()])
    with torch.inference_mode():
        eager_beams = beam_search(ref, ref.encode(hist), bundle.trie, 10)
        onnx_beams = ort_be.beam(ort_be.encode(hist), bundle.trie, 10)
    assert onnx_beams is not None
    diff = float((eager_beams.scores - onnx_beams.scores).nan_to_num(0, 0, 0).abs().max())
    n = len({p.name.removesuffix(".onnx").removesuffix(".ext") for p in out.glob("*.onnx")})
    same = bool(torch.equal(eager_beams.codes, onnx_beams.codes))
    for line in describe_record(record):
        print(line)
    print(f"built {n} graphs for K = {ks} in {out} ({dir_mb(out):.0f} MB) in {time.perf_counter() - t0:.0f} s "
          f"(graphs {t1 - t0:.0f} s, precision {t2 - t1:.0f} s; providers {ort_be.providers}); beam search max "
          f"|eager - onnx| = {diff:.2e}, same beams: {same}")
    return 0


def cmd_synth(a: argparse.Namespace) -> int:
    from .data.synthetic import synthetic_dataset

    ds = synthetic_dataset(n_items=a.items, n_users=a.users, seed=a.seed)
    ds.to_dir(a.out)
    print(f"wrote {ds.n_items} items and {len(ds.sequences)} sequences to {a.out}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="specrec", description="SpecRec: speculative decoding for generative recommendation."
    )
    sub = p.add_subparsers(dest="cmd", required=True, metavar="COMMAND")

    t = sub.add_parser("train", help="fit semantic IDs and train the GR model; writes OUT/bundle",
                       description="Embed item texts (all-MiniLM-L6-v2), fit RQ-KMeans semantic IDs, split the data "
                       "by PROTOCOL and train the encoder-decoder GR model with early stopping on validation "
                       "NDCG@10. Re-running with the same --out resumes from OUT/checkpoint.pt.")
    t.add_argument(
        "--data", default="synthetic", help="dataset directory (items.jsonl[.gz], sequences.jsonl[.gz]) or 'synthetic'"
    )
    t.add_argument("--protocol", choices=["loo", "temporal"], default="loo")
    t.add_argument("--quantile", type=float, default=0.8, help="temporal cut-off as a quantile of interaction times")
    t.add_argument("--out", required=True, help="run directory (checkpoints, logs, bundle/)")
    t.add_argument("--no-resume", action="store_true", help="ignore an existing checkpoint in --out")
    t.add_argument("--sids-from", default=None, metavar="BUNDLE",
                   help="reuse this bundle's semantic IDs (and text embeddings) instead of fitting new ones")
    _add_model_args(t)
    _add_train_args(t)
    t.set_defaults(func=cmd_train)

    e = sub.add_parser("eval", help="Recall/NDCG@K and latency of beam search on a bundle",
                       description="Evaluate a trained bundle on the test (or validation) split of its protocol: "
                       "Recall@K and NDCG@K, per-request latency p50/p99; under the temporal protocol also for "
                       "in-sample and unseen targets.")
    e.add_argument("--bundle", required=True)
    e.add_argument("--ranker", choices=["beam", "sasrec"], default="beam",
                   help="the GR model's beam search, or the bundle's SASRec baseline (specrec train-baseline)")
    e.add_argument("--backend", choices=["onnx", "eager"], help="hot-path backend (default: onnx)")
    e.add_argument("--device", default="cpu", help="device of the eager backend (e.g. cuda)")
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
                   help="also run beam search on the eager (reference) backend: speedup_vs_eager of the default beam")
    g.add_argument("--set", action="append", metavar="POLICY.FIELD=VALUE",
                   help="policy parameter, e.g. --set specgr.gamma=-1.2 (repeatable)")
    e.set_defaults(func=cmd_eval)

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
    d.set_defaults(func=cmd_train_drafters)

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
    tb.set_defaults(func=cmd_train_baseline)

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
    tf.set_defaults(func=cmd_tune_fusion)

    s = sub.add_parser("sids", help="fit semantic IDs on a dataset and report codebook usage and collisions")
    s.add_argument("--data", default="synthetic")
    s.add_argument("--protocol", choices=["loo", "temporal"], default="loo")
    s.add_argument("--levels", type=int, default=3)
    s.add_argument("--codebook-size", type=int, default=256)
    s.add_argument("--collision-size", type=int, default=256)
    s.add_argument("--seed", type=int, default=0)
    s.set_defaults(func=cmd_sids)

    x = sub.add_parser("export-onnx", help="build every ONNX graph the verifier loads (once, beside the bundle) "
                       "and check it against eager PyTorch")
    x.add_argument("--bundle", required=True)
    x.add_argument("--out", default=None, help="where (default: BUNDLE/onnx, which the verifier then loads)")
    x.add_argument("--k", default="10,50", help="list lengths K whose search graphs to build (the verifier's warmup_k)")
    x.add_argument("--threads", type=int, default=1, help="intra-op threads while building and timing (the "
                   "verifier's: 1)")
    x.add_argument("--precisions", default=None, help="the precisions to try for the scoring pass and nezha's "
                   "graphs, comma-separated (float32, int8, int8_nbits, bf16; default: $SPECREC_PRECISIONS, else "
                   "every one this CPU runs; 'float32' keeps every graph float32)")
    x.add_argument("--precision-users", type=int, default=2000, help="validation users a precision is checked on")
    x.add_argument("--precision-seed", type=int, default=0, help="seed of that sample")
    x.set_defaults(func=cmd_export)

    y = sub.add_parser("synth", help="write a synthetic catalogue in the dataset format")
    y.add_argument("--out", required=True)
    y.add_argument("--items", type=int, default=600)
    y.add_argument("--users", type=int, default=800)
    y.add_argument("--seed", type=int, default=0)
    y.set_defaults(func=cmd_synth)

    try:  # serving subcommands (stack, recommend) when the serving code is installed
        from specrec_rpc.cli import register
    except ImportError:
        pass
    else:
        register(sub)
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
