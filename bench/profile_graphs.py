"""Where a whole-search graph's time goes: ONNX Runtime's own profile, node by node.

For the beam-search graph and ``strict``'s draft-and-verify graph of a list
length K (default N = 2K drafts per level), batch 1, one intra-op thread, it
reports the nodes ONNX Runtime executes per call (after its graph
optimisations), their kernel time by operator type, and the MatMuls' share.

    python -m bench.profile_graphs --bundle bundles/beauty-loo --k 10
"""

from __future__ import annotations

import argparse
import json
import tempfile
from collections import Counter
from pathlib import Path

import numpy as np
import torch

from bench.harness import RESULTS_DIR, command_line


def profile(path: Path, feed: dict, runs: int) -> dict:
    import onnxruntime as ort

    so = ort.SessionOptions()
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    so.intra_op_num_threads = 1
    so.enable_profiling = True
    so.profile_file_prefix = str(Path(tempfile.mkdtemp()) / path.stem)
    s = ort.InferenceSession(str(path), so, providers=["CPUExecutionProvider"])
    for _ in range(runs):
        s.run(None, feed)
    events = json.loads(Path(s.end_profiling()).read_text())
    by_op: Counter = Counter()
    nodes = 0
    for e in events:
        if e.get("cat") == "Node" and e["name"].endswith("_kernel_time"):
            by_op[e["args"]["op_name"]] += e["dur"]
            nodes += 1
    total = sum(by_op.values())
    return {"nodes_per_call": nodes / runs, "kernel_us_per_call": total / runs,
            "matmul_share": by_op["MatMul"] / total if total else float("nan"),
            "by_op_us": {op: round(us / runs, 1) for op, us in by_op.most_common(12)}}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--bundle", default="bundles/beauty-loo")
    ap.add_argument("--k", type=int, default=10)
    ap.add_argument("--n", type=int, default=None, help="drafts per level (default 2K)")
    ap.add_argument("--runs", type=int, default=100)
    ap.add_argument("--out", default=str(RESULTS_DIR))
    a = ap.parse_args(argv)
    torch.set_num_threads(1)
    from specrec.backends.onnx import search_name
    from specrec.bundle import Bundle

    b = Bundle.load(a.bundle)
    n = a.n or 2 * a.k
    be = b.backend("onnx", threads=1)
    enc = be.encode(b.history_sids([np.arange(8)]))
    be.search(enc, b.trie, a.k)  # exports the graphs on first use
    be.draft_verify(enc, b.trie, a.k, n)
    tables = be._tables_of(b.trie)
    feed = {"enc_mask": enc.keep.numpy(), "cross_k": enc.cross_k.numpy(), "cross_v": enc.cross_v.numpy(),
            **{f"table{j}": t for j, t in enumerate(tables)}}
    out = {"command": command_line("bench.profile_graphs", argv), "k": a.k, "n": n}
    for kind, name in (("beam", search_name("beam", a.k)), ("strict", search_name("strict", a.k, n, be.drafter_bits))):
        out[kind] = profile(be.graph_path(name), feed, a.runs)
        r = out[kind]
        print(f"{name}: {r['nodes_per_call']:.0f} nodes per call, {r['kernel_us_per_call'] / 1000:.2f} ms of kernels "
              f"(profiled), MatMul {r['matmul_share']:.0%}; by op (us): {r['by_op_us']}")
    (Path(a.out) / f"graph_profile_k{a.k}.json").write_text(json.dumps(out, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
