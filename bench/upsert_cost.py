"""What catalogue writes cost the serving stack: each service's CPU seconds while idle and while an item
is upserted every ``--every-s`` seconds, read from ``/proc/<pid>/stat``.

    python -m bench.upsert_cost --bundle bundles/beauty-loo --seconds 20

Starts its own stack (``bench.harness.Stack``: Redis found or started, the four services as
subprocesses, a private namespace), measures ``--seconds`` of idle, then ``--seconds`` with the
soak's writer (``bench.harness.Writer``) upserting one new item at a time, and stops it all.
Prints and writes ``upsert_cost.json`` (into ``--out``): CPU seconds per service in each phase and per
acknowledged upsert beyond idle. No request traffic: this is the write path's own cost, which the
soak (``bench.soak``) pays on top of serving.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from pathlib import Path

from bench.harness import RESULTS_DIR, Redis, Stack, Writer, command_line, machine_line, sayer
from specrec.eval.results import write_json

say = sayer("upsert_cost")


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of a process (all its threads)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def measure(pids: dict[str, int], seconds: float) -> dict[str, float]:
    before = {n: cpu_seconds(p) for n, p in pids.items()}
    time.sleep(seconds)
    return {n: cpu_seconds(p) - before[n] for n, p in pids.items()}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--bundle", required=True)
    ap.add_argument("--seconds", type=float, default=20.0, help="length of each phase")
    ap.add_argument("--every-s", type=float, default=1.0, help="seconds between upserts")
    ap.add_argument("--redis-url", default=os.environ.get("REDIS_URL"))
    ap.add_argument("--out", default=str(RESULTS_DIR))
    a = ap.parse_args(argv)
    tmp = Path(tempfile.mkdtemp(prefix="upsert-cost-"))
    stack = Stack(Path(a.bundle).resolve(), Redis(a.redis_url, tmp), tmp / "logs", "upsert", threads=None)
    procs = stack.procs
    try:
        stack.start(say=say)
        pids = {n: p.pid for n, p in procs.procs.items()}
        time.sleep(3.0)  # start-up work settles
        say(f"idle for {a.seconds:g} s")
        idle = measure(pids, a.seconds)
        writer = Writer(procs.addr("itemset"), procs.token, pause_s=a.every_s)
        say(f"an upsert every {a.every_s:g} s for {a.seconds:g} s")
        writer.start()
        try:
            writing = measure(pids, a.seconds)
        finally:
            writer.stop()
    finally:
        stack.stop(say=say)
    acked = max(1, len(writer.acked))
    res = {
        "command": command_line("bench.upsert_cost", argv),
        "machine": machine_line(),
        "seconds": a.seconds,
        "every_s": a.every_s,
        "upserts_acked": len(writer.acked),
        "idle_cpu_s": idle,
        "writing_cpu_s": writing,
        "cpu_ms_per_upsert": {n: 1000.0 * (writing[n] - idle[n]) / acked for n in pids},
    }
    write_json("upsert_cost", res, Path(a.out))
    print(json.dumps(res, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
