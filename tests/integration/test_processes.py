"""The gateway and the drafter as groups of two processes on one port each (``processes`` = 2,
:mod:`specrec_rpc.processes`), in the local stack as ``specrec stack up`` runs it (``ServiceProcs``), over a real
Redis and real gRPC: both processes of each group answer calls on the group's port (their metrics, which the
group's parent serves labelled by process, count them), and stopping the stack stops every process; a group
whose parent is killed outright stops as well. The stack runs with the split placement
(``SPECREC_STACK_PLACEMENT``): every process of each service, a group's too, runs on the CPUs placed for it."""

from __future__ import annotations

import os
import signal
import time
import urllib.request
import uuid

import grpc
import numpy as np
from prometheus_client.parser import text_string_to_metric_families

from specrec_rpc.processes import group_pids
from specrec_rpc.v1 import drafter_pb2, drafter_pb2_grpc, recommender_pb2, recommender_pb2_grpc
from specrec_stack.localstack import ServiceProcs, delete_namespace, free_port

#: separate channels, each its own connection (no shared subchannel pool): the kernel hands each connection to
#: one process of the group, so 16 leave a process without one with probability 2 x 2^-16
CHANNELS = 16


def calls_by_process(metrics_port: int, service: str, method: str) -> dict[str, float]:
    """``specrec_rpc_requests_total`` of one method, per process of the group (its ``process`` label)."""
    with urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=10) as r:
        text = r.read().decode()
    out: dict[str, float] = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            if (s.name == "specrec_rpc_requests_total" and s.labels.get("service") == service
                    and s.labels.get("method") == method):
                out[s.labels["process"]] = out.get(s.labels["process"], 0.0) + s.value
    return out


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:  # a zombie (exited, not reaped yet) has stopped too
        return open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def channels(addr: str) -> list[grpc.Channel]:
    return [grpc.insecure_channel(addr, options=[("grpc.use_local_subchannel_pool", 1)]) for _ in range(CHANNELS)]


def test_two_processes_on_one_port_each_answer_and_stop_with_the_stack(redis_url, fused_bundle_dir, serving_bundle,
                                                                       tmp_path):
    ns = f"procs-{uuid.uuid4().hex[:8]}"
    metrics = {"gateway": free_port(), "drafter": free_port()}
    procs = ServiceProcs(fused_bundle_dir, redis_url, ns, tmp_path / "logs", metrics_ports=metrics, max_history=8,
                         env={"SPECREC_GATEWAY_PROCESSES": "2", "SPECREC_DRAFTER_PROCESSES": "2",
                              "SPECREC_GATEWAY_WARMUP_REQUESTS": "1", "SPECREC_VERIFIER_THREADS": "1",
                              "SPECREC_VERIFIER_WARMUP_K": "[10]", "SPECREC_STACK_PLACEMENT": "split"})
    pids: dict[str, list[int]] = {}
    try:
        procs.start(timeout=300, say=lambda _m: None)
        for name in ("gateway", "drafter"):
            pids[name] = group_pids(procs.procs[name].pid)
            assert len(pids[name]) == 3, f"{name}: the parent and two processes, found {pids[name]}"
        assert procs.placement == "split"
        if len(os.sched_getaffinity(0)) >= 2:  # split confines nothing on one CPU
            cpus = sorted(os.sched_getaffinity(0))
            assert procs.cpus["verifier"] == set(cpus[len(cpus) // 2:])
            for name in ("itemset", "verifier", "drafter", "gateway"):
                for pid in group_pids(procs.procs[name].pid):
                    assert os.sched_getaffinity(pid) == procs.cpus[name], (name, pid)
        ids = serving_bundle.catalogue.ids
        rng = np.random.default_rng(0)

        # the gateway: Recommend over 16 connections to its one port
        before = calls_by_process(metrics["gateway"], "gateway", "Recommend")
        for ch in channels(procs.addr("gateway")):
            with ch:
                stub = recommender_pb2_grpc.RecommenderStub(ch)
                for _ in range(2):
                    hist = [ids[i] for i in rng.choice(len(ids), size=5, replace=False)]
                    r = stub.Recommend(recommender_pb2.RecommendRequest(history=hist, k=10, policy="fused",
                                                                        budget_ms=1000), timeout=10)
                    assert len(r.items) == 10
        after = calls_by_process(metrics["gateway"], "gateway", "Recommend")
        assert set(after) == {"0", "1"}, after
        assert all(after[p] > before.get(p, 0.0) for p in after), (before, after)

        # the drafter: Draft over 16 connections to its one port
        before = calls_by_process(metrics["drafter"], "drafter", "Draft")
        for ch in channels(procs.addr("drafter")):
            with ch:
                stub = drafter_pb2_grpc.DrafterStub(ch)
                hist = [ids[i] for i in rng.choice(len(ids), size=5, replace=False)]
                r = stub.Draft(drafter_pb2.DraftRequest(queries=[drafter_pb2.DraftQuery(history=hist, n=10)]),
                               timeout=10)
                assert len(r.drafts) == 1 and len(r.drafts[0].item_ids) > 0
        after = calls_by_process(metrics["drafter"], "drafter", "Draft")
        assert set(after) == {"0", "1"}, after
        assert all(after[p] > before.get(p, 0.0) for p in after), (before, after)

        # the drafter's parent killed outright: its processes see their pipe close and stop
        os.kill(pids["drafter"][0], signal.SIGKILL)
        procs.procs["drafter"].wait(10)
        deadline = time.monotonic() + 30
        while any(alive(p) for p in pids["drafter"][1:]) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not [p for p in pids["drafter"][1:] if alive(p)], "a drafter process outlived its group's parent"
    finally:
        procs.stop()
        delete_namespace(redis_url, ns)
    assert pids, "the stack did not start"
    deadline = time.monotonic() + 5
    while any(alive(p) for ps in pids.values() for p in ps) and time.monotonic() < deadline:
        time.sleep(0.1)
    left = [p for ps in pids.values() for p in ps if alive(p)]
    assert not left, f"processes left after the stack stopped: {left}"
