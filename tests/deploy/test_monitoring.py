"""The alerting rules and the Grafana dashboard, statically: ``promtool check rules`` and ``promtool test
rules`` (a firing and a quiet case for every alert, docs/prometheus/specrec.rules.test.yaml), and the
dashboard's structure. tests/integration/test_prometheus.py evaluates every query and alert expression against
a real Prometheus scraping the services."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
import yaml

from . import tools

ROOT = Path(__file__).resolve().parents[2]
RULES = ROOT / "helm" / "specrec" / "files" / "prometheus-rules.yaml"
RULES_DOC = ROOT / "docs" / "prometheus" / "specrec.rules.yaml"
RULES_TEST = ROOT / "docs" / "prometheus" / "specrec.rules.test.yaml"
DASHBOARD = ROOT / "helm" / "specrec" / "files" / "grafana-dashboard.json"
DASHBOARD_DOC = ROOT / "docs" / "grafana" / "specrec-dashboard.json"


@pytest.fixture(scope="module")
def promtool() -> str:
    binary = tools.prometheus_tool("promtool")
    if binary is None:
        tools.missing(f"no promtool: {tools.PROMETHEUS_HINT}")
    return binary


def alerts() -> list[dict]:
    return [r for g in yaml.safe_load(RULES.read_text())["groups"] for r in g["rules"] if "alert" in r]


def test_docs_copies_are_the_charts_files():
    assert RULES_DOC.read_text() == RULES.read_text(), (
        "cp helm/specrec/files/prometheus-rules.yaml docs/prometheus/specrec.rules.yaml"
    )
    assert DASHBOARD_DOC.read_text() == DASHBOARD.read_text(), \
        "cp helm/specrec/files/grafana-dashboard.json docs/grafana/specrec-dashboard.json"


def test_promtool_check_rules(promtool):
    p = subprocess.run([promtool, "check", "rules", str(RULES)], capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stdout + p.stderr
    assert f"SUCCESS: {len(alerts())} rules found" in p.stdout + p.stderr


def test_promtool_test_rules(promtool):
    p = subprocess.run([promtool, "test", "rules", RULES_TEST.name], capture_output=True, text=True, timeout=120,
                       cwd=RULES_TEST.parent)
    assert p.returncode == 0 and "SUCCESS" in p.stdout + p.stderr, p.stdout + p.stderr


def test_promtool_test_rules_can_fail(promtool, tmp_path):
    """The unit tests really check: a threshold moved so that the firing case no longer fires fails them."""
    rules = yaml.safe_load(RULES.read_text())
    for r in rules["groups"][0]["rules"]:
        if r.get("alert") == "SpecRecShedding":
            r["expr"] = r["expr"].replace("> 0.01", "> 0.5")
    (tmp_path / RULES_DOC.name).write_text(yaml.safe_dump(rules))
    (tmp_path / RULES_TEST.name).write_text(RULES_TEST.read_text())
    p = subprocess.run([promtool, "test", "rules", RULES_TEST.name], capture_output=True, text=True, timeout=120,
                       cwd=tmp_path)
    assert p.returncode != 0 and "SpecRecShedding" in p.stdout + p.stderr


def test_every_alert_has_a_firing_and_a_quiet_case():
    tests = yaml.safe_load(RULES_TEST.read_text())
    assert tests["rule_files"] == [RULES_DOC.name]
    fires, quiet = set(), set()
    for t in tests["tests"]:
        for case in t.get("alert_rule_test", []):
            (fires if case["exp_alerts"] else quiet).add(case["alertname"])
        # every case also proves some series does not fire (another namespace or instance, or an earlier time)
        assert len(t["input_series"]) >= 2, t["name"]
    names = {a["alert"] for a in alerts()}
    assert fires == names, f"alerts without a firing case: {names - fires}"
    for a in alerts():
        assert a["labels"]["severity"] in ("warning", "critical") and a["annotations"]["summary"], a["alert"]


def test_dashboard_structure():
    d = json.loads(DASHBOARD.read_text())
    assert d["uid"] and d["title"] == "SpecRec" and d["schemaVersion"] >= 36
    names = [v["name"] for v in d["templating"]["list"]]
    assert names == ["datasource", "namespace"]
    panels = [p for p in d["panels"] if p["type"] != "row"]
    ids = [p["id"] for p in d["panels"]]
    assert len(ids) == len(set(ids))
    titles = {p["title"] for p in panels}
    # the panels the dashboard promises (issue 22)
    for want in ("Request rate by status", "Latency against the budget", "Served by", "Shed, degraded and fill rates",
                 "Acceptance per position", "Queue wait (p50 / p99)", "Batch size (mean)", "Catalogue version",
                 "Catalogue staleness", "Dependency health"):
        assert want in titles, want
    for p in panels:
        assert p["datasource"]["uid"] == "${datasource}" and p["targets"], p["title"]
        g = p["gridPos"]
        assert 0 <= g["x"] and g["x"] + g["w"] <= 24 and g["h"] > 0, p["title"]
        for t in p["targets"]:
            assert t["expr"] and t["refId"], p["title"]
            assert 'namespace=~"$namespace"' in t["expr"], (p["title"], t["expr"])
