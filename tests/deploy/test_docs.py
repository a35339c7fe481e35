"""The documentation as a reader meets it: docs/settings.md's settings tables are generated from the services'
settings classes; no Markdown file of the repository links to a file or a heading that is not there; the README
and every page under docs/ stay short enough to read (issue 68: the README at most 10 KB, a page at most 30 KB)."""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPTS = ROOT / "scripts"
README_MAX, PAGE_MAX = 10_000, 30_000  # bytes
#: folders that hold no documentation of ours (environments, caches, build and run outputs)
SKIP = {".git", ".venv", "venv", "node_modules", "runs", "build", "dist", ".pytest_cache", ".mypy_cache",
        ".ruff_cache", ".hypothesis"}


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
    assert settings_doc.DOC == ROOT / "docs" / "settings.md"
    text = settings_doc.DOC.read_text()
    assert settings_doc.render(text) == text, "run: python scripts/settings_doc.py"
    for cls in (c for _, c, _ in settings_doc._classes()):
        for name in cls.model_fields:
            assert f"`{name}`" in text, f"{cls.__name__}.{name} missing from docs/settings.md"


def markdown_files(root: Path) -> list[Path]:
    """Every Markdown file under ``root``, outside the folders of :data:`SKIP` and ``*.egg-info``."""
    return sorted(p for p in root.rglob("*.md")
                  if not any(part in SKIP or part.endswith(".egg-info") for part in p.relative_to(root).parts))


def _prose(text: str) -> str:
    """``text`` without fenced code blocks and inline code spans (their brackets are code, not links)."""
    text = re.sub(r"^(```|~~~).*?^\1[^\n]*$", "", text, flags=re.S | re.M)
    return re.sub(r"`[^`\n]*`", "", text)


def anchors(text: str) -> set[str]:
    """The anchors GitHub makes for a Markdown file: each heading's slug (lower case, punctuation but ``-`` and
    ``_`` dropped, spaces as ``-``; a repeated one gets ``-1``, ``-2``, ...), and explicit ``id=`` / ``name=``."""
    out: set[str] = set()
    seen: dict[str, int] = {}
    for line in re.sub(r"^(```|~~~).*?^\1[^\n]*$", "", text, flags=re.S | re.M).splitlines():
        m = re.match(r"^#{1,6}\s+(.*?)\s*#*\s*$", line)
        if not m:
            continue
        title = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", m.group(1))  # a link in a heading: its text
        slug = re.sub(r"[^\w\- ]", "", title.strip().lower()).replace(" ", "-")
        n = seen.get(slug, 0)
        seen[slug] = n + 1
        out.add(slug if n == 0 else f"{slug}-{n}")
    out.update(re.findall(r"""<a\s[^>]*(?:id|name)=["']([^"']+)["']""", text))
    return out


def broken_links(root: Path, files: list[Path]) -> list[str]:
    """Each relative link or image of ``files`` whose file (or folder) is not under ``root``, or whose
    ``#anchor`` is not a heading of the Markdown file it names: ``file: target (why)``."""
    cache: dict[Path, set[str]] = {}
    bad = []
    for md in files:
        text = md.read_text()
        prose = _prose(text)
        targets = re.findall(r"!?\[[^\]]*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)", prose)
        targets += re.findall(r"^\s*\[[^\]]+\]:\s*<?(\S+?)>?(?:\s+\"[^\"]*\")?\s*$", prose, flags=re.M)
        for target in targets:
            if re.match(r"^[a-z][a-z0-9+.-]*:", target, flags=re.I):  # http:, https:, mailto:, ...
                continue
            path, _, anchor = target.partition("#")
            dest = (md.parent / path).resolve() if path else md
            where = f"{md.relative_to(root)}: {target}"
            if not dest.is_relative_to(root.resolve()):
                bad.append(f"{where} (outside the repository)")
            elif not dest.exists():
                bad.append(f"{where} (no such file)")
            elif anchor and dest.suffix == ".md":
                if dest not in cache:
                    cache[dest] = anchors(dest.read_text())
                if anchor not in cache[dest]:
                    bad.append(f"{where} (no heading #{anchor})")
    return bad


def test_no_broken_relative_link_in_any_markdown_file():
    files = markdown_files(ROOT)
    assert ROOT / "README.md" in files and ROOT / "docs" / "README.md" in files
    assert broken_links(ROOT, files) == []


def test_broken_links_can_fail(tmp_path):
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "page.md").write_text("# A page\n\n## Two words: `code`\n\ntext\n")
    (tmp_path / "README.md").write_text(
        "[ok](docs/page.md) [ok](docs/page.md#two-words-code) [ok](#top) ![ok](docs/)\n"
        "[gone](docs/gone.md) [no heading](docs/page.md#nothing) ![no image](docs/x.png) [up](../elsewhere.md)\n"
        "`[code](not/a/link.md)` [web](https://example.com/x)\n\n# Top\n\n```\n[fenced](nor/this.md)\n```\n")
    assert broken_links(tmp_path, markdown_files(tmp_path)) == [
        "README.md: docs/gone.md (no such file)", "README.md: docs/page.md#nothing (no heading #nothing)",
        "README.md: docs/x.png (no such file)", "README.md: ../elsewhere.md (outside the repository)"]


def test_anchors_follow_github():
    text = "# Upgrading to 0.3: content fingerprints\n## Processes: several on one port\n## Notes\n## Notes\n"
    assert anchors(text) == {"upgrading-to-03-content-fingerprints", "processes-several-on-one-port", "notes",
                             "notes-1"}


def too_big(root: Path) -> list[str]:
    """The README over :data:`README_MAX` bytes and each page under docs/ over :data:`PAGE_MAX`."""
    sizes = [(root / "README.md", README_MAX)] + [(p, PAGE_MAX) for p in sorted((root / "docs").rglob("*.md"))]
    return [f"{p.relative_to(root)}: {p.stat().st_size} bytes (at most {limit})" for p, limit in sizes
            if p.stat().st_size > limit]


def test_the_readme_and_every_docs_page_stay_short():
    assert too_big(ROOT) == []


def test_too_big_can_fail(tmp_path):
    (tmp_path / "docs").mkdir()
    (tmp_path / "README.md").write_text("x" * README_MAX)
    (tmp_path / "docs" / "a.md").write_text("y" * PAGE_MAX)
    assert too_big(tmp_path) == []
    (tmp_path / "README.md").write_text("x" * (README_MAX + 1))
    (tmp_path / "docs" / "a.md").write_text("y" * (PAGE_MAX + 1))
    assert too_big(tmp_path) == [f"README.md: {README_MAX + 1} bytes (at most {README_MAX})",
                                 f"docs/a.md: {PAGE_MAX + 1} bytes (at most {PAGE_MAX})"]
