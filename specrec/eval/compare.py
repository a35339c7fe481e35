"""Policies side by side on the same requests (``specrec eval --policies``).

Every request goes through every policy in turn (interleaved, batch 1), so
they are timed under the same machine state; the order rotates by one policy
per request, so none is always first (the identical encode got cheaper with its
position: 1.25 / 1.11 / 1.09 / 0.97 ms when beam always ran first); a few
warm-up requests are not timed. Besides quality and latency it reports what each policy's stats say:
item and token acceptance, the share of requests a level-wise policy served
without a fallback pass, the stage times (plotted), and, with
``eager_beam``, the default beam against beam search on the eager
(reference) backend.
"""

from __future__ import annotations

import time
from collections import defaultdict
from dataclasses import dataclass, field

import numpy as np

from ..data.splits import Examples, Split
from ..policies import RecRequest
from ..terminal import progress_bar
from .evaluate import EvalResult, summarise


@dataclass
class Run:
    ranked: np.ndarray  # [N, K]
    secs: np.ndarray  # [N]
    stage_ms: dict[str, float] = field(default_factory=dict)  # mean per request


def compare_policies(policies: dict, ex: Examples, k: int, progress: bool = True, warmup: int = 5,
                     exclude: list[np.ndarray] | None = None, clock=time.perf_counter) -> dict[str, Run]:
    """Every policy on every request, interleaved, batch 1, in an order that rotates by one policy per request.
    With ``exclude`` (each user's whole history, :meth:`~specrec.data.splits.Examples.full_histories`)
    requests carry it and exclude it. The warm-up requests are left out of every counter the engines keep
    (their :class:`~specrec.policies.metrics.SpecMetrics` start again after them)."""
    hists = ex.histories() if exclude is None else exclude
    excl = exclude is not None
    for pol in policies.values():
        for h in hists[:warmup]:
            pol.run([RecRequest(np.asarray(h, dtype=np.int64), k, exclude_history=excl)])
    for eng in {id(p.engine): p.engine for p in policies.values()}.values():
        eng.metrics.reset()
    runs = {n: Run(np.full((len(ex), k), -1, dtype=np.int64), np.zeros(len(ex))) for n in policies}
    stages: dict[str, defaultdict[str, float]] = {n: defaultdict(float) for n in policies}
    for i in progress_bar(range(len(ex)), desc="requests", disable=not progress, leave=False):
        req = RecRequest(np.asarray(hists[i], dtype=np.int64), k, exclude_history=excl)
        names = list(policies)
        for name in names[i % len(names):] + names[: i % len(names)]:  # rotated: no policy always runs first
            pol = policies[name]
            t0 = clock()
            res = pol.run([req])[0]
            runs[name].secs[i] = clock() - t0
            runs[name].ranked[i, : len(res.items)] = res.items[:k]
            for s, ms in res.stats.stage_ms.items():
                stages[name][s] += ms
    for name in policies:
        runs[name].stage_ms = {s: v / len(ex) for s, v in stages[name].items()}
    return runs


def comparison_table(runs: dict[str, Run], ex: Examples, split: Split, ks, metrics: dict) -> tuple[dict, list[dict]]:
    """Per policy: an EvalResult with the comparison figures in ``extra``, and table rows."""
    beam = runs["beam"]
    beam_mean = float(beam.secs.mean())
    eager = runs.get("beam@eager")
    table, rows = {}, []
    for n, run in runs.items():
        res: EvalResult = summarise(n, run.ranked, run.secs, ex, split, ks)
        snap = metrics.get(n.split("@")[0], {}) if "@" not in n else {}
        x = res.extra
        x["mean_ms"] = float(run.secs.mean() * 1000)
        x["speedup_vs_beam"] = beam_mean / float(run.secs.mean())
        if eager is not None:
            x["speedup_vs_eager"] = float(eager.secs.mean()) / float(run.secs.mean())
        x["stage_ms"] = run.stage_ms
        for key in ("item_acceptance", "token_acceptance", "no_fallback_share", "exit_reasons", "requests",
                    "drafted_level_coverage", "drafted_level_coverage_by_level", "whole_frontier_share",
                    "frontier_coverage_by_level", "accepted_tokens_by_position", "draft_tokens_by_position"):
            if key in snap:
                x[key] = snap[key]
        x["equal_to_beam"] = float(np.mean([np.array_equal(a, b) for a, b in zip(run.ranked, beam.ranked)]))
        ref = summarise("beam", beam.ranked, beam.secs, ex, split, ks).overall
        ratio = {m: res.overall[m] / ref[m] if ref[m] else float("nan") for m in ref if m.startswith("recall@")}
        x["recall_ratio_vs_beam"] = ratio[f"recall@{max(ks)}"]  # at the list's K
        if max(ks) != 10 and "recall@10" in ratio:
            x["recall@10_ratio_vs_beam"] = ratio["recall@10"]
        table[n] = res
        row = {"policy": n, **res.overall, "p50_ms": res.latency["p50_ms"], "p99_ms": res.latency["p99_ms"],
               "speedup": x["speedup_vs_beam"], "item_accept": x.get("item_acceptance", float("nan")),
               "token_accept": x.get("token_acceptance", float("nan")),
               "no_fallback": x.get("no_fallback_share", float("nan")), "equal_to_beam": x["equal_to_beam"]}
        for g, m in res.groups.items():
            row.update({f"{g}_{kk}": v for kk, v in m.items()})
        rows.append(row)
    return table, rows


def summary_keys(table: dict, dataset: str, protocol: str, k: int, tag: str = "") -> dict:
    """Summary keys: ``<dataset>.<protocol>.<policy>[.k<K>][<tag>].<figure>`` (no infix at K = 10; ``tag``:
    ``.excl`` for requests that exclude their history)."""
    keys = {}
    infix = ("" if k == 10 else f".k{k}") + tag
    if table:  # the block's sample: the requests every policy of the run answered (temporal keys name no K)
        block = f"{dataset}.{protocol}.policies" + (tag if protocol == "temporal" else infix)
        keys[f"{block}.users"] = next(iter(table.values())).n
    for n, r in table.items():
        if "@" in n:
            continue
        pre = f"{dataset}.{protocol}.{n}{infix}"
        x = r.extra
        if protocol == "loo":
            if n != "beam":  # beam's own quality keys come from `specrec eval` (width 50, all users)
                for m in (f"recall@{k}", f"ndcg@{k}"):
                    keys[f"{pre}.{m}"] = r.overall.get(m)
                keys[f"{pre}.speedup_vs_beam"] = x["speedup_vs_beam"]
                keys[f"{pre}.recall_ratio_vs_beam"] = x["recall_ratio_vs_beam"]  # recall@K's
                if "recall@10_ratio_vs_beam" in x:
                    keys[f"{pre}.recall@10_ratio_vs_beam"] = x["recall@10_ratio_vs_beam"]
            elif "beam@eager" in table:  # the fast path's list against the eager reference's, request by request
                keys[f"{pre}.equal_to_eager"] = table["beam@eager"].extra["equal_to_beam"]
            if "speedup_vs_eager" in x:  # every policy's mean time against the eager reference beam's
                keys[f"{pre}.speedup_vs_eager"] = x["speedup_vs_eager"]
            keys[f"{pre}.p99_ms"] = r.latency["p99_ms"]  # its tail, beside beam's of the same run
            if n == "strict":
                keys[f"{pre}.equal_to_beam"] = x["equal_to_beam"]
                keys[f"{pre}.no_fallback_share"] = x.get("no_fallback_share")
                for key in ("drafted_level_coverage", "whole_frontier_share"):
                    if key in x:
                        keys[f"{pre}.{key}"] = x[key]
            if n == "specgr":
                keys[f"{pre}.item_acceptance"] = x.get("item_acceptance")
            if n == "drafter":  # the degraded-mode answer: its recall at this K, under one name per K
                keys[f"{dataset}.{protocol}.drafter.recall@{k}"] = r.overall.get(f"recall@{k}")
            if n in ("fused", "auto") and "drafter" in table:  # against the item drafter's own list (SASRec's)
                name = "served" if n == "auto" else n  # auto's list: the one it serves by default
                own = table["drafter"].overall
                for m, ratio in ((f"recall@{k}", "recall_ratio_vs_sasrec"), (f"ndcg@{k}", "ndcg_ratio_vs_sasrec")):
                    mine = r.overall.get(m)
                    keys[f"{dataset}.{protocol}.{name}{infix}.{ratio}"] = (
                        mine / own[m] if mine is not None and own.get(m) else None)
        if protocol == "temporal":  # the figures name their K: no .k<K> infix (SpecGR's protocol reports @50)
            for g in ("overall", "unseen", "in_sample"):
                m = r.overall if g == "overall" else r.groups.get(g, {})
                for metric in (f"recall@{k}", f"ndcg@{k}"):
                    if metric in m:
                        keys[f"{dataset}.{protocol}.{n}{tag}.{'' if g == 'overall' else g + '_'}{metric}"] = m[metric]
    return keys


def valid_pair(fusion_meta: dict, metric: str) -> tuple[float | None, float | None]:
    """The fused list's and the item drafter's own ``metric`` on the same validation users: the pair
    ``tune-fusion``'s default-list decision compared (``fusion.default``), else ``fusion.valid``'s. Where a learned
    combiner is kept the fused list is judged on the half it was not trained on, and a bundle tuned before
    2026-12-07 has the drafter's figure in ``fusion.valid`` from every user: a ratio of the two mixed users."""
    pair = (fusion_meta.get("default") or {}).get(metric) or {}
    if pair.get("fused") is not None and pair.get("drafter") is not None:
        return pair["fused"], pair["drafter"]
    valid = fusion_meta.get("valid", {})
    return valid.get("fused", {}).get(metric), valid.get("drafter", {}).get(metric)


def valid_against_test(fusion_meta: dict | None, table: dict, k: int) -> dict | None:
    """The fused list and the item drafter's own list on validation users (as ``tune-fusion`` measured them with
    the chosen models, :attr:`specrec.fusion.Fusion.valid`) beside the same lists on these test users (``table``:
    a run with ``fused`` and ``drafter`` at K = 10), the fused/drafter ratio on each and their gap, and the list
    ``auto`` serves by default with the reason ``tune-fusion`` recorded (``fusion.default``); None where the bundle
    has no fusion or the run lacks one of the two lists."""
    if not fusion_meta or k != 10 or "fused" not in table or "drafter" not in table:
        return None
    out: dict = {"default": fusion_meta.get("default")}
    for m in ("recall@10", "ndcg@10"):
        v_f, v_d = valid_pair(fusion_meta, m)
        t_f, t_d = table["fused"].overall.get(m), table["drafter"].overall.get(m)
        row: dict = {"valid.fused": v_f, "valid.drafter": v_d, "test.fused": t_f, "test.drafter": t_d}
        row["valid.ratio"] = v_f / v_d if v_f is not None and v_d else None
        row["test.ratio"] = t_f / t_d if t_f is not None and t_d else None
        if row["valid.ratio"] is not None and row["test.ratio"] is not None:
            row["gap"] = abs(row["test.ratio"] - row["valid.ratio"])
        if "auto" in table:
            row["test.served"] = table["auto"].overall.get(m)
            row["test.served_ratio"] = row["test.served"] / t_d if t_d else None
        out[m] = row
    return out


def valid_against_test_lines(vt: dict) -> list[str]:
    """What :func:`valid_against_test` says, as lines for a terminal or a log."""
    lines = []
    for m in ("recall@10", "ndcg@10"):
        r = vt[m]

        def f(x) -> str:
            return "n/a" if x is None else f"{x:.4f}"

        def x(v) -> str:
            return "n/a" if v is None else f"{v:.3f}x"

        lines.append(f"{m}: validation fused {f(r['valid.fused'])} / drafter {f(r['valid.drafter'])} = "
                     f"{x(r['valid.ratio'])}; test fused {f(r['test.fused'])} / drafter {f(r['test.drafter'])} = "
                     f"{x(r['test.ratio'])}" + (f"; gap {r['gap']:.3f}" if "gap" in r else "")
                     + (f"; auto's default list on test {x(r.get('test.served_ratio'))} the drafter's"
                        if "test.served" in r else ""))
    lines.append(default_line(vt.get("default")))
    return lines


def default_line(default: dict | None) -> str:
    """Which list ``auto`` serves by default and why (a bundle's ``fusion.default``, written by tune-fusion)."""
    if not default:
        return ("auto's default list: not decided (no fusion, or one chosen before tune-fusion decided it): its "
                "tiers by their validation figures alone")
    return f"auto serves `{default['list']}` by default: {default['why']}"


def plot_stages(table: dict, path, title: str) -> None:
    """Stacked bars: mean milliseconds per stage, per policy."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(table)
    stages = sorted({s for r in table.values() for s in r.extra["stage_ms"] if s != "total"})
    fig, ax = plt.subplots(figsize=(max(6, 1.1 * len(names) + 2), 4.2))
    bottom = np.zeros(len(names))
    for s in stages:
        v = np.asarray([table[n].extra["stage_ms"].get(s, 0.0) for n in names])
        ax.bar(names, v, bottom=bottom, label=s)
        bottom += v
    ax.scatter(names, [table[n].extra["mean_ms"] for n in names], color="k", marker="_", s=400, zorder=5,
               label="mean wall time")
    ax.set_ylabel("ms per request (mean)")
    ax.set_title(title, fontsize=10)
    ax.legend(fontsize=8, ncol=2)
    ax.grid(True, axis="y", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
