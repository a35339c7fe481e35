#!/usr/bin/env bash
# What only a GPU can show, in one prepared run (issue 51): bench/gpu_check.py's phases (every policy in process on
# the CUDA backend and eagerly, the verifier's RPCs under concurrent callers, the stack at a 30 ms budget, one
# training epoch) on a lent GPU machine, in at most about 6 minutes, its table last, its files in $OUT.
#
# 1. Here, on a machine with a package index, once (the GPU machine has none; it has Python 3.12, a CUDA torch,
#    grpcio and protobuf of other versions, no faiss, no Redis):
#        bash bench/device_check.sh --prepare
#    fills .device/ (git ignores it): the wheels the GPU machine lacks, for Python 3.12, at the versions this
#    checkout's .venv generated its gRPC code with (found by running the dry run with every module the GPU
#    machine's image lacks refused); that generated code; a static redis-server built from Debian's source
#    (no libraries to match there; cached in ~/.cache/specrec); and it says how big the tree that travels is.
#    The device tool takes 64 MiB in all, and every tracked file travels: the check needs bundles/beauty-loo
#    only, so move bundles/beauty-temporal out of the checkout for the call (mv bundles/beauty-temporal
#    /work/.aside/), and back after it.
# 2. On the GPU machine (the device tool: carry [".device"], timeout_s 480 or so, leaving time for one rerun):
#        bash bench/device_check.sh
# 3. Back here, with the files that came back from $OUT:
#        .venv/bin/python -m bench.gpu_check --merge <files_at>
#    copies them into bench/results/gpu/ and sets the gpu.* keys in bench/results/summary.json.
#
# The dry run, on the CPU (CI runs it: tests/integration/test_device_check.py): every phase small, the CUDA
# backend as its stand-in, nothing published:
#        bash bench/device_check.sh --cpu [--out DIR]
set -euo pipefail
cd "$(dirname "$0")/.."
DEV=.device
PY=${PYTHON:-python3}
# what the services, the benchmark and training import that the GPU machine's image lacks, or has at versions the
# generated code refuses (grpcio, protobuf); faiss (30 MB) stays behind: the drafters search exactly in numpy
# without it; tracing's opentelemetry is imported only where an OTLP endpoint is set
WHEELS=(grpcio protobuf grpcio-health-checking grpcio-reflection grpcio-status googleapis-common-protos
        pydantic pydantic-core pydantic-settings annotated-types typing-inspection python-dotenv structlog redis)
REDIS_SRC=http://deb.debian.org/debian/pool/main/r/redis/redis_7.0.15.orig.tar.gz

prepare() {
  local venv=.venv/bin/python
  [[ -x $venv ]] || { echo "run bash scripts/setup.sh first (the versions come from .venv)" >&2; exit 2; }
  rm -rf "$DEV" && mkdir -p "$DEV/wheels"
  local pins=()
  for w in "${WHEELS[@]}"; do
    v=$({ $venv -m pip show "$w" 2>/dev/null || true; } | sed -n 's/^Version: //p')
    if [[ -n $v ]]; then pins+=("$w==$v"); else pins+=("$w"); fi
  done
  $PY -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 \
    --platform manylinux2014_x86_64 --platform manylinux1_x86_64 --platform any -d "$DEV/wheels" "${pins[@]}"
  cp -r specrec_rpc/v1 "$DEV/rpc_v1"  # the generated gRPC code (git ignores it; the GPU machine cannot generate it)
  local cache=${XDG_CACHE_HOME:-$HOME/.cache}/specrec/redis-static
  if [[ ! -x $cache/redis-server ]]; then  # static: it runs on any x86-64 Linux, whatever libraries it has
    mkdir -p "$cache/src"
    curl -sSfL "$REDIS_SRC" | tar xz -C "$cache/src" --strip-components=1
    nice make -s -C "$cache/src" -j"$(nproc)" MALLOC=libc BUILD_TLS=no USE_SYSTEMD=no LDFLAGS=-static \
      redis-server >"$cache/build.log" 2>&1 || { tail "$cache/build.log" >&2; exit 1; }
    strip -o "$cache/redis-server" "$cache/src/src/redis-server"
  fi
  cp "$cache/redis-server" "$DEV/redis-server"
  grep -qx '/.device/' .gitignore 2>/dev/null || { echo "(.gitignore should hold /.device/)" >&2; }
  local tree aside carry
  tree=$(git ls-files -z | xargs -0 du -cb 2>/dev/null | tail -1 | cut -f1)
  aside=$(git ls-files -z bundles/beauty-temporal | xargs -0 du -cb 2>/dev/null | tail -1 | cut -f1)
  carry=$(du -sb "$DEV" | cut -f1)
  echo "prepared $DEV: $(ls "$DEV/wheels" | wc -l) wheels, a static redis-server, the generated gRPC code"
  echo "travels: tracked files $((tree / 1048576)) MiB (bundles/beauty-temporal, $((aside / 1048576)) MiB of them, can" \
       "stay behind) + .device $((carry / 1048576)) MiB; the limit is 64 MiB"
  ((tree - aside + carry < 64 * 1048576)) || { echo "too big for the device tool even without it" >&2; exit 1; }
}

install_carried() {  # on the GPU machine: what --prepare put in .device/
  [[ -d $DEV/wheels ]] || { echo "no $DEV/wheels: run bash bench/device_check.sh --prepare here first" >&2; exit 2; }
  $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/specrec-site \
    "$DEV"/wheels/*.whl
  export PYTHONPATH=/tmp/specrec-site:$PWD${PYTHONPATH:+:$PYTHONPATH}
  [[ -d specrec_rpc/v1 ]] || cp -r "$DEV/rpc_v1" specrec_rpc/v1
  mkdir -p /tmp/specrec-bin && cp "$DEV/redis-server" /tmp/specrec-bin/ && chmod +x /tmp/specrec-bin/redis-server
  export PATH=/tmp/specrec-bin:$PATH  # the benchmark's stack starts its own Redis with it
}

case "${1:-}" in
  --prepare) prepare; exit 0 ;;
  --cpu)
    shift
    OUTDIR=${OUT:-$(mktemp -d)}
    [[ "${1:-}" == "--out" ]] && OUTDIR=$2
    exec $PY -m bench.gpu_check --cpu --out "$OUTDIR"
    ;;
esac

# on the GPU machine
t0=$SECONDS
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || { echo "no GPU here" >&2; exit 3; }
install_carried
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
$PY - <<'PY'
import grpc, google.protobuf, torch
print("torch", torch.__version__, "cuda", torch.cuda.is_available(), torch.cuda.get_device_name(0))
print("grpcio", grpc.__version__, "protobuf", google.protobuf.__version__)
assert torch.cuda.is_available(), "torch sees no CUDA device"
PY
OUTDIR=${OUT:-bench/results/gpu}
mkdir -p "$OUTDIR"
set +e
timeout 330 $PY -m bench.gpu_check --out "$OUTDIR" "$@" 2>&1 | tee "$OUTDIR/gpu_check.log"
rc=${PIPESTATUS[0]}
set -e
echo "device_check: bench.gpu_check exited $rc after $((SECONDS - t0)) s"
[[ -f $OUTDIR/gpu_check.md ]] && tail -n 60 "$OUTDIR/gpu_check.md"
exit "$rc"
