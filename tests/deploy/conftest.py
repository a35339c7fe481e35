"""The deployment tests' tools (:mod:`.tools`): the helm binary, the docker-compose command and podman, or a skip (a
developer's machine) or a failure (CI) saying what to install."""

from __future__ import annotations

import pytest

from . import tools


@pytest.fixture(scope="session")
def helm() -> str:
    binary = tools.helm()
    if binary is None:
        tools.missing(f"no helm binary: {tools.HELM_HINT}")
    return binary


@pytest.fixture(scope="session")
def compose() -> list[str]:
    cmd = tools.docker_compose()
    if cmd is None:
        tools.missing(f"no docker-compose: {tools.COMPOSE_HINT}")
    return cmd


@pytest.fixture(scope="session")
def podman() -> str:
    binary = tools.podman()
    if binary is None:
        tools.missing(f"no podman and podman-compose: {tools.PODMAN_HINT}")
    return binary
