"""Where a request's time goes, per policy (in-process, batch 1).

Each policy runs the same validation histories one at a time; the policies'
own stage timers (encode, draft, verify, beam, head, fallback, sample) are
summed per request, the rest of the wall time is "other" (fill-up, list
building, Python glue). A cProfile of one policy gives the hottest functions.

    python -m bench.profile_policies --bundle bundles/beauty-loo --n 200

Writes bench/results/profile_policies.{json,md,png}.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import sys
import time
from collections import defaultdict

import numpy as np

from bench.harness import command_line
from specrec.eval.results import RESULTS_DIR, write_json

SETUPS = {  # label -> (policy, params)
    "beam": ("beam", {}),
    "specgr (gamma -1)": ("specgr", {"gamma": -1.0}),
    "specgr (gamma -2)": ("specgr", {"gamma": -2.0}),
    "strict": ("strict", {}),
    "nezha": ("nezha", {}),
}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--bundle", required=True)
    ap.add_argument("--n", type=int, default=200, help="validation requests per policy")
    ap.add_argument("--k", type=int, default=10)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--profile", default="specgr (gamma -1)", help="setup to run under cProfile")
    a = ap.parse_args(argv)

    import torch

    from specrec.bundle import Bundle, bundle_split
    from specrec.policies import make_policy
    from specrec.policies.requests import RecRequest
    from specrec.terminal import progress_bar

    torch.set_num_threads(a.threads)
    bundle = Bundle.load(a.bundle)
    _, split = bundle_split(bundle)
    ex = split.valid.head(a.n)
    hists = [h[h >= 0] for h in ex.history]
    engine = bundle.engine(drafter="retrieval")
    out, prof_text = {}, ""
    for label, (name, params) in SETUPS.items():
        pol = make_policy(name, engine, **params)
        pol.run([RecRequest(np.asarray(hists[0]), a.k)])  # warm-up
        stages, walls, rounds = defaultdict(list), [], []
        prof = cProfile.Profile() if label == a.profile else None
        for h in progress_bar(hists, desc=label, leave=False):
            t0 = time.perf_counter()
            if prof:
                prof.enable()
            res = pol.run([RecRequest(np.asarray(h), a.k)])[0]
            if prof:
                prof.disable()
            walls.append((time.perf_counter() - t0) * 1000)
            rounds.append(res.stats.rounds)
            for s, ms in res.stats.stage_ms.items():
                stages[s].append(ms)
        mean = {s: float(np.sum(v) / len(hists)) for s, v in stages.items()}
        mean["other"] = float(np.mean(walls)) - sum(mean.values())
        out[label] = {"mean_ms": float(np.mean(walls)), "p50_ms": float(np.median(walls)), "stages_mean_ms": mean,
                      "rounds_mean": float(np.mean(rounds)), "policy": name, "params": params}
        if prof:
            s = io.StringIO()
            pstats.Stats(prof, stream=s).sort_stats("cumulative").print_stats(25)
            prof_text = s.getvalue()
    cmd = command_line("bench.profile_policies", argv)
    write_json("profile_policies", {"command": cmd, "n": len(hists), "k": a.k, "threads": a.threads, "setups": out})
    stage_names = sorted({s for r in out.values() for s in r["stages_mean_ms"]})
    md = [f"# Where the time goes, per policy\n\nCommand: `{cmd}`\n\n{len(hists)} validation requests, K = {a.k}, "
          f"batch 1, {a.threads} threads, mean ms per request by stage.\n",
          "| setup | mean ms | rounds | " + " | ".join(stage_names) + " |",
          "|---|---|---|" + "---|" * len(stage_names)]
    for label, r in out.items():
        md.append(f"| {label} | {r['mean_ms']:.1f} | {r['rounds_mean']:.2f} | "
                  + " | ".join(f"{r['stages_mean_ms'].get(s, 0):.1f}" for s in stage_names) + " |")
    md.append(f"\n## cProfile of `{a.profile}` (cumulative, top 25)\n\n```\n{prof_text.strip()}\n```\n")
    (RESULTS_DIR / "profile_policies.md").write_text("\n".join(md))

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4))
    left = np.zeros(len(out))
    for s in stage_names:
        v = np.array([max(r["stages_mean_ms"].get(s, 0.0), 0.0) for r in out.values()])
        ax.barh(list(out), v, left=left, label=s)
        left += v
    ax.set_xlabel("mean ms per request (batch 1)")
    ax.set_title(f"Where the time goes: {bundle.meta.get('dataset')}, K={a.k}, {a.threads} CPU threads")
    ax.legend(fontsize=8, loc="lower right")
    ax.invert_yaxis()
    fig.tight_layout()
    fig.savefig(RESULTS_DIR / "profile_policies.png", dpi=120)
    print("\n".join(md[:len(out) + 3]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
