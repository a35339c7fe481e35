"""SpecRec's benchmarks, run from the repository root as modules (``python -m bench.serving ...``).

Every script here is a step of ``bench/rerun.sh`` (or called by one); they share :mod:`bench.harness` (the
sampled users, the stack, timing and result helpers), :mod:`bench.loadgen` (the one load generator) and
:mod:`bench.cpus` (processes placed on CPUs, and a CPU hog).
What they measured is in ``bench/results/README.md`` (the current figures) and ``bench/results/HISTORY.md``
(the runs and probes that led there).
"""
