"""``bench/results/summary.json`` holds only keys a step of ``bench/rerun.sh`` writes (``bench.summary_keys``)."""

from __future__ import annotations

import json
import re
from pathlib import Path

from bench import summary_keys

ROOT = Path(__file__).resolve().parents[2]


def test_every_committed_key_has_a_writer():
    summary = json.loads((ROOT / "bench" / "results" / "summary.json").read_text())
    assert summary_keys.keys_without_writer(summary) == []
    assert summary["bench.keys_without_writer"] == 0


def test_a_key_no_step_writes_is_found_and_every_writer_is_a_step_of_rerun():
    found = summary_keys.keys_without_writer({"beauty.loo.relaxed.recall@10": 0.1,
                                              "beauty.loo.beam.speedup_vs_beam": 1.0,
                                              "beauty.loo.nezha.speedup_vs_beam": 1.8})
    assert found == ["beauty.loo.beam.speedup_vs_beam", "beauty.loo.relaxed.recall@10"]
    steps = set(re.findall(r"^([a-z]+)\(\) \{", (ROOT / "bench" / "rerun.sh").read_text(), re.M))
    assert set(summary_keys.WRITERS) <= steps, set(summary_keys.WRITERS) - steps
