"""Serving at a budget: quality and latency through the gateway.

    python -m bench.serving --bundle bundles/beauty-loo --policies auto,beam,strict,nezha,specgr \\
        --rates 10,20,30,40,60,80 --duration 15 --requests 500

Starts its own stack on this machine (Redis: ``--redis-url`` / ``$REDIS_URL``,
else 127.0.0.1:6379, else a private ``redis-server``; the item set, verifier,
drafter and gateway as subprocesses on free ports, a private namespace) and
stops all of it at the end, Ctrl-C and SIGTERM included.

Requests are a seeded random sample of leave-one-out *test* users of the
bundle's dataset: history = the last ``max_history`` items before the test
target; the target is kept to score the answers.

Phases:

1. ``offline``: beam search in this process on the same users (K = 10, width
   K): the reference Recall@10 of every pass rule;
2. ``overhead``: per policy, closed loop, one request at a time, in-process,
   then through the gateway (two passes: never beside each other), with a
   generous budget (so budgets never act): the gateway's own time, and its
   p50 minus in-process p50;
3. ``closed``: per policy, closed loop at the budget (``--budget-ms``):
   Recall/NDCG@10 of the answers, the share of answers holding catalogue fill
   and made only of fill, budget exits, the policy that served, p50/p95/p99;
4. ``open``: per policy, open loop (Poisson arrivals, grpc.aio) at rising
   offered rates: the same figures and the achieved rate. Latency runs from
   the *scheduled* send time, so queueing in the client counts.

A rate **passes** when p99 <= the budget, at least 99% of answers hold no
fill, at most 1% of requests got no answer (refused with RESOURCE_EXHAUSTED
or failed), and Recall@10 of the answers >= 0.95 x the offline beam's on the
same requests. The figure per policy is the highest tested rate such that it
and every lower tested rate pass.

Writes ``serving.{json,md}`` and ``serving.png`` (R@10 and p99 against the
offered rate, per policy) into ``--out``, the summary keys
``gateway.<policy>.overhead_p50_ms``, ``gateway.<policy>.max_rps_p99_<B>ms``,
``gateway.<policy>.p50_ms``, ``gateway.<policy>.p99_ms_at_<B>ms`` (the caller's clock) and
``gateway.<policy>.server_p99_ms_at_<B>ms`` (the gateway's own, ``stats.total_ms``), with
``gateway.<policy>.budget_exit_share_at_<B>ms`` and ``.gr_ranked_share_at_<B>ms`` (closed loop at the budget;
GR-ranked: a list the GR model made or ranked, not the item drafter's own, no catalogue fill, as
``bench.loadgen.model_answer`` counts them), ``gateway.fused.fused_share_at_<B>ms`` (the fused policy's own lists,
not degraded), ``gateway.<policy>.overhead_p50_ms`` (the gateway's total less its callees' own server time on the
critical path, one request at a time), ``gateway.auto.gr_ranked_share_open_<R>rps`` (open loop) and
``gateway.auto.client_p99_ms_open_<R>rps`` (its p99 at the caller, from each request's scheduled send),
``gateway.auto.recall_ratio_vs_fused_at_<B>ms`` (auto's answers' R@10 over the fused policy's in this process on
the same users),
``gateway.auto.recall_ratio_at_<B>ms`` and ``gateway.auto.all_fill_share_at_<B>ms``,
and this benchmark's section of README.md there.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from bench.cpus import restore
from bench.harness import (
    Redis,
    Stack,
    add_common_args,
    command_line,
    fmt,
    machine_line,
    machine_of,
    no_nan,
    publish,
    raise_on_signals,
    run_line,
    sample_users,
    sayer,
)
from bench.serving_phases import (
    best_rate,
    closed_loop,
    offline_beam,
    offline_fused,
    offline_sasrec,
    open_loop,
    overhead,
    passes,
    place_generator,
    summarise,
)
from specrec.eval.results import paragraph
from specrec.terminal import markdown_table

RETIRED_KEYS = ("gateway.specgr.max_rps_p99_30ms", "gateway.specgr.p99_ms_at_20rps", "gateway.beam.p99_ms_at_20rps",
                "gateway.beam.grpc_overhead_p50_ms", "gateway.specgr.grpc_overhead_p50_ms",
                # a ratio of SASRec's list to itself whenever auto served it; replaced by ..._vs_fused_at_<B>ms
                "gateway.auto.recall_ratio_vs_sasrec_at_30ms",
                # named gr_ranked_share_at_<B>ms now (the same rule: the GR made or ranked the list, no fill)
                *(f"gateway.{p}.model_answer_share_at_30ms" for p in ("auto", "beam", "strict", "nezha", "specgr")),
                *(f"gateway.temporal.{p}.model_answer_share" for p in ("auto", "beam", "specgr")))
#: this benchmark's section of the results README (``<!-- bench.serving: begin -->`` ... ``end``)
README_OWNER = "bench.serving"

say = sayer("serving")


# -- outputs ------------------------------------------------------------------------------------
def plot(rows: list[dict], policies: list[str], budget_ms: float, path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a1, a2) = plt.subplots(1, 2, figsize=(11, 4.4))
    colours = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for c, pol in zip(colours, policies):
        rr = sorted((r for r in rows if r["policy"] == pol and r["answered"]), key=lambda r: r["offered_rps"])
        if not rr:
            continue
        x = [r["offered_rps"] for r in rr]
        a1.plot(x, [r["recall@10"] for r in rr], "-o", color=c, label=pol)
        a2.plot(x, [r["p99_ms"] for r in rr], "-o", color=c, label=f"{pol} p99")
        fails = [r for r in rr if not r["pass"]]
        a2.scatter([r["offered_rps"] for r in fails], [r["p99_ms"] for r in fails], marker="x", color="k", zorder=5)
    ref = [r["offline_beam_recall@10"] for r in rows if r["answered"]]
    if ref:
        a1.axhline(0.95 * float(np.mean(ref)), color="red", linewidth=1, label="0.95 x offline beam")
    a2.axhline(budget_ms, color="red", linewidth=1, label=f"budget {budget_ms:g} ms")
    a2.scatter([], [], marker="x", color="k", label="rate fails")
    a2.set_yscale("log")
    for ax, ylab in ((a1, "Recall@10 of the answers"), (a2, "p99 latency from scheduled send (ms)")):
        ax.set_xlabel("offered rate (requests/s, Poisson)")
        ax.set_ylabel(ylab)
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def summary_of(res: dict, policies: list[str], budget_ms: float) -> dict:
    """The summary keys of a run (``res``: what ``serving.json`` holds)."""
    b = f"{budget_ms:g}"
    summary: dict = {}
    for p, o in res["overhead"].items():
        summary[f"gateway.{p}.overhead_p50_ms"] = o["overhead_p50_ms"]
    for p in policies:
        if p in res["max_rps"]:
            summary[f"gateway.{p}.max_rps_p99_{b}ms"] = res["max_rps"][p]
    for p, c in res["closed"].items():  # closed loop at the budget, the same users for every policy
        summary[f"gateway.{p}.p50_ms"] = c["p50_ms"]
        summary[f"gateway.{p}.p99_ms_at_{b}ms"] = c["p99_ms"]
        summary[f"gateway.{p}.server_p99_ms_at_{b}ms"] = c["server_p99_ms"]
        summary[f"gateway.{p}.budget_exit_share_at_{b}ms"] = c["budget_exit_share"]
        summary[f"gateway.{p}.gr_ranked_share_at_{b}ms"] = c["gr_ranked_share"]
        if p == "fused":
            summary[f"gateway.fused.fused_share_at_{b}ms"] = c["fused_share"]
    auto = res["closed"].get("auto")
    if auto:
        ref = auto["offline_beam_recall@10"]
        summary[f"gateway.auto.recall_ratio_at_{b}ms"] = auto["recall@10"] / ref if ref else None
        summary[f"gateway.auto.all_fill_share_at_{b}ms"] = auto["all_fill_share"]
        fused = res.get("offline_fused_recall@10")
        if fused:  # against the best list we have (in process, no budget), on the same users
            summary[f"gateway.auto.recall_ratio_vs_fused_at_{b}ms"] = auto["recall@10"] / fused
    for r in res["open"]:  # how much of auto's open-loop answers the GR made or ranked, per offered rate
        if r["policy"] == "auto":
            summary[f"gateway.auto.gr_ranked_share_open_{r['offered_rps']:g}rps"] = r["gr_ranked_share"]
            summary[f"gateway.auto.client_p99_ms_open_{r['offered_rps']:g}rps"] = r["p99_ms"]
    return summary


def readme_body(res: dict, summary: dict) -> str:
    """This benchmark's section of the results README: per policy, the closed loop at the budget and the
    gRPC path's overhead; the open loop's highest passing rate; the plot. The words are the README's (its
    "Words used below"); every column and rate is in ``serving.md``."""
    b = f"{res['budget_ms']:g}"
    rows = []
    for p, c in res["closed"].items():
        o = res["overhead"].get(p, {})
        rows.append(f"| {p} | {fmt(c['p50_ms'])} | {fmt(c['p99_ms'])} | {fmt(c['server_p99_ms'])} | "
                    f"{fmt(c['budget_exit_share'], '.1%')} | {fmt(c['gr_ranked_share'], '.1%')} | "
                    f"{fmt(o.get('overhead_p50_ms'), '.2f')} |")
    tried = ", ".join(f"{x:g}" for x in sorted({r["offered_rps"] for r in res["open"]}))
    rates = "; ".join(f"{p}: {f'none of {tried} rps' if v is None else f'{v:g} rps'}"
                      for p, v in res["max_rps"].items())
    auto = ""
    if "auto" in res["closed"]:
        ratio, fill = (summary.get(f"gateway.auto.{k}_at_{b}ms") for k in ("recall_ratio", "all_fill_share"))
        fused = summary.get(f"gateway.auto.recall_ratio_vs_fused_at_{b}ms")
        served = ", ".join(f"{x} {n}" for x, n in res["closed"]["auto"]["served_by"].items())
        auto = (f"`auto` in the closed loop (served by {served}): R@10 {fmt(ratio, '.3f')} x the offline beam's on "
                "the same users" + ("" if fused is None else f", {fmt(fused, '.3f')} x the in-process fused list's")
                + f", {fmt(fill, '.1%')} of answers only fill.")
    return "\n".join([
        "## Serving through the gateway (`bench.serving`, `gateway.*`)\n",
        paragraph(f"Run: {res.get('run', 'n/a')}. {machine_of(res)}. {res['users']}, K = {res['k']}; closed loop, one "
                  f"request at a time, at the {b} ms budget (keys `gateway.<policy>.*`). Every column: "
                  "[`serving.md`](serving.md)."),
        paragraph(f"Command (step `serving`): `{res['command']}`"),
        "| policy | p50 ms | p99 ms | server p99 ms | budget exits | GR-ranked | overhead p50 ms |",
        "|---|---|---|---|---|---|---|",
        *rows,
        "",
        paragraph(f"Open loop (Poisson; {res.get('generator_placement') or 'generator and services unplaced'}), the "
                  f"highest rate passing (`gateway.<policy>.max_rps_p99_{b}ms`): "
                  f"{rates or 'no open-loop sweep in this run'}.", auto),
        "![R@10 and p99 against the offered rate](serving.png)\n",
    ])


def protocol_summary(res: dict) -> dict:
    """The summary keys of a run on another split than leave-one-out (``gateway.<protocol>.<policy>.*``): per
    policy, closed loop at the run's budget, the share of model answers, recall@K overall and of the users whose
    target is unseen, and the gateway's own p99; with the budget and the sample size."""
    pre, k, b = f"gateway.{res['protocol']}", res["k"], f"{res['budget_ms']:g}"
    out: dict = {f"{pre}.budget_ms": res["budget_ms"], f"{pre}.users": res["n_users"]}
    for p, c in res["closed"].items():
        out[f"{pre}.{p}.gr_ranked_share_at_{b}ms"] = c["gr_ranked_share"]
        if p == "fused":
            out[f"{pre}.fused.fused_share_at_{b}ms"] = c["fused_share"]
        out[f"{pre}.{p}.server_p99_ms"] = c["server_p99_ms"]
        for m in (f"recall@{k}", f"unseen_recall@{k}"):
            if m in c:
                out[f"{pre}.{p}.{m}"] = c[m]
    return out


def protocol_readme_body(res: dict, summary: dict, inprocess: dict) -> str:
    """The section of a run on another split: each policy's answers through the gateway beside the in-process
    figure of the same split (``specrec eval``'s keys, where summary.json has them)."""
    proto, k, b = res["protocol"], res["k"], f"{res['budget_ms']:g}"
    rows = []
    for p, c in res["closed"].items():
        ref = inprocess.get(f"beauty.{proto}.{p}.unseen_recall@{k}")
        rows.append(f"| {p} | {fmt(c['gr_ranked_share'], '.1%')} | {fmt(c.get(f'recall@{k}'), '.4f')} | "
                    f"{fmt(c.get(f'unseen_recall@{k}'), '.4f')} | {fmt(ref, '.4f')} | {fmt(c['server_p99_ms'])} | "
                    f"{', '.join(f'{x} {n}' for x, n in c['served_by'].items())} |")
    return "\n".join([
        f"## The {proto} split through the gateway (`bench.serving --protocol {proto}`, `gateway.{proto}.*`)\n",
        paragraph(f"Run: {res.get('run', 'n/a')}. {machine_of(res)}. {res['users']}, K = {k}, closed loop, one "
                  f"request at a time, at the {b} ms budget. In process: `specrec eval`'s figure on the same split "
                  f"(`beauty.{proto}.<policy>.unseen_recall@{k}`); keys `gateway.{proto}.<policy>.*`. Every column: "
                  f"[`serving_{proto}.md`](serving_{proto}.md)."),
        paragraph(f"Command (step `temporal`): `{res['command']}`"),
        f"| policy | GR-ranked | R@{k} | unseen R@{k} ({res['unseen_users']} users) | unseen R@{k} in process "
        f"| server p99 ms | served by |",
        "|---|---|---|---|---|---|---|",
        *rows,
        "",
    ])


def write_protocol_results(out: Path, res: dict) -> dict:
    """Results of a run on another split than leave-one-out: ``serving_<protocol>.{json,md}``, its keys and its
    README section (the leave-one-out run's are left as they are)."""
    name = f"serving_{res['protocol']}"
    summary = protocol_summary(res)
    k = res["k"]
    cols = ["policy", "answered", "gr_ranked_share", f"recall@{k}", f"unseen_recall@{k}",
            f"in_sample_recall@{k}", "fill_share", "budget_exit_share", "p50_ms", "p99_ms", "server_p99_ms",
            "served_by"]
    closed = [{"policy": p, **r, "served_by": ", ".join(f"{x} {n}" for x, n in r["served_by"].items())}
              for p, r in res["closed"].items()]
    markdown = "\n".join([
        f"# The {res['protocol']} split through the gateway\n", f"Command: `{res['command']}`\n",
        f"{res['users']}. K = {k}, budget {res['budget_ms']:g} ms. {res['machine']}.\n",
        markdown_table(closed, cols, "{:.4f}"), ""])
    inprocess = json.loads((out / "summary.json").read_text()) if (out / "summary.json").exists() else {}
    publish(out, name, res, markdown, summary, retire=RETIRED_KEYS,
            readme=(f"{README_OWNER}.{res['protocol']}", protocol_readme_body(res, summary, inprocess)))
    return summary


def write_results(out: Path, res: dict, policies: list[str], budget_ms: float) -> dict:
    b = f"{budget_ms:g}"
    summary = summary_of(res, policies, budget_ms)
    cols = ["policy", "answered", "recall@10", "ndcg@10", "offline_beam_recall@10", "fill_share", "all_fill_share",
            "budget_exit_share", "gr_ranked_share", "fused_share", "no_answer_share", "p50_ms", "p95_ms", "p99_ms",
            "server_p99_ms", "overhead_p50_ms", "served_by"]
    closed = [{"policy": p, **r, "served_by": ", ".join(f"{k} {v}" for k, v in r["served_by"].items())}
              for p, r in res["closed"].items()]
    open_rows = [{**r, "pass": "yes" if r["pass"] else "**no**",
                  "served_by": ", ".join(f"{k} {v}" for k, v in r["served_by"].items())} for r in res["open"]]
    lines = [
        "# Serving at a budget, through the gateway\n",
        f"Command: `{res['command']}`\n",
        f"{res['users']}. K = {res['k']}, budget {b} ms. {res['machine']}.\n",
        f"Pass rule of a rate: {res['criterion']}.\n",
        "## Overhead of the gRPC path (closed loop, one request at a time, 1 s budget)\n",
        "overhead: the gateway's total (`stats.total_ms`) less the callees' own server time on the critical path "
        "(their `x-server-ms`); gap: the caller's p50 through the gateway less the same policy's p50 in this "
        "process (a pass of its own, before the gateway's).\n",
        markdown_table(
            [{"policy": p, **o} for p, o in res["overhead"].items()],
            ["policy", "n", "inprocess_p50_ms", "gateway_p50_ms", "gateway_server_p50_ms", "overhead_p50_ms",
             "overhead_p99_ms", "gap_vs_inprocess_p50_ms"],
            "{:.2f}",
        ),
        f"## Closed loop at the {b} ms budget\n",
        markdown_table(closed, cols, "{:.4f}"),
        "## Open loop at rising rates\n",
        markdown_table(open_rows, ["policy", "offered_rps", "achieved_rps", *cols[1:], "pass"], "{:.3f}"),
        "| policy | highest passing rate (rps) |\n|---|---|",
        *[
            f"| {p} | {'below the lowest tested' if rps is None else fmt(rps, 'g')} |"
            for p, rps in res["max_rps"].items()
        ],
        "",
        "![R@10 and p99 against the offered rate](serving.png)",
        "",
    ]
    publish(out, "serving", res, "\n".join(lines), summary, retire=RETIRED_KEYS,
            readme=(README_OWNER, readme_body(res, summary)), old_sections=("bench/load.py", "bench/serving.py"))
    return summary


# -- main ---------------------------------------------------------------------------------------
def parse(argv):
    ap = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    ap.add_argument("--bundle", required=True, help="bundle directory (with drafters)")
    ap.add_argument("--policies", default="auto,beam,strict,nezha,specgr")
    ap.add_argument("--open-policies", default="auto,beam,strict", help="policies of the open-loop sweep")
    ap.add_argument("--rates", default="10,20,30,40,60,80", help="offered rates, requests/s")
    ap.add_argument("--duration", type=float, default=15.0, help="measured seconds per rate")
    ap.add_argument("--warmup", type=float, default=3.0, help="seconds per rate sent first and not measured")
    ap.add_argument("--k", type=int, default=10)
    ap.add_argument("--budget-ms", type=float, default=30.0)
    ap.add_argument("--requests", type=int, default=500, help="test users sampled")
    ap.add_argument("--overhead-requests", type=int, default=200)
    ap.add_argument("--generator-cpu", type=int, default=-1,
                    help="the open loop's load generator (this process) on this CPU of its own during phase 4 (-1: the "
                    "last usable CPU; -2: not placed)")
    ap.add_argument("--services-cpus", choices=("all", "rest"), default="all",
                    help="during phase 4 the services run where the stack placed them (all: every CPU unless "
                    "SPECREC_STACK_PLACEMENT=split; they may share the generator's), or on "
                    "the CPUs the generator leaves (rest: on a 2-core machine, one)")
    ap.add_argument("--protocol", choices=("loo", "temporal"), default="loo",
                    help="the split the test users come from; temporal: the bundle's cut-off, recall of the users "
                    "whose target is an unseen item reported, results in serving_temporal.* and gateway.temporal.*")
    add_common_args(ap)
    return ap.parse_args(argv)


def main(argv=None) -> int:
    a = parse(argv)
    command = command_line("bench.serving", argv)
    raise_on_signals(signal.SIGTERM, signal.SIGHUP)

    import torch

    from specrec.bundle import Bundle

    torch.set_num_threads(a.threads)
    policies = [p.strip() for p in a.policies.split(",") if p.strip()]
    open_policies = [p.strip() for p in a.open_policies.split(",") if p.strip()]
    rates = sorted({float(x) for x in a.rates.split(",") if x.strip()})
    bundle_dir = Path(a.bundle).resolve()
    bundle = Bundle.load(bundle_dir)
    users = sample_users(bundle, a.requests, a.seed, a.protocol)
    unseen = users.unseen if a.protocol != "loo" else None
    say(users.source)
    say("phase 1: offline beam on the same users")
    offline_hits = offline_beam(bundle, users, a.k)
    sasrec_hits = offline_sasrec(bundle, users, a.k)
    fused_hits = offline_fused(bundle, users, a.k)
    say(f"offline beam R@{a.k} {offline_hits.mean():.4f}"
        + ("" if sasrec_hits is None else f", SASRec {sasrec_hits.mean():.4f}")
        + ("" if fused_hits is None else f", fused {fused_hits.mean():.4f}"))

    tmp = Path(tempfile.mkdtemp(prefix="specrec-serving-"))
    stack = Stack(bundle_dir, Redis(a.redis_url, tmp), tmp / "logs", "serving", threads=a.threads,
                  max_history=bundle.cfg.max_history)
    res = {
        "command": command,
        "run": run_line(),
        "users": users.source,
        "k": a.k,
        "budget_ms": a.budget_ms,
        "machine": machine_line(),
        "criterion": f"p99 <= {a.budget_ms:g} ms, >= 99% of answers hold no fill, <= 1% of requests unanswered, "
        "R@10 >= 0.95 x the offline beam's on the same requests",
        "offline_beam_recall@10": float(offline_hits.mean()),
        "offline_sasrec_recall@10": None if sasrec_hits is None else float(sasrec_hits.mean()),
        "offline_fused_recall@10": None if fused_hits is None else float(fused_hits.mean()),
        "protocol": a.protocol,
        "n_users": len(users.ids),
        "unseen_users": int(sum(users.unseen or [])),
        "overhead": {},
        "closed": {},
        "open": [],
        "max_rps": {},
    }
    try:
        stack.start(a.startup_timeout, say=say)
        target = stack.addr("gateway")
        say("phase 2: overhead of the gRPC path")
        for p in [p for p in policies if p != "auto" and a.overhead_requests > 0]:
            o = overhead(bundle, target, users, p, a.k, a.overhead_requests)
            res["overhead"][p] = o
            say(f"{p}: in-process {o['inprocess_p50_ms']:.2f} ms, gateway {o['gateway_p50_ms']:.2f} ms, "
                f"overhead {o['overhead_p50_ms']:.2f} ms")
        say(f"phase 3: closed loop at {a.budget_ms:g} ms")
        for p in policies:
            row = summarise(asyncio.run(closed_loop(target, users, p, a.k, a.budget_ms, len(users.ids))), offline_hits,
                            len(users.ids), a.k, unseen)
            res["closed"][p] = row
            extra = "".join(f", {m} {row[m]:.4f}" for m in (f"recall@{a.k}", f"unseen_recall@{a.k}")
                            if m in row and m != "recall@10")
            # the answers' R@10; the offline beam's hits are at K (R@K beside it when K is not 10)
            say(f"{p}: R@10 {row['recall@10']:.4f} (offline beam R@{a.k} {row['offline_beam_recall@10']:.4f}){extra}, "
                f"fill {row['fill_share']:.1%}, all-fill {row['all_fill_share']:.1%}, p99 {row['p99_ms']:.1f} ms, "
                f"served by {row['served_by']}")
        say("phase 4: open loop")
        placed = place_generator(stack, a.generator_cpu, a.services_cpus) if open_policies else None
        res["generator_placement"] = None if placed is None else placed[0]
        if placed is not None:
            say(placed[0])
        for p in open_policies:
            for rate in rates:
                measured, sent, achieved = asyncio.run(open_loop(target, users, p, a.k, a.budget_ms, rate, a.duration,
                                                                 a.warmup, a.seed + int(rate)))
                row = {
                    "policy": p,
                    "offered_rps": rate,
                    "achieved_rps": achieved,
                    **summarise(measured, offline_hits, sent, a.k, unseen),
                }
                row["pass"] = passes(row, a.budget_ms)
                res["open"].append(row)
                say(f"{p} @ {rate:g}: achieved {fmt(row['achieved_rps'])}, R@10 {fmt(row['recall@10'], '.4f')}, "
                    f"p99 {fmt(row['p99_ms'])} ms, fill {fmt(row['fill_share'], '.1%')}, unanswered "
                    f"{fmt(row['no_answer_share'], '.1%')} -> {'pass' if row['pass'] else 'FAIL'}")
                time.sleep(1.0)
            res["max_rps"][p] = best_rate([r for r in res["open"] if r["policy"] == p])
        if placed is not None:
            restore(placed[1])
    except KeyboardInterrupt:
        say("interrupted: stopping the stack; nothing written")
        return 130
    finally:
        stack.stop(say=say)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    if a.protocol != "loo":
        summary = write_protocol_results(out, res)
        print(json.dumps(no_nan(summary), indent=2))
        return 0
    plot(res["open"], open_policies, a.budget_ms, out / "serving.png",
         f"{bundle.name}: K={a.k}, budget {a.budget_ms:g} ms, {os.cpu_count()} CPUs, everything co-located")
    summary = write_results(out, res, open_policies, a.budget_ms)
    print(json.dumps(no_nan(summary), indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
