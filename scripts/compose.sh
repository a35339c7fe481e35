#!/usr/bin/env bash
# docker-compose.yml's stack, started and stopped in one command with podman (podman-compose) or Docker
# (docker compose): docs/containers.md.
#
#   bash scripts/compose.sh up      # the images (scripts/images.sh: built, or reused while nothing that goes into
#                                   # them changed), then Redis, the catalogue loader and the four services, each
#                                   # started once what it depends on is healthy / has completed, as the file's
#                                   # depends_on says; every health check run until it passes (SERVING); then
#                                   # one Recommend through the gateway
#   bash scripts/compose.sh ps
#   bash scripts/compose.sh stop    # stop each container with its stop_grace_period, the gateway first
#   bash scripts/compose.sh down    # stop, then remove the containers and the network; `down -v`: the Redis volume too
#
# Why not a bare `podman-compose up -d`: podman-compose 1.0 (Debian 12) starts every container at once and
# ignores depends_on's conditions, and podman schedules health checks with systemd timers, so without systemd
# (a container, a CI runner) no health check ever runs and every service stays "starting". This script runs
# the checks itself (`podman healthcheck run`, the compose file's own test) and starts in the file's order.
# Docker: `docker compose up -d --wait` does all of it.
#
# Environment: docker-compose.yml's variables (SPECREC_GATEWAY_PORT, SPECREC_ITEMSET_WRITE_TOKEN, ...; those
# runs/images.env names, from scripts/images.sh, unless already set), scripts/images.sh's,
# SPECREC_COMPOSE_PROJECT (default: this directory's name, as compose's own), SPECREC_COMPOSE_FILES (more
# compose files, space-separated, after docker-compose.yml), SPECREC_SKIP_IMAGES=1 (use the images as they are).
set -euo pipefail
cd "$(dirname "$0")/.."
. scripts/engine-env.sh

action=${1:-up}
shift || true
PROJECT=${SPECREC_COMPOSE_PROJECT:-$(basename "$PWD")}
files=(docker-compose.yml)
for f in ${SPECREC_COMPOSE_FILES:-}; do files+=("$f"); done
fargs=()
for f in "${files[@]}"; do fargs+=(-f "$f"); done
say() { printf '[compose] %s\n' "$*" >&2; }

if [[ $ENGINE == podman ]]; then
  command -v podman-compose >/dev/null 2>&1 || { say "no podman-compose: apt-get install podman-compose"; exit 1; }
  compose=(podman-compose -p "$PROJECT" "${fargs[@]}")
elif docker compose version >/dev/null 2>&1; then
  compose=(docker compose -p "$PROJECT" "${fargs[@]}")
else
  compose=(docker-compose -p "$PROJECT" "${fargs[@]}")
fi

if [[ -f runs/images.env ]]; then  # the images scripts/images.sh made, unless the caller names others
  while IFS='=' read -r k v; do
    [[ -n $k && -z ${!k:-} ]] && export "$k=$v"
  done < runs/images.env
fi

container() {  # the container of service $1
  "$ENGINE" ps -a --filter "label=com.docker.compose.project=$PROJECT" \
    --filter "label=com.docker.compose.service=$1" --format '{{.Names}}' | head -1
}

wait_done() {  # service $1 ran to completion with exit 0
  local c rc
  c=$(container "$1")
  rc=$("$ENGINE" wait "$c" | tail -1)
  if [[ $rc != 0 ]]; then
    say "$1 exited with $rc:"; "$ENGINE" logs --tail 30 "$c" >&2; exit 1
  fi
  say "$1 completed"
}

wait_healthy() {  # service $1's health check passes (run here: podman without systemd schedules none), within $2 s
  local c t0=$SECONDS state
  c=$(container "$1")
  while true; do
    if [[ $ENGINE == podman ]]; then
      podman healthcheck run "$c" >/dev/null 2>&1 && break
    else
      [[ $(docker inspect --format '{{.State.Health.Status}}' "$c") == healthy ]] && break
    fi
    state=$("$ENGINE" inspect --format '{{.State.Status}}' "$c")
    if [[ $state != running ]] || ((SECONDS - t0 > $2)); then
      say "$1 is not healthy after $((SECONDS - t0)) s ($state):"; "$ENGINE" logs --tail 30 "$c" >&2; exit 1
    fi
    sleep 2
  done
  say "$1 healthy ($((SECONDS - t0)) s)"
}

# the compose file's services in start order: name, what it depends on (service:condition,...), whether it has a
# health check, and how long one may take to pass (start_period + interval x retries)
plan() {
  python3 - "${files[@]}" <<'PY'
import re, sys
import yaml

def merge(a, b):
    if isinstance(a, dict) and isinstance(b, dict):
        return {**a, **{k: merge(a.get(k), v) if k in a else v for k, v in b.items()}}
    return b

def seconds(d, default):
    parts = re.findall(r"(\d+(?:\.\d+)?)(h|ms|m|s|us)", str(d or ""))
    return sum(float(n) * {"h": 3600, "m": 60, "s": 1, "ms": 1e-3, "us": 1e-6}[u] for n, u in parts) or default

cfg = {}
for f in sys.argv[1:]:
    cfg = merge(cfg, yaml.safe_load(open(f)))
svcs = cfg["services"]
deps = {s: (v.get("depends_on") or {}) for s, v in svcs.items()}
deps = {s: ({d: {"condition": "service_started"} for d in x} if isinstance(x, list) else x) for s, x in deps.items()}
order, seen = [], set()
def visit(s):
    if s not in seen:
        seen.add(s)
        for d in deps[s]:
            visit(d)
        order.append(s)
for s in svcs:
    visit(s)
for s in order:
    hc = svcs[s].get("healthcheck") or {}
    wait = seconds(hc.get("start_period"), 0) + seconds(hc.get("interval"), 30) * int(hc.get("retries", 3))
    on = ",".join(f"{d}:{c['condition']}" for d, c in deps[s].items())
    grace = seconds(svcs[s].get("stop_grace_period"), 10)
    print(s, on or "-", "yes" if hc.get("test") and not hc.get("disable") else "no", int(wait), int(grace))
PY
}
grace() { printf '%s\n' "${steps[@]}" | awk -v s="$1" '$1 == s {print $5}'; }

log=runs/compose-$PROJECT.log
mkdir -p runs

case $action in
  up)
    t0=$SECONDS
    [[ ${SPECREC_SKIP_IMAGES:-} == 1 ]] || bash scripts/images.sh < /dev/null
    while IFS='=' read -r k v; do export "$k=$v"; done < runs/images.env
    if [[ $ENGINE != podman ]]; then
      "${compose[@]}" up -d --no-build --wait "$@"
    else
      declare -A done_=()
      mapfile -t steps < <(plan)
      # podman-compose makes the containers (its translation of the file: what its users get) and the network;
      # they are started here, in order (its own `up` starts every one at once, and takes --no-deps for nothing)
      # (podman's output goes to a file: conmon and aardvark-dns, which stay, would hold a pipe open)
      "${compose[@]}" up --no-start --no-build "$@" > "$log" 2>&1 || { cat "$log" >&2; exit 1; }
      grep -e '^Error' "$log" | grep -v -e 'no such volume' -e 'already in use' >&2 || true
      for step in "${steps[@]}"; do
        read -r svc on _ <<< "$step"
        if [[ $on != - ]]; then
          for dc in ${on//,/ }; do
            dep=${dc%%:*} cond=${dc#*:}
            [[ -n ${done_[$dep]:-} ]] && continue
            case $cond in
              service_healthy)
                wait_healthy "$dep" "$(printf '%s\n' "${steps[@]}" | awk -v s="$dep" '$1 == s {print $4}')" ;;
              service_completed_successfully) wait_done "$dep" ;;
            esac
            [[ $cond == service_started ]] || done_[$dep]=1
          done
        fi
        say "starting $svc"
        podman start "$(container "$svc")" > "$log" 2>&1 || { cat "$log" >&2; exit 1; }
      done
      for step in "${steps[@]}"; do  # and every health check passes, whatever depends on it
        read -r svc _ health wait _ <<< "$step"
        [[ $health == yes && -z ${done_[$svc]:-} ]] && wait_healthy "$svc" "$wait" && done_[$svc]=1
      done
    fi
    say "up in $((SECONDS - t0)) s"
    "$ENGINE" exec "$(container gateway)" specrec recommend --target 127.0.0.1:50050 \
      --history "${SPECREC_DEMO_HISTORY:-1258,1259,1260}" --k 5
    ;;
  ps)
    "${compose[@]}" ps ;;
  stop|down)
    # podman-compose 1.0 stops every container with 1 s of grace: here each gets its stop_grace_period (the
    # services finish their in-flight requests), the gateway first, Redis last
    if [[ $ENGINE == podman ]]; then
      mapfile -t steps < <(plan)
      for ((i = ${#steps[@]} - 1; i >= 0; i--)); do
        read -r svc _ <<< "${steps[$i]}"
        c=$(container "$svc")
        [[ -n $c ]] && podman stop -t "$(grace "$svc")" "$c" > "$log" 2>&1
      done
    fi
    [[ $action == stop ]] && { [[ $ENGINE == podman ]] || "${compose[@]}" stop; say "stopped"; exit 0; }
    "${compose[@]}" down "$@" > /dev/null 2>&1 || true
    if [[ $ENGINE == podman ]]; then  # podman-compose 1.0 leaves its network
      "$ENGINE" network rm "${PROJECT}_default" >/dev/null 2>&1 || true
    fi
    left=$("$ENGINE" ps -a --filter "label=com.docker.compose.project=$PROJECT" --format '{{.Names}}')
    [[ -z $left ]] || { say "still here: $left"; exit 1; }
    say "down" ;;
  *)
    echo "usage: bash scripts/compose.sh up|ps|stop|down [compose arguments]" >&2; exit 2 ;;
esac
