"""Opportunistic batching across concurrent callers (Triton's default).

A job that arrives while the model is idle is computed at once, alone (its
caller's :meth:`Batcher.submit` hands it to the compute thread itself); jobs
that arrive during a computation queue up and go together into the next one
(up to ``max_batch``), handed over by the computation's end. Nothing waits for
a batch to fill and nothing polls.
Jobs whose deadline passed or whose caller gave up while queued are dropped,
never computed (they fail with :class:`Expired`). Batches run on compute
threads, so the event loop stays free for gRPC: ``concurrency`` batches at
once (default one), so with two a job that arrives while one batch computes
starts at once on the other thread; or, without an executor, on the event
loop's own thread, one at a time (:class:`Batcher`).
A caller's jobs never overlap (each waits for its answer), so concurrent batches
touch disjoint sessions.

A failed device ends the batcher (:mod:`specrec.verifier.device`): a batch
whose computation raised a device failure (a sticky CUDA error, a lost GPU; a
bad request or an out-of-memory batch is not one), or one that has computed
longer than ``hang_s`` (the watchdog, which looks every ``hang_s / 4``, at most
every second), fails with a :class:`~specrec.verifier.DeviceFailure`, and so
does every job computing or queued then, and every job submitted later;
``on_failure`` is told once. A hung computing thread cannot be stopped: it is
left behind, and nothing is computed again.
"""

from __future__ import annotations

import asyncio
import functools
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import Executor, Future
from dataclasses import dataclass, field
from typing import Generic, TypeVar

from prometheus_client import Counter, Histogram

from specrec.verifier import DeviceFailure, device_failure

J = TypeVar("J")
R = TypeVar("R")

BATCH_SIZE = Histogram("specrec_verifier_batch_size", "Jobs per computed batch", ["batcher"],
                       buckets=(1, 2, 4, 8, 16, 32, 64, 128))
QUEUE_WAIT = Histogram("specrec_verifier_queue_wait_seconds", "Time from arrival to computation", ["batcher"],
                       buckets=(0.0001, 0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.03, 0.05, 0.1))
EXPIRED = Counter("specrec_verifier_expired",
                  "Jobs dropped, not computed: their deadline passed or their caller gave up while queued", ["batcher"])


class Expired(Exception):
    pass


@dataclass(eq=False)  # identity semantics: jobs hold tensors
class Pending(Generic[J]):
    job: J
    deadline: float | None  # time.monotonic() deadline
    future: asyncio.Future
    arrived: float = field(default_factory=time.monotonic)


class Batcher(Generic[J, R]):
    """Jobs of concurrent callers, computed in batches of up to ``max_batch``, driven from the event loop by
    callbacks, not tasks. With an ``executor``, ``concurrency`` batches compute at once on its threads: a job that
    finds a compute slot free goes to the executor from its caller's own :meth:`submit`, and a batch that ends
    hands the jobs queued meanwhile to the executor from its completion callback. Without one (``executor``
    None), batches compute on the event loop's own thread, one at a time, on the loop's next turn after a job
    finds it idle (so the jobs that arrived with it go too), and the next batch is what queued meanwhile: no
    hand-off to another thread and back (measured on the verifier, 2 cores: ~0.25 ms of CPU a call less), but
    nothing else runs on the loop while a batch computes, and no watchdog can see a hang (for a CPU's compute,
    where a batch does not hang as a lost GPU's does)."""

    def __init__(self, name: str, run_batch: Callable[[list[J]], list[R]], executor: Executor | None,
                 max_batch: int = 64, concurrency: int = 1, hang_s: float = 0.0,
                 on_failure: Callable[[DeviceFailure], None] = lambda failure: None):
        self.name = name
        self.run_batch = run_batch
        self.executor = executor
        self.max_batch = max_batch
        self.concurrency = concurrency if executor is not None else 1
        self.hang_s = hang_s if executor is not None else 0.0  # a batch computing longer is a hung device (0: none)
        self.on_failure = on_failure
        self.failed: DeviceFailure | None = None  # set once, when the device failed: nothing is computed again
        self.queue: deque[Pending[J]] = deque()  # jobs waiting for a compute slot
        self.busy = 0  # batches computing now
        self._slots = list(range(self.concurrency))  # compute slots free now
        self._computing: dict[int, tuple[float, list[Pending[J]]]] = {}  # slot -> (its batch's start, its jobs)
        self._tasks: list[asyncio.Task] = []
        self._stopped = False
        self._due = False  # (no executor) a batch is due on the loop's next turn
        # every series exists from the start (at 0): a rate is data, not "no data", before the first event
        BATCH_SIZE.labels(name), QUEUE_WAIT.labels(name), EXPIRED.labels(name)
        self._batch_size, self._queue_wait = BATCH_SIZE.labels(name), QUEUE_WAIT.labels(name)

    def start(self) -> None:
        self._stopped = False
        if self.hang_s > 0:
            self._tasks.append(asyncio.create_task(self._watchdog()))

    async def stop(self) -> None:
        """No batch starts after this; one computing finishes on its thread, its callers no longer waited for."""
        self._stopped = True
        for t in self._tasks:
            t.cancel()
        for t in self._tasks:
            try:
                await t
            except asyncio.CancelledError:
                pass
        self._tasks = []

    @property
    def depth(self) -> int:
        """Jobs waiting, plus one per batch computing."""
        return len(self.queue) + self.busy

    async def submit(self, job: J, deadline: float | None) -> R:
        if self.failed is not None:
            raise self.failed
        loop = asyncio.get_running_loop()
        fut = loop.create_future()
        self.queue.append(Pending(job, deadline, fut))
        self._dispatch(loop)
        return await fut

    def _dispatch(self, loop: asyncio.AbstractEventLoop) -> None:
        """On the loop: while a compute slot is free, the jobs queued (up to ``max_batch``) go to the executor as
        one batch (without one: a batch is due on the loop's next turn)."""
        if self.executor is None:
            if self.queue and not self.busy and not self._due and not self._stopped:
                self._due = True
                loop.call_soon(self._compute_here, loop)
            return
        while self._slots and self.queue and not self._stopped:
            pending = self._take()
            if self.failed is not None:
                self._fail(self.failed, pending)
                continue
            slot = self._slots.pop()
            self._begin(slot, pending)
            done = self.executor.submit(self._run, pending)
            done.add_done_callback(functools.partial(self._computed, loop, slot, pending))

    def _take(self) -> list[Pending[J]]:
        return [self.queue.popleft() for _ in range(min(self.max_batch, len(self.queue)))]

    def _begin(self, slot: int, pending: list[Pending[J]]) -> None:
        self.busy += 1
        self._computing[slot] = (time.monotonic(), pending)

    def _compute_here(self, loop: asyncio.AbstractEventLoop) -> None:
        """(No executor) on the loop's thread: the jobs queued now, one batch."""
        self._due = False
        if not self.queue or self._stopped:
            return
        pending = self._take()
        if self.failed is not None:
            self._fail(self.failed, pending)
            return
        self._begin(0, pending)
        try:
            live, results = self._run(pending)
        except Exception as exc:  # the whole batch failed: every caller learns why
            live, results = pending, [exc] * len(pending)
        self._finish(loop, 0, pending, live, results)

    def _computed(self, loop: asyncio.AbstractEventLoop, slot: int, pending: list[Pending[J]],
                  done: Future) -> None:
        """On the compute thread, as a batch ends: its results go to the loop."""
        try:
            live, results = done.result()
        except Exception as exc:  # the whole batch failed: every caller learns why
            live, results = pending, [exc] * len(pending)
        try:
            loop.call_soon_threadsafe(self._finish, loop, slot, pending, live, results)
        except RuntimeError:  # the loop closed (the service stopped): nobody waits for the answers
            pass

    def _finish(self, loop: asyncio.AbstractEventLoop, slot: int, pending: list[Pending[J]], live: list[Pending[J]],
                results: list) -> None:
        """On the loop: a batch's results to its callers (a device failure fails everything), then the next batch."""
        self.busy -= 1
        self._computing.pop(slot, None)
        if self.executor is not None:
            self._slots.append(slot)
        failure = self.failed or next(
            (f for r in results if isinstance(r, BaseException) and (f := device_failure(r)) is not None), None)
        if failure is not None:  # nothing this device computed is trusted, nor is anything computed on it again
            self._fail(failure, pending)
            return
        done_ids = {id(p) for p in live}
        for p in pending:
            if id(p) not in done_ids:
                EXPIRED.labels(self.name).inc()
                if not p.future.done():
                    p.future.set_exception(Expired(f"{self.name}: deadline passed while queued"))
        for p, r in zip(live, results):
            if not p.future.done():
                if isinstance(r, BaseException):
                    p.future.set_exception(r)
                else:
                    p.future.set_result(r)
        self._dispatch(loop)

    async def _watchdog(self) -> None:
        """Every ``hang_s / 4`` (at most every second): a batch computing longer than ``hang_s`` is a hung device."""
        while self.failed is None:
            await asyncio.sleep(min(1.0, self.hang_s / 4))
            now = time.monotonic()
            for started, pending in list(self._computing.values()):
                if now - started > self.hang_s:
                    self._fail(DeviceFailure.hang(now - started, self.hang_s), pending)
                    return

    def _fail(self, failure: DeviceFailure, pending: list[Pending[J]]) -> None:
        """The device failed: ``pending``, every job computing or queued, and every later one fail with
        ``failure`` (the first failure is the one kept and told to ``on_failure``)."""
        first = self.failed is None
        if self.failed is None:
            self.failed = failure
        kept = self.failed
        jobs = [*pending, *(p for _, ps in list(self._computing.values()) for p in ps), *self.queue]
        self.queue.clear()
        for p in jobs:
            if not p.future.done():
                p.future.set_exception(kept)
        if first:
            self.on_failure(failure)

    def _run(self, pending: list[Pending[J]]):
        """On the compute thread: drop what expired while queued, compute the rest."""
        now = time.monotonic()
        live = [p for p in pending if (p.deadline is None or now < p.deadline) and not p.future.cancelled()]
        for p in live:
            self._queue_wait.observe(now - p.arrived)
        if not live:
            return [], []
        self._batch_size.observe(len(live))
        return live, self.run_batch([p.job for p in live])
