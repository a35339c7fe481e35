"""How long the stack takes to serve: a fresh verifier, and the whole stack started again.

1. The bundle's graphs are built once (``specrec export-onnx --bundle B``, into ``B/onnx``) unless they are
   there and current (timed too, as ``onnx.build_s``, when it builds them); ``onnx.graphs_mb`` is the size of
   that directory after the full build (every graph, the chosen precisions' too, and their one shared weights
   file).
2. Cold: with an empty ``$SPECREC_CACHE``, as on a fresh clone or a new pod (nothing but the bundle's
   prebuilt graphs), the item set starts, then a verifier alone, as when one scales out
   (``verifier.cold_start_s``: its spawn to SERVING), then the drafter and the gateway.
3. Warm: the same stack stopped and started again as ``specrec stack up`` starts it
   (``specrec_stack.localstack.ServiceProcs.start``: item set, verifier and drafter together, then the
   gateway; ``stack.warm_start_s``: the first spawn to the gateway's SERVING).

    python -m bench.cold_start --bundle bundles/beauty-loo
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

from specrec.backends.weights import dir_mb
from specrec.eval.results import update_summary
from specrec_stack.localstack import ORDER, ServiceProcs, delete_namespace, find_or_start_redis, stop_process


def start_timed(bundle: Path, redis_url: str, namespace: str, logs: Path, max_history: int, cache: Path,
                one_by_one: bool) -> tuple:
    """Start the stack (``one_by_one``: each service alone, in order) -> (procs, seconds in all, per service)."""
    seen: dict[str, float] = {}
    procs = ServiceProcs(bundle, redis_url, namespace, logs, max_history=max_history,
                         env={"SPECREC_CACHE": str(cache)})

    def say(msg: str) -> None:
        print(msg, flush=True)
        if " SERVING after " in msg:
            name, _, rest = msg.partition(" SERVING after ")
            seen[name] = float(rest.split()[0])

    t0 = time.time()
    if one_by_one:
        for name in ORDER:
            procs.start_one(name, say=say)
    else:
        procs.start(say=say)
    return procs, time.time() - t0, seen


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--bundle", default="bundles/beauty-loo")
    ap.add_argument("--redis-url", default=os.environ.get("REDIS_URL"))
    ap.add_argument("--no-save", action="store_true")
    a = ap.parse_args(argv)
    from specrec.bundle import Bundle

    bundle_dir = Path(a.bundle).resolve()
    b = Bundle.load(bundle_dir)
    keys: dict = {}
    if b.prebuilt_graphs(b.sid_mlp) is None:
        t = time.time()
        subprocess.run([sys.executable, "-m", "specrec.cli", "export-onnx", "--bundle", str(bundle_dir)], check=True)
        keys["onnx.build_s"] = round(time.time() - t, 1)
    keys["onnx.graphs_mb"] = round(dir_mb(bundle_dir / "onnx"), 1)
    tmp = Path(tempfile.mkdtemp(prefix="specrec-cold-"))
    namespace = f"bench-cold-{uuid.uuid4().hex[:10]}"
    redis_url, redis_proc = find_or_start_redis(a.redis_url, workdir=tmp / "redis", log_path=tmp / "redis.log")
    cache = tmp / "cache"  # empty: no exported graph, no embedding, nothing a previous run left
    try:
        procs, cold_total, cold = start_timed(bundle_dir, redis_url, namespace, tmp / "logs-cold",
                                              b.cfg.max_history, cache, one_by_one=True)
        procs.stop()
        procs, warm_total, warm = start_timed(bundle_dir, redis_url, namespace, tmp / "logs-warm",
                                              b.cfg.max_history, cache, one_by_one=False)
        procs.stop()
    finally:
        try:
            delete_namespace(redis_url, namespace)
        finally:
            stop_process(redis_proc)
    keys.update({"verifier.cold_start_s": round(cold["verifier"], 1),
                 "stack.cold_start_one_by_one_s": round(cold_total, 1),
                 "stack.warm_start_s": round(warm_total, 1),
                 **{f"stack.warm_start.{n}_s": round(s, 1) for n, s in warm.items()}})
    print({k: v for k, v in keys.items()})
    if not a.no_save:
        update_summary(keys)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
