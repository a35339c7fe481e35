"""``bench/results/summary.json`` holds only keys a step of ``bench/rerun.sh`` writes (bench/summary_keys.py)."""

from __future__ import annotations

import importlib.util
import json
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _module():
    spec = importlib.util.spec_from_file_location("summary_keys", ROOT / "bench" / "summary_keys.py")
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_every_committed_key_has_a_writer():
    mod = _module()
    summary = json.loads((ROOT / "bench" / "results" / "summary.json").read_text())
    assert mod.keys_without_writer(summary) == []
    assert summary["bench.keys_without_writer"] == 0


def test_a_key_no_step_writes_is_found_and_every_writer_is_a_step_of_rerun():
    mod = _module()
    assert mod.keys_without_writer({"beauty.loo.relaxed.recall@10": 0.1, "beauty.loo.beam.speedup_vs_beam": 1.0,
                                    "beauty.loo.nezha.speedup_vs_beam": 1.8}) == [
        "beauty.loo.beam.speedup_vs_beam", "beauty.loo.relaxed.recall@10"]
    steps = set(re.findall(r"^([a-z]+)\(\) \{", (ROOT / "bench" / "rerun.sh").read_text(), re.M))
    assert set(mod.WRITERS) <= steps, set(mod.WRITERS) - steps
