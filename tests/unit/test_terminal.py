"""Output that reads well in a terminal, a pipe and a log (specrec.terminal, issue 68): tables never cut, progress
as plain lines where nobody watches, the same figures either way; and ``specrec eval ... | cat`` on a small
bundle prints every header and value whole."""

from __future__ import annotations

import io
import re
import subprocess
import sys
from pathlib import Path

import pytest

from specrec.terminal import LineProgress, markdown_table, print_table, progress_bar, watched

ROOT = Path(__file__).resolve().parents[2]
BUNDLE = ROOT / "bundles" / "beauty-loo"
ROWS = [{"policy": "beam", "recall@10": 0.102812, "unseen_recall@50": 0.0123, "in_sample_recall@50": float("nan"),
         "p50_ms": 12.3456, "equal_to_beam": 1.0, "served_by": "a-rather-long-value-of-a-cell"}]
COLS = list(ROWS[0])
CELLS = ["beam", "0.1028", "0.0123", "n/a", "12.3456", "1.0000", "a-rather-long-value-of-a-cell"]


class Tty(io.StringIO):
    """A terminal's stream, as far as the code can tell."""

    def isatty(self) -> bool:
        return True


def cells(line: str) -> list[str]:
    return [c.strip() for c in line.strip().strip("|│┃").replace("┃", "|").replace("│", "|").split("|")]


def test_a_pipe_gets_a_padded_markdown_table_with_every_header_and_value_whole():
    out = io.StringIO()
    print_table(ROWS, COLS, title="bundle: 1 requests", file=out)
    lines = out.getvalue().splitlines()
    assert lines[:2] == ["bundle: 1 requests", ""]
    head, rule, row = lines[2:]
    assert cells(head) == COLS and cells(row) == CELLS
    assert len(head) == len(rule) == len(row) and "…" not in out.getvalue()  # lined up, nothing cut


def test_a_narrow_terminal_gets_rich_table_as_wide_as_its_cells():
    out = Tty()
    assert watched(out) and not watched(io.StringIO())
    import rich.console

    wide = len(markdown_table(ROWS, COLS, pad=True).splitlines()[0])
    assert wide > 80  # the width rich would have cut it to
    print_table(ROWS, COLS, file=out)
    text = re.sub(r"\x1b\[[0-9;]*m", "", out.getvalue())  # colours and bold apart
    assert "…" not in text
    head = next(line for line in text.splitlines() if cells(line)[:1] == ["policy"])
    row = next(line for line in text.splitlines() if cells(line)[:1] == ["beam"])
    assert cells(head) == COLS and cells(row) == CELLS
    assert rich.console.Console(file=Tty()).width <= 80 < len(head)  # wider than the terminal: whole, not cut


def test_markdown_table_pads_only_when_asked():
    assert markdown_table([{"a": 1.0, "bb": "x"}], ["a", "bb"]) == "| a | bb |\n|---|---|\n| 1.0000 | x |\n"
    assert markdown_table([{"a": 1.0, "bb": "x"}], ["a", "bb"], pad=True) == (
        "| a      | bb  |\n|--------|-----|\n| 1.0000 | x   |\n")


def test_progress_is_tqdm_in_a_terminal_and_lines_in_a_log():
    from tqdm.auto import tqdm

    bar = progress_bar(range(3), file=Tty(), desc="x")
    assert isinstance(bar, tqdm) and not isinstance(bar, LineProgress)
    bar.close()
    assert isinstance(progress_bar(range(3), file=io.StringIO(), disable=True), LineProgress)


def test_progress_lines_carry_the_bars_figures_and_no_carriage_return():
    out = io.StringIO()
    bar = LineProgress(total=10, desc="embedding", unit="batch", file=out, interval_s=30.0)  # writes its first line
    now = [bar.start_t]
    bar._time = lambda: now[0]  # tqdm's clock, moved 7 s at every step
    for _ in range(10):
        now[0] += 7.0
        bar.update(1)
        bar.refresh()  # offered a line at every step: at most one per 30 s is written
    bar.set_postfix(loss="0.1234")
    bar.close()
    bar.close()  # closing twice writes nothing more
    text = out.getvalue()
    assert "\r" not in text and "\x1b" not in text and text.endswith("\n")
    lines = text.splitlines()
    assert lines[0].startswith("embedding:   0% 0/10")
    assert re.fullmatch(r"embedding: 100% 10/10 \[[0-9:]+<00:00, +[0-9.]+(s/)?batch(/s)?, loss=0\.1234\]", lines[-1])
    assert len(lines) == 4  # the first, one every 30 s of the 70 (at 35 and 70 s), the last: not one a step
    assert all(re.match(r"embedding: +\d+% \d+/10 \[", line) for line in lines)


def test_progress_lines_without_a_total_and_when_disabled():
    out = io.StringIO()
    for _ in LineProgress(iter(range(5)), desc="rows", file=out):
        pass
    assert out.getvalue().splitlines()[-1].startswith("rows: 5it [")
    quiet = io.StringIO()
    for _ in LineProgress(range(5), desc="rows", file=quiet, disable=True):
        pass
    assert quiet.getvalue() == ""


@pytest.mark.skipif(not (BUNDLE / "bundle.json").exists(), reason="needs the committed bundles/beauty-loo")
@pytest.mark.parametrize("policies", [None, "beam,fused"])
def test_specrec_eval_piped_prints_every_header_and_value_whole(policies):
    """``specrec eval ... | cat``: its stdout a pipe, as in a log; 8 users, eager beam, a few seconds."""
    cmd = [sys.executable, "-m", "specrec.cli", "eval", "--bundle", str(BUNDLE), "--sample", "8", "--backend", "eager"]
    cmd += ["--ks", "10"] if policies is None else ["--policies", policies, "--k", "10"]
    r = subprocess.run(cmd, cwd=ROOT, check=True, capture_output=True, text=True, timeout=300)
    rows = [cells(line) for line in r.stdout.splitlines() if line.startswith("|") and not line.startswith("|-")]
    if policies is None:
        want = ["group", "R@10", "N@10"]
        assert rows[0] == want and rows[1][0] == "overall"
    else:  # wider than 80 columns: what a pipe used to cut to "recal…", "ndcg@…", "10.28…"
        want = ["policy", "recall@10", "ndcg@10", "p50_ms", "p99_ms", "speedup", "equal_to_beam", "item_accept",
                "token_accept", "no_fallback"]
        assert rows[0] == want and [row[0] for row in rows[1:]] == policies.split(",")
        assert max(len(line) for line in r.stdout.splitlines()) > 80
    assert "…" not in r.stdout and all(len(row) == len(want) for row in rows)
    for row in rows[1:]:
        assert all(re.fullmatch(r"\d+\.\d{4}|n/a", v) for v in row[1:]), row  # every figure whole
    assert "\r" not in r.stderr  # its progress: plain lines
