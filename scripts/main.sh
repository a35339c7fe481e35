#!/usr/bin/env bash
# The main job (README "Quick start"): install, prepare a model and catalogue
# (the committed Amazon Beauty bundle, bundles/beauty-loo, whose data is in
# data/beauty; without it a small synthetic one, built once), start Redis (or use $REDIS_URL) and the
# four services, wait for their health checks and send real Recommend calls.
# Stop everything with: .venv/bin/specrec stack down
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
. .venv/bin/activate
exec specrec stack up "$@"
