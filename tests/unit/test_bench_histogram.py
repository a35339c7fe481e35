"""The gateway's own latency histogram as the benchmarks read it (``bench.harness``): parsed from the
exposition the services serve, two readings subtracted, quantiles as PromQL's ``histogram_quantile``."""

from __future__ import annotations

import math

import pytest
from prometheus_client import CollectorRegistry, Counter, generate_latest, start_http_server
from prometheus_client import Histogram as PromHistogram

from bench.harness import Histogram, histogram_of, scrape_histogram, server_figures
from specrec_rpc.server import LATENCY_BUCKETS
from specrec_stack.localstack import free_port


def registry() -> tuple[CollectorRegistry, PromHistogram]:
    reg = CollectorRegistry()
    h = PromHistogram("specrec_rpc_latency_seconds", "RPC latency by method", ["service", "method"],
                      buckets=LATENCY_BUCKETS, registry=reg)
    Counter("specrec_other", "another family", registry=reg).inc()
    h.labels("verifier", "Score").observe(5.0)  # another series: never the gateway's
    h.labels("gateway", "Check").observe(5.0)
    return reg, h


def observe(h: PromHistogram, values: list[float]) -> None:
    for v in values:
        h.labels("gateway", "Recommend").observe(v)


def test_the_difference_of_two_readings_holds_only_what_came_between():
    reg, h = registry()
    observe(h, [0.2] * 1000)  # before the window
    first = histogram_of(generate_latest(reg).decode())
    observe(h, [0.012] * 98 + [0.032] * 2)  # in it: 98 in (10, 15] ms, 2 in (30, 35] ms
    window = histogram_of(generate_latest(reg).decode()) - first
    assert first.count == 1000 and window.count == 100
    # the 99th of 100 is the first of the two in (30, 35]: halfway through it, as PromQL interpolates
    assert window.quantile(0.99) == pytest.approx(0.0325)
    assert window.quantile(0.50) == pytest.approx(0.010 + 0.005 * 50 / 98)
    assert window.bucket_of(0.99) == pytest.approx((0.030, 0.035))
    assert window.share_over(0.030) == pytest.approx(0.02)  # exact: 30 ms is a bound
    assert window.share_over(0.031) is None  # not a bound: no exact share
    assert histogram_of(generate_latest(reg).decode()).quantile(0.99) == pytest.approx(0.2, abs=0.05)  # without


def test_server_figures_in_ms_and_the_inf_bucket():
    reg, h = registry()
    observe(h, [0.012] * 98 + [0.032] * 2)
    f = server_figures(histogram_of(generate_latest(reg).decode()), 30.0)
    assert f["server_count"] == 100 and f["server_p99_ms"] == pytest.approx(32.5)
    assert f["server_p99_bucket_ms"] == pytest.approx([30.0, 35.0])
    assert f["server_over_budget_share"] == pytest.approx(0.02)
    reg, h = registry()
    observe(h, [20.0] * 10)  # every one past the highest finite bound (10 s)
    f = server_figures(histogram_of(generate_latest(reg).decode()), 30.0)
    assert f["server_p99_ms"] == pytest.approx(10_000.0) and f["server_p99_bucket_ms"] == [10_000.0, None]
    assert math.isnan(server_figures(Histogram(), 30.0)["server_p99_ms"])


def test_readings_that_cannot_be_subtracted():
    a = Histogram(((0.1, 5.0), (math.inf, 6.0)))
    with pytest.raises(ValueError, match="bucket bounds"):
        _ = a - Histogram(((0.2, 0.0), (math.inf, 0.0)))
    with pytest.raises(ValueError, match="restarted"):
        _ = a - Histogram(((0.1, 7.0), (math.inf, 7.0)))
    assert (a - Histogram()) == a  # no first reading (the series had no observation yet): all of it


def test_no_series_of_those_labels_is_an_empty_histogram():
    reg, _ = registry()
    h = histogram_of(generate_latest(reg).decode())
    assert h.count == 0 and math.isnan(h.quantile(0.99)) and h.bucket_of(0.99) is None


def test_scraped_from_a_metrics_port_as_the_services_serve_it():
    reg, h = registry()
    observe(h, [0.004] * 10)
    port = free_port()
    server, thread = start_http_server(port, addr="127.0.0.1", registry=reg)
    try:
        got = scrape_histogram(f"http://127.0.0.1:{port}/metrics")
    finally:
        server.shutdown()
        server.server_close()
        thread.join(5)
    assert got == histogram_of(generate_latest(reg).decode()) and got.count == 10
    assert got.bucket_of(0.5) == pytest.approx((0.002, 0.005))
