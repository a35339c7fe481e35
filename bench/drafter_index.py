"""Approximate vs exact search for the vector drafters.

The drafters search exactly (faiss IndexFlatIP) up to 200k items and with
HNSW beyond. This measures, on a synthetic catalogue of clustered unit
vectors, HNSW's recall@n against exact search and the query time of both.

    python -m bench.drafter_index --items 300000 --dim 64 --queries 500

Writes bench/results/drafter_index.json and .md and the summary keys
``drafter.hnsw.recall@50`` and ``drafter.hnsw.speedup``.
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import numpy as np

from bench.harness import command_line
from specrec.drafters.vector import build_index
from specrec.eval.results import RESULTS_DIR, update_summary, write_json


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--items", type=int, default=300_000)
    ap.add_argument("--dim", type=int, default=64)
    ap.add_argument("--queries", type=int, default=500)
    ap.add_argument("--n", type=int, default=50)
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args(argv)
    import faiss

    faiss.omp_set_num_threads(1)
    rng = np.random.default_rng(a.seed)
    centres = rng.normal(size=(1000, a.dim)).astype(np.float32)
    x = centres[rng.integers(0, 1000, a.items)] + 0.5 * rng.normal(size=(a.items, a.dim)).astype(np.float32)
    x /= np.linalg.norm(x, axis=1, keepdims=True)
    q = x[rng.integers(0, a.items, a.queries)] + 0.3 * rng.normal(size=(a.queries, a.dim)).astype(np.float32)
    q = (q / np.linalg.norm(q, axis=1, keepdims=True)).astype(np.float32)

    t0 = time.perf_counter()
    exact = build_index(x, exact_limit=10**12)
    t_build_exact = time.perf_counter() - t0
    t0 = time.perf_counter()
    hnsw = build_index(x, exact_limit=0)
    t_build_hnsw = time.perf_counter() - t0

    def timed(index):
        out, t = [], []
        for i in range(a.queries):
            s = time.perf_counter()
            _, ids = index.search(q[i : i + 1], a.n)
            t.append(time.perf_counter() - s)
            out.append(ids[0])
        return np.stack(out), np.asarray(t)

    ids_e, t_e = timed(exact)
    ids_h, t_h = timed(hnsw)
    recall = float(np.mean([len(set(a_) & set(b_)) / a.n for a_, b_ in zip(ids_e, ids_h)]))
    res = {
        "items": a.items, "dim": a.dim, "queries": a.queries, "n": a.n, "threads": 1,
        "exact": {"kind": type(exact).__name__, "build_s": t_build_exact, "query_p50_ms": float(np.median(t_e) * 1e3)},
        "hnsw": {"kind": type(hnsw).__name__, "build_s": t_build_hnsw, "query_p50_ms": float(np.median(t_h) * 1e3),
                 "recall_at_n_vs_exact": recall, "M": 32, "efSearch": hnsw.hnsw.efSearch},
        "command": command_line("bench.drafter_index", argv),
    }
    write_json("drafter_index", res)
    md = (
        f"# Drafter index: HNSW vs exact\n\nCommand: `{res['command']}`\n\n"
        f"{a.items} clustered unit vectors of dimension {a.dim}, {a.queries} queries, top {a.n}, 1 thread.\n\n"
        "| index | build s | query p50 ms | recall@n vs exact |\n|---|---|---|---|\n"
        f"| exact (IndexFlatIP) | {t_build_exact:.1f} | {res['exact']['query_p50_ms']:.2f} | 1.000 |\n"
        f"| HNSW (M 32, efSearch {hnsw.hnsw.efSearch}) | {t_build_hnsw:.1f} | {res['hnsw']['query_p50_ms']:.2f} "
        f"| {recall:.3f} |\n"
    )
    (RESULTS_DIR / "drafter_index.md").write_text(md)
    update_summary({f"drafter.hnsw.recall@{a.n}": recall,
                    "drafter.hnsw.speedup": float(np.median(t_e) / np.median(t_h))})
    print(json.dumps(res, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
