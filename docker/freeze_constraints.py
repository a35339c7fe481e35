"""Print docker/constraints.txt: the exact installed versions of the closure of
SpecRec's runtime dependencies (not the test or dev tools in the environment).

    python docker/freeze_constraints.py > docker/constraints.txt

Run it in an environment where ``pip install -e .`` has been done.
"""

from __future__ import annotations

import sys
from importlib.metadata import PackageNotFoundError, distribution

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

HEADER = """\
# Exact versions of SpecRec's runtime dependencies (the closure of
# pyproject.toml's [project.dependencies]) that the images install, so an
# image build resolves the same set we test with. Applied with
# `pip install -c docker/constraints.txt`: a constraint only pins a package
# that something asks for, so extra lines are harmless.
#
# Regenerate from a working environment (after changing dependencies):
#     python docker/freeze_constraints.py > docker/constraints.txt"""


def closure(root: str = "specrec") -> dict[str, str]:
    found: dict[str, str] = {}
    seen: set[tuple[str, tuple[str, ...]]] = set()

    def walk(req: Requirement) -> None:
        name = canonicalize_name(req.name)
        key = (name, tuple(sorted(req.extras)))
        if key in seen:
            return
        seen.add(key)
        try:
            dist = distribution(req.name)
        except PackageNotFoundError:
            print(f"warning: {req.name} is not installed", file=sys.stderr)
            return
        found[name] = dist.version
        for raw in dist.requires or []:
            sub = Requirement(raw)
            if sub.marker and not any(sub.marker.evaluate({"extra": e}) for e in (sorted(req.extras) or [""])):
                continue
            walk(sub)

    walk(Requirement(root))
    found.pop(canonicalize_name(root), None)
    return found


def main() -> int:
    print(HEADER)
    for name, version in sorted(closure().items()):
        print(f"{name}=={version}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
