"""The machine's CPUs as a benchmark arranges them: which CPUs this process may use, confining processes
(every thread of each) to some of them and back, a process's CPU time, and a busy process that takes one CPU
(the CPU hog of ``bench.chaos``).

Linux's ``sched_setaffinity(pid, mask)`` sets the mask of one *thread*, the one whose id is ``pid`` (for a
process id, its main thread); a thread started later inherits the mask of the thread that starts it. So
:func:`confine` sets the mask of every thread listed under ``/proc/<pid>/task`` (again until a pass finds no
thread it has not set: one may start while it works), and what those threads start afterwards stays within
the mask. :func:`restore` gives every thread back its mask from before (a thread started meanwhile: its
process's main thread's mask from before). Used by ``bench.overload`` (the load generator on a CPU of its own,
the services on the others) and ``bench.chaos`` (``cpu-hog``: :class:`Hog`; ``one-core``: the verifier
confined to one CPU).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from collections.abc import Iterable
from pathlib import Path

__all__ = ["Hog", "affinity", "confine", "cpu_seconds", "restore", "split", "threads_of", "usable"]

#: the hog's code (arguments: a CPU, the pid of the process that starts it): confine itself to the CPU, then spin
#: until it is killed, or until that process is no longer its parent (a benchmark killed before it could stop
#: its hog leaves no busy process behind; the pid is given, not read at its start, when it might be gone already)
HOG_CODE = ("import os, sys\n"
            "os.sched_setaffinity(0, {int(sys.argv[1])})\n"
            "while os.getppid() == int(sys.argv[2]):\n"
            "    for _ in range(100_000):\n"
            "        pass\n")


def usable() -> list[int]:
    """The CPUs this process may run on (its affinity: a container's cpuset may give fewer than the machine has)."""
    return sorted(os.sched_getaffinity(0))


def split(cpus: list[int], own: int | None = None) -> tuple[set[int], set[int]]:
    """(one CPU of its own, the rest) out of ``cpus``: ``own`` if given, else the last. ValueError when there is
    no rest (fewer than two CPUs) or ``own`` is not one of them."""
    if len(cpus) < 2:
        raise ValueError(f"{len(cpus)} CPU(s): none left for the rest once one is taken")
    pick = cpus[-1] if own is None else own
    if pick not in cpus:
        raise ValueError(f"CPU {pick} is not one of {cpus}")
    return {pick}, set(cpus) - {pick}


def threads_of(pid: int) -> list[int]:
    """The thread ids of a process (``/proc/<pid>/task``); [] when it is gone."""
    try:
        return sorted(int(t) for t in os.listdir(f"/proc/{pid}/task"))
    except (FileNotFoundError, ProcessLookupError):
        return []


def affinity(pid: int) -> dict[int, list[int]]:
    """Each thread of a process -> the CPUs it may run on (threads gone meanwhile left out)."""
    out = {}
    for tid in threads_of(pid):
        try:
            out[tid] = sorted(os.sched_getaffinity(tid))
        except (ProcessLookupError, PermissionError):
            continue
    return out


def confine(pids: Iterable[int], cpus: set[int], max_passes: int = 10) -> dict[int, dict[int, set[int]]]:
    """Every thread of every process of ``pids`` may run on ``cpus`` only; a process that is gone is skipped.
    -> what to give :func:`restore`: per process, each thread's mask from before."""
    before: dict[int, dict[int, set[int]]] = {}
    for pid in pids:
        masks = before.setdefault(pid, {})
        for _ in range(max_passes):  # again while threads appear: one started during a pass may escape it
            new = [t for t in threads_of(pid) if t not in masks]
            if not new:
                break
            for tid in new:
                try:
                    masks[tid] = os.sched_getaffinity(tid)
                    os.sched_setaffinity(tid, cpus)
                except ProcessLookupError:  # the thread ended meanwhile
                    masks[tid] = set()
    return before


def restore(before: dict[int, dict[int, set[int]]]) -> None:
    """Undo :func:`confine`: each thread its mask from before; one started since, its process's main thread's
    mask from before (else every CPU this process may use)."""
    for pid, masks in before.items():
        default = masks.get(pid) or set(usable())
        for tid in threads_of(pid):
            try:
                os.sched_setaffinity(tid, masks.get(tid) or default)
            except ProcessLookupError:
                continue


def cpu_seconds(pid: int) -> float | None:
    """The CPU time a process has used, all its threads, user and system (``/proc/<pid>/stat``); None when it
    cannot be read."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = stat[stat.rindex(")") + 2:].split()  # after "pid (comm) ": the state is field 3 of proc(5)
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime, stime: fields 14 and 15


class Hog:
    """A busy process on one CPU: a Python loop, confined to ``cpu`` (it confines itself first, and
    :meth:`start` confines it again by its pid); :meth:`stop` kills it (and it ends by itself when this
    process is gone). ``code``: what it runs (default :data:`HOG_CODE`; a test gives one that sleeps), with
    the CPU and this process's pid as its arguments."""

    def __init__(self, cpu: int, code: str = HOG_CODE):
        self.cpu, self.code = cpu, code
        self.proc: subprocess.Popen | None = None

    @property
    def pid(self) -> int:
        assert self.proc is not None, "not started"
        return self.proc.pid

    def start(self) -> Hog:
        self.proc = subprocess.Popen([sys.executable, "-c", self.code, str(self.cpu), str(os.getpid())],
                                     stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, start_new_session=True)
        confine([self.proc.pid], {self.cpu})
        return self

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait()
