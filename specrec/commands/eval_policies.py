"""``specrec eval --policies``: policies side by side on the same requests (interleaved, batch 1), against beam
search as the reference (:mod:`specrec.eval.compare`).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from .options import backend_device, hot_path_backend


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


def run_policies(a: argparse.Namespace, bundle, split, ex, exclude=None) -> int:
    """Side-by-side comparison of policies on the same requests (interleaved, batch 1)."""
    from ..eval.compare import (
        compare_policies,
        comparison_table,
        default_line,
        plot_stages,
        summary_keys,
        valid_against_test,
        valid_against_test_lines,
    )
    from ..eval.results import update_summary, write_json
    from ..policies import make_policy
    from ..terminal import markdown_table, print_table

    names = [p.strip() for p in a.policies.split(",") if p.strip()]
    if "beam" not in names:
        names = ["beam", *names]
    params = _policy_params(a.set)
    kind = bundle.default_drafter() if a.drafter == "default" else a.drafter
    shares = ({"text_share": a.text_share, "unseen_share": a.unseen_share} if kind == "retrieval"
              else {"unseen_share": a.unseen_share} if kind == "sasrec" else {})
    engine = bundle.engine(drafter=kind, backend=hot_path_backend(bundle, a), **shares)
    policies = {n: make_policy(n, engine, **params.get(n, {})) for n in names}
    engine.verifier.backend.warmup(engine.itemset.trie, (a.k,), scored=bundle.scored_counts((a.k,)))  # none timed
    if a.compare_eager:
        eager = bundle.backend("eager", device=backend_device(a))  # the reference, on the same device
        policies["beam@eager"] = make_policy("beam", bundle.engine(drafter=None, backend=eager))
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
    vt = valid_against_test(bundle.meta.get("fusion"), table, k)
    if vt is not None:
        out["valid_against_test"] = vt
    cols = ["policy", *[f"recall@{x}" for x in ks], *[f"ndcg@{x}" for x in ks]]
    if split.protocol == "temporal":
        cols += [f"unseen_recall@{max(ks)}", f"in_sample_recall@{max(ks)}"]
    cols += ["p50_ms", "p99_ms", "speedup", "equal_to_beam", "item_accept", "token_accept", "no_fallback"]
    fusion_meta = bundle.meta.get("fusion")
    said = (valid_against_test_lines(vt) if vt is not None
            else [default_line(fusion_meta.get("default"))] if fusion_meta else [])
    if bundle.meta.get("refit"):
        said.append(f"the models were refit after every choice ({bundle.meta['refit'].get('summary')}): validation "
                    "figures are the chosen models', test figures the refit ones'")
    if a.json:
        print(json.dumps(out, indent=2, default=str))
    else:
        print_table(rows, cols)
        for line in said:
            print(line)
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
              + markdown_table(rows, cols) + "".join(f"\n{line}\n" for line in said)
              + f"\n![stage times]({name}_stages.png)\n")
        (results / f"{name}.md").write_text(md)
        plot_stages(table, results / f"{name}_stages.png",
                    f"{ds_name} {split.protocol}, K={k}: mean time per request by stage ({len(ex)} requests)")
        keys = summary_keys(table, ds_name, split.protocol, k, tag.replace("_", "."))
        if vt is not None and exclude is not None and a.sample is None:  # all users: validation beside test
            pre = f"{ds_name}.{split.protocol}"
            for m in ("recall@10", "ndcg@10"):
                keys[f"{pre}.fused.excl.valid.{m}"] = vt[m]["valid.fused"]
                keys[f"{pre}.drafter.excl.valid.{m}"] = vt[m]["valid.drafter"]
            keys[f"{pre}.fused.excl.valid_test_gap"] = vt["recall@10"].get("gap")
        if keys:  # frontier_coverage averaged in the target's own levels: drafted_level_coverage replaces it
            retire = tuple(x.replace(".drafted_level_coverage", ".frontier_coverage") for x in keys
                           if x.endswith(".drafted_level_coverage"))
            update_summary(keys, results / "summary.json", retire=retire)
    return 0
