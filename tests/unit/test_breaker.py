"""The verifier's circuit breaker and the drafter's cooldown (specrec.policies.breaker), on a fake clock."""

from __future__ import annotations

import threading

from specrec.policies.breaker import Breaker, Cooldown


def clocked(cls, *args):
    t = [0.0]
    return cls(*args, clock=lambda: t[0]), t


def test_failures_in_a_row_open_it_and_a_success_between_resets_the_count():
    b, _ = clocked(Breaker, 3, 1.0)
    for ok in (False, False, True, False, False):
        assert b.allow()
        b.result(ok)
    assert not b.is_open() and b.allow()
    b.result(False)
    assert b.is_open() and not b.allow()


def test_after_open_s_one_probe_goes_and_its_success_closes_it():
    b, t = clocked(Breaker, 2, 1.0)
    b.result(False)
    b.result(False)
    t[0] = 0.5
    assert not b.allow()  # still open
    t[0] = 1.0
    assert b.allow()  # the half-open probe
    assert not b.allow()  # only one at a time
    b.result(True)
    assert not b.is_open() and b.allow() and b.allow()


def test_a_failed_probe_opens_it_again_for_open_s():
    b, t = clocked(Breaker, 1, 1.0)
    b.result(False)
    t[0] = 1.0
    assert b.allow()
    b.result(False)
    t[0] = 1.5
    assert not b.allow()
    t[0] = 2.0
    assert b.allow()


def test_a_probe_that_never_reports_stops_blocking_after_open_s_and_settle_frees_it_at_once():
    b, t = clocked(Breaker, 1, 1.0)
    b.result(False)
    t[0] = 1.0
    assert b.allow()  # a probe whose request then ended without a verdict and never said so
    t[0] = 1.5
    assert not b.allow()
    t[0] = 2.0
    assert b.allow()  # the next probe
    b.settle()  # its request ended without a verdict (a budget too small): another may go now
    assert b.allow()
    assert b.is_open()  # settling is no verdict: still open until a probe succeeds


def test_threads_reporting_at_once_count_every_failure():
    b = Breaker(1000, 1.0)
    threads = [threading.Thread(target=lambda: [b.result(False) for _ in range(100)]) for _ in range(8)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    assert b.count == 800 and not b.is_open()


def test_the_drafter_counts_as_down_for_down_s_after_it_failed():
    c, t = clocked(Cooldown, 1.0)
    assert not c.is_down()
    c.failed()
    t[0] = 0.99
    assert c.is_down()
    t[0] = 1.0
    assert not c.is_down()


def test_refusing_tells_what_allow_would_say_without_taking_the_probe():
    b, t = clocked(Breaker, 1, 1.0)
    assert not b.refusing()
    b.result(False)
    assert b.refusing() and not b.allow()
    t[0] = 1.0
    assert not b.refusing() and not b.refusing()  # the probe is due: asking does not take it
    assert b.allow()  # ... the request that calls does
    assert b.refusing()  # and while it is out, the verifier counts as down
    b.result(True)
    assert not b.refusing()
