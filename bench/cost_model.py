"""The seed's cost model against what was measured.

The survey's model (seeds/000): Speedup ~= (1 + alpha K) / (1 + rho K), with alpha the
acceptance per drafted step and rho the drafter's cost relative to one target step. For
SID decoding the steps are the L levels. Per policy and K this plots the measured
speedup over beam (``specrec eval --policies``, same run) against the measured alpha,
and the model's prediction from the measured alpha and rho:

- ``strict``: alpha = frontier coverage (share of the target's kept prefixes per level that
  the drafts held), rho = the distilled drafter's call / the beam search (``drafters.json``);
- ``specgr``: alpha = item acceptance, rho = its draft stage / beam's time;
- ``nezha``: alpha = recall ratio to beam, rho = its whole time / beam's (it never verifies).

    python -m bench.cost_model      # reads bench/results/beauty_loo_policies_k{10,50}.json, drafters.json
"""

from __future__ import annotations

import json
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results"


def points() -> list[dict]:
    drafters = json.loads((RESULTS / "drafters.json").read_text()) if (RESULTS / "drafters.json").exists() else {}
    out = []
    for k in (10, 50):
        f = RESULTS / f"beauty_loo_policies_k{k}.json"
        if not f.exists():
            continue
        run = json.loads(f.read_text())
        pol = run["policies"]
        beam_ms = pol["beam"]["mean_ms"]
        L = 4
        for name, r in pol.items():
            x = r
            if name == "strict" and "drafted_level_coverage" in x:
                drafted = x.get("draft_tokens_by_position", {})
                n = round(drafted.get("1", 2 * k * x["n"]) / max(1, x["n"]))  # mean drafts per level (adaptive)
                near = min(drafters.get("curve", []), key=lambda c: (c["k"] != k, abs(c["n"] - n)), default=None)
                call = near["sid_mlp_search_ms"] if near else x["stage_ms"].get("draft_verify", 0)
                alpha, rho = x["drafted_level_coverage"], call / beam_ms
            elif name == "specgr" and x.get("item_acceptance") == x.get("item_acceptance"):
                alpha, rho = x["item_acceptance"], x["stage_ms"].get("draft", 0.0) / beam_ms
            elif name == "nezha":
                alpha, rho = x["recall_ratio_vs_beam"], x["mean_ms"] / beam_ms
            else:
                continue
            out.append({"policy": name, "k": k, "alpha": alpha, "rho": rho, "measured": x["speedup_vs_beam"],
                        "predicted": (1 + alpha * L) / (1 + rho * L)})
    return out


def main() -> int:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    pts = points()
    fig, ax = plt.subplots(figsize=(6.5, 4.2))
    for p in pts:
        ax.scatter(p["alpha"], p["measured"], marker="o" if p["k"] == 10 else "s", s=50)
        ax.scatter(p["alpha"], p["predicted"], marker="x", color="k", s=40)
        ax.plot([p["alpha"]] * 2, [p["measured"], p["predicted"]], color="gray", lw=0.8)
        ax.annotate(f"{p['policy']} K={p['k']}", (p["alpha"], p["measured"]), fontsize=7, xytext=(4, 2),
                    textcoords="offset points")
    ax.axhline(1.0, ls=":", color="gray")
    ax.set_xlabel("measured alpha (strict: frontier coverage; specgr: item acceptance; nezha: recall ratio)")
    ax.set_ylabel("speedup over beam")
    ax.set_title("Measured (dots, squares: K=50) vs the seed's (1 + aL)/(1 + rL) (crosses)", fontsize=9)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(RESULTS / "cost_model.png", dpi=120)
    (RESULTS / "cost_model.json").write_text(json.dumps(pts, indent=1) + "\n")
    for p in pts:
        print(f"{p['policy']:7s} K={p['k']:2d}: alpha {p['alpha']:.3f} rho {p['rho']:.3f} -> predicted "
              f"{p['predicted']:.2f}x, measured {p['measured']:.2f}x")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
