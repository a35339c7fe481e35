#!/usr/bin/env bash
# The test command (README "Tests"; .ci/run calls this same script).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
. .venv/bin/activate
python -m pytest tests "$@"
