"""The versions Phalanx promises (issue 53): the torch floors the code refuses below, as pyproject.toml and the
README declare them."""

import re
from pathlib import Path

import pytest

from phalanx import devices
from phalanx.cli import main
from phalanx.errors import ConfigError

try:
    import tomllib
except ImportError:  # Python 3.10
    import tomli as tomllib

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("version, release", [("2.13.0+cpu", (2, 13)), ("2.5.0", (2, 5)), ("2.11.0a0+git1234", (2, 11)),
                                              ("2.14.1+cu130", (2, 14)), ("3.0.0rc1", (3, 0))])
def test_torch_release_reads_major_and_minor(version, release):
    assert devices.torch_release(version) == release


def test_below_a_floor_is_one_line_naming_what_needs_which_torch():
    devices.require_torch("Phalanx", devices.TORCH_FLOOR, "2.5.0")
    with pytest.raises(ConfigError) as err:
        devices.require_torch("config key 'compile'", devices.COMPILE_FLOOR, "2.10.0+cu126")
    assert str(err.value) == ("config key 'compile' needs torch >= 2.11; this is torch 2.10.0+cu126 "
                              "(pip install 'torch>=2.11')")
    with pytest.raises(ConfigError, match=r"Phalanx needs torch >= 2\.5; this is torch 2\.4\.1"):
        devices.require_torch("Phalanx", devices.TORCH_FLOOR, "2.4.1")


def test_compile_on_an_older_torch_is_refused_before_anything_is_built(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(devices.torch, "__version__", "2.10.0")
    assert main(["train", "--compile", "true", "--run-dir", str(tmp_path / "r"), "--progress", "false"]) == 2
    err = capsys.readouterr().err.strip()
    assert err == "phalanx: error: config key 'compile' needs torch >= 2.11; this is torch 2.10.0 (pip install 'torch>=2.11')"
    assert not (tmp_path / "r").exists()


def test_pyproject_and_readme_declare_the_floors_the_code_holds():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    floor = ".".join(map(str, devices.TORCH_FLOOR))
    assert f"torch>={floor}" in project["dependencies"]
    readme = (ROOT / "README.md").read_text()
    assert f"torch {floor}" in readme and f"torch {'.'.join(map(str, devices.COMPILE_FLOOR))}" in readme
    python_floor = re.fullmatch(r">=3\.(\d+)", project["requires-python"])
    assert python_floor and f"Python 3.{python_floor.group(1)}" in readme
