"""docs/operations.md's settings tables are generated from the services' settings classes."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

SCRIPTS = Path(__file__).resolve().parents[2] / "scripts"


def _script(name: str):
    """A module of scripts/ (tools above the packages, not importable from them)."""
    spec = importlib.util.spec_from_file_location(name, SCRIPTS / f"{name}.py")
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_settings_tables_are_up_to_date():
    pytest.importorskip("specrec_rpc.v1", reason="generated gRPC code missing (python -m specrec_rpc.codegen)")
    settings_doc = _script("settings_doc")
    text = settings_doc.DOC.read_text()
    assert settings_doc.render(text) == text, "run: python scripts/settings_doc.py"
    for cls in (c for _, c, _ in settings_doc._classes()):
        for name in cls.model_fields:
            assert f"`{name}`" in text, f"{cls.__name__}.{name} missing from docs/operations.md"
