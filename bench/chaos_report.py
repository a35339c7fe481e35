"""What ``bench.chaos`` writes of a run: the timeline plot (``chaos.png``), the tables and text of ``chaos.md``
and of its section of the results README (``res``: what ``chaos.json`` holds)."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from bench.harness import fmt, machine_of
from specrec.eval.results import paragraph
from specrec.terminal import markdown_table


def plot(recs: list[dict], windows: list[tuple[str, float, float]], t_base: float, budgets_ms: list[float],
         path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax, ax2) = plt.subplots(2, 1, figsize=(13, 6.5), sharex=True, gridspec_kw={"height_ratios": [3, 1]})
    kinds = {"model": ("tab:blue", lambda r: r["code"] == "OK" and r["model"] and not r["degraded"]),
             "model, degraded": ("tab:orange", lambda r: r["code"] == "OK" and r["model"] and r["degraded"]),
             "fill": ("tab:red", lambda r: r["code"] == "OK" and not r["model"]),
             "shed": ("tab:gray", lambda r: r["code"] == "RESOURCE_EXHAUSTED"),
             "error": ("black", lambda r: r["code"] not in ("OK", "RESOURCE_EXHAUSTED"))}
    for label, (color, pred) in kinds.items():
        sel = [r for r in recs if pred(r)]
        if sel:
            ax.scatter([r["t"] - t_base for r in sel], [r["latency_ms"] for r in sel], s=6, c=color, label=label)
    for name, t0, t1 in windows:
        for a_ in (ax, ax2):
            a_.axvspan(t0 - t_base, t1 - t_base, color="tab:red", alpha=0.08)
        ax.text((t0 + t1) / 2 - t_base, 1.02, name, transform=ax.get_xaxis_transform(), ha="center", fontsize=7,
                rotation=20)
    for budget_ms, ls in zip(sorted(set(budgets_ms)), ("--", ":", "-.")):
        ax.axhline(budget_ms, color="k", ls=ls, lw=0.8, label=f"budget {budget_ms:g} ms")
    ax.set_yscale("log")
    ax.set_ylabel("client latency, ms")
    ax.legend(loc="upper right", fontsize=7, ncol=3)
    # model share per second
    t = np.asarray([r["t"] - t_base for r in recs])
    good = np.asarray([r["code"] == "OK" and r["model"] for r in recs], dtype=float)
    if len(t):
        bins = np.arange(0, t.max() + 1.0, 1.0)
        idx = np.digitize(t, bins)
        share = [good[idx == i].mean() if (idx == i).any() else np.nan for i in range(1, len(bins))]
        ax2.plot(bins[:-1], share, drawstyle="steps-post")
    ax2.set_ylim(-0.05, 1.05)
    ax2.set_ylabel("model answers")
    ax2.set_xlabel("seconds")
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def markdown(res: dict) -> str:
    """``chaos.md``: the head line, the faults of the machine, the faults of the services and of Redis."""
    rows = res["scenarios"]
    mf = res.get("machine_faults") or {}
    parts = [f"# Chaos benchmark\n\n{head_line(res)}\n"]
    if mf:
        table = "" if mf.get("skipped") else machine_table(mf.get("rows", []))
        parts.append(f"## Faults of the machine\n\n{machine_line_of(mf)}\n\n{table}")
    if rows:
        parts.append(f"## Faults of the services and of Redis\n\n{services_line_of(res)}\n\n{scenario_table(rows)}")
    return "\n".join(parts) + "\n"


def services_line_of(res: dict) -> str:
    """What the faults of the services and of Redis ran at, and what their columns mean."""
    return (f"`auto` at {res['budget_ms']:g} ms, {res['rate']:g} requests/s offered (Poisson); `overload` offers "
            f"{res['flood_x']:g}x the capacity measured first ({fmt(res['capacity_rps'])} answers/s, closed loop, one "
            "at a time). Model share: the requests sent during the fault answered by the GR model or the drafter, "
            "not catalogue fill (errors count as not); recovery: from the fault's end (SIGCONT, or the new process "
            f"SERVING) to the first of {res['streak']} undegraded answers in a row from the GR model through the "
            "verifier. `kill-redis-primary` runs last, on a stack of its own over a Sentinel-managed Redis (a "
            "primary, a replica, three sentinels) with a writer upserting one item at a time: its fault lasts from "
            "the SIGKILL to the promotion, its recovery until writes are acknowledged again and the answers have "
            "recovered; its items lost are acknowledged writes missing afterwards.")


def scenario_table(rows: list[dict]) -> str:
    cols = ["scenario", "fault s", "requests", "model share", "degraded share", "p99 ms (during)", "shed", "errors",
            "recovery s", "items lost"]
    return markdown_table([dict(zip(cols, [
        r["scenario"], fmt(r["fault_s"], ".1f"), r["requests_during"], fmt(r["model_share_during"], ".1%"),
        fmt(r["degraded_share_during"], ".1%"), fmt(r["p99_ms_during"], ".1f"), r["shed_during"],
        ", ".join(f"{c} {n}" for c, n in sorted(r["errors"].items())) or "none", fmt(r["recovery_s"], ".2f"),
        r["catalogue_items_lost"]])) for r in rows], cols)


def machine_table(rows: list[dict]) -> str:
    """The windows of the faults of the machine, the baseline first."""
    cols = ["window", "CPU", "seconds", "requests", "undegraded", "R@10 / no fault", "GR-ranked", "fill", "drafter",
            "shed", "errors", "gateway p99 ms", "its bucket ms", "over budget", "caller p99 ms", "CPU s / s"]

    def bucket(b) -> str:
        return "n/a" if not b else f"{fmt(b[0], 'g')}-{fmt(b[1], 'g') if b[1] is not None else 'inf'}"

    return markdown_table([dict(zip(cols, [
        r["scenario"], "all" if r.get("cpu") is None else r["cpu"], fmt(r["seconds"], ".1f"), r["requests"],
        fmt(r.get("undegraded_share"), ".1%"),
        f"{fmt(r.get('recall@10'), '.3f')} / {fmt(r.get('recall@10_no_fault'), '.3f')}"
        f" = {fmt(r.get('recall_ratio_vs_no_fault'), '.2f')}" if r.get("recall@10_no_fault") is not None else "",
        fmt(r.get("gr_ranked_share"), ".1%"), fmt(r["fill_share"], ".1%"), fmt(r["drafter_share"], ".1%"),
        fmt(r["shed_share"], ".1%"), ", ".join(f"{c} {n}" for c, n in sorted(r["errors"].items())) or "none",
        fmt(r["server_p99_ms"]), bucket(r.get("server_p99_bucket_ms")), fmt(r.get("server_over_budget_share"), ".1%"),
        fmt(r["client_p99_ms"]), ", ".join(f"{n} {v:.2f}" for n, v in r.get("cpu_share", {}).items())]))
        for r in rows], cols)


def machine_line_of(mf: dict) -> str:
    """What the faults of the machine ran at (``mf``: what ``chaos.json`` holds of them)."""
    if mf.get("skipped"):
        return f"Skipped: {mf['skipped']}."
    return (f"`auto` at {mf['budget_ms']:g} ms, {fmt(mf.get('rate'))} requests/s offered (Poisson): "
            f"{mf.get('load', 0.5):g} x the capacity measured at that budget first ({fmt(mf.get('capacity_rps'))} "
            f"answers/s, closed loop, one at a time); `cpu-hog`'s hogs on every CPU, `one-core` on CPU "
            f"{mf.get('cpu')}, each for a window of its own "
            "after a `baseline` window without one. Undegraded: the policy's own choice, answered whole (not degraded, "
            "no fill, no budget exit), of the requests sent, shed and errors counting as not; R@10 / no fault: the "
            "window's recall@10 (shed and errors as misses) over that of the same users asked again after the last "
            "window, at the same rate, with no fault; GR-ranked: the GR model's lists (made or ranked by it: not the "
            "item drafter's own, no fill) of the answers; fill: answers holding "
            "catalogue fill, of the answers; gateway p99: its own latency histogram over the window (the difference "
            "of two readings, interpolated within the bucket as PromQL does; the bucket and the share over the budget "
            "beside it); caller p99: every request from its scheduled send; CPU s / s: the CPU time each process "
            "used over the window.")


def head_line(res: dict) -> str:
    line = f"Produced by `{res['command']}` ({res['machine']}). {res['users']}."
    if res["scenarios"]:
        line += (f" Faults of the services: policy auto, budget {res['budget_ms']:g} ms, {res['rate']:g} requests/s "
                 f"offered (Poisson), capacity measured at {fmt(res['capacity_rps'])} answers/s (closed loop, one at "
                 f"a time), overload at {res['flood_x']:g}x that.")
    return line


def readme_body(res: dict) -> str:
    """This benchmark's section of the results README (``res``: what ``chaos.json`` holds): the run and its keys;
    the windows of the machine's faults, the scenarios of the services and every definition are ``chaos.md``'s."""
    keys = ", ".join(f"`{k.removeprefix('chaos.')}` {fmt(v, '.3g') if isinstance(v, float) else v}"
                     for k, v in res["summary"].items())
    mf = res.get("machine_faults") or {}
    machine = ""
    if mf and not mf.get("skipped"):
        machine = (f"Faults of the machine (`cpu-hog`, `one-core`): `auto` at {mf['budget_ms']:g} ms, "
                   f"{fmt(mf.get('rate'))} requests/s, {mf.get('load', 0.5):g} x the capacity at that budget "
                   f"({fmt(mf.get('capacity_rps'))} answers/s).")
    services = ""
    if res["scenarios"]:
        services = (f"Faults of the services and of Redis: `auto` at {res['budget_ms']:g} ms, {res['rate']:g} "
                    f"requests/s; `overload` at {res['flood_x']:g}x the capacity ({fmt(res['capacity_rps'])} "
                    f"answers/s); recovery: to {res['streak']} undegraded GR answers in a row.")
    return "\n".join([
        "## Chaos: faults under load (`bench.chaos`, `chaos.*`)\n",
        paragraph(f"Run: {res.get('run', 'n/a')}. {machine_of(res)}. {res['users']}.", machine, services,
                  "Every window and scenario: [`chaos.md`](chaos.md)."),
        paragraph(f"Command (step `chaos`): `{res['command']}`"),
        paragraph(f"Keys: {keys}."),
        "![timeline](chaos.png)\n",
    ])
