"""The generated gRPC code (specrec_rpc/v1, git-ignored) matches protos/ and staleness is detected."""

import shutil

import pytest

from specrec_rpc import codegen


@pytest.fixture(scope="module")
def fresh_copy(tmp_path_factory):
    """A copy of the generated package to damage (never the real files)."""
    out = tmp_path_factory.mktemp("gen") / "v1"
    shutil.copytree(codegen.OUT, out)
    return out


def test_generated_code_is_current():
    assert codegen.OUT.exists(), "run python -m specrec_rpc.codegen"
    assert codegen.check() == []


def test_copy_is_current(fresh_copy):
    assert codegen.check(out=fresh_copy) == []


def test_modified_file_is_stale(fresh_copy, tmp_path):
    out = tmp_path / "v1"
    shutil.copytree(fresh_copy, out)
    f = out / "itemset_pb2.py"
    f.write_text(f.read_text() + "\n# edited by hand\n")
    assert codegen.check(out=out) == ["itemset_pb2.py"]


def test_missing_and_extra_files_are_stale(fresh_copy, tmp_path):
    out = tmp_path / "v1"
    shutil.copytree(fresh_copy, out)
    (out / "common_pb2.pyi").unlink()
    (out / "old_service_pb2.py").write_text("# left over from a removed proto\n")
    assert sorted(codegen.check(out=out)) == ["common_pb2.pyi", "old_service_pb2.py"]


def test_changed_proto_makes_code_stale(fresh_copy, tmp_path, monkeypatch):
    protos = tmp_path / "protos"
    shutil.copytree(codegen.PROTO_ROOT, protos)
    p = protos / "specrec" / "v1" / "itemset.proto"
    p.write_text(
        p.read_text().replace("message GetVersionRequest {}", "message GetVersionRequest { bool verbose = 1; }")
    )
    monkeypatch.setattr(codegen, "PROTO_ROOT", protos)
    monkeypatch.setattr(codegen, "PROTO_DIR", protos / "specrec" / "v1")
    assert "itemset_pb2.py" in codegen.check(out=fresh_copy)
