"""How many processes a service runs (``processes``, :func:`specrec_rpc.processes.process_count`), and the group's
one metrics port (:meth:`~specrec_rpc.processes.Group.exposition`). The group itself, on real ports, is
``tests/integration/test_processes.py``'s."""

from __future__ import annotations

import subprocess
import sys
from types import SimpleNamespace

import pytest
from prometheus_client import CollectorRegistry, Counter, Gauge, Info, start_http_server
from prometheus_client.parser import text_string_to_metric_families

from specrec_rpc import processes
from specrec_rpc.processes import CORES_PER_PROCESS, Group, Member, cgroup_cpu_limit, process_count


@pytest.mark.parametrize("cores, gateway, drafter", [
    (1, 1, 1), (2, 1, 1),  # our development machines: one of each, a second would only contend
    (4, 1, 1), (6, 1, 1), (7.5, 1, 1), (8, 2, 1), (12, 3, 2), (16, 4, 2), (64, 16, 10),
])
def test_auto_is_one_process_per_share_of_the_cores(cores, gateway, drafter):
    assert process_count(0, "gateway", cores) == gateway
    assert process_count(0, "drafter", cores) == drafter


def test_a_count_that_is_set_wins_and_a_negative_one_is_refused():
    assert process_count(3, "gateway", 2) == 3
    assert process_count(1, "drafter", 64) == 1
    with pytest.raises(ValueError, match="processes"):
        process_count(-1, "gateway", 2)


def test_auto_reads_this_machine(monkeypatch):
    monkeypatch.setattr(processes, "usable_cores", lambda: 12.0)
    assert process_count(0, "gateway") == 12 // CORES_PER_PROCESS["gateway"]


def test_the_cgroup_quota_caps_the_cores(tmp_path, monkeypatch):
    (tmp_path / "cpu.max").write_text("200000 100000\n")
    assert cgroup_cpu_limit(tmp_path) == 2.0
    (tmp_path / "cpu.max").write_text("max 100000\n")
    assert cgroup_cpu_limit(tmp_path) is None
    v1 = tmp_path / "v1"
    (v1 / "cpu").mkdir(parents=True)
    (v1 / "cpu" / "cpu.cfs_quota_us").write_text("150000\n")
    (v1 / "cpu" / "cpu.cfs_period_us").write_text("100000\n")
    assert cgroup_cpu_limit(v1) == 1.5
    (v1 / "cpu" / "cpu.cfs_quota_us").write_text("-1\n")
    assert cgroup_cpu_limit(v1) is None
    assert cgroup_cpu_limit(tmp_path / "none") is None
    # a container limited to 2 cores on a 64-core machine: 2 usable
    monkeypatch.setattr(processes, "cgroup_cpu_limit", lambda: 2.0)
    monkeypatch.setattr(processes.os, "sched_getaffinity", lambda _pid: set(range(64)))
    assert processes.usable_cores() == 2.0


def test_auto_and_counts_from_the_environment(monkeypatch):
    from drafter_svc.service import DrafterSettings
    from gateway.settings import GatewaySettings

    for value, want in (("auto", 0), ("AUTO", 0), ("0", 0), ("3", 3)):
        monkeypatch.setenv("SPECREC_GATEWAY_PROCESSES", value)
        monkeypatch.setenv("SPECREC_DRAFTER_PROCESSES", value)
        assert GatewaySettings().processes == want and DrafterSettings().processes == want
    monkeypatch.setenv("SPECREC_GATEWAY_PROCESSES", "-2")
    with pytest.raises(ValueError, match="processes"):
        GatewaySettings()


def test_a_member_takes_the_groups_port_and_no_public_metrics_port():
    from gateway.settings import GatewaySettings

    assert Member.of_env({}) is None
    m = Member.of_env({processes.ENV: '{"index": 1, "count": 2, "port": 50123, "health_port": 50124, '
                                      '"report_fd": 7, "go_fd": 8}'})
    assert m is not None and (m.index, m.count, m.report_fd, m.go_fd) == (1, 2, 7, 8)
    s = m.settings(GatewaySettings(port=0, metrics_port=9100, processes=2))
    assert (s.port, s.health_port, s.metrics_port, s.processes) == (50123, 50124, 0, 1)


RUNNING = SimpleNamespace(poll=lambda: None)  # a process that has not exited


def test_the_groups_metrics_port_serves_every_process_labelled():
    servers, procs = [], []
    for i in range(2):
        reg = CollectorRegistry()
        Counter("specrec_rpc_requests", "RPCs", ["method"], registry=reg).labels("Recommend").inc(3 + i)
        Gauge("specrec_rpc_inflight", "in flight", registry=reg).set(i)
        Info("specrec_build", "build", registry=reg).info({"version": "x"})
        server, _ = start_http_server(0, addr="127.0.0.1", registry=reg)
        servers.append(server)
        procs.append(SimpleNamespace(index=i, metrics_port=server.server_port, popen=RUNNING))
    # a third whose metrics do not answer (still starting): up 0, nothing else of it
    procs.append(SimpleNamespace(index=2, metrics_port=0, popen=RUNNING))
    group = Group(["true"], 3, 0)
    group.procs = procs  # type: ignore[assignment]
    try:
        fams = {f.name: f for f in text_string_to_metric_families(group.exposition().decode())}
        reqs = {s.labels["process"]: s.value for s in fams["specrec_rpc_requests"].samples
                if s.name == "specrec_rpc_requests_total"}
        assert reqs == {"0": 3.0, "1": 4.0}
        assert {s.labels["process"]: s.value for s in fams["specrec_rpc_inflight"].samples} == {"0": 0.0, "1": 1.0}
        assert {s.labels["process"]: s.value for s in fams["specrec_process_up"].samples} == {
            "0": 1.0, "1": 1.0, "2": 0.0}
        assert len(fams["specrec_build_info"].samples) == 2
        # a scrape's filter reaches the processes
        only = {f.name for f in text_string_to_metric_families(
            group.exposition("name[]=specrec_rpc_inflight").decode())}
        assert only == {"specrec_rpc_inflight", "specrec_process_up"}
    finally:
        for s in servers:
            s.shutdown()
            s.server_close()


def test_a_group_whose_process_fails_to_start_exits_1():
    """A process that exits before it is warm stops the group: the parent exits 1 (the container restarts it)."""
    group = Group([sys.executable, "-c", "import sys; sys.exit(3)"], 2, 0, grace_s=1.0)
    assert group.run() == 1
    assert all(p.popen.returncode is not None for p in group.procs)


def test_a_group_runs_its_processes_and_says_go_once_all_are_warm(tmp_path):
    """The parent's side of the protocol with stand-in processes: each reports warm on its pipe, waits for the go,
    writes a file, and exits when its pipe closes or on SIGTERM; the parent stops them all on SIGTERM."""
    code = (
        "import json, os, signal, sys, time\n"
        "m = json.loads(os.environ['SPECREC_PROCESS'])\n"
        f"time.sleep(0.3 * m['index'])\n"
        "os.write(m['report_fd'], b'{\"warm\": true, \"metrics_port\": 0}\\n')\n"
        "assert os.read(m['go_fd'], 16) == b'go\\n'\n"
        f"open(r'{tmp_path}' + '/go%d' % m['index'], 'w').write(str(time.time()))\n"
        "signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))\n"
        "while os.read(m['go_fd'], 16): pass\n")
    runner = subprocess.Popen([sys.executable, "-c",
                               "import sys; from specrec_rpc.processes import Group; "
                               f"sys.exit(Group([sys.executable, '-c', {code!r}], 3, 1234, grace_s=2).run())"])
    try:
        import time

        deadline = time.monotonic() + 30
        while len(list(tmp_path.glob("go*"))) < 3 and time.monotonic() < deadline:
            time.sleep(0.05)
        went = sorted(float(p.read_text()) for p in tmp_path.glob("go*"))
        assert len(went) == 3, "not every process got its go"
        assert went[-1] - went[0] < 0.25, "the go came to each when it was warm, not once all were"
        runner.terminate()
        assert runner.wait(10) == 0
    finally:
        if runner.poll() is None:
            runner.kill()


def test_free_ports_are_never_handed_out_twice():
    """The kernel may hand a just-closed port out again, and the services bind with SO_REUSEPORT: a stack whose
    drafter and gateway got one port shared it silently (the gateway's callers met the drafter's UNIMPLEMENTED)."""
    ports = [processes.free_port() for _ in range(200)]
    assert len(set(ports)) == len(ports)
