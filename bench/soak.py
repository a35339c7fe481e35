"""A soak run: ``auto`` through the gateway at half the stack's capacity for ten minutes, with an
item upserted every second, watching each service's memory and the latency minute by minute.

    python -m bench.soak --bundle bundles/beauty-loo --minutes 10

Starts its own stack (as ``bench.overload``), measures the capacity the same way, then runs
``bench.loadgen`` in its own process at ``--load`` x capacity for ``--minutes`` while a writer
thread upserts one new item a second through the item set (with the write token) and a sampler reads
every service's RSS from ``/proc`` every ``--sample-s`` seconds.

Reported: each service's RSS at the start (the median of the second minute, once caches are warm) and
at the end (the median of the last minute), the largest relative growth, the p99 of each minute (caller
side), the drift (the last minute's p99 minus the first's), errors (any status but OK;
RESOURCE_EXHAUSTED counted apart as shed) and the writes acknowledged and failed. Writes
``soak.{json,md,png}`` and the summary keys ``soak.rss_growth_max``, ``soak.errors``, ``soak.shed``,
``soak.p99_drift_ms``, ``soak.upserts_acked``, ``soak.upsert_errors``.
"""

from __future__ import annotations

import argparse
import json
import sys
import threading
import time
from pathlib import Path

from bench.harness import (
    Writer,
    command_line,
    fmt,
    machine_line,
    machine_of,
    no_nan,
    open_stack,
    pct,
    publish,
    rss_mb,
    run_line,
    sayer,
)
from bench.loadgen import add_load_args, in_process, measured_capacity
from specrec.eval.results import paragraph
from specrec.terminal import markdown_table

#: this benchmark's section of the results README
README_OWNER = "bench.soak"

say = sayer("soak")


class Sampler:
    """Every ``every`` seconds, the RSS of each service process (monotonic time, MB)."""

    def __init__(self, pids: dict[str, int], every: float):
        self.pids, self.every = pids, every
        self.samples: list[dict] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="rss", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(10)

    def _run(self) -> None:
        while not self._stop.is_set():
            self.samples.append({"t": time.monotonic(), **{n: rss_mb(p) for n, p in self.pids.items()}})
            self._stop.wait(self.every)


def per_minute(recs: list[dict], t0: float, minutes: int) -> list[dict]:
    out = []
    for m in range(minutes):
        part = [r for r in recs if t0 + 60 * m <= r["t"] < t0 + 60 * (m + 1)]
        out.append({"minute": m + 1, "requests": len(part), "p99_ms": pct([r["latency_ms"] for r in part], 99),
                    "p50_ms": pct([r["latency_ms"] for r in part], 50),
                    "errors": sum(r["code"] not in ("OK", "RESOURCE_EXHAUSTED") for r in part),
                    "shed": sum(r["code"] == "RESOURCE_EXHAUSTED" for r in part)})
    return out


def plot(minutes: list[dict], samples: list[dict], names: list[str], t0: float, path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax, bx) = plt.subplots(1, 2, figsize=(11, 4))
    ax.plot([m["minute"] for m in minutes], [m["p99_ms"] for m in minutes], "o-", label="p99 (caller)")
    ax.plot([m["minute"] for m in minutes], [m["p50_ms"] for m in minutes], "s-", label="p50 (caller)")
    ax.set_xlabel("minute")
    ax.set_ylabel("ms")
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    for n in names:
        pts = [(s["t"] - t0, s[n]) for s in samples if s.get(n) is not None]
        bx.plot([p[0] / 60 for p in pts], [p[1] for p in pts], label=n)
    bx.set_xlabel("minutes")
    bx.set_ylabel("RSS, MB")
    bx.legend(fontsize=8)
    bx.grid(alpha=0.3)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def readme_body(res: dict) -> str:
    """This benchmark's section of the results README (``res``: what ``soak.json`` holds; the words are the
    README's, minute by minute ``soak.md``)."""
    def pc(v) -> str:
        return "n/a" if v is None else f"{100.0 * v:.1f}%"

    rss = ", ".join(f"{n} {fmt(v['start_mb'], '.0f')} -> {fmt(v['end_mb'], '.0f')} ({pc(v['growth'])})"
                    for n, v in res["rss"].items())
    return "\n".join([
        "## Soak (`bench.soak`, `soak.*`)\n",
        paragraph(f"Run: {res.get('run', 'n/a')}. {machine_of(res)}. `auto` at {res.get('budget_ms', 30.0):g} ms, "
                  f"{res['rate_rps']:.1f} rps (capacity {res['capacity_rps']:.1f} beam answers/s) for "
                  f"{res['soak.minutes']} min, an upsert every {res.get('upsert_every_s', 1.0):g} s through the item "
                  "set. Minute by minute: [`soak.md`](soak.md)."),
        paragraph(f"Command (step `soak`): `{res['command']}`"),
        "| `rss_growth_max` | `errors` | `shed` | `p99_drift_ms` | `upserts_acked` | `upsert_errors` |",
        "|---|---|---|---|---|---|",
        f"| {pc(res['soak.rss_growth_max'])} | {res['soak.errors']} | {res['soak.shed']} | "
        f"{fmt(res['soak.p99_drift_ms'])} | {res['soak.upserts_acked']} | {res['soak.upsert_errors']} |",
        "",
        paragraph(f"RSS at the start and the end, MB: {rss}."),
        "![soak](soak.png)\n",
    ])


def parse(argv):
    ap = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    ap.add_argument("--minutes", type=int, default=10)
    ap.add_argument("--load", type=float, default=0.5, help="offered load as a multiple of the measured capacity")
    ap.add_argument("--upsert-every-s", type=float, default=1.0)
    ap.add_argument("--sample-s", type=float, default=5.0, help="seconds between RSS samples")
    add_load_args(ap)
    return ap.parse_args(argv)


def main(argv=None) -> int:
    a = parse(argv)
    command = command_line("bench.soak", argv)
    bundle, users, tmp, users_file, stack = open_stack(a, "soak")
    procs = stack.procs
    try:
        stack.start(a.startup_timeout, say=say)
        target = stack.addr("gateway")
        cap = measured_capacity(target, users.ids, a)
        rate = a.load * cap
        say(f"capacity {cap:.1f} beam answers/s; soaking at {rate:.1f} rps for {a.minutes} min, an upsert every "
            f"{a.upsert_every_s:g} s")
        names = sorted(procs.procs)
        sampler = Sampler({n: p.pid for n, p in procs.procs.items()}, a.sample_s)
        writer = Writer(procs.addr("itemset"), procs.token, pause_s=a.upsert_every_s)
        t0 = time.monotonic()
        sampler.start()
        writer.start()
        try:
            recs = in_process(target, users_file, rate, 60.0 * a.minutes, a.budget_ms, a.seed, tmp / "soak.jsonl",
                              say=say)
        finally:
            writer.stop()
            sampler.stop()
    except KeyboardInterrupt:
        say("interrupted: stopping the stack; nothing written")
        return 130
    finally:
        stack.stop(say=say)
    t_load = min(r["t"] for r in recs) if recs else t0
    minutes = per_minute(recs, t_load, a.minutes)
    # a minute's median at each end, not one sample: RSS swings by several percent between samples as the
    # allocator takes and returns memory, which one sample at each end would read as growth or shrinkage
    if a.minutes < 3:
        say(f"--minutes {a.minutes:g}: the start (second minute) and end (last minute) windows of RSS overlap, "
            "so its growth says little; 3 or more for a figure")
    t_end = max((s["t"] for s in sampler.samples), default=t_load)
    start = [s for s in sampler.samples if t_load + 60.0 <= s["t"] < t_load + 120.0] or sampler.samples[:1]
    end = [s for s in sampler.samples if s["t"] > t_end - 60.0] or sampler.samples[-1:]

    def median_mb(window: list[dict], n: str) -> float | None:
        vals = sorted(s[n] for s in window if s.get(n))
        return vals[len(vals) // 2] if vals else None

    rss = {n: {"start_mb": median_mb(start, n), "end_mb": median_mb(end, n)} for n in names}
    for v in rss.values():
        v["growth"] = (v["end_mb"] / v["start_mb"] - 1.0) if v["start_mb"] and v["end_mb"] else None
    growth = [v["growth"] for v in rss.values() if v["growth"] is not None]
    errors = sum(m["errors"] for m in minutes)
    keys = {"soak.rss_growth_max": max(growth) if growth else None, "soak.errors": errors,
            "soak.shed": sum(m["shed"] for m in minutes),
            "soak.p99_drift_ms": minutes[-1]["p99_ms"] - minutes[0]["p99_ms"] if minutes else None,
            "soak.upserts_acked": len(writer.acked),
            "soak.upsert_errors": sum(r["code"] != "OK" for r in writer.records), "soak.rate_rps": rate,
            "soak.minutes": a.minutes}
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    res = {"command": command, "run": run_line(), "users": users.source, "machine": machine_line(),
           "capacity_rps": cap, "rate_rps": rate, "budget_ms": a.budget_ms, "upsert_every_s": a.upsert_every_s,
           "minutes": minutes, "rss": rss, "rss_samples": sampler.samples, **keys}
    plot(minutes, sampler.samples, names, t_load, out / "soak.png",
         f"{bundle.name}: auto at {a.budget_ms:g} ms, {rate:.0f} rps ({a.load:g} x capacity), an upsert every "
         f"{a.upsert_every_s:g} s")
    rss_rows = [{"service": n, **v} for n, v in rss.items()]
    md = (f"Produced by:\n\n```bash\n{command}\n```\n\n{res['machine']}; capacity {cap:.1f} beam answers/s, soak at "
          f"{rate:.1f} rps. Errors: any status but OK (shed, RESOURCE_EXHAUSTED, counted apart).\n\n"
          + markdown_table([{"key": k, "value": v} for k, v in keys.items()], ["key", "value"]) + "\n"
          + markdown_table(rss_rows, ["service", "start_mb", "end_mb", "growth"]) + "\n"
          + markdown_table(minutes, ["minute", "requests", "p50_ms", "p99_ms", "errors", "shed"])
          + "\n![soak](soak.png)\n")
    publish(out, "soak", res, "# Soak\n\n" + md, keys, readme=(README_OWNER, readme_body(no_nan(res))),
            old_sections=("bench/soak.py",))
    print(json.dumps(no_nan(keys), indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
