"""Dynamic batching across concurrent requests.

Calls of one kind queue up; a collector takes up to ``max_batch`` of them,
waiting at most ``max_wait_ms`` after the first, drops those whose deadline
has passed (they fail with DEADLINE_EXCEEDED, never computed), and runs the
rest as one batch on the single compute thread. Results go back to each
caller's future.
"""

from __future__ import annotations

import asyncio
import time
from concurrent.futures import Executor
from dataclasses import dataclass, field
from typing import Any, Callable

from prometheus_client import Counter, Histogram

BATCH_SIZE = Histogram("specrec_verifier_batch_size", "Requests per computed batch", ["kind"],
                       buckets=(1, 2, 4, 8, 16, 32, 64, 128))
QUEUE_WAIT = Histogram("specrec_verifier_queue_wait_seconds", "Time from arrival to batch start", ["kind"],
                       buckets=(0.0001, 0.0005, 0.001, 0.002, 0.005, 0.01, 0.03, 0.1))
EXPIRED = Counter("specrec_verifier_expired",
                  "Requests dropped, not computed: their deadline passed or their caller gave up while queued", ["kind"])


class Expired(Exception):
    pass


@dataclass(eq=False)  # identity semantics: payloads hold arrays
class Job:
    payload: Any
    deadline: float | None  # time.monotonic() deadline
    future: asyncio.Future
    arrived: float = field(default_factory=time.monotonic)


class Batcher:
    def __init__(self, kind: str, run_batch: Callable[[list[Any]], list[Any]], executor: Executor,
                 max_batch: int = 32, max_wait_ms: float = 1.0):
        self.kind = kind
        self.run_batch = run_batch
        self.executor = executor
        self.max_batch = max_batch
        self.max_wait = max_wait_ms / 1000.0
        self.queue: asyncio.Queue[Job] = asyncio.Queue()
        self._task: asyncio.Task | None = None

    def start(self) -> None:
        self._task = asyncio.create_task(self._loop())

    async def stop(self) -> None:
        if self._task:
            self._task.cancel()
            try:
                await self._task
            except asyncio.CancelledError:
                pass

    async def submit(self, payload: Any, deadline: float | None) -> Any:
        fut = asyncio.get_running_loop().create_future()
        await self.queue.put(Job(payload, deadline, fut))
        return await fut

    async def _loop(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            first = await self.queue.get()
            jobs = [first]
            until = time.monotonic() + self.max_wait
            # fill without asyncio.wait_for(queue.get()): on Python < 3.12 a timeout racing a
            # completed get() loses the item, and its caller would wait forever
            while len(jobs) < self.max_batch:
                try:
                    jobs.append(self.queue.get_nowait())
                    continue
                except asyncio.QueueEmpty:
                    pass
                left = until - time.monotonic()
                if left <= 0:
                    break
                await asyncio.sleep(min(left, 0.0002))
            gone = [j for j in jobs if j.future.cancelled()]  # the RPC was cancelled (e.g. its deadline passed)
            if gone:
                EXPIRED.labels(self.kind).inc(len(gone))
            jobs = [j for j in jobs if not j.future.cancelled()]
            if not jobs:
                continue
            try:
                live, results = await loop.run_in_executor(self.executor, self._run, jobs)
            except Exception as exc:  # the whole batch failed: every caller learns why
                for j in jobs:
                    if not j.future.done():
                        j.future.set_exception(exc)
                continue
            alive = {id(j) for j in live}
            for j in jobs:
                if id(j) not in alive:
                    EXPIRED.labels(self.kind).inc()
                    if not j.future.done():
                        j.future.set_exception(Expired(f"{self.kind}: deadline passed while queued"))
            for j, r in zip(live, results):
                if not j.future.done():
                    if isinstance(r, Exception):
                        j.future.set_exception(r)
                    else:
                        j.future.set_result(r)

    def _run(self, jobs: list[Job]):
        """On the compute thread: drop what expired while waiting for it, compute the rest."""
        now = time.monotonic()
        live = [j for j in jobs if (j.deadline is None or now < j.deadline) and not j.future.cancelled()]
        for j in live:
            QUEUE_WAIT.labels(self.kind).observe(now - j.arrived)
        if not live:
            return [], []
        BATCH_SIZE.labels(self.kind).observe(len(live))
        return live, self.run_batch([j.payload for j in live])
