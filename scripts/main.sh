#!/usr/bin/env bash
# The main job (README "Quick start"): set up, then evaluate the committed
# Amazon Beauty bundle when ../shared/data is here; otherwise train a small
# model on the synthetic catalogue and evaluate it.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
. .venv/bin/activate
BEAUTY=${SPECREC_BEAUTY_DATA:-../shared/data/beauty}
if [[ -d "$BEAUTY" && -f bundles/beauty-loo/bundle.json ]]; then
  echo "== Beauty, leave-one-out: beam search on the committed bundle (first ${LIMIT:-1000} users)"
  specrec eval --bundle bundles/beauty-loo --data "$BEAUTY" --limit "${LIMIT:-1000}"
else
  echo "== no ../shared/data: training a small model on the synthetic catalogue"
  specrec train --data synthetic --protocol temporal --out runs/synthetic --epochs 8 --d-model 64 --d-ff 256 \
    --heads 4 --d-kv 16 --enc-layers 2 --dec-layers 2 --codebook-size 32 --collision-size 64 --warmup-steps 50
  specrec eval --bundle runs/synthetic/bundle
fi
