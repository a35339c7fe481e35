"""``bench.cpus``: confining every thread of a process to some CPUs and back (threads started meanwhile
included), a process's CPU time, the CPU hog; on child processes that sleep, and on this process itself."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from bench import cpus as C

#: a child with three sleeping threads; each line on its stdin starts one more, and it answers with a line
CHILD = """import sys, threading, time
for _ in range(3):
    threading.Thread(target=time.sleep, args=(60,), daemon=True).start()
print("ready", flush=True)
for line in sys.stdin:
    threading.Thread(target=time.sleep, args=(60,), daemon=True).start()
    print("started", flush=True)
"""


def fake_pid() -> int:
    """A pid no process can have (pids are below pid_max)."""
    return int(Path("/proc/sys/kernel/pid_max").read_text())


@pytest.fixture
def child():
    p = subprocess.Popen([sys.executable, "-c", CHILD], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    assert p.stdout is not None and p.stdout.readline().strip() == "ready"
    yield p
    p.kill()
    p.wait()


def masks(pid: int) -> set[frozenset[int]]:
    return {frozenset(c) for c in C.affinity(pid).values()}


def two_cpus() -> list[int]:
    cpus = C.usable()
    if len(cpus) < 2:
        pytest.skip("needs two CPUs to confine to one")
    return cpus


def test_split_takes_one_cpu_and_leaves_the_rest():
    assert C.split([0, 1, 2, 3]) == ({3}, {0, 1, 2})
    assert C.split([0, 1, 2, 3], own=0) == ({0}, {1, 2, 3})
    with pytest.raises(ValueError, match="1 CPU"):
        C.split([0])
    with pytest.raises(ValueError, match="not one of"):
        C.split([0, 1], own=5)


def test_every_thread_is_confined_and_a_thread_started_after_inherits_then_all_are_restored(child):
    cpus = two_cpus()
    one = {cpus[0]}
    assert len(C.threads_of(child.pid)) >= 4 and masks(child.pid) == {frozenset(cpus)}
    before = C.confine([child.pid, fake_pid()], one)
    assert before[fake_pid()] == {}  # a process that is not there is skipped
    assert set(before[child.pid]) == set(C.threads_of(child.pid))
    assert masks(child.pid) == {frozenset(one)}
    child.stdin.write("\n")
    child.stdin.flush()
    assert child.stdout.readline().strip() == "started"
    new = set(C.threads_of(child.pid)) - set(before[child.pid])
    assert len(new) == 1 and set(C.affinity(child.pid)[new.pop()]) == one  # started by a confined thread
    C.restore(before)
    assert masks(child.pid) == {frozenset(cpus)}  # the new thread too: its main thread's mask from before


def test_this_process_confined_and_restored():
    cpus = two_cpus()
    before = C.confine([os.getpid()], {cpus[-1]})
    try:
        assert masks(os.getpid()) == {frozenset({cpus[-1]})}
        assert C.usable() == [cpus[-1]]
    finally:
        C.restore(before)
    assert C.usable() == cpus


def test_cpu_seconds_reads_the_process_time_of_all_its_threads():
    t = C.cpu_seconds(os.getpid())
    assert t is not None and abs(t - time.process_time()) < 0.1  # clock ticks: 10 ms
    assert C.cpu_seconds(fake_pid()) is None


def test_the_hog_is_confined_to_its_cpu_and_killed():
    cpu = C.usable()[-1]
    hog = C.Hog(cpu, code="import time\ntime.sleep(60)\n").start()  # one that sleeps: the test takes no CPU
    try:
        assert masks(hog.pid) == {frozenset({cpu})}
    finally:
        hog.stop()
    assert hog.proc is not None and hog.proc.poll() is not None


def alive(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat[stat.rindex(")") + 2] != "Z"  # a zombie nobody reaped has ended


def test_the_hog_code_confines_itself_to_the_cpu_it_is_given():
    cpu = C.usable()[-1]
    said = "print(sorted(os.sched_getaffinity(0)))\n"
    code = C.HOG_CODE.replace("while os.getppid()", said + "while False and os.getppid()")  # says, never spins
    assert code != C.HOG_CODE
    out = subprocess.run([sys.executable, "-c", code, str(cpu), str(os.getpid())], capture_output=True, text=True,
                         check=True).stdout
    assert out.strip() == f"[{cpu}]"


def test_the_hog_ends_when_its_parent_is_gone():
    cpu = C.usable()[-1]
    code = C.HOG_CODE.replace("for _ in range(100_000):\n        pass", "import time; time.sleep(0.05)")  # no spinning
    assert code != C.HOG_CODE
    # a parent that starts it, says its pid and ends at once (its stdout not a pipe this test waits on: the hog
    # holds it as long as it lives)
    starter = (f"import os, subprocess, sys; print(subprocess.Popen([sys.executable, '-c', {code!r}, '{cpu}', "
               "str(os.getpid())], stdout=subprocess.DEVNULL).pid)")
    pid = int(subprocess.run([sys.executable, "-c", starter], capture_output=True, text=True, check=True,
                             timeout=30).stdout)
    deadline = time.monotonic() + 10
    while alive(pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    ended = not alive(pid)
    if not ended:
        os.kill(pid, signal.SIGKILL)  # a failing test leaves nothing behind
    assert ended


def test_the_cpu_class_names_what_the_cpu_computes_in():
    from bench.request_path import cpu_class

    assert cpu_class({"avx2", "fma"}) == "AVX2 only"
    assert cpu_class({"avx2", "avx512f", "avx512_vnni"}) == "AVX-512"
    assert cpu_class({"avx2", "avx512f", "amx_tile", "amx_bf16"}) == "AMX"
    assert cpu_class({"sse4_2"}) == "no AVX2"
    assert cpu_class() in ("AVX2 only", "AVX-512", "AMX", "no AVX2")  # this machine's, from /proc/cpuinfo
