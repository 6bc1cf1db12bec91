"""The documentation site (mkdocs.yml): built strict, as `mkdocs build --strict` would on a user's machine (a broken
link or anchor, a page missing from the nav, a reference to a name that no longer exists fails it), and an API
reference that covers the public API, every name of it with a docstring."""

from __future__ import annotations

import importlib
import inspect
import re
import subprocess
import sys
from pathlib import Path

import pytest

import phalanx
import phalanx.envs
import phalanx.export

ROOT = Path(__file__).resolve().parents[1]
API = ROOT / "docs" / "api"


def _targets() -> dict[str, list[str]]:
    """`::: dotted.path` of every API page -> the members its options list (empty: all)."""
    out: dict[str, list[str]] = {}
    for page in sorted(API.glob("*.md")):
        lines = page.read_text().splitlines()
        for i, line in enumerate(lines):
            m = re.match(r"^::: ([\w.]+)$", line)
            if m:
                members = []
                for nxt in lines[i + 1:]:
                    if nxt.startswith("::: ") or (nxt and not nxt.startswith(" ")):
                        break
                    if re.match(r"^\s+- \w+$", nxt):
                        members.append(nxt.strip()[2:])
                out[m.group(1)] = members
    return out


def _resolve(path: str):
    parts = path.split(".")
    for i in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:i]))
        except ImportError:
            continue
        for name in parts[i:]:
            obj = getattr(obj, name)
        return obj
    raise ImportError(path)


def _documented() -> dict[str, object]:
    """Every object the reference renders: its targets, and the listed members of a module target."""
    out = {}
    for target, members in _targets().items():
        obj = _resolve(target)
        if inspect.ismodule(obj):
            out.update({f"{target}.{m}": getattr(obj, m) for m in members})
        else:
            out[target] = obj
    return out


def test_the_site_builds_strict(tmp_path):
    pytest.importorskip("mkdocstrings_handlers.python", reason="the docs extra (pip install -e '.[docs]')")
    done = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path / "site")],
                          cwd=ROOT, capture_output=True, text=True, env={"NO_MKDOCS_2_WARNING": "1", "PATH": ""})
    assert done.returncode == 0, done.stderr[-3000:]
    training = (tmp_path / "site" / "api" / "training" / "index.html").read_text()
    assert "play_outcome_plies" in training and "total_steps" in training  # the config keys, from the schema
    policy = (tmp_path / "site" / "api" / "policy" / "index.html").read_text()
    assert "Forget every slot" in policy  # Policy.reset_memory's docstring, rendered


def test_the_reference_covers_the_public_api():
    rendered = {id(obj) for obj in _documented().values()}
    public = {f"phalanx.{n}": getattr(phalanx, n) for n in phalanx.__all__ if n != "__version__"}
    public.update({f"phalanx.envs.{n}": getattr(phalanx.envs, n) for n in phalanx.envs.__all__})
    public.update({f"phalanx.export.{n}": getattr(phalanx.export, n) for n in phalanx.export.__all__
                   if callable(getattr(phalanx.export, n))})
    missing = sorted(name for name, obj in public.items() if id(obj) not in rendered)
    assert not missing, f"public names the API reference (docs/api/) does not render: {missing}"


def test_every_documented_name_and_its_public_methods_have_docstrings():
    bare = []
    for name, obj in _documented().items():
        if not (obj.__doc__ or "").strip() or (inspect.isclass(obj) and obj.__doc__.startswith(f"{obj.__name__}(")):
            bare.append(name)  # a dataclass's generated signature is no docstring
        if inspect.isclass(obj):
            for attr, member in vars(obj).items():
                fn = member.fget if isinstance(member, property) else getattr(member, "__func__", member)
                if not attr.startswith("_") and callable(fn) and not (fn.__doc__ or "").strip():
                    bare.append(f"{name}.{attr}")
    assert not bare, f"public names without a docstring: {bare}"


def test_the_coverage_check_sees_a_name_left_out(monkeypatch):
    monkeypatch.setattr(phalanx.envs, "__all__", [*phalanx.envs.__all__, "frame_rows_unlisted"], raising=True)
    monkeypatch.setattr(phalanx.envs, "frame_rows_unlisted", lambda: None, raising=False)
    with pytest.raises(AssertionError, match="frame_rows_unlisted"):
        test_the_reference_covers_the_public_api()


@pytest.mark.parametrize("link", ["[ok](other.md#a-heading)", "[broken](missing.md)", "[no anchor](other.md#nowhere)"])
def test_the_sites_settings_refuse_a_broken_link(tmp_path, link):
    """The settings of mkdocs.yml (inherited: strict, link validation, GitHub's anchors) on a two-page site: a link to a
    page or an anchor that does not exist fails the build."""
    pytest.importorskip("mkdocs")
    docs = tmp_path / "docs"
    docs.mkdir()
    (docs / "index.md").write_text(f"# Home\n\nSee {link}.\n")
    (docs / "other.md").write_text("# Other\n\n## A heading\n\ntext\n")
    config = tmp_path / "mkdocs.yml"
    config.write_text(f"INHERIT: {ROOT / 'mkdocs.yml'}\ndocs_dir: {docs}\nhooks: []\nplugins: [search]\n"
                      "nav: [index.md, other.md]\n")
    done = subprocess.run([sys.executable, "-m", "mkdocs", "build", "-f", str(config), "--site-dir", str(tmp_path / "s")],
                          cwd=tmp_path, capture_output=True, text=True, env={"NO_MKDOCS_2_WARNING": "1", "PATH": ""})
    assert (done.returncode == 0) == link.startswith("[ok]"), done.stderr[-2000:]
