#!/usr/bin/env bash
# What only a GPU can show, in one prepared run (issues 51 and 65): bench/gpu_check.py's phases (the CUDA unit tests
# first, then every policy in process on the CUDA backend and eagerly, the stack's verifier under concurrent callers,
# the stack at a 30 ms budget, one training epoch) on a lent GPU machine, each phase with its own time budget and
# its results written as soon as it ends, the whole run inside 8 minutes, its files in $OUT. The step-by-step
# procedure for 15 minutes of GPU: docs/gpu-check.md.
#
#   bash bench/device_check.sh --prepare    here, once per code change: fills .device/ (git ignores it) with what the
#                                           run carries, in one archive (carry.tar.xz): the Python packages the GPU
#                                           machine lacks (or has at versions the generated gRPC code refuses), for
#                                           its Python 3.12, at this checkout's .venv versions; that generated code;
#                                           a static redis-server (built once from Debian's source, cached in
#                                           ~/.cache/specrec). It sets aside, into .device-aside/ (ignored, never
#                                           carried), the tracked files the run does not need (DEVICE_LEAVES), says
#                                           what travels, and refuses (saying by how much) when that passes
#                                           LIMIT_MIB. From a fresh clone it sets the checkout up first
#                                           (scripts/setup.sh, the README's command) where that was not done.
#                                           --prepare --keep-tree sets nothing aside and allows the tool's 64 MiB.
#   bash bench/device_check.sh              on the GPU machine (the device tool: carry [".device"]); its files in
#                                           $OUT; extra arguments go to bench.gpu_check (a rerun: --phases train)
#   bash bench/device_check.sh --restore    here, after the device calls: puts back what --prepare set aside
#   .venv/bin/python -m bench.gpu_check --merge <files_at> [<files_at of a rerun>]
#                                           here: publishes into bench/results/gpu/ and summary.json's gpu.* keys
#   bash bench/device_check.sh --cpu [--out DIR]
#                                           the dry run (CI: tests/integration/test_device_check.py): every phase
#                                           small on the CPU, the CUDA backend as its stand-in, nothing published;
#                                           then the interrupt path: a copy sent SIGTERM once its stack is up must
#                                           exit 143 with every finished phase's results written (DIR/interrupted)
set -euo pipefail
cd "$(dirname "$0")/.."
DEV=.device
ASIDE=.device-aside
PY=${PYTHON:-python3}
#: what the device tool takes is 64 MiB; this check keeps 4 MiB of it for what a checkout gains between --prepare and
#: the call
LIMIT_MIB=${LIMIT_MIB:-60}
#: tracked paths the device run never reads (the run needs bundles/beauty-loo only), set aside by --prepare
DEVICE_LEAVES=(bundles/beauty-temporal)
#: the whole run's limit on the GPU machine: bench/gpu_check.py's BUDGET_S summed (420 s) + its RUN_SLACK_S (30 s)
#: (tests/unit/test_gpu_check.py holds them equal); then SIGTERM, which the run answers by writing what it measured
RUN_LIMIT_S=${RUN_LIMIT_S:-450}
# what the services, the benchmark and training import that the GPU machine's image lacks, or has at versions the
# generated code refuses (grpcio, protobuf), and what those need newer than the image may have (typing-extensions,
# for pydantic); faiss (30 MB) stays behind: the drafters search exactly in numpy without it; tracing's
# opentelemetry is imported only where an OTLP endpoint is set
WHEELS=(grpcio protobuf grpcio-health-checking grpcio-reflection grpcio-status googleapis-common-protos
        pydantic pydantic-core pydantic-settings annotated-types typing-inspection typing-extensions python-dotenv
        structlog redis)
PLATFORMS=(manylinux_2_28_x86_64 manylinux_2_27_x86_64 manylinux_2_17_x86_64 manylinux2014_x86_64 manylinux1_x86_64)
REDIS_SRC=http://deb.debian.org/debian/pool/main/r/redis/redis_7.0.15.orig.tar.gz

mib() { awk -v b="$1" 'BEGIN { printf "%.1f", b / 1048576 }'; }

travelling_bytes() {  # what the device tool sends: tracked files that are here, untracked ones git does not ignore, .device
  { git ls-files -z --cached --others --exclude-standard; find "$DEV" -type f -print0; } | sort -zu |
    { xargs -0 -r stat -c '%s %F' 2>/dev/null || true; } |  # (a tracked file set aside is not there: no size)
    awk '$2 == "regular" || $2 == "symbolic" { s += $1 } END { print s + 0 }'
}

restore() {  # what --prepare set aside, back where git has it
  local p
  for p in "${DEVICE_LEAVES[@]}"; do
    if [[ -e $ASIDE/$p ]]; then
      [[ -e $p ]] && { echo "both $p and $ASIDE/$p exist: left as they are" >&2; continue; }
      mkdir -p "$(dirname "$p")" && mv "$ASIDE/$p" "$p" && echo "restored $p"
    fi
  done
  find "$ASIDE" -depth -type d -empty -delete 2>/dev/null || true
}

prepare() {
  local venv=.venv/bin/python
  if [[ ! -x $venv ]]; then
    echo "no .venv: setting the checkout up first (bash scripts/setup.sh, the README's command)"
    bash scripts/setup.sh
  fi
  [[ -f specrec_rpc/v1/__init__.py ]] || $venv -m specrec_rpc.codegen
  grep -qx '/.device/' .gitignore && grep -qx '/.device-aside/' .gitignore ||
    { echo ".gitignore must hold /.device/ and /.device-aside/: what they hold must never travel uncarried" >&2; exit 2; }
  restore  # an earlier --prepare's, so that this one measures the checkout as it is
  local cache=${XDG_CACHE_HOME:-$HOME/.cache}/specrec
  STAGE=$(mktemp -d)
  trap 'rm -rf "$STAGE"' EXIT
  local stage=$STAGE
  # the wheels, at the versions this checkout's .venv generated its gRPC code with and runs
  local pins=() w v
  for w in "${WHEELS[@]}"; do
    v=$({ $venv -m pip show "$w" 2>/dev/null || true; } | sed -n 's/^Version: //p')
    if [[ -n $v ]]; then pins+=("$w==$v"); else pins+=("$w"); fi
  done
  $venv -m pip download -q --disable-pip-version-check --no-deps --only-binary=:all: --python-version 3.12 \
    --implementation cp "${PLATFORMS[@]/#/--platform=}" --platform any -d "$stage/wheels" "${pins[@]}"
  $venv -m pip install -q --disable-pip-version-check --no-index --no-deps --no-compile --only-binary=:all: \
    --python-version 3.12 --implementation cp "${PLATFORMS[@]/#/--platform=}" --target "$stage/site" \
    "$stage"/wheels/*.whl
  rm -rf "$stage/site/bin"  # console scripts, for this machine's Python; nothing runs them there
  cp -r specrec_rpc/v1 "$stage/rpc_v1"  # the generated gRPC code (git ignores it; the GPU machine cannot generate it)
  local redis=$cache/redis-static
  if [[ ! -x $redis/redis-server ]]; then  # static: it runs on any x86-64 Linux, whatever libraries it has
    mkdir -p "$redis/src"
    curl -sSfL "$REDIS_SRC" | tar xz -C "$redis/src" --strip-components=1
    nice make -s -C "$redis/src" -j"$(nproc)" MALLOC=libc BUILD_TLS=no USE_SYSTEMD=no LDFLAGS=-static \
      redis-server >"$redis/build.log" 2>&1 || { tail "$redis/build.log" >&2; exit 1; }
    strip -o "$redis/redis-server" "$redis/src/src/redis-server"
  fi
  mkdir -p "$stage/bin" && cp "$redis/redis-server" "$stage/bin/"
  rm -rf "$DEV" && mkdir -p "$DEV"
  # one archive: xz (with its x86 filter for the shared objects) carries in 8 MiB what takes 15 as wheels
  tar -C "$stage" -cf - site rpc_v1 bin | nice xz --x86 --lzma2=preset=9e -T1 >"$DEV/carry.tar.xz"
  printf '%s\n' "${pins[@]}" >"$DEV/packages.txt"
  for w in "${DEVICE_LEAVES[@]}"; do
    [[ -e $w && $KEEP_TREE == 0 ]] || continue
    mkdir -p "$ASIDE/$(dirname "$w")" && mv "$w" "$ASIDE/$w" && echo "set aside $w (in $ASIDE/: bash bench/device_check.sh --restore puts it back)"
  done
  local carried travels
  carried=$(du -sb "$DEV" | cut -f1)
  travels=$(travelling_bytes)
  echo "prepared $DEV: ${#pins[@]} packages for Python 3.12, the generated gRPC code, a static redis-server:" \
       "carried $(mib "$carried") MiB"
  echo "travels: $(mib "$travels") MiB (the tracked files here, untracked ones git does not ignore, and $DEV)," \
       "of the $LIMIT_MIB MiB this check allows itself (the device tool takes 64)"
  if ((travels > LIMIT_MIB * 1048576)); then
    echo "too big by $(mib $((travels - LIMIT_MIB * 1048576))) MiB: make less travel (untracked files, what the run" \
         "does not need: DEVICE_LEAVES)" >&2
    exit 1
  fi
}

install_carried() {  # on the GPU machine: what --prepare put in .device/
  [[ -f $DEV/carry.tar.xz ]] ||
    { echo "no $DEV/carry.tar.xz: run bash bench/device_check.sh --prepare here first, and carry .device" >&2; exit 2; }
  local to=/tmp/specrec-carry
  rm -rf "$to"
  $PY -c 'import sys, tarfile; tarfile.open(sys.argv[1]).extractall(sys.argv[2], filter="data")' "$DEV/carry.tar.xz" "$to"
  export PYTHONPATH=$to/site:$PWD${PYTHONPATH:+:$PYTHONPATH}
  [[ -f specrec_rpc/v1/__init__.py ]] || cp -r "$to/rpc_v1" specrec_rpc/v1
  export PATH=$to/bin:$PATH  # the benchmark's stack starts its own Redis with it
}

interrupt_path() {  # $1: where a copy of the dry run writes; it is sent SIGTERM once its stack is up
  local dir=$1 pid rc
  rm -rf "$dir"
  $PY -m bench.gpu_check --cpu --phases cuda_tests,inprocess,verifier,train --out "$dir" >"$dir.log" 2>&1 &
  pid=$!
  until $PY -c 'import json, sys; sys.exit("stack" not in json.load(open(sys.argv[1]))["seconds"])' \
      "$dir/gpu_check.json" 2>/dev/null; do
    kill -0 "$pid" 2>/dev/null || { echo "the copy ended before its stack was up:" >&2; tail "$dir.log" >&2; return 1; }
    sleep 0.2
  done
  kill -TERM "$pid"
  rc=0 && wait "$pid" || rc=$?
  $PY - "$dir/gpu_check.json" "$rc" <<'PY'
import json, sys
res, rc = json.load(open(sys.argv[1])), int(sys.argv[2])
kept = [p for p in res["seconds"] if p not in res["errors"]]
print(f"the interrupt path: exit {rc}; {res['interrupted']}; kept {', '.join(kept)} "
      f"({sum(len(res['keys_of'][p]) for p in kept)} keys); stack {res['phases'].get('stack')}")
sys.exit(0 if rc == 143 and res["interrupted"] and {"cuda_tests", "inprocess", "stack"} <= set(kept) else 1)
PY
}

KEEP_TREE=0
case "${1:-}" in
  --prepare)
    if [[ "${2:-}" == "--keep-tree" ]]; then  # nothing set aside (should the device tool refuse a tree with tracked
      KEEP_TREE=1 LIMIT_MIB=64                # files missing): about 60.4 MiB, under the tool's own limit alone
    fi
    prepare; exit 0 ;;
  --restore) restore; exit 0 ;;
  --cpu)
    shift
    OUTDIR=${OUT:-$(mktemp -d)}
    [[ "${1:-}" == "--out" ]] && OUTDIR=$2
    mkdir -p "$OUTDIR"
    t0=$SECONDS
    rc=0 && $PY -m bench.gpu_check --cpu --out "$OUTDIR" || rc=$?
    irc=0 && interrupt_path "$OUTDIR/interrupted" || irc=$?
    echo "device_check --cpu: the dry run exited $rc, its interrupt path $irc, in $((SECONDS - t0)) s"
    exit $((rc ? rc : irc))
    ;;
esac

# on the GPU machine
t0=$SECONDS
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || { echo "no GPU here" >&2; exit 3; }
install_carried
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
$PY - <<'PY'
import grpc, google.protobuf, pydantic, typing_extensions, torch
print("torch", torch.__version__, "cuda", torch.cuda.is_available(), torch.cuda.get_device_name(0))
print("grpcio", grpc.__version__, "protobuf", google.protobuf.__version__, "pydantic", pydantic.VERSION)
assert torch.cuda.is_available(), "torch sees no CUDA device"
PY
echo "device_check: set up in $((SECONDS - t0)) s; the run's limit is $RUN_LIMIT_S s"
OUTDIR=${OUT:-bench/results/gpu}
mkdir -p "$OUTDIR"
set +e
timeout -k 20 "$RUN_LIMIT_S" $PY -m bench.gpu_check --out "$OUTDIR" "$@" 2>&1 | tee "$OUTDIR/gpu_check.log"
rc=${PIPESTATUS[0]}
set -e
echo "device_check: bench.gpu_check exited $rc after $((SECONDS - t0)) s (124: the run's limit; 143: SIGTERM)"
[[ -f $OUTDIR/gpu_check.md ]] && tail -n 80 "$OUTDIR/gpu_check.md"
exit "$rc"
