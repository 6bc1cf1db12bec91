"""The documentation holds together: every link and every cited page resolves inside the repository, nothing
points outside it, and the README stays short. Standard library only (no torch, no phalanx import)."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
README_MAX_LINES = 220
OUTSIDE = "../" + "shared"  # spelled in two pieces so that this file does not mention it itself

FENCE = re.compile(r"^(```|~~~).*?^\1[ \t]*$", re.S | re.M)
INLINE_CODE = re.compile(r"`[^`\n]*`")
LINK = re.compile(r"\[[^\]\n]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")
SCHEME = re.compile(r"^[A-Za-z][A-Za-z0-9+.-]*:")
DOCS_MENTION = re.compile(r"(?<![\w./-])docs/[\w.-]+\.md\b")
# A cited page in Python source: `docs/<name>.md`, or an upper-case `<NAME>.md`, with the folders before it.
CITED = re.compile(r"(?<![\w./-])((?:[\w.-]+/)*)([A-Z][A-Z0-9_]*\.md|(?<=docs/)[\w.-]+\.md)\b")
TEST_FILE = re.compile(r"(?<![\w./-])tests/[\w]+\.py\b")


def markdown_pages() -> list[Path]:
    return [README, *sorted((ROOT / "docs").glob("*.md"))]


def python_sources() -> list[Path]:
    files = []
    for top in ("src", "tests"):
        for path in sorted((ROOT / top).rglob("*.py")):
            parts = path.relative_to(ROOT).parts
            if "__pycache__" in parts or any(p.endswith(".egg-info") for p in parts):
                continue
            files.append(path)
    return files


def rel(path: Path) -> str:
    return path.relative_to(ROOT).as_posix()


def inside_repo(path: Path) -> bool:
    try:
        path.resolve().relative_to(ROOT)
    except ValueError:
        return False
    return True


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, code and link marks dropped, punctuation removed,
    spaces to hyphens."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading.strip())
    text = text.replace("`", "").lower()
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def anchors(page: Path) -> set[str]:
    seen: dict[str, int] = {}
    found = set()
    for line in FENCE.sub("", page.read_text(encoding="utf-8")).splitlines():
        m = re.match(r"^#{1,6}\s+(.*?)\s*#*\s*$", line)
        if not m:
            continue
        base = slug(m.group(1))
        n = seen.get(base, 0)
        seen[base] = n + 1
        found.add(base if n == 0 else f"{base}-{n}")
    return found


def test_markdown_links_resolve_inside_the_repository():
    bad = []
    for page in markdown_pages():
        text = INLINE_CODE.sub("", FENCE.sub("", page.read_text(encoding="utf-8")))
        for target in LINK.findall(text):
            if SCHEME.match(target):
                continue  # http(s), mailto: not ours to check
            path_part, _, fragment = target.partition("#")
            path_part = path_part.split("?", 1)[0]
            dest = (page.parent / path_part) if path_part else page
            if not inside_repo(dest):
                bad.append(f"{rel(page)}: link ({target}) points outside the repository")
            elif not dest.exists():
                bad.append(f"{rel(page)}: link ({target}) names a missing file {dest.resolve().relative_to(ROOT)}")
            elif fragment and dest.suffix == ".md" and fragment not in anchors(dest):
                bad.append(f"{rel(page)}: link ({target}) names no heading of {rel(dest.resolve())}")
    assert not bad, "\n".join(bad)


def test_docs_pages_named_in_markdown_exist():
    bad = []
    for page in markdown_pages():
        for name in DOCS_MENTION.findall(page.read_text(encoding="utf-8")):
            if not (ROOT / name).is_file():
                bad.append(f"{rel(page)}: mentions {name}, which does not exist")
    assert not bad, "\n".join(bad)


def test_pages_cited_in_source_exist():
    bad = []
    this = Path(__file__).resolve()
    for source in python_sources():
        if source.resolve() == this:
            continue
        for folders, name in CITED.findall(source.read_text(encoding="utf-8")):
            if folders:
                candidates = [ROOT / folders / name]
            else:
                candidates = [ROOT / "docs" / name, ROOT / name]
            if not any(inside_repo(c) and c.is_file() for c in candidates):
                bad.append(f"{rel(source)}: cites {folders}{name}, which is not in the repository")
    assert not bad, "\n".join(bad)


def test_test_files_cited_in_docs_and_source_exist():
    bad = []
    this = Path(__file__).resolve()
    for path in [*markdown_pages(), *python_sources()]:
        if path.resolve() == this:
            continue
        for name in TEST_FILE.findall(path.read_text(encoding="utf-8")):
            if not (ROOT / name).is_file():
                bad.append(f"{rel(path)}: cites {name}, which does not exist")
    assert not bad, "\n".join(bad)


def test_nothing_points_outside_the_repository():
    files = [README, *(ROOT / "docs").rglob("*"), *(ROOT / "src").rglob("*"), *(ROOT / "tests").rglob("*"),
             *(ROOT / "bench").glob("*.py"), *(ROOT / "examples").rglob("*"), *(ROOT / "scripts").rglob("*")]
    bad = []
    for path in files:
        parts = path.relative_to(ROOT).parts
        if not path.is_file() or "__pycache__" in parts or any(p.endswith(".egg-info") for p in parts):
            continue
        try:
            text = path.read_text(encoding="utf-8")
        except UnicodeDecodeError:
            continue  # not a text file
        for number, line in enumerate(text.splitlines(), 1):
            if OUTSIDE in line:
                bad.append(f"{rel(path)}:{number}: mentions {OUTSIDE}: {line.strip()}")
    assert not bad, "\n".join(bad)


def test_readme_is_short():
    lines = README.read_text(encoding="utf-8").count("\n")
    assert lines <= README_MAX_LINES, (
        f"README.md has {lines} lines, more than {README_MAX_LINES}: move detail into a page under docs/")
