"""Opportunistic batching across concurrent callers (Triton's default).

A job that arrives while the model is idle is computed at once, alone; jobs
that arrive during a computation queue up and go together into the next one
(up to ``max_batch``). Nothing waits for a batch to fill and nothing polls.
Jobs whose deadline passed or whose caller gave up while queued are dropped,
never computed (they fail with :class:`Expired`). Batches run on compute
threads, so the event loop stays free for gRPC: ``concurrency`` batches at
once (default one), each taken by whichever compute loop is free, so with two a
job that arrives while one batch computes starts at once on the other thread.
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
import time
from collections.abc import Callable
from concurrent.futures import Executor
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
    def __init__(self, name: str, run_batch: Callable[[list[J]], list[R]], executor: Executor, max_batch: int = 64,
                 concurrency: int = 1, hang_s: float = 0.0,
                 on_failure: Callable[[DeviceFailure], None] = lambda failure: None):
        self.name = name
        self.run_batch = run_batch
        self.executor = executor
        self.max_batch = max_batch
        self.concurrency = concurrency
        self.hang_s = hang_s  # a batch computing longer is a hung device (0: no watchdog)
        self.on_failure = on_failure
        self.failed: DeviceFailure | None = None  # set once, when the device failed: nothing is computed again
        self.queue: asyncio.Queue[Pending[J]] = asyncio.Queue()
        self.busy = 0  # batches computing now
        self._computing: dict[int, tuple[float, list[Pending[J]]]] = {}  # compute loop -> (its batch's start, jobs)
        self._tasks: list[asyncio.Task] = []
        # every series exists from the start (at 0): a rate is data, not "no data", before the first event
        BATCH_SIZE.labels(name), QUEUE_WAIT.labels(name), EXPIRED.labels(name)

    def start(self) -> None:
        self._tasks = [asyncio.create_task(self._loop(n)) for n in range(self.concurrency)]
        if self.hang_s > 0:
            self._tasks.append(asyncio.create_task(self._watchdog()))

    async def stop(self) -> None:
        for t in self._tasks:
            t.cancel()
        for t in self._tasks:
            try:
                await t
            except asyncio.CancelledError:
                pass

    @property
    def depth(self) -> int:
        """Jobs waiting, plus one per batch computing."""
        return self.queue.qsize() + self.busy

    async def submit(self, job: J, deadline: float | None) -> R:
        if self.failed is not None:
            raise self.failed
        fut = asyncio.get_running_loop().create_future()
        self.queue.put_nowait(Pending(job, deadline, fut))
        return await fut

    async def _loop(self, n: int) -> None:
        loop = asyncio.get_running_loop()
        while True:
            pending = [await self.queue.get()]
            while len(pending) < self.max_batch and not self.queue.empty():
                pending.append(self.queue.get_nowait())
            if self.failed is not None:
                self._fail(self.failed, pending)
                continue
            self.busy += 1
            self._computing[n] = (time.monotonic(), pending)
            try:
                live, results = await loop.run_in_executor(self.executor, self._run, pending)
            except Exception as exc:  # the whole batch failed: every caller learns why
                live, results = pending, [exc] * len(pending)
            finally:
                self.busy -= 1
                self._computing.pop(n, None)
            failure = self.failed or next(
                (f for r in results if isinstance(r, BaseException) and (f := device_failure(r)) is not None), None)
            if failure is not None:  # nothing this device computed is trusted, nor is anything computed on it again
                self._fail(failure, pending)
                continue
            done = {id(p) for p in live}
            for p in pending:
                if id(p) not in done:
                    EXPIRED.labels(self.name).inc()
                    if not p.future.done():
                        p.future.set_exception(Expired(f"{self.name}: deadline passed while queued"))
            for p, r in zip(live, results):
                if not p.future.done():
                    if isinstance(r, BaseException):
                        p.future.set_exception(r)
                    else:
                        p.future.set_result(r)

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
        jobs = [*pending, *(p for _, ps in list(self._computing.values()) for p in ps)]
        while not self.queue.empty():
            jobs.append(self.queue.get_nowait())
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
            QUEUE_WAIT.labels(self.name).observe(now - p.arrived)
        if not live:
            return [], []
        BATCH_SIZE.labels(self.name).observe(len(live))
        return live, self.run_batch([p.job for p in live])
