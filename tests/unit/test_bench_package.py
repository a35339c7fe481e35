"""``bench/`` is a package whose scripts all run from ``bench/rerun.sh``, as modules (``python -m bench.X``)."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
BENCH = ROOT / "bench"
#: modules the scripts import, not steps of their own (the load generator's process form runs under overload and soak;
#: cpus places processes on CPUs for overload and chaos; chaos_* and serving_phases are parts of chaos and serving)
LIBRARY = {"__init__", "harness", "loadgen", "cpus", "chaos_services", "chaos_machine", "chaos_failover",
           "chaos_report", "serving_phases"}


def test_every_script_is_a_step_of_rerun():
    rerun = (BENCH / "rerun.sh").read_text()
    called = set(re.findall(r"python -m bench\.(\w+)", rerun))
    scripts = {p.stem for p in BENCH.glob("*.py")} - LIBRARY
    assert scripts <= called, f"not run by any step of bench/rerun.sh: {sorted(scripts - called)}"
    assert called <= scripts | LIBRARY, f"rerun.sh runs modules that are not there: {sorted(called - scripts)}"
    for sh in re.findall(r"bash (bench/[\w.]+\.sh)", rerun):
        assert (ROOT / sh).exists(), sh


def test_no_path_manipulation_and_no_script_commands():
    for p in BENCH.glob("*.py"):
        assert "sys.path" not in p.read_text(), f"{p.name} changes sys.path: import through the bench package"
    # bench/results/HISTORY.md keeps the commands as they were run (its preface says how they run now)
    docs = [ROOT / "README.md", BENCH / "results" / "README.md", *BENCH.glob("*.py"), *BENCH.glob("*.sh"),
            *(ROOT / "docs").glob("*.md")]
    for p in docs:
        stale = re.findall(r"python3? bench/\w+\.py", p.read_text())
        assert not stale, f"{p.relative_to(ROOT)}: {stale} (the scripts run as python -m bench.<name>)"


def test_the_results_readme_is_short_and_keeps_the_writers_markers():
    text = (BENCH / "results" / "README.md").read_text()
    assert len(text.splitlines()) < 250
    for owner in ("bench.serving", "bench.overload", "bench.soak", "bench.chaos"):
        assert text.count(f"<!-- {owner}: begin -->") == 1 and text.count(f"<!-- {owner}: end -->") == 1, owner
        assert f'README_OWNER = "{owner}"' in (BENCH / f"{owner.split('.')[1]}.py").read_text()
