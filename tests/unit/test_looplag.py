"""The gateway's event-loop lateness (gateway.looplag): what its deadline cut keeps back. How the gateway feeds
it (the time from a worker finishing an answer to the loop taking it up) is tested in
tests/unit/test_gateway_parts.py (``test_the_early_cut_learns_how_late_the_loop_takes_up_an_answer``)."""

from __future__ import annotations

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
    lag.observe(-0.001)  # taken up "before" it finished (clocks of two threads): on time
    assert lag.estimate.tail() is not None and min(lag.estimate._ring) == 0.0
    for _ in range(5):  # and what a cut takes to build its answer counts too
        lag.observe_cut(0.002)
    assert lag.margin() == pytest.approx(0.05 + 0.002 + 0.0005)


def test_the_gauge_follows_the_margin():
    from gateway.looplag import LOOP_LAG

    lag = LoopLag(CostModel(), floor_s=0.0)
    lag.observe(0.004)
    assert LOOP_LAG._value.get() == pytest.approx(lag.margin()) and lag.margin() == pytest.approx(0.004)
    lag.observe_cut(0.002)
    assert LOOP_LAG._value.get() == pytest.approx(0.006)
