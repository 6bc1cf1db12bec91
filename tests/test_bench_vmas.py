"""bench/vmas_vs_benchmarl.py: `--threads` is the thread count of both libraries, and each result records the
threads its library ran with (Phalanx's side once chose its own unless told twice)."""

import importlib.util
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[1] / "bench"


def _load():
    spec = importlib.util.spec_from_file_location("vmas_vs_benchmarl", BENCH / "vmas_vs_benchmarl.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def test_phalanx_side_runs_on_the_threads_given_and_records_them(tmp_path):
    pytest.importorskip("vmas")
    bench = _load()
    # Small calls: left to itself, Phalanx would run them on one thread.
    result = bench.run_phalanx("navigation", 1, 64, 64, 2, "cpu", tmp_path, threads=2,
                               settings={"num_envs": "4", "num_steps": "16", "num_minibatches": "1", "num_epochs": "1"})
    assert result["torch_threads"] == {"collect": 2, "update": 2}


def test_phalanx_threads_are_set_by_threads_not_a_second_flag(capsys):
    bench = _load()
    with pytest.raises(SystemExit) as exit_:
        bench.main(["--phalanx-set", "torch_threads=1", "--out", "unused"])
    assert exit_.value.code == 2
    assert "give --threads" in capsys.readouterr().err


def test_vmas_scripted_policy_is_scored_by_the_same_protocol_and_moves_the_package():
    # The transport row's reference (issue 51): VMAS's HeuristicPolicy pushes the package, random play does not.
    pytest.importorskip("vmas")
    bench = _load()
    heuristic = bench.run_heuristic("transport", 1, 16, "cpu")
    random_play = bench.run_random("transport", 1, 16, "cpu")["return"]
    assert heuristic > 1.0 > 0.1 > random_play
