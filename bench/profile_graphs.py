"""Where each graph's time goes: node counts before and after ONNX Runtime's optimisations, and its kernel time
by kind of operator.

For every graph a request of list length K runs (the encoder, the beam search of width K, the NEZHA head's
search, the distilled drafter's search, ``specgr``'s draft-and-score round and ``strict``'s draft-and-verify
graph with N = 2K drafts per level; those the bundle has), batch 1, one intra-op thread, on a seeded random
sample of test users:

- nodes as traced (the exported graph, after our own constant sharing and size folding) and as ONNX Runtime
  runs them (ORT_ENABLE_ALL);
- the time of a call (median over the users, an unprofiled session), and ONNX Runtime's profile of the same
  calls split by kind of operator: matrix products, normalisation and softmax, elementwise arithmetic, data
  movement (reshapes, gathers, concatenations, slices, transposes), the searches' top-k, other. The profiler
  adds its own cost to every node (a few us), so the split is a share of the profiled kernel time, drawn on
  the unprofiled time.

The floor of the beam-search graphs (their weight products alone) is ``bench.pass_cost``'s.

    python -m bench.profile_graphs --bundle bundles/beauty-loo --k 10

Writes ``graph_profile_k{K}.{json,png}``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from collections import Counter
from pathlib import Path

import numpy as np
import torch

from bench.harness import RESULTS_DIR, command_line, sample_users

KINDS = {  # kind of operator -> ONNX operators
    "matmul": {"MatMul", "Gemm", "MatMulNBits", "FusedMatMul", "MatMulInteger"},
    "norm+softmax": {"LayerNormalization", "SkipLayerNormalization", "Softmax", "LogSoftmax"},
    "elementwise": {"Add", "Sub", "Mul", "Div", "Relu", "Gelu", "Where", "Equal", "Less", "Greater",
                    "GreaterOrEqual", "LessOrEqual", "Or", "And", "Not", "IsInf", "Cast", "Clip", "Exp", "Neg",
                    "ReduceSum", "ReduceMax", "Sqrt", "Pow"},
    "data movement": {"Reshape", "Gather", "GatherElements", "GatherND", "Concat", "Split", "Slice", "Transpose",
                      "Unsqueeze", "Squeeze", "Expand", "Shape", "ConstantOfShape", "Range", "ScatterElements",
                      "Identity", "Tile"},
    "top-k": {"TopK", "ArgMax", "CumSum"},
}


def kind_of(op: str) -> str:
    return next((k for k, ops in KINDS.items() if op in ops), "other")


def session(path: Path, profile: bool = False, optimized: Path | None = None):
    import onnxruntime as ort

    so = ort.SessionOptions()
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    so.intra_op_num_threads = 1
    so.inter_op_num_threads = 1
    so.add_session_config_entry("session.intra_op.allow_spinning", "0")
    so.log_severity_level = 3
    if optimized is not None:
        so.optimized_model_filepath = str(optimized)
    if profile:
        so.enable_profiling = True
        so.profile_file_prefix = str(Path(tempfile.mkdtemp()) / path.stem)
    return ort.InferenceSession(str(path), so, providers=["CPUExecutionProvider"])


def nodes(path: Path) -> int:
    import onnx

    return len(onnx.load(str(path), load_external_data=False).graph.node)


def measure(path: Path, traced: Path, feeds: list[dict], runs: int) -> dict:
    """Node counts, the median call (unprofiled) and the profiled kernel time by kind of operator."""
    opt = Path(tempfile.mkdtemp()) / "opt.onnx"
    s = session(path, optimized=opt)
    names = {i.name for i in s.get_inputs()}
    feeds = [{k: v for k, v in f.items() if k in names} for f in feeds]
    for f in feeds[:3]:
        s.run(None, f)
    calls = []
    for _ in range(runs):
        for f in feeds:
            t0 = time.perf_counter()
            s.run(None, f)
            calls.append((time.perf_counter() - t0) * 1000)
    p = session(path, profile=True)
    for f in feeds:
        p.run(None, f)
    events = json.loads(Path(p.end_profiling()).read_text())
    by_op: Counter = Counter()
    ran = 0
    for e in events:
        if e.get("cat") == "Node" and e["name"].endswith("_kernel_time"):
            by_op[e["args"]["op_name"]] += e["dur"]
            ran += 1
    total = sum(by_op.values())
    by_kind: Counter = Counter()
    for op, us in by_op.items():
        by_kind[kind_of(op)] += us
    return {"nodes_traced": nodes(traced), "nodes_after": nodes(opt), "nodes_run_per_call": ran / len(feeds),
            "call_ms_p50": statistics.median(calls), "profiled_kernel_ms": total / len(feeds) / 1000,
            "share_by_kind": {k: by_kind[k] / total for k in [*KINDS, "other"]},
            "by_op_us": {op: round(us / len(feeds), 1) for op, us in by_op.most_common(12)}}


def plot(out: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    graphs = list(out["graphs"])
    fig, ax = plt.subplots(figsize=(9, 0.6 * len(graphs) + 2.0))
    left = np.zeros(len(graphs))
    for k in [*KINDS, "other"]:
        ms = np.array([out["graphs"][g]["call_ms_p50"] * out["graphs"][g]["share_by_kind"][k] for g in graphs])
        ax.barh(graphs, ms, left=left, label=k)
        left += ms
    for i, g in enumerate(graphs):
        r = out["graphs"][g]
        ax.text(left[i], i, f"  {r['call_ms_p50']:.2f} ms, {r['nodes_traced']} -> {r['nodes_after']} nodes",
                va="center", fontsize=8)
    ax.set_xlim(0, left.max() * 1.45)
    ax.invert_yaxis()
    ax.set_xlabel("ms per call (median, batch 1, one thread), split by the profiled kernel time")
    ax.set_title(f"Where each graph's time goes, K={out['k']} (nodes: traced -> as ONNX Runtime runs them)",
                 fontsize=10)
    ax.legend(fontsize=8, loc="upper center", bbox_to_anchor=(0.5, -0.12), ncol=6, frameon=False)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--bundle", default="bundles/beauty-loo")
    ap.add_argument("--k", type=int, default=10)
    ap.add_argument("--n", type=int, default=None, help="drafts per level for strict (default 2K)")
    ap.add_argument("--users", type=int, default=20, help="random test users whose requests are run")
    ap.add_argument("--seed", type=int, default=11)
    ap.add_argument("--runs", type=int, default=10, help="timed passes over the users")
    ap.add_argument("--out", default=str(RESULTS_DIR))
    a = ap.parse_args(argv)
    torch.set_num_threads(1)
    from specrec.backends.onnx import export_onnx, export_search, search_name
    from specrec.bundle import Bundle

    b = Bundle.load(a.bundle)
    n = a.n or 2 * a.k
    be = b.backend("onnx", threads=1)
    users = sample_users(b, a.users, a.seed)
    encs = [be.encode(b.history_sids([np.asarray(h)])) for h in users.rows]
    enc0 = encs[0]
    wanted = [("encode", None, "encode", None)]
    tag, tables = be.table_feed(b.trie)
    be.search("beam", enc0, b.trie, (a.k,))  # each call exports its graph on first use
    wanted.append(("beam", "beam", search_name("beam", a.k, tables=tag), None))
    if be.nezha_head is not None and be.search("head", enc0, b.trie, (a.k,)) is not None:
        wanted.append(("head", "head", search_name("head", a.k, tables=tag), None))
    if be.drafter is not None:
        bits = be.drafter_bits
        if be.search("draft", enc0, b.trie, (a.k,)) is not None:
            wanted.append(("draft", "draft", search_name("draft", a.k, None, bits, tag), None))
        if be.search("draft_scored", enc0, b.trie, (2 * a.k,)) is not None:
            wanted.append(("draft_scored", "draft_scored", search_name("draft_scored", 2 * a.k, None, bits, tag),
                           None))
        if be.search("strict", enc0, b.trie, (a.k, n)) is not None:
            wanted.append(("strict", "strict", search_name("strict", a.k, n, bits, tag), n))
    feeds = [{"hist_sids": b.history_sids([np.asarray(h)]).numpy(), "enc_mask": e.keep.numpy(),
              "cross_k": e.cross_k.numpy(), "cross_v": e.cross_v.numpy(), **tables} for h, e in zip(users.rows, encs)]
    traced_dir = Path(tempfile.mkdtemp(prefix="traced-"))
    export_onnx(be.model, traced_dir, be.nezha_head, be.drafter)  # the traced graphs, to count their nodes
    out: dict = {"command": command_line("bench.profile_graphs", argv), "k": a.k, "n": n, "users": users.source,
                 "graphs": {}}
    for label, kind, name, drafts in wanted:
        if kind is None:
            traced = traced_dir / "encode.onnx"
        else:
            width = 2 * a.k if kind == "draft_scored" else a.k
            traced = export_search(be.model, traced_dir, kind, width, be.nezha_head, be.drafter, drafts,
                                   be.drafter_bits if kind in ("draft", "draft_scored", "strict") else None, tag)
        r = out["graphs"][f"{label} ({name})"] = measure(be.graph_path(name), traced, feeds, a.runs)
        print(f"{name}: {r['nodes_traced']} -> {r['nodes_after']} nodes, {r['call_ms_p50']:.2f} ms; "
              + ", ".join(f"{k} {v:.0%}" for k, v in r["share_by_kind"].items()), flush=True)
    res = Path(a.out)
    (res / f"graph_profile_k{a.k}.json").write_text(json.dumps(out, indent=1) + "\n")
    plot(out, res / f"graph_profile_k{a.k}.png")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
