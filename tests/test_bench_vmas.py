"""phalanx_bench/studies/vmas_vs_benchmarl.py: `--threads` is the thread count of both libraries, and each result records the
threads its library ran with (Phalanx's side once chose its own unless told twice)."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from phalanx_bench.studies import vmas_phalanx as phalanx_side
from phalanx_bench.studies import vmas_vs_benchmarl as bench

ROOT = Path(__file__).resolve().parents[1]


def test_phalanx_side_runs_on_the_threads_given_and_records_them(tmp_path):
    pytest.importorskip("vmas")
    # Small calls: left to itself, Phalanx would run them on one thread.
    result = phalanx_side.run_phalanx("navigation", 1, 64, 64, 2, "cpu", tmp_path, threads=2,
                               settings={"num_envs": "4", "num_steps": "16", "num_minibatches": "1", "num_epochs": "1"})
    assert result["torch_threads"] == {"collect": 2, "update": 2}


def test_phalanx_threads_are_set_by_threads_not_a_second_flag(capsys):
    with pytest.raises(SystemExit) as exit_:
        bench.main(["--phalanx-set", "torch_threads=1", "--out", "unused"])
    assert exit_.value.code == 2
    assert "give --threads" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exit_:  # the Phalanx side's process, started by itself, checks the same
        phalanx_side.main(["--one", "phalanx", "navigation", "1", "--phalanx-set", "torch_threads=1", "--out", "unused"])
    assert exit_.value.code == 2
    assert "give --threads" in capsys.readouterr().err


def test_benchmarls_side_never_imports_phalanx():
    """BenchMARL's runs start from this module, in processes that never import phalanx: importing it sets
    OMP_WAIT_POLICY in the environment of every process it starts. The Phalanx side runs in processes of its own."""
    code = ("import os, sys, phalanx_bench.studies.vmas_vs_benchmarl\n"
            "print(sorted(m for m in sys.modules if m.split('.')[0] == 'phalanx'), os.environ.get('OMP_WAIT_POLICY'))")
    env = {k: v for k, v in os.environ.items() if k != "OMP_WAIT_POLICY"}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, env=env, cwd=ROOT)
    assert out.stdout.split() == ["[]", "None"], out.stdout


def test_random_play_runs_in_the_phalanx_sides_process(tmp_path):
    pytest.importorskip("vmas")
    assert bench.main(["--one", "random", "transport", "1", "--eval-episodes", "4", "--threads", "1",
                       "--out", str(tmp_path)]) == 0
    result = json.loads((tmp_path / "random-transport-1" / "result.json").read_text())
    assert result["library"] == "random" and result["task"] == "transport" and result["return"] < 0.1


def test_vmas_scripted_policy_is_scored_by_the_same_protocol_and_moves_the_package():
    # The transport row's reference (issue 51): VMAS's HeuristicPolicy pushes the package, random play does not.
    pytest.importorskip("vmas")
    heuristic = phalanx_side.run_heuristic("transport", 1, 16, "cpu")
    random_play = phalanx_side.run_random("transport", 1, 16, "cpu")["return"]
    assert heuristic > 1.0 > 0.1 > random_play
