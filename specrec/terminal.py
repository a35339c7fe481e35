"""Output that reads well in a terminal, a pipe and a log: progress and tables.

Where a person watches (the stream is a terminal, or the code runs in a notebook) progress is tqdm's live bar and a
table is rich's, as wide as its cells: never cut to the terminal's width (a narrow terminal wraps the line, and
every header and value is still whole). Anywhere else (a pipe, a file, a service's or a CI job's log) progress is
a plain line at the start, every :data:`INTERVAL_S` seconds and at the end, with the figures the bar shows (done,
total, percentage, elapsed, remaining, rate, the bar's postfix), and a table is plain Markdown, its columns padded
to line up. tqdm's carriage-return frames never reach a log.

:func:`progress_bar` takes tqdm's arguments and returns a tqdm (the line writer is one too), so ``update``,
``set_postfix``, ``set_description``, ``total`` and ``close`` work either way; :func:`print_table` prints rows;
:func:`markdown_table` is the Markdown the results files and the pipe share.
"""

from __future__ import annotations

import math
import sys
from typing import IO, Any

from tqdm.std import tqdm as _std_tqdm

#: seconds between two progress lines when nobody watches (a build's log gets a line every half minute per bar)
INTERVAL_S = 30.0


def watched(stream: IO[str] | None) -> bool:
    """Whether a person watches ``stream``: a terminal, or any stream of a notebook's kernel."""
    if "ipykernel" in sys.modules:
        return True
    isatty = getattr(stream, "isatty", None)
    try:
        return bool(isatty and isatty())
    except ValueError:  # a closed stream
        return False


class LineProgress(_std_tqdm):
    """tqdm as plain lines: one at the start, then at most one every ``interval_s`` seconds, and one at the end;
    each ends with a newline and carries the bar's figures, and nothing is ever cleared or overwritten."""

    def __init__(self, *args, interval_s: float = INTERVAL_S, **kwargs):
        self.interval_s = interval_s
        self._printed_at = -math.inf
        kwargs.setdefault("mininterval", min(1.0, interval_s))  # how often tqdm offers a line; display() chooses
        kwargs["smoothing"] = 0  # the rate and the time remaining over the whole run, as a log wants them
        super().__init__(*args, **kwargs)

    def line(self) -> str:
        """This bar's figures as one line (tqdm's meter without the bar)."""
        return self.format_meter(**{**self.format_dict, "ncols": 0})

    def display(self, msg: str | None = None, pos: int | None = None, final: bool = False) -> bool:
        if msg == "":  # tqdm clearing its frame: a line written stays written
            return True
        now = self._time()  # tqdm's clock
        if final or now - self._printed_at >= self.interval_s:
            self._printed_at = now
            self.fp.write((msg if msg is not None else self.line()).rstrip() + "\n")
            self.fp.flush()
        return True

    def clear(self, nolock: bool = False) -> None:
        """Nothing to clear on a stream of lines."""

    def moveto(self, n: int) -> None:
        """Lines never move the cursor (nested bars write their lines in turn)."""

    def close(self) -> None:
        if getattr(self, "disable", True):  # closed, disabled, or never fully made
            return
        try:
            self.display(final=True)  # the last figures: how many, how long, how fast
        except ValueError:  # its stream was closed first (at exit)
            pass
        self.disable = True
        self._decr_instances(self)


def progress_bar(iterable: Any = None, *, interval_s: float = INTERVAL_S, **kwargs: Any) -> _std_tqdm:
    """A progress bar over ``iterable`` (or for ``update`` calls, with ``total=``): tqdm's own where a person
    watches its stream (``file``, default stderr), :class:`LineProgress` elsewhere. ``kwargs`` are tqdm's
    (``desc``, ``total``, ``unit``, ``disable``, ``leave``, ...); ``interval_s``: seconds between lines."""
    if watched(kwargs.get("file") or sys.stderr):
        from tqdm.auto import tqdm

        return tqdm(iterable, **kwargs)
    return LineProgress(iterable, interval_s=interval_s, **kwargs)


def markdown_cell(v: Any, fmt: str = "{:.4f}") -> str:
    """One value as :func:`markdown_table` writes it."""
    if isinstance(v, float):
        return "n/a" if math.isnan(v) else fmt.format(v)
    return str(v)


def markdown_table(rows: list[dict], columns: list[str], fmt: str = "{:.4f}", pad: bool = False) -> str:
    """``rows`` as a Markdown table of ``columns`` (floats by ``fmt``, NaN as ``n/a``); ``pad``: every column as
    wide as its widest cell, so that the table lines up as plain text too (a log, a pipe)."""

    body = [[markdown_cell(r.get(c, ""), fmt) for c in columns] for r in rows]
    widths = [max([len(c), 3, *(len(b[i]) for b in body)]) if pad else 0 for i, c in enumerate(columns)]
    lines = ["| " + " | ".join(c.ljust(w) for c, w in zip(columns, widths)) + " |",
             "|" + "|".join("-" * (w + 2) if pad else "---" for w in widths) + "|"]
    lines += ["| " + " | ".join(v.ljust(w) for v, w in zip(b, widths)) + " |" for b in body]
    return "\n".join(lines) + "\n"


def print_table(rows: list[dict], columns: list[str], title: str = "", fmt: str = "{:.4f}",
                file: IO[str] | None = None) -> None:
    """Print ``rows``: a rich table as wide as its cells where a person watches ``file`` (default stdout), else
    ``title`` and a padded Markdown table; every header and value whole either way."""
    out = file if file is not None else sys.stdout
    if not watched(out):
        out.write((f"{title}\n\n" if title else "") + markdown_table(rows, columns, fmt, pad=True))
        out.flush()
        return
    from rich.console import Console
    from rich.measure import Measurement
    from rich.table import Table

    first = rows[0] if rows else {}
    t = Table(title=title or None)
    for c in columns:
        t.add_column(c, justify="right" if isinstance(first.get(c), (int, float)) else "left", no_wrap=True)
    for r in rows:
        t.add_row(*(markdown_cell(r.get(c, ""), fmt) for c in columns))
    console = Console(file=out)
    need = Measurement.get(console, console.options.update_width(100_000), t).maximum
    (console if need <= console.width else Console(file=out, width=need)).print(t)
