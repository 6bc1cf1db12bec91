"""Kept results remake from what is kept: a packed study (bench/packs.py) gives its published tables byte for byte,
and a pack round-trips the run folders it was made from."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench import bucket_study as study
from bench import packs

ROOT = Path(__file__).resolve().parents[1]
KEPT = ROOT / "bench" / "results" / "bucket_study_full"


@pytest.mark.parametrize("pack, evals, table", [("runs.jsonl.gz", "eval_vs.json", "table.md"),
                                                ("runs.jsonl.gz", "eval_vs_200.json", "table_200.md"),
                                                ("holdout/runs.jsonl.gz", "eval_vs.json", "holdout/table.md")])
def test_the_bucket_study_tables_remake_from_the_pack(pack, evals, table):
    md, rows = study.table(study.load(KEPT / pack, evals))
    assert md == (KEPT / table).read_text()
    assert rows == json.loads((KEPT / table).with_suffix(".json").read_text())


def test_a_pack_holds_every_run_file_and_reads_back_as_the_folder(tmp_path):
    for name, seed in (("c000-s1", 1), ("c001-s2", 2)):
        run = tmp_path / "runs" / name
        run.mkdir(parents=True)
        (run / "config.json").write_text(json.dumps({"seed": seed, "env_options": {"scenario": "default"}}))
        (run / "eval_vs.json").write_text(json.dumps({"learned": {"mean_return": float(seed)}}))
    packs.pack(tmp_path / "runs", tmp_path / "p.jsonl.gz")
    assert packs.runs(tmp_path / "p.jsonl.gz") == packs.runs(tmp_path / "runs")
    assert [r["name"] for r in packs.runs(tmp_path / "p.jsonl.gz")] == ["c000-s1", "c001-s2"]
    first = (tmp_path / "p.jsonl.gz").read_bytes()
    packs.pack(tmp_path / "runs", tmp_path / "p.jsonl.gz")
    assert (tmp_path / "p.jsonl.gz").read_bytes() == first  # no timestamp: the same runs, the same bytes


@pytest.mark.parametrize("folder, episodes", [("connect_four/defaults", 200), ("tictactoe/10M_opening4", 500),
                                              ("tictactoe/16M", 500), ("connect_four/10M", 200)])
def test_a_games_study_remakes_from_its_pack(folder, episodes):
    """bench/games/study.py over a kept pack: the published table byte for byte (the players a kept study was not
    evaluated against, and walks it kept no checkpoint for, are left out as when it was made)."""
    from bench.games import study as games

    kept = ROOT / "bench" / "results" / "games" / folder
    with packs.unpacked(kept / "runs.jsonl.gz") as runs:
        md, _ = games.table(runs, episodes, threads=1)
    assert md == (kept / "study.md").read_text()
