"""Memory under catalogue churn: the local stack with requests and upserts together, each service's RSS
every 10 s. What the soak's RSS figures come down to, in a couple of minutes (it measured the gateway's
growth from catalogue versions held in reference cycles, and the watcher's collection pass that frees them).

    python bench/churn_probe.py --bundle bundles/beauty-loo --rate 30 --upsert-every-s 0.5 --seconds 80

Starts its own stack (as ``bench/soak.py``); prints one line of RSS (MB) per service every 10 s, then the
answers by status and by the policy that served them. Writes nothing.
"""

from __future__ import annotations

import argparse
import collections
import sys
import threading
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from chaos import Writer  # noqa: E402
from overload import open_stack, stop_stack  # noqa: E402
from serving import say  # noqa: E402
from soak import parse as soak_parse  # noqa: E402
from soak import rss_mb  # noqa: E402


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--bundle", default="bundles/beauty-loo")
    ap.add_argument("--rate", type=float, default=30.0, help="requests per second (0: upserts alone)")
    ap.add_argument("--upsert-every-s", type=float, default=0.5, help="0: requests alone")
    ap.add_argument("--seconds", type=float, default=80.0)
    a = ap.parse_args(argv)
    from overload import run_load

    s = soak_parse(["--bundle", a.bundle])  # the soak's stack settings
    _, _, tmp, users_file, stack = open_stack(s, "churn")
    procs = stack[0]
    try:
        procs.start(s.startup_timeout, say=say)

        def rss() -> dict:
            return {n: round(rss_mb(p.pid) or 0) for n, p in procs.procs.items()}

        print("start", rss(), flush=True)
        writer = Writer(procs.addr("itemset"), procs.token, pause_s=a.upsert_every_s)
        if a.upsert_every_s > 0:
            writer.start()
        stop = threading.Event()

        def monitor() -> None:
            while not stop.wait(10):
                print(f"upserts {len(writer.acked)}", rss(), flush=True)

        threading.Thread(target=monitor, daemon=True).start()
        recs = []
        if a.rate > 0:
            recs = run_load(procs.addr("gateway"), users_file, a.rate, a.seconds, s.budget_ms, s.seed,
                            tmp / "load.jsonl")
        else:
            stop.wait(a.seconds)
        stop.set()
        if a.upsert_every_s > 0:
            writer.stop()
        print("answers", dict(collections.Counter(r.get("code") for r in recs)),
              "served by", dict(collections.Counter(r.get("served_by") for r in recs).most_common(6)))
        print("end", rss(), flush=True)
    finally:
        stop_stack(*stack)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
