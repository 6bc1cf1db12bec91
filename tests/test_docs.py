"""The documentation holds together: every link, every cited page and every repository path the pages and the
docstrings cite resolve inside the repository, nothing points outside it, the cli's docstring lists every command,
and the README stays short. Standard library only (no torch, no phalanx import)."""

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
             *(ROOT / "bench").glob("*.sh"), *(ROOT / "examples").rglob("*"), *(ROOT / "scripts").rglob("*")]
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


# -- paths the docs and docstrings cite -----------------------------------------------------------------
# A cited repository path: `src/...`, `bench/...`, `tests/...`, `scripts/...`, `docs/...`, `examples/...`,
# `deploy/...` (from the root); a module under a package, `models/registry.py` or `phalanx_bench/main.py` (from
# src/phalanx or src); or a bare module file, `rollout.py` (somewhere in the repository).
REPO_DIRS = ("src", "bench", "tests", "scripts", "docs", "examples", "deploy")
# Where commands write their results: a path there may name a file not written yet; its folder must exist.
OUTPUT_DIRS = ("bench/results/",)
# Other projects' files that the pages compare against.
OTHER_PROJECTS = {"ppo_continuous_action.py", "on_policy_algorithm.py", "buffers.py", "pufferl.py"}
SLASHED = re.compile(r"(?<![\w./:@~$-])((?:[\w+-][\w.+-]*/)+[\w.+-]*)")
BARE_MODULE = re.compile(r"(?<![\w./:@~$-])([A-Za-z_]\w*\.py)\b(?![\w/])")
PLACEHOLDER = re.compile(r"\.\.\.|[*<>{}]")
# Stale citations whose page is being rewritten elsewhere. Each entry must still be stale: once its page is fixed,
# the test asks for the entry to go.
PENDING: set[tuple[str, str]] = set()


def cited_sources() -> list[tuple[Path, str]]:
    """(file, text) of the pages and docstrings that may cite paths: README.md, docs/*.md, bench/README.md,
    examples' READMEs; every docstring under src/; the module docstrings of tests/."""
    import ast

    out = [(page, page.read_text(encoding="utf-8")) for page in
           [*markdown_pages(), ROOT / "bench" / "README.md", *sorted((ROOT / "examples").glob("*/README.md"))]]
    scripts = sorted((ROOT / "tests").glob("*.py"))
    for path in [*(p for p in python_sources() if rel(p).startswith("src/")), *scripts]:
        tree = ast.parse(path.read_text(encoding="utf-8"))
        nodes = [tree] if path in scripts else [n for n in ast.walk(tree) if isinstance(
            n, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))]
        out += [(path, doc) for doc in map(ast.get_docstring, nodes) if doc]
    return out


def repository_files() -> list[str]:
    skip = {".git", ".venv", "__pycache__", "node_modules"}
    found = []
    for top in REPO_DIRS:
        for path in (ROOT / top).rglob("*"):
            parts = path.relative_to(ROOT).parts
            if path.is_file() and not skip & set(parts) and not any(p.endswith(".egg-info") for p in parts):
                found.append(rel(path))
    return found


def missing_citation(token: str, files: list[str]) -> str | None:
    """Why `token` names nothing in the repository (None where it does, or is not a repository path)."""
    token = token.rstrip(".,;:")
    bare = token.rstrip("/")
    first = token.split("/", 1)[0]
    if PLACEHOLDER.search(token) or not bare:
        return None
    if "/" not in token:  # a bare module file
        if token in OTHER_PROJECTS or any(f == token or f.endswith("/" + token) for f in files):
            return None
        return f"{token} is no file of the repository"
    if first in REPO_DIRS:
        if (ROOT / bare).exists() or (token.startswith(OUTPUT_DIRS) and (ROOT / bare).parent.is_dir()):
            return None
        return f"{token} does not exist"
    packages = {p.name for base in (ROOT / "src", ROOT / "src" / "phalanx") for p in base.iterdir() if p.is_dir()}
    if first in packages and token.endswith(".py"):
        if any(f.startswith("src/") and f.endswith("/" + token) for f in files):
            return None
        return f"{token} is no module under src/phalanx or src"
    return None


def test_paths_cited_in_docs_and_docstrings_exist():
    files = repository_files()
    bad = []
    this = Path(__file__).resolve()
    for path, text in cited_sources():
        if path.resolve() == this:
            continue
        for token in [*SLASHED.findall(text), *BARE_MODULE.findall(text)]:
            why = missing_citation(token, files)
            if why:
                bad.append((rel(path), why))
    stale = sorted(set(bad) - PENDING)
    assert not stale, "\n".join(f"{page}: {why}" for page, why in stale)
    fixed = sorted(PENDING - set(bad))
    assert not fixed, "fixed, so drop from PENDING in tests/test_docs.py: " + "; ".join(f"{p}: {w}" for p, w in fixed)


def test_the_path_check_catches_what_it_should():
    files = repository_files()
    for stale in ("train.py", "src/phalanx/train.py", "bench/nosuch.py", "phalanx/bench.py", "models/kinds.py",
                  "scripts/nosuch.sh", "bench/results/nosuch/out.json"):
        assert missing_citation(stale, files), stale
    for fine in ("rollout.py", "src/phalanx/cli/__init__.py", "bench/gpu.sh", "models/registry.py", "league/sampling.py",
                 "phalanx_bench/main.py", "tests/test_docs.py", "bench/results/bench.md", "docs/", "src/phalanx/...",
                 "league/snapshots/", "runs/x/model.safetensors", "ppo_continuous_action.py", "scripts/setup.sh."):
        assert missing_citation(fine, files) is None, fine


def test_the_cli_docstring_lists_every_command():
    import ast

    cli = ROOT / "src" / "phalanx" / "cli" / "__init__.py"
    tree = ast.parse(cli.read_text(encoding="utf-8"))
    commands = {n.args[0].value for n in ast.walk(tree) if isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute)
                and n.func.attr == "add_parser" and n.args and isinstance(n.args[0], ast.Constant)}
    section = (ROOT / "pyproject.toml").read_text(encoding="utf-8").split('[project.entry-points."phalanx.commands"]')[1]
    commands |= set(re.findall(r"^([\w-]+)\s*=", section.split("\n[", 1)[0], re.M))  # plugins: bench
    assert {"train", "eval", "export", "bench"} <= commands
    doc = ast.get_docstring(tree)
    missing = sorted(c for c in commands if not re.search(rf"phalanx {re.escape(c)}\b", doc))
    assert not missing, f"the cli's docstring does not list: {', '.join(missing)}"
