"""A policy's speed predicted from measured parts, against the policy's measured speed.

The prediction reads only inputs measured apart from the policy it predicts, so the comparison can fail:

- the calls' costs, batch 1, from ``bench.drafters`` (``drafters.json``, ``cost_ms``): the encoder, the target's
  whole beam search of width K, the distilled drafter's search of width N, ``strict``'s draft-and-verify call at
  (K, N) (its misses resumed, for the share of rows the drafts missed in that run);
- one decoder pass's cost, ``f + n * c`` for n nodes, from ``bench.pass_cost`` (``pass_cost.json``);
- from the policies' run (``specrec eval --policies``, ``beauty_loo_policies_k{10,50}.json``) only counts and
  rates: ``strict``'s drafts per level and the share of rows its drafts covered whole; and ``beam``'s mean time,
  which turns the predicted speedup into a predicted time (beam is measured as its own policy).

Per policy and K:

- ``nezha`` answers from the distilled drafter's K beams (no verification):
  ``t = encode + drafter search (N = K)``;
- ``strict`` drafts N per level and verifies in one call; rows whose drafts missed the target's frontier are
  resumed by L - 2 passes over K beams:
  ``t = encode + strict call (K, N) + (covered share in bench.drafters - covered share in the run) x resume``,
  ``resume = (L - 2) x (f + K c)``, N the measured draft count nearest the run's mean;
- ``beam``: ``t = encode + beam search (K)``.

predicted speedup = t_beam / t_policy; predicted time = beam's measured mean time / predicted speedup; it agrees
with the policy's measured mean time within :data:`TOLERANCE`. The seed's model, (1 + alpha L) / (1 + rho L)
(alpha: ``strict``'s drafted-level coverage, ``nezha``'s recall ratio to beam; rho: the drafter's call over one
decoder pass of K nodes), is reported beside it: it takes verification as free, which on a CPU it is not.

``specgr`` and ``fused`` are left out: the node count of their scoring pass is measured by no step.

    python -m bench.cost_model      # step policies; reads the JSON files above, writes cost_model.{json,png}
"""

from __future__ import annotations

import json
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results"

#: a prediction agrees when predicted / measured time lies within [1 / (1 + TOLERANCE), 1 + TOLERANCE]. The parts
#: come from other runs than the policies' (other users, other minutes; the same command's times move by ~10%
#: between runs, and ``bench.drafters``' call times by more between neighbouring rows), so closer would be luck
TOLERANCE = 0.25


def _nearest(measured: list[int], n: float) -> int:
    return min(measured, key=lambda m: (abs(m - n), m))


def predict(policies: dict[int, dict], drafters: dict, pass_cost: dict) -> list[dict]:
    """``policies``: K -> that run's ``policies`` object; ``drafters``: ``drafters.json``; ``pass_cost``:
    ``pass_cost.json``. One row per (policy, K) predicted, with what it read and whether it agrees."""
    cost, cover = drafters["cost_ms"], drafters["coverage"]
    L = 1 + len(next(iter(cover.values()))["levels"])  # coverage is of prefix lengths 1 .. L-1
    f, c = pass_cost["pass_fixed_ms"], pass_cost["pass_node_us"] / 1000.0
    out = []
    for k, pol in sorted(policies.items()):
        if "beam" not in pol or f"beam.k{k}" not in cost:
            continue
        encode, t_beam = cost["encode"], cost["encode"] + cost[f"beam.k{k}"]
        beam_ms = pol["beam"]["mean_ms"]
        for name, r in pol.items():
            row: dict = {"policy": name, "k": k, "measured_ms": r["mean_ms"], "beam_measured_ms": beam_ms}
            if name == "nezha" and f"sid_mlp_search.n{k}" in cost:
                drafter_call = cost[f"sid_mlp_search.n{k}"]
                t = encode + drafter_call
                alpha = r["recall_ratio_vs_beam"]
                row.update(inputs={"encode_ms": encode, "drafter_search_ms": drafter_call, "n": k})
            elif name == "strict" and "drafted_level_coverage" in r:
                ns = sorted(int(key.rsplit(".n", 1)[1]) for key in cost if key.startswith(f"draft_verify.k{k}.n"))
                if not ns:
                    continue
                drafted = r.get("draft_tokens_by_position", {}).get("1")
                n = _nearest(ns, drafted / r["n"] if drafted else 2 * k)
                call, drafter_call = cost[f"draft_verify.k{k}.n{n}"], cost[f"sid_mlp_search.n{n}"]
                resume = (L - 2) * (f + k * c)
                covered_there, covered_here = cover[f"sid_mlp.k{k}.n{n}"]["whole"], r["whole_frontier_share"]
                t = encode + call + (covered_there - covered_here) * resume
                alpha = r["drafted_level_coverage"]
                row.update(inputs={"encode_ms": encode, "strict_call_ms": call, "drafter_search_ms": drafter_call,
                                   "n": n, "covered_share_drafters": covered_there, "covered_share_run": covered_here,
                                   "resume_ms": resume})
            else:
                continue
            speedup = t_beam / t
            rho = drafter_call / (f + k * c)
            row.update(predicted_speedup=speedup, measured_speedup=r["speedup_vs_beam"],
                       predicted_ms=beam_ms / speedup, seed_speedup=(1 + alpha * L) / (1 + rho * L),
                       seed_alpha=alpha, seed_rho=rho)
            row["inputs"].update(beam_search_ms=cost[f"beam.k{k}"], pass_fixed_ms=f, pass_node_us=c * 1000.0, L=L)
            row["ratio"] = row["predicted_ms"] / row["measured_ms"]
            row["agrees"] = bool(1 / (1 + TOLERANCE) <= row["ratio"] <= 1 + TOLERANCE)
            out.append(row)
    return out


def read_inputs(results: Path = RESULTS) -> tuple[dict[int, dict], dict, dict]:
    policies = {k: json.loads((results / f"beauty_loo_policies_k{k}.json").read_text())["policies"]
                for k in (10, 50) if (results / f"beauty_loo_policies_k{k}.json").exists()}
    missing = [p for p in ("drafters.json", "pass_cost.json") if not (results / p).exists()]
    if missing or not policies:
        raise SystemExit(f"bench.cost_model needs {missing or 'beauty_loo_policies_k10.json / _k50.json'} in "
                         f"{results} (steps drafters, profile, policies of bench/rerun.sh)")
    return (policies, json.loads((results / "drafters.json").read_text()),
            json.loads((results / "pass_cost.json").read_text()))


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.5, 4.2))
    top = max([1.0, *(max(r["measured_ms"], r["predicted_ms"]) for r in rows)]) * 1.1
    ax.plot([0, top], [0, top], color="gray", lw=0.8)
    ax.fill_between([0, top], [0, top / (1 + TOLERANCE)], [0, top * (1 + TOLERANCE)], color="gray", alpha=0.12)
    for r in rows:
        ax.scatter(r["measured_ms"], r["predicted_ms"], marker="o" if r["k"] == 10 else "s", s=45,
                   color="tab:green" if r["agrees"] else "tab:red")
        ax.annotate(f"{r['policy']} K={r['k']}", (r["measured_ms"], r["predicted_ms"]), fontsize=7, xytext=(4, 2),
                    textcoords="offset points")
    ax.set_xlabel("measured mean ms per request (specrec eval --policies)")
    ax.set_ylabel("predicted from the parts' measured costs, ms")
    ax.set_title(f"Predicted against measured (shaded: within {TOLERANCE:.0%}; squares: K=50)", fontsize=9)
    ax.set_xlim(0, top)
    ax.set_ylim(0, top)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main() -> int:
    rows = predict(*read_inputs())
    plot(rows, RESULTS / "cost_model.png")
    (RESULTS / "cost_model.json").write_text(json.dumps({"tolerance": TOLERANCE, "rows": rows}, indent=1) + "\n")
    for r in rows:
        print(f"{r['policy']:7s} K={r['k']:2d}: predicted {r['predicted_ms']:.1f} ms ({r['predicted_speedup']:.2f}x "
              f"beam), measured {r['measured_ms']:.1f} ms ({r['measured_speedup']:.2f}x): "
              f"{'agrees' if r['agrees'] else 'DISAGREES'}; the seed's model {r['seed_speedup']:.2f}x")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
