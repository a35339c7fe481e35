"""Drafters against the target: frontier coverage on test, cost per call, and the tree pass's cost curve.

For a seeded random sample of test histories it measures, per drafter family
and draft count N, how much of the target's width-K frontier (the prefixes its
beam search keeps after every level) the drafter's beams hold:

- ``nezha_head``: the bundle's NEZHA head, its N final SIDs' prefixes (what
  the level-by-level ``strict`` verifies);
- ``sid_mlp``: the distilled drafter (level 0 exact), its kept prefixes at
  every level (what ``draft_verify`` verifies).

It times, batch 1 on the ONNX backend, each drafter's call, the old tree pass
over the drafts (a T x T mask, every level's head at every node) against the
new draft-and-verify graph (ancestor attention, one head per node, drafting
and the target's search included), and the target's beam search, and plots
the per-node cost curve.

    python -m bench.drafters --bundle bundles/beauty-loo --users 1000 --seed 11
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import numpy as np
import torch

from bench.harness import RESULTS_DIR, command_line


def _median_ms(fn, inputs, repeat: int = 1) -> float:
    xs = []
    for x in inputs:
        t0 = time.perf_counter()
        for _ in range(repeat):
            fn(x)
        xs.append((time.perf_counter() - t0) / repeat)
    return float(np.median(xs) * 1000)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--bundle", default="bundles/beauty-loo")
    ap.add_argument("--users", type=int, default=1000, help="random test users for coverage")
    ap.add_argument("--timing-users", type=int, default=200, help="random test users for timing")
    ap.add_argument("--seed", type=int, default=11)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", default=str(RESULTS_DIR))
    a = ap.parse_args(argv)
    torch.set_num_threads(a.threads)
    from specrec.bundle import Bundle, bundle_split
    from specrec.data.splits import sample_examples
    from specrec.decoding.scoring import tree_pass
    from specrec.decoding.searches.head import nezha_beam_search
    from specrec.models.hotpath import FusedHotPath
    from specrec.train.batches import history_batch
    from specrec.train.distill import cat_padded, drafter_beams, frontier_coverage, target_frontier

    b = Bundle.load(a.bundle)
    if b.sid_mlp is None:
        raise SystemExit(f"{a.bundle} has no distilled drafter (specrec train-drafters --which distill)")
    _, split = bundle_split(b)
    ex = sample_examples(split.test, a.users, a.seed)
    sizes = b.cfg.level_sizes
    L = len(sizes)
    fused = FusedHotPath(b.model, b.nezha_head, b.sid_mlp).eval()
    tables = b.trie.search_tables(fused.vmax)
    eager = b.backend("eager")
    grid = {10: [10, 15, 20, 30, 40], 50: [50, 75, 100, 150]}
    cov: dict = {}
    for k, ns in grid.items():
        tgt = [[] for _ in range(L - 1)]
        alive = [[] for _ in range(L - 1)]
        drafted: dict = {(f, n): [[] for _ in range(L - 1)] for f in ("sid_mlp", "nezha_head") for n in ns}
        for s in range(0, len(ex), 250):
            hist = history_batch(b.sids_t, ex.history[s : s + 250])
            with torch.inference_mode():
                h0, root, levels, _ = target_frontier(fused, tables, hist, k, keep_logp=False)
                enc = eager.encode(b.history_sids(list(ex.history[s : s + 250])))
            for j, (c, al, _) in enumerate(levels):
                tgt[j].append(c.numpy())
                alive[j].append(al.numpy())
            for n in ns:
                beams = drafter_beams(b.sid_mlp, h0, root, tables, [k] + [n] * (L - 2))
                for j in range(L - 1):
                    drafted[("sid_mlp", n)][j].append(beams[j].numpy())
                with torch.inference_mode():
                    hb = (
                        nezha_beam_search(
                            b.nezha_head,
                            b.model,
                            b.nezha_head.hidden(b.model, b.model.encode(b.history_sids(list(ex.history[s : s + 250])))),
                            b.trie,
                            n,
                        )
                        if b.nezha_head is not None
                        else None
                    )
                if hb is not None:
                    codes = torch.where(hb.alive.unsqueeze(-1), hb.codes, -1).numpy()
                    for j in range(L - 1):
                        drafted[("nezha_head", n)][j].append(codes[:, :, : j + 1])
            del enc
        for (fam, n), d in drafted.items():
            if not d[0]:
                continue
            rep = frontier_coverage([cat_padded(x, fill=-1) for x in d], [cat_padded(t) for t in tgt],
                                    [cat_padded(x, fill=False) for x in alive], sizes)
            cov[f"{fam}.k{k}.n{n}"] = rep
            print(f"K={k} {fam:10s} N={n:3d}: per level {[round(x, 3) for x in rep['levels']]}  "
                  f"mean {rep['mean']:.3f}  whole frontier {rep['whole']:.3f}", flush=True)

    # -- cost per call, batch 1, ONNX ------------------------------------------------------------
    be = b.backend("onnx", threads=a.threads)
    trie = b.trie
    tex = sample_examples(split.test, a.timing_users, a.seed + 1)
    encs = [be.encode(b.history_sids([h])) for h in tex.histories()]
    be.warmup(trie, (10, 50))
    cost: dict = {"encode": _median_ms(lambda h: be.encode(b.history_sids([h])), tex.histories())}
    curve = []
    for k, ns in grid.items():
        be.search("beam", encs[0], trie, (k,))
        cost[f"beam.k{k}"] = _median_ms(lambda e: be.search("beam", e, trie, (k,)), encs)
        own = [be.search("beam", e, trie, (k,)) for e in encs]
        cost[f"tree_own_frontier.k{k}"] = _median_ms(lambda i: tree_pass(be, encs[i], [(own[i].codes, own[i].alive)]),
                                                     range(len(encs)))
        for n in ns:
            be.search("strict", encs[0], trie, (k, n))
            be.search("draft", encs[0], trie, (n,))
            dv = _median_ms(lambda e: be.search("strict", e, trie, (k, n)), encs)
            ds = _median_ms(lambda e: be.search("draft", e, trie, (n,)), encs)
            heads = [be.search("head", e, trie, (n,)) for e in encs] if b.nezha_head is not None else None
            hs = _median_ms(lambda e: be.search("head", e, trie, (n,)), encs) if heads else float("nan")
            old = _median_ms(lambda i: tree_pass(be, encs[i], [(heads[i].codes, heads[i].alive)]),
                             range(len(encs))) if heads else float("nan")
            nodes_new = k + (L - 2) * n
            nodes_old = float(np.mean([tree_pass(be, encs[i], [(heads[i].codes, heads[i].alive)])[0].n_nodes[0]
                                       for i in range(10)])) if heads else float("nan")
            cost[f"draft_verify.k{k}.n{n}"] = dv
            cost[f"sid_mlp_search.n{n}"] = ds
            cost[f"nezha_head_search.n{n}"] = hs
            cost[f"tree_old.head_drafts.n{n}"] = old
            curve.append({"k": k, "n": n, "nodes_new": nodes_new, "draft_verify_ms": dv, "nodes_old": nodes_old,
                          "old_tree_ms": old, "head_search_ms": hs, "sid_mlp_search_ms": ds})
            print(f"K={k} N={n}: draft_verify {dv:.2f} ms ({nodes_new} nodes, drafting and search included); old tree "
                  f"{old:.2f} ms ({nodes_old:.0f} nodes) + head search {hs:.2f}; sid_mlp search {ds:.2f}", flush=True)
        print(
            f"K={k}: beam {cost[f'beam.k{k}']:.2f} ms, "
            f"tree over its own frontier {cost[f'tree_own_frontier.k{k}']:.2f} ms"
        )
    print(f"encode {cost['encode']:.2f} ms")
    params = {"sid_mlp": b.sid_mlp.n_params(), "nezha_head": b.nezha_head.n_params() if b.nezha_head else None}
    out = {"command": command_line("bench.drafters", argv), "users": a.users, "seed": a.seed,
           "timing_users": a.timing_users, "threads": a.threads, "coverage": cov, "cost_ms": cost, "curve": curve,
           "params": params}
    res = Path(a.out)
    (res / "drafters.json").write_text(json.dumps(out, indent=1) + "\n")
    _write_md(out, res / "drafters.md")
    _plot(out, res / "drafters.png")
    return 0


def _write_md(out: dict, path: Path) -> None:
    cov, cost = out["coverage"], out["cost_ms"]
    lines = [f"# Drafters against the target\n\nCommand: `{out['command']}`\n",
             f"Coverage: {out['users']} random test users (seed {out['seed']}); the share of the target's width-K "
             "frontier (kept prefixes after each level) that the drafts hold, per level (prefix length 1, 2, 3), "
             "and the share of requests whose whole frontier is held (no fallback). Cost: batch 1, ONNX Runtime, "
             f"{out['threads']} threads, median over {out['timing_users']} random test users.\n",
             "| family | params | K | N | level 1 | level 2 | level 3 | mean | whole frontier | draft call ms "
             "| verify ms |", "|---|---|---|---|---|---|---|---|---|---|---|"]
    for key, r in cov.items():
        fam, k, n = key.split(".")
        k, n = int(k[1:]), int(n[1:])
        p = out["params"].get(fam)
        if fam == "sid_mlp":
            call, ver = cost.get(f"sid_mlp_search.n{n}"), cost.get(f"draft_verify.k{k}.n{n}")
            ver_s = f"{ver:.2f} (draft + tree + search, one graph)" if ver is not None else ""
        else:
            call, ver = cost.get(f"nezha_head_search.n{n}"), cost.get(f"tree_old.head_drafts.n{n}")
            ver_s = f"{ver:.2f} (tree pass only)" if ver is not None else ""
        lv = r["levels"]
        lines.append(f"| {fam} | {p} | {k} | {n} | {lv[0]:.3f} | {lv[1]:.3f} | {lv[2]:.3f} | {r['mean']:.3f} | "
                     f"{r['whole']:.3f} | {call:.2f} | {ver_s} |" if call is not None else
                     f"| {fam} | {p} | {k} | {n} | {lv[0]:.3f} | {lv[1]:.3f} | {lv[2]:.3f} | {r['mean']:.3f} | "
                     f"{r['whole']:.3f} | | |")
    lines += ["", f"Reference: encode {cost['encode']:.2f} ms; beam search K=10 {cost['beam.k10']:.2f} ms, K=50 "
              f"{cost['beam.k50']:.2f} ms; one old tree pass over the target's own frontier K=10 "
              f"{cost['tree_own_frontier.k10']:.2f} ms, K=50 {cost['tree_own_frontier.k50']:.2f} ms.", "",
              "![tree-pass cost](drafters.png)", ""]
    path.write_text("\n".join(lines))


def _plot(out: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    c = out["curve"]
    fig, ax = plt.subplots(figsize=(7, 4.2))
    ax.plot([x["nodes_new"] for x in c], [x["draft_verify_ms"] for x in c], "o-",
            label="draft_verify: drafting + tree pass (ancestor attention, one head) + target search")
    ax.plot([x["nodes_old"] for x in c], [x["old_tree_ms"] for x in c], "s--",
            label="old tree pass over the NEZHA head's drafts (T x T mask, all heads)")
    for k in (10, 50):
        ax.axhline(out["cost_ms"][f"beam.k{k}"], ls=":", color="gray")
        ax.text(2, out["cost_ms"][f"beam.k{k}"], f" beam search K={k}", va="bottom", fontsize=8)
    ax.set_xlabel("tree nodes")
    ax.set_ylabel("ms per call (batch 1, median)")
    ax.set_title("Tree-pass cost per node", fontsize=10)
    ax.legend(fontsize=7)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


if __name__ == "__main__":
    raise SystemExit(main())
