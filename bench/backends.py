"""Which backend runs the hot path fastest on this machine?

Times each backend's four hot-path calls (encode, a KV-cached beam step, a
prefix-tree pass, the NEZHA head's pass) and a whole beam search, at batch 1,
on real histories of the bundle, after a warm-up, interleaved so that every
backend sees the same machine state. Also checks each backend's outputs
against eager's.

    python -m bench.backends --bundle bundles/beauty-loo --n 200

Writes bench/results/backends.{json,md}.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch

from bench.harness import ROOT, command_line
from specrec.bundle import Bundle
from specrec.decoding.beam import beam_search
from specrec.decoding.scoring import score_sids


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--bundle", default=str(ROOT / "bundles" / "beauty-loo"))
    p.add_argument("--backends", default="eager,onnx",
                   help="eager (the reference), onnx (ONNX Runtime, the CPU default); torch.compile was measured "
                   "and dropped (see bench/results/HISTORY.md)")
    p.add_argument("--n", type=int, default=200, help="timed repetitions per call (histories drawn at random)")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--widths", default="10,50")
    p.add_argument("--drafts", default="20,50", help="drafted SIDs per tree pass")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=str(ROOT / "bench" / "results"))
    a = p.parse_args()
    torch.set_num_threads(a.threads)
    bundle = Bundle.load(a.bundle)
    names = a.backends.split(",")
    widths = [int(w) for w in a.widths.split(",")]
    drafts = [int(d) for d in a.drafts.split(",")]
    rng = np.random.default_rng(a.seed)
    n_items = len(bundle.catalogue)
    hists = [rng.integers(0, n_items, int(rng.integers(3, 21))) for _ in range(a.n)]
    cands = {m: [torch.from_numpy(bundle.sids[rng.integers(0, n_items, m)])[None] for _ in range(a.n)] for m in drafts}
    backends, setup = {}, {}
    for name in names:
        t0 = time.perf_counter()
        be = bundle.backend(name, **({"threads": a.threads} if name == "onnx" else {}))
        with torch.inference_mode():  # warm every shape the timed loop uses
            for h in hists[:20]:
                enc = be.encode(bundle.history_sids([h]))
                for w in widths:
                    beam_search(be, enc, bundle.trie, w)
                for m in drafts:
                    score_sids(be, enc, cands[m][0])
                be.head_hidden(enc)
        setup[name] = time.perf_counter() - t0
        backends[name] = be
        print(f"{name}: ready in {setup[name]:.1f} s", flush=True)

    calls = {"encode": lambda be, i: be.encode(bundle.history_sids([hists[i]]))}
    encs = {}

    def with_enc(fn):
        def run(be, i):
            key = (be.name, i)
            if key not in encs:
                encs[key] = be.encode(bundle.history_sids([hists[i]]))
            return fn(be, encs[key], i)
        return run

    calls["head_pass"] = with_enc(lambda be, e, i: be.head_hidden(e))
    for m in drafts:
        calls[f"tree_{m}_drafts"] = with_enc(lambda be, e, i, m=m: score_sids(be, e, cands[m][i]))
    for w in widths:
        calls[f"beam_search_w{w}"] = with_enc(lambda be, e, i, w=w: beam_search(be, e, bundle.trie, w))
        calls[f"encode+beam_w{w}"] = lambda be, i, w=w: beam_search(
            be, be.encode(bundle.history_sids([hists[i]])), bundle.trie, w)
    times = {name: {c: [] for c in calls} for name in names}
    with torch.inference_mode():
        for name in names:  # encoder states of the calls that start from one, outside the timed region
            for i in range(a.n):
                with_enc(lambda be, e, i: None)(backends[name], i)
        for c, fn in calls.items():
            for i in range(a.n):
                for name in names:
                    t0 = time.perf_counter()
                    fn(backends[name], i)
                    times[name][c].append(time.perf_counter() - t0)
        # agreement with eager
        agree = {}
        ref = backends.get("eager")
        for name, be in backends.items():
            if ref is None or name == "eager":
                continue
            diffs, same = [], []
            for i in range(min(50, a.n)):
                e1, e2 = ref.encode(bundle.history_sids([hists[i]])), be.encode(bundle.history_sids([hists[i]]))
                # encoder states are laid out per backend (the fused path keeps K transposed): compare outputs
                s1, s2 = score_sids(ref, e1, cands[drafts[0]][i]), score_sids(be, e2, cands[drafts[0]][i])
                diffs.append(float((s1.token_logp - s2.token_logp).abs().max()))
                b1, b2 = beam_search(ref, e1, bundle.trie, widths[0]), beam_search(be, e2, bundle.trie, widths[0])
                same.append(bool(torch.equal(b1.codes, b2.codes)))
                diffs.append(float((b1.scores - b2.scores).abs().max()))
            agree[name] = {"max_abs_diff": max(diffs), "beam_equal_share": float(np.mean(same))}
    res = {"n": a.n, "threads": a.threads, "setup_s": setup, "agreement_with_eager": agree,
           "describe": {n: b.describe() for n, b in backends.items()},
           "p50_ms": {n: {c: 1000 * statistics.median(v) for c, v in t.items()} for n, t in times.items()},
           "mean_ms": {n: {c: 1000 * statistics.fmean(v) for c, v in t.items()} for n, t in times.items()}}
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "backends.json").write_text(json.dumps(res, indent=2) + "\n")
    cols = list(calls)
    lines = ["# Hot-path backends", "", f"Command: `{command_line('bench.backends')}`", "",
             f"Batch 1, {a.threads} threads, {a.n} random histories per call, interleaved; p50 ms "
             f"(mean in brackets). {platform_line()}", "",
             "| backend | " + " | ".join(cols) + " | setup s |", "|---" * (len(cols) + 2) + "|"]
    for n in names:
        cells = [f"{res['p50_ms'][n][c]:.2f} ({res['mean_ms'][n][c]:.2f})" for c in cols]
        lines.append(f"| {n} | " + " | ".join(cells) + f" | {setup[n]:.0f} |")
    lines += ["", "Agreement with eager (first 50 histories): " + ", ".join(
        f"{n}: max |diff| {v['max_abs_diff']:.1e}, equal beams {v['beam_equal_share']:.0%}" for n, v in agree.items())]
    (out / "backends.md").write_text("\n".join(lines) + "\n")
    if "eager" in names:
        from specrec.eval.results import update_summary

        keys = {}
        for n in names:
            if n == "eager":
                continue
            for c in cols:
                keys[f"backends.{n}.{c}.p50_ms"] = res["p50_ms"][n][c]
                keys[f"backends.{n}.{c}.speedup_vs_eager"] = res["p50_ms"]["eager"][c] / res["p50_ms"][n][c]
            if n in agree:
                keys[f"backends.{n}.max_abs_diff_vs_eager"] = agree[n]["max_abs_diff"]
        for c in cols:
            keys[f"backends.eager.{c}.p50_ms"] = res["p50_ms"]["eager"][c]
        update_summary(keys, out / "summary.json")
    print("\n".join(lines))
    return 0


def platform_line() -> str:
    import os
    import platform

    return f"{platform.processor() or platform.machine()}, {os.cpu_count()} CPUs, torch {torch.__version__}"


if __name__ == "__main__":
    sys.exit(main())
