"""The core subcommands of the ``specrec`` tool, one module each. A module gives ``add_parser(sub)``, which adds
its subparser to ``sub`` (with ``func=run``), and ``run(args)``, which does the work and returns the exit status.
Option groups and helpers that several commands share live in :mod:`specrec.commands.options`.

Subcommands of other installed packages (the serving layer's ``stack`` and ``recommend``) are not listed here:
:mod:`specrec.cli` finds them through the ``specrec.commands`` entry point group.
"""

from __future__ import annotations

from types import ModuleType

from . import (
               build_bundle,
               evaluate,
               export_onnx,
               refit,
               sids,
               synth,
               train,
               train_baseline,
               train_drafters,
               tune_fusion,
)

# in the order ``specrec --help`` lists them
COMMANDS: tuple[ModuleType, ...] = (
    train, evaluate, train_drafters, train_baseline, tune_fusion, refit, sids, export_onnx, synth, build_bundle,
)
