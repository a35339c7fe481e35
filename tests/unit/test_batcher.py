"""The verifier's opportunistic batcher: what queues during a computation is batched, expired jobs are
never computed, and with ``concurrency`` 2 two batches compute at the same time."""

from __future__ import annotations

import asyncio
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from verifier_svc.batcher import Batcher, Expired


def run(coro):
    return asyncio.run(coro)


def test_jobs_that_queue_during_a_computation_go_together():
    batches = []
    gate = threading.Event()

    def run_batch(jobs):
        batches.append(list(jobs))
        gate.wait(5)
        return [j * 10 for j in jobs]

    async def go():
        b = Batcher("t", run_batch, ThreadPoolExecutor(1))
        b.start()
        first = asyncio.ensure_future(b.submit(1, None))
        await asyncio.sleep(0.05)  # 1 is computing alone; 2 and 3 queue behind it
        rest = [asyncio.ensure_future(b.submit(j, None)) for j in (2, 3)]
        await asyncio.sleep(0.05)
        gate.set()
        out = await asyncio.gather(first, *rest)
        await b.stop()
        return out

    assert run(go()) == [10, 20, 30]
    assert batches == [[1], [2, 3]]


def test_a_job_whose_deadline_passed_while_queued_is_not_computed():
    computed = []
    gate = threading.Event()

    def run_batch(jobs):
        computed.extend(jobs)
        gate.wait(5)
        return jobs

    async def go():
        b = Batcher("t", run_batch, ThreadPoolExecutor(1))
        b.start()
        first = asyncio.ensure_future(b.submit("a", None))
        await asyncio.sleep(0.05)
        late = asyncio.ensure_future(b.submit("b", time.monotonic() + 0.01))
        await asyncio.sleep(0.05)
        gate.set()
        assert await first == "a"
        with pytest.raises(Expired):
            await late
        await b.stop()

    run(go())
    assert computed == ["a"]


@pytest.mark.parametrize("concurrency", [1, 2])
def test_concurrency_computes_that_many_batches_at_once(concurrency):
    """Two jobs submitted together meet inside run_batch only when two batches run at once."""
    barrier = threading.Barrier(2, timeout=1.0)

    def run_batch(jobs):
        if len(jobs) == 2:  # both in one batch: nothing to meet
            return ["batched"] * 2
        try:
            barrier.wait()
            return ["together"]
        except threading.BrokenBarrierError:
            return ["alone"]

    async def go():
        b = Batcher("t", run_batch, ThreadPoolExecutor(concurrency), concurrency=concurrency)
        b.start()
        first = asyncio.ensure_future(b.submit(1, None))
        await asyncio.sleep(0.05)  # the first batch is computing when the second job arrives
        out = await asyncio.gather(first, b.submit(2, None))
        await b.stop()
        return out

    out = run(go())
    assert out == (["together", "together"] if concurrency == 2 else ["alone", "alone"])


def test_without_an_executor_batches_compute_on_the_loops_thread_with_what_arrived_together():
    """No hand-off to another thread: a lone job computes on the event loop's own thread, and jobs submitted in
    the same turn of the loop (before their batch is due) go together; an expired one is not computed."""
    threads, batches = [], []

    def run_batch(jobs):
        threads.append(threading.get_ident())
        batches.append(list(jobs))
        return [j * 10 for j in jobs]

    async def go():
        b = Batcher("t", run_batch, None)
        b.start()
        assert await b.submit(1, None) == 10
        together = await asyncio.gather(*(b.submit(j, None) for j in (2, 3, 4)))
        late = asyncio.ensure_future(b.submit(5, time.monotonic() - 1.0))
        with pytest.raises(Expired):
            await late
        await b.stop()
        return threading.get_ident(), together

    loop_thread, together = run(go())
    assert together == [20, 30, 40] and batches == [[1], [2, 3, 4]]
    assert threads == [loop_thread, loop_thread]
