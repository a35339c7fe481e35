"""``bench/device_check.sh --cpu``, the dry run of what a lent GPU machine runs (``bench/gpu_check.py``): every
phase (in process on the CUDA backend's stand-in and eagerly, the verifier's RPCs under concurrent callers, the
stack at 30 ms with the verifier on the CUDA backend and the text embedder off, a training epoch) runs to the end
on the CPU, writes its files, says it is a dry run, and ``--merge`` refuses to publish it."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def test_the_dry_run_runs_every_phase_and_publishes_nothing(tmp_path):
    env = {**os.environ, "PYTHON": sys.executable}
    r = subprocess.run(["bash", "bench/device_check.sh", "--cpu", "--out", str(tmp_path)], cwd=ROOT, env=env,
                       capture_output=True, text=True, timeout=900)
    res = json.loads((tmp_path / "gpu_check.json").read_text())
    assert r.returncode == 0 and not res["errors"], r.stdout[-3000:] + r.stderr[-3000:]
    assert res["dry_run"] and set(res["seconds"]) == {"inprocess", "stack", "verifier", "gateway", "train"}
    keys = json.loads((tmp_path / "gpu_keys.json").read_text())
    assert keys["gpu.device"] == "cpu (dry run)"
    for k in ("gpu.cuda.beam.k10.p50_ms", "gpu.cuda.fused.k10.p50_ms", "gpu.cuda.beam.equal_to_eager",
              "gpu.cuda.strict.equal_to_beam", "gpu.verifier.rank_rps", "gpu.gateway.capacity_rps",
              "gpu.train.epoch_s"):
        assert k in keys, k
    assert keys["gpu.cuda.strict.equal_to_beam"] == 1.0 and keys["gpu.cuda.beam.equal_to_eager"] == 1.0
    assert "not GPU figures" in (tmp_path / "gpu_check.md").read_text()
    m = subprocess.run([sys.executable, "-m", "bench.gpu_check", "--merge", str(tmp_path)], cwd=ROOT,
                       capture_output=True, text=True, timeout=120)
    assert m.returncode != 0 and "dry run" in (m.stdout + m.stderr)


def test_the_prepared_tree_fits_the_device_tool():
    """What --prepare weighs: the tracked files without the bundle that can stay behind leave room for the carried
    wheels and redis-server (about 15 MiB) under the device tool's 64 MiB."""
    files = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, check=True).stdout.split(b"\0")
    size = sum((ROOT / f.decode()).stat().st_size for f in files if f and not f.startswith(b"bundles/beauty-temporal/")
               and (ROOT / f.decode()).is_file() and not (ROOT / f.decode()).is_symlink())
    if not size:
        pytest.skip("not a git checkout")
    assert size + 16 * 2**20 < 64 * 2**20, f"{size / 2**20:.1f} MiB of tracked files travel"
