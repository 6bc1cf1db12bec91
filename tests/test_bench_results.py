"""Kept results remake from what is kept: a packed study (bench/bucket_study.py --pack) gives its published tables
byte for byte, and a pack round-trips the run folders it was made from."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
KEPT = ROOT / "bench" / "results" / "bucket_study_full"


def _study():
    spec = importlib.util.spec_from_file_location("bucket_study", ROOT / "bench" / "bucket_study.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("pack, evals, table", [("runs.jsonl.gz", "eval_vs.json", "table.md"),
                                                ("runs.jsonl.gz", "eval_vs_200.json", "table_200.md"),
                                                ("holdout/runs.jsonl.gz", "eval_vs.json", "holdout/table.md")])
def test_the_bucket_study_tables_remake_from_the_pack(pack, evals, table):
    study = _study()
    md, rows = study.table(study.load(KEPT / pack, evals))
    assert md == (KEPT / table).read_text()
    assert rows == json.loads((KEPT / table).with_suffix(".json").read_text())


def test_a_pack_holds_every_run_file_and_reads_back_as_the_folder(tmp_path):
    study = _study()
    for name, seed in (("c000-s1", 1), ("c001-s2", 2)):
        run = tmp_path / "runs" / name
        run.mkdir(parents=True)
        (run / "config.json").write_text(json.dumps({"seed": seed, "env_options": {"scenario": "default"}}))
        (run / "eval_vs.json").write_text(json.dumps({"learned": {"mean_return": float(seed)}}))
    study.pack(tmp_path / "runs", tmp_path / "p.jsonl.gz")
    assert study.runs(tmp_path / "p.jsonl.gz") == study.runs(tmp_path / "runs")
    assert [r["name"] for r in study.runs(tmp_path / "p.jsonl.gz")] == ["c000-s1", "c001-s2"]
    first = (tmp_path / "p.jsonl.gz").read_bytes()
    study.pack(tmp_path / "runs", tmp_path / "p.jsonl.gz")
    assert (tmp_path / "p.jsonl.gz").read_bytes() == first  # no timestamp: the same runs, the same bytes
