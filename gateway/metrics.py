"""The gateway's Prometheus metrics, and the collector that exports the core library's spec-decode counters."""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client import Counter, Gauge, Histogram
from prometheus_client.core import CounterMetricFamily

from specrec.policies import SpecMetrics

RECS = Counter("specrec_gateway_recommendations", "Recommend answers by policy asked, policy that served, exit reason "
               "and degradation", ["policy", "served_by", "exit_reason", "degraded"])
STAGE = Histogram("specrec_gateway_stage_seconds", "Time per policy stage", ["policy", "stage"],
                  buckets=(0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.025, 0.03, 0.035, 0.04, 0.05, 0.1))
HOP_OVERHEAD = Histogram("specrec_gateway_hop_overhead_seconds", "Per downstream call: its time at the gateway less "
                         "the callee's own server time (the x-server-ms it answers with): what the request path costs "
                         "per hop", ["method"],
                         buckets=(0.0002, 0.0005, 0.001, 0.0015, 0.002, 0.003, 0.005, 0.01, 0.02))
BUDGET_MISSES = Counter("specrec_gateway_budget_misses", "Answers that took longer than their budget (server side), "
                        "by policy asked", ["policy"])
BUDGET_CUTS = Counter("specrec_gateway_budget_cuts", "Answers given at the deadline while the policy still ran (the "
                      "catalogue's fill, exit_reason budget), by policy asked and policy run", ["policy", "ran"])
DEFAULT_BUDGET = Gauge("specrec_gateway_default_budget_seconds", "The budget of a request that gives none")
DEPENDENCY_UP = Gauge("specrec_gateway_dependency_up", "The gateway's view of a dependency: 0 while the verifier's "
                      "breaker is open, the drafter counts as down after a failure, or the item set has not answered "
                      "a catalogue poll for 5 s", ["dependency"])


class SpecCollector:
    """Exports the core library's spec-decode counters to Prometheus (counters only;
    rates are PromQL, e.g. accepted_items / draft_items)."""

    def __init__(self, metrics: SpecMetrics) -> None:
        self.m = metrics

    def collect(self) -> Iterator[CounterMetricFamily]:
        snap = self.m.snapshot()
        fams = {k: CounterMetricFamily(f"specrec_spec_{k}", h, labels=["policy"]) for k, h in (
            ("draft_rounds", "Draft rounds"), ("draft_items", "Drafted candidate items"),
            ("accepted_items", "Accepted candidate items"), ("verifier_calls", "Verifier calls"),
            ("fallback_steps", "Level-wise beam steps the drafts did not cover"))}
        tokens = CounterMetricFamily(
            "specrec_spec_draft_tokens", "Drafted SID tokens by position", labels=["policy", "position"]
        )
        accepted = CounterMetricFamily("specrec_spec_accepted_tokens", "Accepted SID tokens by position",
                                       labels=["policy", "position"])
        for p, v in snap.items():
            for k, fam in fams.items():
                fam.add_metric([p], v[k])
            for j, n in v["draft_tokens_by_position"].items():
                tokens.add_metric([p, str(j)], n)
            for j, n in v["accepted_tokens_by_position"].items():
                accepted.add_metric([p, str(j)], n)
        yield from fams.values()
        yield tokens
        yield accepted
