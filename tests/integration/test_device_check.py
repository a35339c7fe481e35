"""``bench/device_check.sh --cpu``, the dry run of what a lent GPU machine runs (``bench/gpu_check.py``): every
phase (the CUDA unit tests first, in process on the CUDA backend's stand-in and eagerly, the stack with the verifier on
the CUDA backend and the text embedder off, the verifier's RPCs under concurrent callers, the stack at 30 ms, a
training epoch) runs to the end on the CPU, writes its files, says it is a dry run, and ``--merge`` refuses to
publish it; a copy sent SIGTERM once its stack is up keeps every finished phase's results and stops its services.
And what the device run carries fits the device tool (issue 65)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def test_the_dry_run_runs_every_phase_and_its_interrupt_path_and_publishes_nothing(tmp_path):
    env = {**os.environ, "PYTHON": sys.executable}
    r = subprocess.run(["bash", "bench/device_check.sh", "--cpu", "--out", str(tmp_path)], cwd=ROOT, env=env,
                       capture_output=True, text=True, timeout=1500)
    res = json.loads((tmp_path / "gpu_check.json").read_text())
    assert r.returncode == 0 and not res["errors"], r.stdout[-3000:] + r.stderr[-3000:]
    assert res["dry_run"] and list(res["seconds"]) == ["cuda_tests", "inprocess", "stack", "verifier", "gateway",
                                                       "train"]
    keys = json.loads((tmp_path / "gpu_keys.json").read_text())
    assert keys["gpu.device"] == "cpu (dry run)"
    for k in ("gpu.cuda_tests.passed", "gpu.cuda.beam.k10.p50_ms", "gpu.cuda.fused.k10.p50_ms",
              "gpu.cuda.beam.k10.eager_rows_not_a_tie", "gpu.cuda.strict.k10.beam_rows_not_a_tie",
              "gpu.cuda.beam.k10.cpu_rows_not_a_tie", "gpu.cuda.captured_after_start", "gpu.verifier.graphs",
              "gpu.verifier.rank_rps", "gpu.verifier.captured_after_start", "gpu.gateway.capacity_rps",
              "gpu.train.epoch_s"):
        assert k in keys, k
    assert keys["gpu.cuda_tests.failed"] == 0 and keys["gpu.cuda_tests.passed"] > 10
    assert keys["gpu.cuda.strict.equal_to_beam"] == 1.0 and keys["gpu.cuda.beam.equal_to_eager"] == 1.0
    assert keys["gpu.cuda.lossless_rows_not_a_tie"] == 0 and keys["gpu.cuda.searches_eager"] == 0
    assert "not GPU figures" in (tmp_path / "gpu_check.md").read_text()
    # the interrupt path: SIGTERM once the stack was up (in the verifier phase); exit 143, every finished phase kept
    assert "the interrupt path: exit 143" in r.stdout, r.stdout[-3000:]
    cut = json.loads((tmp_path / "interrupted" / "gpu_check.json").read_text())
    # (during the verifier phase, or, should the signal land while the stack phase writes its files, between phases)
    said = cut["interrupted"]
    assert re.fullmatch(r"signal 15 \(SIGTERM\) (during phase \w+|between phases)", said), said
    finished = [p for p in cut["seconds"] if p not in cut["errors"]]
    assert finished[:3] == ["cuda_tests", "inprocess", "stack"] and "train" not in cut["seconds"]
    cut_keys = json.loads((tmp_path / "interrupted" / "gpu_keys.json").read_text())
    assert {"gpu.cuda_tests.passed", "gpu.cuda.beam.k10.p50_ms", "gpu.verifier.graphs"} <= set(cut_keys)
    assert cut["phases"]["stack"] == "stopped"
    for pid in cut["service_pids"].values():
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)
    m = subprocess.run([sys.executable, "-m", "bench.gpu_check", "--merge", str(tmp_path)], cwd=ROOT,
                       capture_output=True, text=True, timeout=120)
    assert m.returncode != 0 and "dry run" in (m.stdout + m.stderr)


def test_graphs_captured_by_the_timed_runs_are_counted(monkeypatch):
    """The in-process phase reads the graphs captured after the warm-up once its timed runs are done: with a warm-up
    that captures nothing, every graph the runs use is one (read before them, the figure was always 0)."""
    from bench import gpu_check
    from bench.harness import sample_users
    from specrec.backends.cuda import CudaBackend
    from specrec.bundle import Bundle

    def no_warm_up(self, trie, ks=(10,), drafts=(), scored=()):
        self.runner.started = True

    monkeypatch.setattr(CudaBackend, "warmup", no_warm_up)
    bundle = Bundle.load(ROOT / "bundles" / "beauty-loo")
    a = gpu_check.parse(["--cpu"])
    keys: dict = {}
    out = gpu_check.inprocess(bundle, sample_users(bundle, 3, 7), a, keys, [])
    assert keys["gpu.cuda.graphs"] == 0  # after the warm-up: nothing
    assert keys["gpu.cuda.captured_after_start"] > 0
    after = out["after_runs"]
    assert after["captured_after_start"] == after["graphs"] == keys["gpu.cuda.captured_after_start"]


def test_the_prepared_tree_fits_the_device_tool():
    """What --prepare sends: the tracked files but what it sets aside (DEVICE_LEAVES), and the carried archive (about
    8.5 MiB: the measured one where --prepare ran here), under its own limit of 60 MiB."""
    script = (ROOT / "bench" / "device_check.sh").read_text()
    leaves = re.search(r"^DEVICE_LEAVES=\(([^)]*)\)", script, re.MULTILINE).group(1).split()
    limit = int(re.search(r"^LIMIT_MIB=\$\{LIMIT_MIB:-(\d+)\}", script, re.MULTILINE).group(1))
    assert leaves == ["bundles/beauty-temporal"] and limit == 60
    files = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, check=True).stdout.split(b"\0")
    paths = [ROOT / f.decode() for f in files if f]
    if not paths:
        pytest.skip("not a git checkout")
    size = sum(p.lstat().st_size for p in paths if (p.is_file() or p.is_symlink())
               and not any(str(p.relative_to(ROOT)).startswith(leaf + "/") for leaf in leaves))
    carried = ROOT / ".device" / "carry.tar.xz"
    carry = carried.stat().st_size if carried.exists() else 9 * 2**20
    assert size + carry < limit * 2**20, f"{size / 2**20:.1f} MiB of tracked files + {carry / 2**20:.1f} MiB carried"
