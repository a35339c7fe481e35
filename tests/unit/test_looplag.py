"""The gateway's event-loop lateness (gateway.looplag): what its deadline cut keeps back."""

from __future__ import annotations

import asyncio
import time

import pytest

from gateway.looplag import LoopLag
from specrec.costs import CostModel


def test_the_margin_is_the_tail_of_the_lateness_plus_the_floor():
    lag = LoopLag(CostModel(0.99, 200), floor_s=0.0005)
    assert lag.margin() == 0.0005  # nothing seen yet
    for _ in range(197):
        lag.observe(0.001)
    for _ in range(3):
        lag.observe(0.05)
    assert lag.margin() == pytest.approx(0.05 + 0.0005)  # p99 of 200: the third largest
    lag.observe(-0.001)  # a sleep that woke early counts as on time
    assert lag.estimate.tail() is not None and min(lag.estimate._ring) == 0.0
    for _ in range(5):  # and what a cut takes to build its answer counts too
        lag.observe_cut(0.002)
    assert lag.margin() == pytest.approx(0.05 + 0.002 + 0.0005)


def test_a_loop_held_by_blocking_work_raises_the_margin():
    async def main() -> float:
        lag = LoopLag(CostModel(), every_s=0.002)
        lag.start()
        try:
            await asyncio.sleep(0.02)
            for _ in range(30):  # the loop's thread busy 20 ms at a time: every sleep ends at least that late
                time.sleep(0.02)
                await asyncio.sleep(0)
            return lag.margin()
        finally:
            await lag.stop()

    assert asyncio.run(main()) >= 0.01
