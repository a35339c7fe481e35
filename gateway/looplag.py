"""How late the gateway's event loop runs: the margin its deadline cut keeps.

The gateway answers by the deadline with a timer on its event loop
(:meth:`~.service.GatewayService.serve`). When the machine's CPUs are busy (a
noisy neighbour, every core shared with the models), the loop runs late: a
timer due at the deadline fires some milliseconds after it, and an answer that
was ready in time is sent late (measured with ``bench.chaos``'s CPU hog: the
gateway's own p99 33-35 ms at a 30 ms budget, none of it the models'). So the
cut is set earlier by the loop's own lateness, read off the requests
themselves: each answer a worker thread finishes is handed to the loop, and
the time from the worker's end to the loop taking it up
(:meth:`LoopLag.observe`, from :meth:`~.service.GatewayService.serve`) is how
late the loop runs what is due on it. The cut keeps back the tail of that (the
cost model's quantile over its window: p99 of the last 200 answers), plus the
tail of what the cut itself takes to build its answer
(:meth:`LoopLag.observe_cut`: the held list, or the catalogue's fill), plus
``floor_s``. On an idle machine that is a fraction of a millisecond.

It learned from a task of its own before, one sleep of 10 ms after another:
that cost the idle gateway 22 CPU ms a second (2-4 without it), about 0.6 ms of
CPU per request on two cores (``bench.request_path``), and said nothing of
the hand-off from a worker that every answer pays.
"""

from __future__ import annotations

from prometheus_client import Gauge

from specrec.costs import CostModel

LOOP_LAG = Gauge("specrec_gateway_loop_lag_seconds", "The tail of how late the gateway's event loop takes up an "
                 "answer a worker finished (what its deadline cut keeps back)")


class LoopLag:
    """The tail of the event loop's lateness (:meth:`margin`), learned from the answers it takes up. Only the
    loop's thread calls it."""

    def __init__(self, costs: CostModel, floor_s: float = 0.0):
        self.estimate = costs.estimator()  # how late the loop took up a finished answer
        self.cut = costs.estimator()  # the time a cut takes to answer
        self.floor_s = floor_s

    def observe(self, late_s: float) -> None:
        """An answer's time from its worker's end to the loop taking it up."""
        self.estimate.observe(max(0.0, late_s))
        LOOP_LAG.set(self.margin())  # here, on the loop's thread: the estimates are not read from a scrape's

    def observe_cut(self, seconds: float) -> None:
        """A cut's time from its timer firing to its answer built."""
        self.cut.observe(max(0.0, seconds))
        LOOP_LAG.set(self.margin())

    def margin(self) -> float:
        """Seconds the deadline's cut keeps back: the lateness's tail (0 before any answer), the cut's own tail
        (0 before any cut), plus ``floor_s``."""
        return (self.estimate.tail() or 0.0) + (self.cut.tail() or 0.0) + self.floor_s
