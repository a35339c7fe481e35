"""``bench.chaos``'s ``kill-redis-primary``: the Redis Sentinel failover, on a stack of its own over a
Sentinel-managed Redis (``specrec_stack/localsentinel.py``), with a writer upserting one item at a time through the
item set while the load runs; the primary is SIGKILLed and the sentinels promote a replica
(:func:`run_failover_phase`). :class:`ReplicaWatch` tells which acknowledged writes no replica can have held.
"""

from __future__ import annotations

import bisect
import threading
import time
from collections import Counter
from pathlib import Path

import numpy as np

from bench.chaos_services import catalogue_check, make_load, recovery_s, scenario_row
from bench.harness import Stack, Writer, sayer

say = sayer("chaos", clock=True)


class ReplicaWatch:
    """The replicas connected to whichever data server is the primary, read every ``every_s`` in a thread of its
    own (``polls``: (time, connected replicas), None while no server is primary): which acknowledged writes no
    replica can have held."""

    def __init__(self, ports: list[int], every_s: float = 0.02):
        import redis

        self.clients = [redis.Redis(port=p, socket_timeout=0.2, socket_connect_timeout=0.2) for p in ports]
        self.every_s, self.polls = every_s, []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="replica-watch", daemon=True)

    def _run(self) -> None:
        import redis

        while not self._stop.is_set():
            n = None
            for c in self.clients:
                try:
                    info = c.info("replication")
                except redis.RedisError:
                    continue  # killed, or not answering
                if info.get("role") == "master":
                    n = int(info.get("connected_slaves", 0) or 0)
                    break
            self.polls.append((time.monotonic(), n))
            self._stop.wait(self.every_s)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(5)
        for c in self.clients:
            c.close()

    def without_replica(self, done: list[float]) -> int:
        """The writes acknowledged at times ``done`` when the primary had no replica: the last reading before
        the acknowledgement and the first after it both say none (a replica that connected in between is given
        the benefit of the doubt)."""
        times = [t for t, _ in self.polls]
        count = 0
        for d in done:
            i = bisect.bisect_right(times, d)
            if 0 < i < len(self.polls) and not self.polls[i - 1][1] and not self.polls[i][1]:
                count += 1
        return count


def run_failover_phase(a, bundle_dir: Path, bundle, users, tmp: Path, name: str = "kill-redis-primary") -> dict:
    """The ``kill-redis-primary`` scenario on a stack of its own over a Sentinel-managed Redis: a primary and two
    replicas (the failover leaves one), three sentinels."""
    from specrec_stack.localsentinel import LocalSentinel

    rs = LocalSentinel(tmp / "sentinel", replicas=2).start()
    say(f"{name}: Sentinel-managed Redis up ({rs.url}); starting the stack on it")
    stack = Stack(bundle_dir, rs.url, tmp / "logs-failover", "chaos-fo", threads=a.threads,
                  max_history=bundle.cfg.max_history, env={"SPECREC_ITEMSET_REDIS_TIMEOUT_S": "1.0"})
    procs = stack.procs
    load = writer = None
    watch = ReplicaWatch(rs.data_ports)
    try:
        procs.start(a.startup_timeout, say=say)
        watch.start()
        load = make_load(procs.addr("gateway"), users, a.budget_ms, a.rate, seed=a.seed + 1)
        writer = Writer(procs.addr("itemset"), procs.token)
        load.start()
        writer.start()
        time.sleep(a.settle_s)
        old = rs.kill_primary()
        t0 = time.monotonic()
        new, promoted_s = rs.wait_promoted(old, 60.0)
        t1 = time.monotonic()
        say(f"{name}: primary {old} killed, {new} promoted after {promoted_s:.2f} s")
        time.sleep(a.settle_s)
        writer.stop()
        load.stop()
        watch.stop()
        t_next = time.monotonic()
        acked = dict(writer.acked)
        without = watch.without_replica([r["done"] for r in writer.records if r["code"] == "OK"])
        check = catalogue_check(procs.addr("itemset"), 0, list(acked))
        recs = list(load.records)
        row = scenario_row(name, recs, t0, t1, t_next, a, check["lost"])
        # recovery from the kill: writes acknowledged again, and the readers' answers undegraded model answers
        w_after = sorted(r["done"] for r in writer.records if r["t"] >= t0 and r["code"] == "OK")
        write_recovery = (w_after[0] - t0) if w_after else float("inf")
        read_recovery = recovery_s([r for r in recs if r["t"] >= t0], t0, a.streak)
        w_codes = Counter(r["code"] for r in writer.records)
        row.update(recovery_s=max(write_recovery, read_recovery if not np.isnan(read_recovery) else float("inf")),
                   write_recovery_s=write_recovery, read_recovery_s=read_recovery, promoted_s=promoted_s,
                   acked_writes=len(acked), acked_writes_lost=check["lost"], write_codes=dict(w_codes),
                   acked_without_replica=without,
                   internal_errors=row["internal_errors"] + w_codes.get("INTERNAL", 0))
        say(f"{name}: {len(acked)} writes acknowledged, {check['lost']} of them lost, {without} with no replica "
            f"connected to the primary; writes {dict(w_codes)}; "
            f"recovery {row['recovery_s']:.2f} s (writes {write_recovery:.2f} s, reads {read_recovery:.2f} s)")
        return {"row": row, "records": recs, "window": (name, t0, t1)}
    finally:
        watch.stop()
        if writer is not None:
            writer.stop()
        if load is not None:
            load.stop()
        stack.stop(say=say, delete_namespace=False)  # the private Sentinel-managed Redis goes with the run
        rs.stop()
