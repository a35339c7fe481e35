#!/usr/bin/env bash
# Re-run the benchmarks behind bench/results/summary.json on one bundle, one after another, with the
# machine to themselves (no training, no tests beside them: most of them time things).
#
#   bash bench/rerun.sh                      # every step, on bundles/beauty-loo
#   bash bench/rerun.sh quality policies     # only these steps
#   BUNDLE=runs/x bash bench/rerun.sh policies
#
# Steps: quality (GR + SASRec, TIGER protocol and --exclude-history, all test users; the fusion curve; the learning curve),
# policies (K=10/50, 500 random test users, the cost model), temporal (bundles/beauty-temporal, where its
# unseen targets are lost, and the same users through the gateway), drafters, backends, profile (policies,
# graphs, pass cost and floor), startup (cold and warm start), index (HNSW), path (the request path against the same
# work in process, the CPU a fused request costs each service), serving, overload (the load generator on a CPU of its own), soak (and what a write costs), chaos (faults of the services, of Redis and of the machine), scaleout,
# catalogue (cost against catalogue size, 12k to 10M items, in process, the item set and the stack: about 15 GB of memory
# and half an hour at 10M), keys (which
# summary keys no step writes: bench.summary_keys), quick (a bundle rebuilt with recipes/beauty-quick.json, timed). Not in the default list, run only when named: gpu
# (bench/device_check.sh, on a machine with an NVIDIA GPU). Every script of bench/ runs from a step, as a module
# (python -m bench.<name>, from the repository root). Each step's output goes to $LOG/<step>.log; a line per
# step with its wall time is appended to $LOG/steps.tsv. The commands are the ones bench/results/README.md
# documents.
set -euo pipefail
cd "$(dirname "$0")/.."
BUNDLE=${BUNDLE:-bundles/beauty-loo}
LOG=${LOG:-runs/rerun}
export BUNDLE LOG
mkdir -p "$LOG"
. .venv/bin/activate

quality() {
  specrec eval --bundle "$BUNDLE" --batch-size 64 --save
  specrec eval --bundle "$BUNDLE" --ranker sasrec --batch-size 256 --save
  specrec eval --bundle "$BUNDLE" --ranker sasrec --batch-size 256 --exclude-history --save
  specrec eval --bundle "$BUNDLE" --batch-size 64 --exclude-history --save
  # every list a user of the stack can get, history excluded, all test users: fused ranking by both models
  specrec eval --bundle "$BUNDLE" --policies beam,fused,drafter --k 10 --exclude-history --save
  # what the GR adds to SASRec's list at every fusion weight, validation (chooses) and test (reported only)
  python -m bench.fusion_curve --bundle "$BUNDLE"
  # where the GR loses to SASRec between validation and test (losses per split, ranking by history length)
  python -m bench.generalisation --bundle "$BUNDLE"
  python -m bench.learning_curve --bundle "$BUNDLE" --out bench/results/beauty_loo_learning_curve
}
policies() {
  for k in 10 50; do
    specrec eval --bundle "$BUNDLE" --policies beam,strict,nezha,fused,specgr,drafter --k "$k" --sample 500 --seed 11 \
      --compare-eager --save
  done
  python -m bench.cost_model
}
temporal() {  # the temporal split: unseen items, with and without the drafter's share of them
  specrec eval --bundle bundles/beauty-temporal --policies beam,fused,drafter --k 50 --sample 2000 --seed 0 --save
  specrec eval --bundle bundles/beauty-temporal --policies beam,fused,drafter --k 50 --sample 2000 --seed 0 --save \
    --unseen-share 0
  python -m bench.unseen_drafted --bundle bundles/beauty-temporal --sample 2000 --seed 0
  # the same users through the gateway (a stack on the temporal bundle): model answers, unseen recall
  specrec export-onnx --bundle bundles/beauty-temporal --k 10,50
  python -m bench.serving --bundle bundles/beauty-temporal --protocol temporal --policies fused,auto,drafter,beam \
    --open-policies "" --overhead-requests 0 --k 50 --budget-ms 30 --requests 2000 --seed 0
  python -m bench.unseen_text_reach --data data/beauty --emb bundles/beauty-loo/text_emb.npy
}
startup() { python -m bench.cold_start --bundle "$BUNDLE"; }
index() { python -m bench.drafter_index --items 300000 --dim 64 --queries 500; }
keys() { python -m bench.summary_keys; }  # last: summary keys no step writes (bench.keys_without_writer)
drafters() { python -m bench.drafters --bundle "$BUNDLE" --users 1000 --timing-users 200 --seed 11; }
backends() { python -m bench.backends --bundle "$BUNDLE" --n 200; }
profile() {
  python -m bench.profile_policies --bundle "$BUNDLE" --n 150
  python -m bench.profile_graphs --bundle "$BUNDLE" --k 10
  python -m bench.pass_cost --bundle "$BUNDLE"
}
# the request path: the same users in process and through the stack (their ratio), CPU ms per fused request per
# service against a bare gRPC front making the same two calls, the bare round trip and each hop above its callee
path() { python -m bench.request_path --bundle "$BUNDLE" --requests 300; }
serving() {
  python -m bench.serving --bundle "$BUNDLE" --policies auto,fused,beam,strict,nezha,specgr,drafter \
    --open-policies auto --rates 30,60 --duration 10 --requests 300 --overhead-requests 100
}
overload() { python -m bench.overload --bundle "$BUNDLE" --multiples 1,2,3 --duration 20 --door 2 --clients 2 --private-redis; }
soak() {
  python -m bench.soak --bundle "$BUNDLE" --minutes 10
  python -m bench.upsert_cost --bundle "$BUNDLE" --seconds 20  # the write path alone, no requests
}
chaos() { python -m bench.chaos --bundle "$BUNDLE" --rate 10 --budget-ms 100 --machine-budget-ms 30; }
scaleout() { python -m bench.scaleout --bundle "$BUNDLE" --rates 10,20,30,40 --duration 10; }
catalogue() { python -m bench.catalogue_scale --bundle "$BUNDLE" --sizes 12k,100k,1m,10m --parts inprocess,itemset,stack --stack-probe fused; }
quick() {  # a newcomer's rebuild from the shipped data, timed, its lists on all test users (issues 54, 66); for
  # Beauty (and Beauty with IDs from SASRec's item embeddings), Yelp and Yelp without item texts: validation (the
  # chosen models) beside test (the refit ones), and what the refit changed on test (bench.valid_test, the chosen
  # models kept in OUT/chosen)
  local ids=${TMPDIR:-/tmp}/specrec-yelp-ids
  python -m bench.ids_only --data data/yelp --out "$ids"
  for spec in "beauty-quick data/beauty beauty.quick" "beauty-quick-sasrec-ids data/beauty beauty_sas.quick" \
              "yelp-quick data/yelp yelp.quick" "yelp-quick $ids yelp_ids.quick"; do
    set -- $spec
    local out=runs/quick-${3%%.*}
    python -m bench.quick_recipe --recipe recipes/$1.json --data "$2" --out "$out" --name "$3"
    python -m bench.valid_test --bundle "$out/chosen" --served "$out/bundle" --name "$3.refit" --without-last \
      --beam-users 2000
  done
}
gpu() {  # needs an NVIDIA GPU (exits 3 without one): only when named; on the device tool, see device_check.sh
  bash bench/device_check.sh  # its results into bench/results/gpu, then their keys into summary.json
  python -m bench.gpu_check --merge bench/results/gpu
}

ALL=(quality policies temporal drafters backends profile startup index path serving overload soak chaos scaleout catalogue quick keys)
EXTRA=(gpu)
STEPS=("$@")
[ ${#STEPS[@]} -eq 0 ] && STEPS=("${ALL[@]}")
for step in "${STEPS[@]}"; do
  declare -F "$step" >/dev/null || { echo "unknown step: $step (one of: ${ALL[*]} ${EXTRA[*]})" >&2; exit 2; }
done
for step in "${STEPS[@]}"; do
  echo "== $step ($(date -u +%H:%M:%S))"
  t0=$(date +%s)
  rc=0
  # in a shell of its own: run as `"$step" || rc=$?` here, errexit would be off inside it, and a failing
  # command that is not the step's last would go unnoticed
  bash -euo pipefail -c "$(declare -f "$step"); $step" >"$LOG/$step.log" 2>&1 || rc=$?
  printf '%s\t%s\t%ss\trc=%s\n' "$(date -u +%FT%TZ)" "$step" "$(( $(date +%s) - t0 ))" "$rc" | tee -a "$LOG/steps.tsv"
  [ "$rc" -eq 0 ] || echo "   failed: see $LOG/$step.log" >&2
done
