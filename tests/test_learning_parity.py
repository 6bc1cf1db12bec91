"""phalanx_bench/studies/learning_parity.py: a row's sweep runs, every seed is scored greedy and sampled, and the
table puts Phalanx's mean beside the peer's published figure; run again, it trains nothing."""

import json
import shutil
from pathlib import Path

import pytest

from phalanx_bench.studies import learning_parity as parity

BENCH = Path(__file__).resolve().parents[1] / "bench"


def test_every_row_has_its_spec_and_a_peer():
    assert parity.SPECS == BENCH / "parity"  # the checkout's specs, wherever the study is run from
    assert sorted(p.stem for p in (BENCH / "parity").glob("*.yaml")) == sorted(parity.PEERS)


@pytest.mark.slow
def test_a_row_is_trained_scored_and_tabled_then_kept(tmp_path, capsys):
    specs = tmp_path / "specs"
    specs.mkdir()
    # The cartpole row's name and peer, on the built-in cartpole env at a test's budget.
    (specs / "cartpole_cleanrl.yaml").write_text(
        "base: {env: cartpole, total_steps: 1024, num_envs: 4, num_steps: 128, torch_threads: 1, tensorboard: false, "
        "eval_episodes: 0}\nseeds: [1, 2]\n")
    out = tmp_path / "out"
    args = ["--rows", "cartpole_cleanrl", "--specs", str(specs), "--out", str(out), "--episodes", "3", "--workers", "2"]
    assert parity.main(args) == 0
    results = json.loads((out / "results.json").read_text())["cartpole_cleanrl"]
    assert results["seeds"] == [1, 2] and len(results["greedy"]) == len(results["sampled"]) == 2
    assert all(r > 0 for r in results["greedy"] + results["sampled"]) and all(s > 0 for s in results["train_seconds"])
    table = (out / "table.md").read_text()
    assert "| CartPole-v1 | CleanRL ppo.py | 500k |" in table and "490.04 +- 6.12" in table
    runs = sorted((out / "cartpole_cleanrl" / "runs").iterdir())
    stamps = [(r / "metrics.jsonl").stat().st_mtime_ns for r in runs]
    capsys.readouterr()
    assert parity.main(args) == 0  # a second time: the sweep keeps its finished runs, the scores come from the cache
    assert [(r / "metrics.jsonl").stat().st_mtime_ns for r in runs] == stamps
    assert json.loads((out / "results.json").read_text())["cartpole_cleanrl"] == results
    # The runs are not kept with the results (bench/results keeps sweep.json and the scores): the table is made
    # again from what is kept, and training another row leaves this one in it.
    shutil.rmtree(out / "cartpole_cleanrl" / "runs")
    assert parity.main([*args, "--report-only"]) == 0
    assert (out / "table.md").read_text() == table
