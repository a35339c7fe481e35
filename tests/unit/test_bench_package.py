"""``bench/`` is a package whose scripts all run from ``bench/rerun.sh``, as modules (``python -m bench.X``)."""

from __future__ import annotations

import json
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
BENCH = ROOT / "bench"
#: modules the scripts import, not steps of their own (the load generator's process form runs under overload and soak;
#: cpus places processes on CPUs for overload and chaos; chaos_* and serving_phases are parts of chaos and serving;
#: bare_front is the process request_path measures the gateway against)
LIBRARY = {"__init__", "harness", "loadgen", "cpus", "chaos_services", "chaos_machine", "chaos_failover",
           "chaos_report", "serving_phases", "bare_front"}


def test_every_script_is_a_step_of_rerun():
    """Run by a step of rerun.sh, or by a script a step runs (``bash bench/device_check.sh`` runs ``$PY -m
    bench.gpu_check``)."""
    rerun = (BENCH / "rerun.sh").read_text()
    shells = re.findall(r"bash (bench/[\w.]+\.sh)", rerun)
    for sh in shells:
        assert (ROOT / sh).exists(), sh
    called = {m for text in [rerun, *((ROOT / sh).read_text() for sh in shells)]
              for m in re.findall(r"-m bench\.(\w+)", text)}
    scripts = {p.stem for p in BENCH.glob("*.py")} - LIBRARY
    assert scripts <= called, f"not run by any step of bench/rerun.sh: {sorted(scripts - called)}"
    assert called <= scripts | LIBRARY, f"rerun.sh runs modules that are not there: {sorted(called - scripts)}"


def test_no_path_manipulation_and_no_script_commands():
    for p in BENCH.glob("*.py"):
        assert "sys.path" not in p.read_text(), f"{p.name} changes sys.path: import through the bench package"
    # bench/results/HISTORY.md keeps the commands as they were run (its preface says how they run now)
    docs = [ROOT / "README.md", BENCH / "results" / "README.md", *BENCH.glob("*.py"), *BENCH.glob("*.sh"),
            *(ROOT / "docs").glob("*.md")]
    for p in docs:
        stale = re.findall(r"python3? bench/\w+\.py", p.read_text())
        assert not stale, f"{p.relative_to(ROOT)}: {stale} (the scripts run as python -m bench.<name>)"


#: the results page is a reader's page (issue 52): its current figures, each with its command and plot; the story
#: of how they came is HISTORY.md's
MAX_LINES, MAX_BYTES, MAX_LINE = 250, 20_000, 300
WRITERS = ("bench.serving", "bench.serving.temporal", "bench.overload", "bench.soak", "bench.chaos")


def over_the_limits(text: str) -> list[str]:
    """What makes ``text`` too long for the results page (nothing: it fits)."""
    lines = text.splitlines()
    out = [f"{len(lines)} lines (at most {MAX_LINES})"] if len(lines) > MAX_LINES else []
    if len(text.encode()) > MAX_BYTES:
        out.append(f"{len(text.encode())} bytes (at most {MAX_BYTES})")
    out += [f"line {i}: {len(line)} characters (at most {MAX_LINE})" for i, line in enumerate(lines, 1)
            if len(line) > MAX_LINE]
    return out


def test_the_results_readme_fits_a_reader():
    assert over_the_limits((BENCH / "results" / "README.md").read_text()) == []


def test_the_limits_can_fail():
    assert over_the_limits("x\n" * 250) == [] and over_the_limits("x\n" * 251) == ["251 lines (at most 250)"]
    assert over_the_limits("y" * 300) == [] and over_the_limits("y" * 301) == ["line 1: 301 characters (at most 300)"]
    assert over_the_limits(("z" * 199 + "\n") * 100) == [] and over_the_limits(("z" * 199 + "\n") * 101) == [
        "20200 bytes (at most 20000)"]


def test_the_results_readme_keeps_the_writers_markers():
    text = (BENCH / "results" / "README.md").read_text()
    for owner in WRITERS:
        assert text.count(f"<!-- {owner}: begin -->") == 1 and text.count(f"<!-- {owner}: end -->") == 1, owner
    for owner in ("bench.serving", "bench.overload", "bench.soak", "bench.chaos"):
        assert f'README_OWNER = "{owner}"' in (BENCH / f"{owner.split('.')[1]}.py").read_text()


def sections_from_results() -> dict[str, str]:
    """Each writer's README section as it renders its committed results (what its next run writes, in form)."""
    from bench import chaos_report, overload, serving, soak
    from bench.harness import no_nan

    res = BENCH / "results"

    def load(name: str) -> dict:
        return no_nan(json.loads((res / f"{name}.json").read_text()))

    s = load("serving")
    t = load("serving_temporal")
    return {
        "bench.serving": serving.readme_body(s, serving.summary_of(s, list(s["closed"]), s["budget_ms"])),
        "bench.serving.temporal": serving.protocol_readme_body(t, serving.protocol_summary(t),
                                                               json.loads((res / "summary.json").read_text())),
        "bench.overload": overload.readme_body(load("overload")),
        "bench.soak": soak.readme_body(load("soak")),
        "bench.chaos": chaos_report.readme_body(load("chaos")),
    }


def test_the_writers_sections_are_what_they_render_from_their_results():
    """A writer's section is its own: a hand edit between its markers would be lost at its next run, and a writer
    whose section breaks the page's limits fails here rather than at the next run."""
    text = (BENCH / "results" / "README.md").read_text()
    for owner, body in sections_from_results().items():
        begin, end = f"<!-- {owner}: begin -->\n", f"\n<!-- {owner}: end -->"
        assert text[text.index(begin) + len(begin) : text.index(end)] == body.rstrip(), owner
        assert [line for line in body.splitlines() if len(line) > MAX_LINE] == [], owner
