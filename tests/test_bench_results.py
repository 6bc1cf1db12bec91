"""Kept results remake from what is kept: a packed study (phalanx_bench/packs.py) gives its published tables byte for byte,
and a pack round-trips the run folders it was made from."""

from __future__ import annotations

import json
import statistics
from pathlib import Path

import pytest

from phalanx_bench import packs
from phalanx_bench.studies import bucket_brigade as study

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("folder, pack, evals, table", [
    ("bucket_study_full", "runs.jsonl.gz", "eval_vs.json", "table.md"),
    ("bucket_study_full", "runs.jsonl.gz", "eval_vs_200.json", "table_200.md"),
    ("bucket_study_full", "holdout/runs.jsonl.gz", "eval_vs.json", "holdout/table.md"),
    ("bucket_hard_gamma", "runs.jsonl.gz", "eval_vs.json", "table.md"),
    ("bucket_hard_budget", "runs.jsonl.gz", "eval_vs.json", "table.md")])
def test_the_bucket_study_tables_remake_from_the_pack(folder, pack, evals, table):
    kept = ROOT / "bench" / "results" / folder
    md, rows = study.table(study.load(kept / pack, evals))
    assert md == (kept / table).read_text()
    assert rows == json.loads((kept / table).with_suffix(".json").read_text())


def test_a_pack_holds_every_run_file_and_reads_back_as_the_folder(tmp_path):
    for name, seed in (("c000-s1", 1), ("c001-s2", 2)):
        run = tmp_path / "runs" / name
        run.mkdir(parents=True)
        (run / "config.json").write_text(json.dumps({"seed": seed, "env_options": {"scenario": "default"}}))
        (run / "eval_vs.json").write_text(json.dumps({"learned": {"mean_return": float(seed)}}))
        (run / "metrics.jsonl").write_text("".join(json.dumps({"step": 64 * k, "loss": 0.1 / k}) + "\n" for k in (1, 2)))
    packs.pack(tmp_path / "runs", tmp_path / "p.jsonl.gz")
    assert packs.runs(tmp_path / "p.jsonl.gz") == packs.runs(tmp_path / "runs")
    assert [r["name"] for r in packs.runs(tmp_path / "p.jsonl.gz")] == ["c000-s1", "c001-s2"]
    assert "metrics.jsonl" not in packs.runs(tmp_path / "p.jsonl.gz")[0]  # JSON files only, unless asked
    packs.pack(tmp_path / "runs", tmp_path / "curves.jsonl.gz", files=("*.json", "metrics.jsonl"))
    with packs.unpacked(tmp_path / "curves.jsonl.gz") as runs:
        for run in runs:
            assert (run / "metrics.jsonl").read_bytes() == (tmp_path / "runs" / run.name / "metrics.jsonl").read_bytes()
    first = (tmp_path / "p.jsonl.gz").read_bytes()
    packs.pack(tmp_path / "runs", tmp_path / "p.jsonl.gz")
    assert (tmp_path / "p.jsonl.gz").read_bytes() == first  # no timestamp: the same runs, the same bytes


@pytest.mark.parametrize("folder, episodes", [("connect_four/defaults", 200), ("tictactoe/10M_opening4", 500),
                                              ("tictactoe/16M", 500), ("connect_four/10M", 200),
                                              ("connect_four/rollouts16", 200), ("connect_four/rollouts16/net", 200),
                                              ("connect_four/solve24", 200), ("connect_four/opening6", 200),
                                              ("connect_four/opening6/net", 200),
                                              ("connect_four/lr3e-3", 200),
                                              ("connect_four/lr3e-3/heldout", 200),
                                              ("connect_four/returns", 200),
                                              ("connect_four/mirror", 200),
                                              ("connect_four/pool20", 200),
                                              ("connect_four/pool20/heldout", 200),
                                              ("connect_four/ent1e-2", 200),
                                              ("tictactoe/10M_pool_fixed", 500),
                                              ("connect_four/pool_fixed", 200)])
def test_a_games_study_remakes_from_its_pack(folder, episodes):
    """phalanx_bench/studies/games.py over a kept pack: the published table byte for byte (the players a kept study was not
    evaluated against, and walks it kept no checkpoint for, are left out as when it was made)."""
    from phalanx_bench.studies import games

    kept = ROOT / "bench" / "results" / "games" / folder
    with packs.unpacked(kept / "runs.jsonl.gz") as runs:
        assert games.table(runs, episodes, threads=1) == (kept / "study.md").read_text()


def test_a_kept_evaluation_is_read_under_its_players_former_names():
    """The kept packs' evaluations name the players as they were named before they moved into phalanx_bench.players
    (issue 64): the study reads them under the current names (games.MOVED), so the tables above remake unchanged."""
    from phalanx_bench.studies import games

    kept = packs.runs(ROOT / "bench" / "results" / "games" / "connect_four" / "defaults" / "runs.jsonl.gz")
    assert "bench.games.connect_four:varied_4" in kept[0]["eval_games.json"]["vs"]
    assert games.current_name("bench.games.connect_four:varied_4") == "phalanx_bench.players.connect_four:varied_4"
    assert games.current_name("bench.games.tictactoe:act") == "phalanx_bench.players.tictactoe:act"
    assert games.current_name("phalanx_bench.players.tictactoe:varied") == "phalanx_bench.players.tictactoe:varied"
    assert games.current_name("random") == "random"


def test_the_connect_four_probes_remake_from_their_pack():
    """The single-seed probes, one pack: `python -m phalanx_bench.studies.games probes/runs.jsonl.gz --each --episodes 200`
    gives their study.md byte for byte, a table a probe under its name."""
    from phalanx_bench.studies import games

    kept = ROOT / "bench" / "results" / "games" / "connect_four" / "probes"
    with packs.unpacked(kept / "runs.jsonl.gz") as runs:
        assert len(runs) == 13
        assert games.each(runs, 200, threads=1) == (kept / "study.md").read_text()


@pytest.mark.parametrize("study", sorted(p.parent.name for p in (ROOT / "bench" / "results" / "games" / "exploit").glob(
    "*/exploit.json")))
def test_a_kept_exploit_report_draws_its_curve(study, tmp_path):
    """The curves are not kept: each kept exploit.json draws its exploit.png again (docs/EXPERIMENTS.md's command;
    the same bytes as `phalanx exploit` drew, when the PNGs were removed)."""
    from phalanx.exploit import draw_curve

    report = json.loads((ROOT / "bench" / "results" / "games" / "exploit" / study / "exploit.json").read_text())
    assert draw_curve(report, tmp_path / "exploit.png").stat().st_size > 10_000


VMAS = ROOT / "bench" / "results"


@pytest.mark.parametrize("study, tasks, frames", [
    ("vmas_vs_benchmarl-six", "navigation,balance,dispersion,passage,transport,wheel", 360_000),
    ("vmas_vs_benchmarl-720k", "transport,wheel", 720_000)])
def test_a_vmas_table_remakes_from_its_pack(study, tasks, frames):
    """phalanx_bench/studies/vmas_vs_benchmarl.py over a kept pack (`--out STUDY/runs.jsonl.gz`, the study README's command): its
    table.md byte for byte."""
    from phalanx_bench.studies import vmas_vs_benchmarl as vmas

    kept = vmas.kept_results(VMAS / study / "runs.jsonl.gz")
    tasks, seeds = tasks.split(","), [1, 2]
    runs = [kept[f"{lib}-{task}-{seed}"] for task in tasks for seed in seeds for lib in vmas.LIBRARIES]
    random_play = [kept[f"random-{task}-{seed}"] for task in tasks for seed in seeds]
    assert vmas.table(runs, tasks, seeds, frames, "cpu", random_play, 200) == (VMAS / study / "table.md").read_text()


def test_the_first_vmas_table_keeps_its_rows_in_its_pack():
    """bench/results/vmas_vs_benchmarl/table.md was printed before the table had its random-play column and its
    threads line: every row of it, that column aside, remakes from its pack."""
    from phalanx_bench.studies import vmas_vs_benchmarl as vmas

    kept = vmas.kept_results(VMAS / "vmas_vs_benchmarl" / "runs.jsonl.gz")
    tasks, seeds = ["navigation", "balance"], [1, 2]
    runs = [kept[f"{lib}-{task}-{seed}"] for task in tasks for seed in seeds for lib in vmas.LIBRARIES]
    rows = [line.split(" | ") for line in vmas.table(runs, tasks, seeds, 360_000, "cpu").splitlines()
            if line.startswith(("| navigation", "| balance"))]
    printed = [line for line in (VMAS / "vmas_vs_benchmarl" / "table.md").read_text().splitlines()
               if line.startswith(("| navigation", "| balance"))]
    assert printed == [" | ".join(row[:3] + row[4:]) for row in rows] and len(printed) == 4


# The default-budget study's table (its README): each row's run in the pack, as it is printed.
DEFAULT_BUDGET = ["wheel-1", "wheel-2", "transport-defaults-1", "transport-defaults-2", "transport-defaults-3",
                  "transport-10m-1", "transport-10m-2", "transport-unit-noise-3", "passage-1", "passage-2", "passage-3",
                  "passage-shared-defaults-1", "passage-shared-defaults-2"]


def test_the_vmas_default_budget_table_reads_its_pack():
    """bench/results/vmas_default_budget/README.md's table is written by hand from each run's eval_benchmarl.json:
    every return it prints is its run's, rounded as printed."""
    kept = {run["name"]: run for run in packs.runs(VMAS / "vmas_default_budget" / "runs.jsonl.gz")}
    text = (VMAS / "vmas_default_budget" / "README.md").read_text()
    cells = [line.split("|")[3].strip() for line in text.splitlines() if line.startswith("| ") and "task" not in line]
    assert len(cells) == len(DEFAULT_BUDGET)
    for name, cell in zip(DEFAULT_BUDGET, cells):
        places = len(cell.split(".")[1]) if "." in cell else 0
        assert round(kept[name]["eval_benchmarl.json"]["return"], places) == float(cell.replace(",", "")), name
    curves = {name: run["metrics.jsonl"] for name, run in kept.items() if "metrics.jsonl" in run}
    assert sorted(curves) == ["transport-defaults-1", "transport-defaults-2", "transport-defaults-3",
                              "transport-unit-noise-3"]  # the README's runs kept with their training curve
    assert all(rows[-1]["step"] >= 10_000_000 for rows in curves.values())


def test_the_spread_table_remakes_from_its_pack():
    """phalanx_bench/studies/spread.py over its kept pack (`--runs bench/results/spread/runs.jsonl.gz`): table.md byte for byte,
    and table.json's every number (its runs named where they were read)."""
    pytest.importorskip("mpe2")
    from phalanx_bench.studies import spread

    kept = VMAS / "spread"
    out = spread.scores(spread.evaluated(kept / "runs.jsonl.gz", 100), 100, [1, 2, 3])
    assert spread.table(out) == (kept / "table.md").read_text()
    printed = json.loads((kept / "table.json").read_text())
    assert out["trained"].pop("runs") == [f"{kept / 'runs.jsonl.gz'}:s{seed}" for seed in (1, 2, 3)]
    printed["trained"].pop("runs")  # the folders the runs were read from when it was made
    assert out == printed


def test_the_compile_table_reads_its_pack():
    """docs/BENCHMARKS.md's `--compile` table (What `--compile` captures) is written by hand from each run's
    `phalanx bench suite --json` report, packed in bench/results/compile-28/runs.jsonl.gz: every rate, ratio, median
    and cached compile time it prints is its runs', rounded as printed; so are the busy runs' ratios below it."""
    modes = {run["name"]: run["suite.json"]["rows"][0]["modes"]
             for run in packs.runs(VMAS / "compile-28" / "runs.jsonl.gz")}
    text = (ROOT / "docs" / "BENCHMARKS.md").read_text().split("## What `--compile` captures")[1].split("\n## ")[0]

    def ratio(name: str, key: str) -> float:
        return modes[name]["compile"]["train"][key] / modes[name]["eager"]["train"][key]

    for workload, names in (("trial_nav", ["tn1", "tn2", "tn3"]), ("duel", ["du1", "du2", "du3"])):
        (line,) = [row for row in text.splitlines() if row.startswith(f"| {workload} (")]
        cells = [cell.strip() for cell in line.split("|")[2:7]]
        for cell, mode in zip(cells[:2], ("eager", "compile")):
            places = len(cell.split(" / ")[0].rstrip("k").split(".")[1])
            assert cell == " / ".join(f"{modes[n][mode]['train']['sps'] / 1e3:.{places}f}k" for n in names), workload
        for cell, key in zip(cells[2:4], ("sps", "mean_sps")):
            ratios = [ratio(n, key) for n in names]
            assert cell == " / ".join(f"{r:.2f}" for r in ratios) + f", median **{statistics.median(ratios):.2f}x**"
        cached = [modes[n]["compile"]["train"]["warmup_seconds"] for n in names]
        assert cells[4].startswith(f"{min(cached):.0f}-{max(cached):.0f} s cached"), workload
    busy = ", ".join(f"{workload} {ratio(name, 'sps'):.2f}x (mean {ratio(name, 'mean_sps'):.2f}x)"
                     for workload, name in (("trial_nav", "busy_tn"), ("duel", "busy_du")))
    assert f"the pack's `busy_*`): {busy}." in text


def test_the_learning_parity_table_remakes_from_its_pack():
    """phalanx_bench/studies/learning_parity.py over its kept pack (`--report-only`: every row read from runs.jsonl.gz): table.md and
    results.json byte for byte."""
    from phalanx_bench.studies import learning_parity as parity

    kept_dir = ROOT / "bench" / "results" / "learning_parity"
    kept = parity.kept_rows(kept_dir / "runs.jsonl.gz")
    results = {row: parity.scores(row, kept_dir, 100, kept[row]) for row in parity.PEERS if row in kept}
    assert list(results) == list(parity.PEERS)
    assert parity.table(results, 100) == (kept_dir / "table.md").read_text()
    assert json.dumps(results, indent=1) == (kept_dir / "results.json").read_text()
