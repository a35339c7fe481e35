"""docs/operations.md's settings tables are generated from the services' settings classes."""

from __future__ import annotations

import pytest


def test_settings_tables_are_up_to_date():
    pytest.importorskip("specrec_rpc.v1", reason="generated gRPC code missing (python -m specrec_rpc.codegen)")
    from specrec_rpc import settings_doc

    text = settings_doc.DOC.read_text()
    assert settings_doc.render(text) == text, "run: python -m specrec_rpc.settings_doc"
    for cls in (c for _, c, _ in settings_doc._classes()):
        for name in cls.model_fields:
            assert f"`{name}`" in text, f"{cls.__name__}.{name} missing from docs/operations.md"
