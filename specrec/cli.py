"""The ``specrec`` command line.

    specrec train   --data DIR --protocol loo --out runs/beauty-loo
    specrec eval    --bundle runs/beauty-loo/bundle --limit 2000
    specrec sids    --data DIR
    specrec export-onnx --bundle DIR [--out DIR]
    specrec synth   --out DIR

Every subcommand has ``--help``. Each core subcommand is a module of :mod:`specrec.commands`. Other installed
packages add theirs through the ``specrec.commands`` entry point group: a callable that takes the subparsers and
adds its own (the serving layer's ``stack`` and ``recommend``: ``specrec_stack.cli:register``, declared in
``pyproject.toml``), so the core imports nothing of them.
"""

from __future__ import annotations

import argparse
import sys
from importlib.metadata import entry_points

from .commands import COMMANDS

PLUGIN_GROUP = "specrec.commands"


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="specrec", description="SpecRec: speculative decoding for generative recommendation."
    )
    sub = p.add_subparsers(dest="cmd", required=True, metavar="COMMAND")
    for command in COMMANDS:
        command.add_parser(sub)
    for ep in sorted(entry_points(group=PLUGIN_GROUP), key=lambda ep: ep.name):
        try:
            register = ep.load()
        except ImportError:  # a plugin whose own dependencies are not installed
            continue
        register(sub)
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
