"""How late the gateway's event loop runs: the margin its deadline cut keeps.

The gateway answers by the deadline with a timer on its event loop
(:meth:`~.service.GatewayService.serve`). When the machine's CPUs are busy (a
noisy neighbour, every core shared with the models), the loop runs late: a
timer due at the deadline fires some milliseconds after it, and an answer that
was ready in time is sent late (measured with ``bench.chaos``'s CPU hog: the
gateway's own p99 33-35 ms at a 30 ms budget, none of it the models'). So the
cut is set earlier by the loop's own lateness: a task sleeps ``every_s`` again
and again and observes how much longer each sleep took than asked, and the
cut keeps back the tail of that (the cost model's quantile over its window:
p99 of the last 200 sleeps, two seconds at 10 ms), plus the tail of what the
cut itself takes to build its answer (:meth:`LoopLag.observe_cut`: the held
list, or the catalogue's fill), plus ``floor_s``. On an idle machine that is a
fraction of a millisecond.
"""

from __future__ import annotations

import asyncio

from prometheus_client import Gauge

from specrec.costs import CostModel

LOOP_LAG = Gauge("specrec_gateway_loop_lag_seconds", "The tail of how late the gateway's event loop runs a timer "
                 "(what its deadline cut keeps back)")


class LoopLag:
    """The tail of the event loop's lateness (:meth:`margin`), learned by :meth:`run` on that loop."""

    def __init__(self, costs: CostModel, every_s: float = 0.01, floor_s: float = 0.0):
        self.estimate = costs.estimator()  # only the loop's thread reads and writes these
        self.cut = costs.estimator()  # the time a cut takes to answer
        self.every_s, self.floor_s = every_s, floor_s
        self._task: asyncio.Task | None = None

    def observe(self, late_s: float) -> None:
        self.estimate.observe(max(0.0, late_s))

    def observe_cut(self, seconds: float) -> None:
        """A cut's time from its timer firing to its answer built."""
        self.cut.observe(max(0.0, seconds))

    def margin(self) -> float:
        """Seconds the deadline's cut keeps back: the lateness's tail (0 before any sleep), the cut's own tail
        (0 before any cut), plus ``floor_s``."""
        return (self.estimate.tail() or 0.0) + (self.cut.tail() or 0.0) + self.floor_s

    async def run(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            t = loop.time()
            await asyncio.sleep(self.every_s)
            self.observe(loop.time() - t - self.every_s)
            LOOP_LAG.set(self.margin())

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self.run(), name="loop-lag")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except asyncio.CancelledError:
                pass
            self._task = None
