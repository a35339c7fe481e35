# Sourced (not run) by scripts/images.sh, scripts/compose.sh and tests/deploy/test_compose_stack.py: picks the
# container engine and, for podman on a machine whose defaults cannot start a container, writes a
# containers.conf beside the image cache and exports CONTAINERS_CONF (what each setting is for: below).
#
# Sets: ENGINE (podman or docker: $SPECREC_ENGINE, else podman when installed), IMAGES_CACHE (the base
# images' root file systems, pip's cache, that containers.conf: $SPECREC_IMAGES_CACHE, else /var/cache/specrec
# when writable, else ~/.cache/specrec), and for podman maybe CONTAINERS_CONF.

ENGINE=${SPECREC_ENGINE:-}
if [[ -z $ENGINE ]]; then
  if command -v podman >/dev/null 2>&1; then ENGINE=podman; else ENGINE=docker; fi
fi
if [[ -n ${SPECREC_IMAGES_CACHE:-} ]]; then
  IMAGES_CACHE=$SPECREC_IMAGES_CACHE
elif mkdir -p /var/cache/specrec 2>/dev/null && [[ -w /var/cache/specrec ]]; then
  IMAGES_CACHE=/var/cache/specrec
else
  IMAGES_CACHE=${XDG_CACHE_HOME:-$HOME/.cache}/specrec
fi
mkdir -p "$IMAGES_CACHE"

# podman's defaults that fail on some machines (a user's own CONTAINERS_CONF is left alone):
# - root podman raises every container's open-files limit to 1048576; where the engine may not raise the hard
#   limit (no CAP_SYS_RESOURCE: a container or VM sandbox) runc fails with "error setting rlimit type 7:
#   operation not permitted": default_ulimits = [] keeps the caller's limits;
# - crun (podman's first choice) refuses a hybrid cgroup v1/v2 hierarchy: runc, where it is installed;
# - without systemd as PID 1 there is no systemd cgroup manager: cgroupfs;
# - compose's services find each other by name. aardvark-dns before 1.11 (netavark's DNS; Debian 12 has 1.4)
#   drops lookups while podman reloads it, which it does whenever a container on the network starts or stops: a
#   service then waited up to 40 s for a name (containers/aardvark-dns#389; here an item set outlived its stop
#   grace period, SIGKILL, in 2 of 10 runs of tests/deploy/test_compose_stack.py, and 0 of 8 with CNI): the CNI
#   backend with its dnsname plugin (dnsmasq) where that is installed; netavark where CNI has no dnsname plugin
#   (no names at all).
if [[ $ENGINE == podman && -z ${CONTAINERS_CONF:-} ]]; then
  _containers="" _engine="" _network=""
  if [[ $(id -u) -eq 0 ]] && ! python3 -c 'import resource as r; r.setrlimit(r.RLIMIT_NOFILE, (1048576, 1048576))' \
      2>/dev/null; then
    _containers+=$'default_ulimits = []\n'
  fi
  _info=$(podman info --format '{{.Host.CgroupsVersion}} {{.Host.NetworkBackend}}' 2>/dev/null || true)
  if [[ $_info == v1* ]] && command -v runc >/dev/null 2>&1; then
    _engine+=$'runtime = "runc"\n'
  fi
  if [[ ! -d /run/systemd/system ]]; then
    _engine+=$'cgroup_manager = "cgroupfs"\nevents_logger = "file"\n'
  fi
  _dnsname=""
  for _d in /usr/lib/cni /usr/libexec/cni /opt/cni/bin; do [[ -x $_d/dnsname ]] && _dnsname=yes; done
  _aardvark=$( { /usr/libexec/podman/aardvark-dns --version || /usr/lib/podman/aardvark-dns --version; } 2>/dev/null \
    | grep -o '[0-9][0-9.]*' | head -1)
  if [[ $_info == *netavark* && -n $_dnsname ]] && [[ $(printf '%s\n' "${_aardvark:-0}" 1.11 | sort -V | head -1) != 1.11 ]]; then
    _network+=$'network_backend = "cni"\n'
  elif [[ $_info == *cni* && -z $_dnsname ]] && [[ -x /usr/lib/podman/netavark || -x /usr/libexec/podman/netavark ]]; then
    _network+=$'network_backend = "netavark"\n'
  fi
  if [[ -n $_containers$_engine$_network ]]; then
    _conf="# written by scripts/engine-env.sh: podman's defaults that fail on this machine\n"
    [[ -n $_containers ]] && _conf+="[containers]\n$_containers"
    [[ -n $_engine ]] && _conf+="[engine]\n$_engine"
    [[ -n $_network ]] && _conf+="[network]\n$_network"
    _conf=$(printf '%b' "$_conf")
    _file="$IMAGES_CACHE/containers-$(printf '%s' "$_conf" | sha256sum | cut -c1-12).conf"
    [[ -f $_file ]] || printf '%s\n' "$_conf" > "$_file"
    export CONTAINERS_CONF=$_file
  fi
  unset _containers _engine _network _info _conf _file _dnsname _aardvark _d
fi
export ENGINE IMAGES_CACHE
