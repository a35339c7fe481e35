"""Overload at a 30 ms budget: ``auto`` through the gateway at 1x, 2x and 3x the stack's capacity.

    python -m bench.overload --bundle bundles/beauty-loo --multiples 1,2,3 --duration 20

Starts its own stack (``bench.harness.open_stack``: Redis found or started, the four services as
subprocesses, a private namespace) and stops it at the end. Requests are a seeded random sample of
leave-one-out test users.

1. **Capacity**: the GR model's answers/s: a closed loop of ``--clients`` concurrent callers (each sends
   its next request when the last is answered) asking ``beam`` with a budget that never acts, counting
   beam's own answers: what the stack serves at full quality when saturated.
2. **Load**: for each multiple m, Poisson arrivals at m x capacity for warm-up + ``--duration``
   seconds from ``bench.loadgen`` in its own process (the caller's event loop never competes with
   anything of ours). Reported over the measured part: the caller-side p99 (scheduled send to answer,
   every request, shed ones included), the gateway-side p99 (``stats.total_ms`` of its answers), the
   shed share (RESOURCE_EXHAUSTED), other errors, and the share of answers that are model answers
   (no catalogue fill).

Writes ``overload.{json,md,png}`` into ``--out`` and the summary keys
``serving.overload_<m>x.{client_p99_ms,server_p99_ms,shed_share,model_share,error_share,offered_rps,
achieved_rps}`` and ``serving.capacity_rps``.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from bench.harness import command_line, fmt, machine_line, no_nan, open_stack, pct, run_line, sayer
from bench.loadgen import CAPACITY_BUDGET_MS, add_load_args, in_process, measured_capacity, py_spy
from specrec.eval.results import markdown_table, readme_section, update_summary, write_json

#: this benchmark's section of the results README
README_OWNER = "bench.overload"

say = sayer("overload")


def top_frames(path: Path, seconds: float, rate: float = 250.0, n: int = 15) -> dict:
    """A py-spy raw profile (collapsed stacks: ``thread;frame;frame... count``, active samples only) -> how busy
    each thread was (its samples over ``rate`` x ``seconds``: 1.0 = running the whole time) and, over all
    threads, the innermost frames with the most samples."""
    by_thread: dict[str, int] = {}
    leaf: dict[str, int] = {}
    total = 0
    for line in path.read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        if not stack or not count.isdigit():
            continue
        c = int(count)
        frames = stack.split(";")
        total += c
        by_thread[frames[0]] = by_thread.get(frames[0], 0) + c
        leaf[frames[-1]] = leaf.get(frames[-1], 0) + c
    top = sorted(leaf.items(), key=lambda kv: -kv[1])[:n]
    return {"samples": total,
            "busy": {t: round(c / (rate * seconds), 4) for t, c in sorted(by_thread.items(), key=lambda kv: -kv[1])},
            "top": [{"frame": f, "share": round(c / max(total, 1), 4)} for f, c in top]}


def summarise(recs: list[dict], t_from: float, t_to: float) -> dict:
    part = [r for r in recs if t_from <= r["t"] < t_to]
    ok = [r for r in part if r["code"] == "OK"]
    n = max(1, len(part))
    lat = [r["latency_ms"] for r in part]
    return {
        "sent": len(part),
        "answered": len(ok),
        "offered_rps": len(part) / max(t_to - t_from, 1e-9),
        "achieved_rps": len(ok) / max(t_to - t_from, 1e-9),
        "client_p50_ms": pct(lat, 50),
        "client_p99_ms": pct(lat, 99),
        "client_p99_answered_ms": pct([r["latency_ms"] for r in ok], 99),
        "client_send_lag_p99_ms": pct([r.get("send_lag_ms", 0.0) for r in part], 99),
        "server_p50_ms": pct([r["server_ms"] for r in ok], 50),
        "server_p99_ms": pct([r["server_ms"] for r in ok], 99),
        "shed_share": sum(r["code"] == "RESOURCE_EXHAUSTED" for r in part) / n,
        "error_share": sum(r["code"] not in ("OK", "RESOURCE_EXHAUSTED") for r in part) / n,
        "model_share": sum(bool(r.get("model")) for r in ok) / max(1, len(ok)),
        "degraded_share": sum(bool(r.get("degraded")) for r in ok) / max(1, len(ok)),
        "served_by": {
            s: sum(r["served_by"] == s for r in ok) / max(1, len(ok)) for s in sorted({r["served_by"] for r in ok})
        },
    }


def plot(rows: list[dict], budget_ms: float, path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    m = [r["multiple"] for r in rows]
    fig, (ax, bx) = plt.subplots(1, 2, figsize=(10, 4))
    ax.plot(m, [r["client_p99_ms"] for r in rows], "o-", label="caller p99 (all requests)")
    ax.plot(m, [r["server_p99_ms"] for r in rows], "s-", label="gateway p99 (its answers)")
    ax.axhline(budget_ms, color="grey", ls="--", lw=1, label=f"budget {budget_ms:g} ms")
    ax.set_xlabel("offered load / capacity")
    ax.set_ylabel("ms")
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    bx.plot(m, [r["model_share"] for r in rows], "o-", label="model answers / answers")
    bx.plot(m, [r["shed_share"] for r in rows], "s-", label="shed / requests")
    bx.set_xlabel("offered load / capacity")
    bx.set_ylim(-0.02, 1.02)
    bx.legend(fontsize=8)
    bx.grid(alpha=0.3)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def readme_body(res: dict) -> str:
    """This benchmark's section of the results README (``res``: what ``overload.json`` holds)."""
    rows = [f"| {r['multiple']:g}x | {fmt(r['offered_rps'], '.0f')} | {fmt(r['achieved_rps'], '.0f')} | "
            f"{fmt(r['client_p99_ms'])} | {fmt(r['server_p99_ms'])} | {fmt(r['client_send_lag_p99_ms'])} | "
            f"{fmt(100 * r['shed_share'] if r['shed_share'] is not None else None)}% | "
            f"{fmt(100 * r['model_share'] if r['model_share'] is not None else None)}% | "
            f"{fmt(100 * r['error_share'] if r['error_share'] is not None else None)}% |" for r in res["rows"]]
    b = f"{res['budget_ms']:g}"
    return "\n".join([
        f"## Overload at {b} ms (`bench.overload`, `serving.capacity_rps`, `serving.overload_<m>x.*`)\n",
        f"Command (rerun step `overload`): `{res['command']}`\n",
        f"Run: {res.get('run', 'n/a')}. {res['machine']}. {res['users']}. Capacity: {fmt(res['capacity_rps'])} "
        f"beam answers/s ({res['clients']} closed-loop callers, a budget that never acts); then `auto` at {b} ms, "
        "Poisson arrivals at multiples of it from the load generator in its own process. Caller p99: every request "
        "of the measured part from its scheduled send, shed ones included; gateway p99: its answers' "
        "`stats.total_ms`; send lag: how late the generator sent (its own tail). "
        "Table: [`overload.md`](overload.md).\n",
        "| load | offered rps | achieved rps | caller p99 ms | gateway p99 ms | send lag p99 ms | shed | model answers "
        "| errors |",
        "|---|---|---|---|---|---|---|---|---|",
        *rows,
        "",
        "![overload](overload.png)\n",
    ])


def parse(argv):
    ap = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    ap.add_argument("--multiples", default="1,2,3", help="offered load as multiples of the measured capacity")
    ap.add_argument("--duration", type=float, default=20.0, help="measured seconds per multiple")
    ap.add_argument("--warmup", type=float, default=3.0, help="seconds per multiple sent first and not measured")
    ap.add_argument("--profile", action="store_true", help="then one more run at the last multiple with py-spy on the "
                    "gateway, the verifier and the load generator (needs py-spy); where their samples are goes into "
                    "overload.json (not the table: samplers beside it stretch the tail)")
    add_load_args(ap)
    return ap.parse_args(argv)


def main(argv=None) -> int:
    a = parse(argv)
    if a.profile:
        py_spy()  # before anything starts
    command = command_line("bench.overload", argv)
    bundle, users, tmp, users_file, stack = open_stack(a, "overload")
    rows: list[dict] = []
    profiles: dict = {}
    try:
        stack.start(a.startup_timeout, say=say)
        target = stack.addr("gateway")
        cap = measured_capacity(target, users.ids, a)
        say(f"capacity: {cap:.1f} beam answers/s ({a.clients} closed-loop callers, budget {CAPACITY_BUDGET_MS:g} ms)")
        multiples = [float(x) for x in a.multiples.split(",") if x.strip()]
        for m in multiples:
            recs = in_process(target, users_file, m * cap, a.warmup + a.duration, a.budget_ms, a.seed + int(10 * m),
                              tmp / f"load_{m:g}x.jsonl", say=say)
            t0 = min(r["t"] for r in recs)
            row = {"multiple": m, **summarise(recs, t0 + a.warmup, t0 + a.warmup + a.duration)}
            rows.append(row)
            say(f"{m:g}x ({row['offered_rps']:.0f} rps offered): caller p99 {row['client_p99_ms']:.1f} ms, gateway p99 "
                f"{row['server_p99_ms']:.1f} ms, shed {row['shed_share']:.1%}, model answers {row['model_share']:.1%}, "
                f"errors {row['error_share']:.1%}")
            time.sleep(2.0)
        if a.profile:  # one more run at the last multiple, with the samplers: its figures are not the table's
            spy = {n: stack.procs.procs[n].pid for n in ("gateway", "verifier")}
            m = multiples[-1]
            in_process(target, users_file, m * cap, a.warmup + a.duration, a.budget_ms, a.seed + int(10 * m) + 1,
                       tmp / "load_profiled.jsonl", spy, tmp / "profile", say=say)
            profiles = {n: top_frames(tmp / "profile" / f"{n}.txt", a.warmup + a.duration) for n in [*spy, "loadgen"]
                        if (tmp / "profile" / f"{n}.txt").exists()}
            profiles["multiple"] = m
    except KeyboardInterrupt:
        say("interrupted: stopping the stack; nothing written")
        return 130
    finally:
        stack.stop(say=say)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    res = {"command": command, "run": run_line(), "users": users.source, "budget_ms": a.budget_ms,
           "machine": machine_line(), "capacity_rps": cap, "clients": a.clients, "rows": rows,
           **({"profiles": profiles} if profiles else {})}
    write_json("overload", no_nan(res), out)
    plot(rows, a.budget_ms, out / "overload.png",
         f"{bundle.name}: auto at {a.budget_ms:g} ms, capacity {cap:.0f} rps, load generator in its own process")
    keys = {"serving.capacity_rps": cap}
    for r in rows:
        for f in ("client_p99_ms", "server_p99_ms", "shed_share", "model_share", "error_share", "offered_rps",
                  "achieved_rps"):
            keys[f"serving.overload_{r['multiple']:g}x.{f}"] = r[f]
    update_summary(no_nan(keys), out / "summary.json")
    cols = ["multiple", "offered_rps", "achieved_rps", "client_p99_ms", "server_p99_ms", "shed_share", "model_share",
            "error_share"]
    md = (f"Produced by:\n\n```bash\n{command}\n```\n\n{res['machine']}; capacity {cap:.1f} beam answers/s "
          f"({a.clients} closed-loop callers). Caller p99: every request of the measured part, shed ones included. "
          f"Table: [`overload.md`](overload.md).\n\n" + markdown_table(rows, cols) + "\n![overload](overload.png)\n")
    (out / "overload.md").write_text("# Overload at a budget\n\n" + md)
    readme_section(out / "README.md", README_OWNER, readme_body(no_nan(res)), retire=("bench/overload.py",))
    print(json.dumps(no_nan(keys), indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
