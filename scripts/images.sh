#!/usr/bin/env bash
# Build the images docker-compose.yml runs, with podman (or Docker), on any machine: docs/containers.md.
#
#   bash scripts/images.sh            # then: bash scripts/compose.sh up   (or podman-compose / docker compose)
#
# 1. The Python base. SPECREC_BASE=registry: docker/Dockerfile's default, the official python image, pulled.
#    SPECREC_BASE=debian: built here from Debian's packages (debootstrap --variant=minbase with python3,
#    python3-venv and ca-certificates, then `podman import`), for a machine that cannot pull from a registry;
#    its root file system is kept in the cache, keyed by what made it (suite, mirror, packages, month), so
#    later runs import it in seconds. SPECREC_BASE=auto (the default): the registry's when it can be pulled
#    (or is here already), else Debian's.
# 2. Redis: with the Debian base, docker/Dockerfile.redis (Debian's redis-server) on that base, since
#    compose's default redis:7 image cannot be pulled either.
# 3. The SpecRec image (docker/Dockerfile). podman: first a wheelhouse, every wheel the build installs, fetched
#    by this machine's pip configuration (its config files and PIP_* variables merged into one PIP_CONFIG_FILE,
#    the certificate, wheel directories and file:// indexes it names mounted read-only at the same paths) from a
#    container of the base, on the host's network; kept in the cache by what decides its content (the base,
#    docker/constraints.txt, the torch version); the build then installs from it alone (--no-index). Docker: the
#    PIP_INDEX_URL / PIP_EXTRA_INDEX_URL / PIP_FIND_LINKS / PIP_TRUSTED_HOST variables as build arguments. The
#    image is tagged by the hash of what goes into it (the files the Dockerfile copies, the base image, the build
#    arguments) and reused while that hash is unchanged; then tagged $SPECREC_IMAGE.
#
# Writes the names of the images it made to runs/images.env (SPECREC_IMAGE, SPECREC_REDIS_IMAGE), which
# scripts/compose.sh reads.
#
# Environment: SPECREC_ENGINE (podman | docker), SPECREC_BASE (auto | registry | debian), SPECREC_IMAGE
# (default specrec:0.3.0), SPECREC_IMAGES_CACHE (default /var/cache/specrec, else ~/.cache/specrec),
# SPECREC_DEBIAN_MIRROR (default http://deb.debian.org/debian), SPECREC_PULL_TIMEOUT_S (default 60),
# SPECREC_TORCH_INDEX_URL (where the +cpu torch wheel comes from when pip's configuration has none; default
# PyTorch's CPU index).
set -euo pipefail
cd "$(dirname "$0")/.."
. scripts/engine-env.sh

REGISTRY_PYTHON=docker.io/library/python:3.11.13-slim-bookworm
SUITE=bookworm
MIRROR=${SPECREC_DEBIAN_MIRROR:-http://deb.debian.org/debian}
PACKAGES=python3,python3-venv,ca-certificates
IMAGE=${SPECREC_IMAGE:-specrec:0.3.0}
BASE=${SPECREC_BASE:-auto}
say() { printf '[images] %s\n' "$*" >&2; }
t0=$SECONDS

have_image() { "$ENGINE" image inspect "$1" >/dev/null 2>&1; }

# ------------------------------------------------------------------- 1. the Python base
python_image=""
redis_image=""
if [[ $BASE == registry || $BASE == auto ]]; then
  if have_image "$REGISTRY_PYTHON"; then
    python_image=$REGISTRY_PYTHON
  elif timeout "${SPECREC_PULL_TIMEOUT_S:-60}" "$ENGINE" pull -q "$REGISTRY_PYTHON" >/dev/null 2>&1; then
    python_image=$REGISTRY_PYTHON
  elif [[ $BASE == registry ]]; then
    say "cannot pull $REGISTRY_PYTHON (SPECREC_BASE=debian builds one from Debian's packages)"; exit 1
  else
    say "cannot pull $REGISTRY_PYTHON: building the base from Debian's packages"
  fi
fi
if [[ -z $python_image ]]; then
  [[ $ENGINE == podman ]] || { say "the Debian base is imported with podman (SPECREC_ENGINE=podman)"; exit 1; }
  key=$(printf '%s\n' "$SUITE" minbase "$PACKAGES" "$MIRROR" "$(date -u +%Y-%m)" | sha256sum | cut -c1-12)
  python_image=localhost/specrec-python:$SUITE-$key
  rootfs_tar=$IMAGES_CACHE/rootfs-$SUITE-$key.tar.gz
  if ! have_image "$python_image"; then
    if [[ ! -s $rootfs_tar ]]; then
      command -v debootstrap >/dev/null 2>&1 || { say "no debootstrap: apt-get install debootstrap"; exit 1; }
      [[ $(id -u) -eq 0 ]] || { say "debootstrap needs root"; exit 1; }
      say "debootstrap --variant=minbase --include=$PACKAGES $SUITE ($MIRROR) ..."
      tmp=$(mktemp -d "${TMPDIR:-/tmp}/specrec-rootfs.XXXXXX")
      trap 'rm -rf "$tmp"' EXIT
      debootstrap --variant=minbase --include="$PACKAGES" "$SUITE" "$tmp/root" "$MIRROR" > "$tmp/log" 2>&1 \
        || { tail -20 "$tmp/log" >&2; exit 1; }
      # the downloaded packages and the package lists: not part of an image (apt-get update fetches them again)
      rm -rf "$tmp"/root/var/cache/apt/archives/*.deb "$tmp"/root/var/lib/apt/lists/*
      tar --numeric-owner -C "$tmp/root" -cf - . | gzip -1 > "$tmp/rootfs.tar.gz"
      mv "$tmp/rootfs.tar.gz" "$rootfs_tar"
      rm -rf "$tmp"; trap - EXIT
      say "root file system: $rootfs_tar ($((SECONDS - t0)) s)"
    fi
    podman import -q --change 'CMD ["/bin/bash"]' --change 'ENV LANG=C.UTF-8' "$rootfs_tar" "$python_image" >/dev/null
    say "imported $python_image"
  fi
  # ------------------------------------------------------------- 2. Redis on the same base
  rkey=$( { printf '%s\n' "$python_image"; cat docker/Dockerfile.redis; } | sha256sum | cut -c1-12)
  redis_image=localhost/specrec-redis:$SUITE-$rkey
  if ! have_image "$redis_image"; then
    say "building $redis_image (Debian's redis-server)"
    podman build -q --network host --build-arg BASE_IMAGE="$python_image" -f docker/Dockerfile.redis \
      -t "$redis_image" docker >/dev/null
  fi
fi

# ------------------------------------------------------------------- 3. the SpecRec image
torch_version=$(sed -n 's/^ARG TORCH_VERSION=//p' docker/Dockerfile)
build=(--build-arg "PYTHON_IMAGE=$python_image")
mounts=()
if [[ $ENGINE == podman ]]; then
  # this machine's pip configuration, merged (files and PIP_* variables, as `pip config list` shows them), as
  # one file; the local paths it names are mounted at the same place
  pipconf_dir=$IMAGES_CACHE/pip-config
  mkdir -p "$pipconf_dir"
  python3 - "$pipconf_dir/pip.conf" > "$pipconf_dir/mounts" <<'PY'
import ast, os, subprocess, sys
out = subprocess.run([sys.executable, "-m", "pip", "config", "list"], capture_output=True, text=True).stdout
if not out.strip() and os.path.exists(".venv/bin/python"):  # a python3 without pip: the venv's
    out = subprocess.run([".venv/bin/python", "-m", "pip", "config", "list"], capture_output=True, text=True).stdout
settings: dict[str, str] = {}
for line in out.splitlines():  # section.key='value'; files first, then ":env:." (the variables win)
    key, _, value = line.partition("=")
    section, _, name = key.rpartition(".")
    if section in ("global", "install", "download", ":env:") and name not in (
            "cache-dir", "no-cache-dir", "user", "target", "prefix", "root", "require-virtualenv"):
        settings[name] = ast.literal_eval(value)
with open(sys.argv[1], "w") as f:
    f.write("[global]\n" + "".join(f"{k} = {v}\n" for k, v in sorted(settings.items())))
paths = set()
for name in ("cert", "client-cert", "find-links", "index-url", "extra-index-url", "constraint", "requirement"):
    for word in settings.get(name, "").split():
        p = word.removeprefix("file://").rstrip("/")
        if not (p.startswith("/") and os.path.exists(p)):
            continue
        if name.endswith("index-url") and os.path.dirname(p) != "/":
            p = os.path.dirname(p)  # a file:// index's pages may link to files beside it (../../files/...)
        paths.add(p)
print("\n".join(sorted(paths)))
PY
  hostpip=(-v "$pipconf_dir/pip.conf:/etc/specrec-pip.conf:ro")
  while IFS= read -r p; do
    [[ -n $p ]] && hostpip+=(-v "$p:$p:ro")
  done < "$pipconf_dir/mounts"

  # The wheelhouse: every wheel the build installs, fetched once by that configuration from a container of
  # the base (its Python and platform), kept in the cache by what decides its content; the build then installs
  # from it alone (--no-index). (pip's own HTTP cache would do where the index's responses allow caching; here
  # they did not.) torch: the +cpu wheel where the configuration finds one, else from PyTorch's CPU index.
  build_requires=$(python3 -c 'import tomllib; print(" ".join(tomllib.load(open("pyproject.toml", "rb"))["build-system"]["requires"]))')
  wkey=$( { "$ENGINE" image inspect --format '{{.Id}}' "$python_image"; cat docker/constraints.txt;
            echo "$build_requires $torch_version ${SPECREC_TORCH_INDEX_URL-}"; } | sha256sum | cut -c1-16)
  wheels=$IMAGES_CACHE/wheels/$wkey
  if [[ ! -f $wheels/.complete ]]; then
    say "filling the wheelhouse $wheels"
    rm -rf "$wheels"; mkdir -p "$wheels"
    w0=$SECONDS
    # shellcheck disable=SC2016  # expanded in the container
    if podman run --rm --network host "${hostpip[@]}" -v "$wheels:/wheels" \
        -v "$PWD/docker/constraints.txt:/ctx/constraints.txt:ro" -e PIP_CONFIG_FILE=/etc/specrec-pip.conf \
        -e PIP_DISABLE_PIP_VERSION_CHECK=1 -e TV="$torch_version" -e BR="$build_requires" \
        -e TI="${SPECREC_TORCH_INDEX_URL-https://download.pytorch.org/whl/cpu}" "$python_image" sh -ec '
          python3 -m venv /tmp/v
          grep -v -i "^torch==" /ctx/constraints.txt > /tmp/requirements.txt
          /tmp/v/bin/pip download -q -d /wheels -c /ctx/constraints.txt -r /tmp/requirements.txt $BR
          /tmp/v/bin/pip download -q --no-deps -d /wheels "torch==$TV+cpu" 2>/dev/null \
            || /tmp/v/bin/pip download -q --no-deps -d /wheels ${TI:+--extra-index-url "$TI"} "torch==$TV+cpu"' \
        2> >(grep -v "^WARNING: Location" >&2); then
      touch "$wheels/.complete"
      say "wheelhouse: $(find "$wheels" -name '*.whl' | wc -l) wheels, $(du -sh "$wheels" | cut -f1), $((SECONDS - w0)) s"
    else
      say "could not fetch every wheel: pip in the build uses this machine's configuration instead"
      rm -rf "$wheels"
    fi
  fi
  # wheelhouses unused for two weeks go
  find "$IMAGES_CACHE/wheels" -mindepth 1 -maxdepth 1 -type d -mtime +14 -exec rm -rf {} + 2>/dev/null || true
  if [[ -f $wheels/.complete ]]; then
    touch "$wheels"
    printf '[global]\nno-index = true\nfind-links = /wheels\n' > "$pipconf_dir/wheelhouse.conf"
    mounts+=(-v "$pipconf_dir/wheelhouse.conf:/etc/specrec-pip.conf:ro" -v "$wheels:/wheels:ro")
    torch_index=""
  else
    mounts+=("${hostpip[@]}")
    torch_index=${SPECREC_TORCH_INDEX_URL-https://download.pytorch.org/whl/cpu}
  fi
  build+=(--build-arg PIP_CONFIG_FILE=/etc/specrec-pip.conf)
else
  for v in PIP_INDEX_URL PIP_EXTRA_INDEX_URL PIP_FIND_LINKS PIP_TRUSTED_HOST; do
    [[ -n ${!v:-} ]] && build+=(--build-arg "$v=${!v}")
  done
  torch_index=${SPECREC_TORCH_INDEX_URL-https://download.pytorch.org/whl/cpu}
fi
build+=(--build-arg "TORCH_INDEX_URL=$torch_index")

# what goes into the image: the files the Dockerfile copies (as .dockerignore leaves them), the base, the arguments
base_id=$("$ENGINE" image inspect --format '{{.Id}}' "$python_image")
context_hash() {
  python3 - "$@" <<'PY'
import hashlib, pathlib, re, sys
h = hashlib.sha256("\0".join(sys.argv[1:]).encode())
text = pathlib.Path("docker/Dockerfile").read_text()
h.update(text.encode())
skip = re.compile(r"(^|/)(__pycache__|\.pytest_cache)(/|$)|\.py[co]$|^specrec_rpc/v1/|^bundles/[^/]+/onnx/|\.onnx$")
for src in sorted(set(re.findall(r"^COPY (?!--from)(\S+) ", text, re.M))):
    root = pathlib.Path(src)
    for p in sorted([root] if root.is_file() else [q for q in root.rglob("*") if q.is_file()]):
        if not skip.search(p.as_posix()):
            h.update(p.as_posix().encode() + b"\0" + p.read_bytes())
print(h.hexdigest()[:16])
PY
}
ctx=$(context_hash "$base_id" "${build[@]}")
hashed=localhost/specrec:ctx-$ctx
if have_image "$hashed"; then
  say "$hashed is built already (the same files, base and arguments)"
else
  say "building $hashed from $python_image (torch from ${torch_index:-the index or wheels pip is configured with here})"
  b0=$SECONDS
  if [[ $ENGINE == podman ]]; then
    podman build --network host --layers "${mounts[@]}" "${build[@]}" -f docker/Dockerfile -t "$hashed" .
  else
    docker build --network host "${build[@]}" -f docker/Dockerfile -t "$hashed" .
  fi
  say "built in $((SECONDS - b0)) s"
fi
"$ENGINE" tag "$hashed" "$IMAGE"
# the three newest hashed images stay (a branch switched back reuses them); older ones lose their tag, and their
# own layers go unless a newer build reuses them (the build cache keeps the layers they share)
"$ENGINE" images --format '{{.CreatedAt}} {{.Repository}}:{{.Tag}}' localhost/specrec 2>/dev/null \
  | grep ':ctx-' | sort -r | tail -n +4 | awk '{print $NF}' | xargs -r "$ENGINE" rmi >/dev/null 2>&1 || true

mkdir -p runs
{
  echo "SPECREC_IMAGE=$IMAGE"
  [[ -n $redis_image ]] && echo "SPECREC_REDIS_IMAGE=$redis_image"
  true
} > runs/images.env
say "ready in $((SECONDS - t0)) s: $(tr '\n' ' ' < runs/images.env)"
