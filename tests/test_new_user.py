"""What a new user hits at the command line (issue 47): a reused run directory, Ctrl-C before the first
checkpoint, a closed pipe, flags where a user reaches for them, and what the readouts say."""

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from phalanx import trainer as trainer_module
from phalanx.cli import build_parser, main

TINY = ["--env", "cartpole", "--num-envs", "4", "--num-steps", "16", "--total-steps", "128", "--progress", "false",
        "--tensorboard", "true", "--eval-episodes", "0", "--torch-threads", "1"]


def _crashed_run(run: Path) -> dict[str, bytes]:
    """A run directory as a run that crashed before its first checkpoint leaves it."""
    (run / "tb").mkdir(parents=True)
    (run / "tb" / "events.out.tfevents.1.host").write_bytes(b"old events")
    files = {"metrics.jsonl": b'{"step": 1024, "update": 0}\n', "env_crash.txt": b"Traceback (most recent call last):\n",
             "config.json": json.dumps({"env": "pendulum"}).encode()}
    for name, data in files.items():
        (run / name).write_bytes(data)
    return {p.relative_to(run).as_posix(): p.read_bytes() for p in sorted(run.rglob("*")) if p.is_file()}


def _tree(run: Path) -> dict[str, bytes]:
    return {p.relative_to(run).as_posix(): p.read_bytes() for p in sorted(run.rglob("*")) if p.is_file()}


def test_a_run_directory_holding_a_crashed_run_is_refused_and_left_as_it_was(tmp_path, capsys):
    run = tmp_path / "r"
    before = _crashed_run(run)
    assert main(["train", *TINY, "--run-dir", str(run)]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1, err
    assert "cannot be resumed" in err and "no checkpoint" in err and "--overwrite" in err, err
    assert _tree(run) == before


def test_overwrite_starts_a_crashed_run_directory_clean(tmp_path, capsys):
    run = tmp_path / "r"
    _crashed_run(run)
    (run / "notes.txt").write_text("the user's own file")
    assert main(["train", *TINY, "--run-dir", str(run), "--overwrite"]) == 0
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    steps = [r["step"] for r in rows]
    assert steps == sorted(set(steps)) and steps[0] == 64, steps  # this run's rows only, no step twice
    assert not (run / "env_crash.txt").exists()
    assert len(list((run / "tb").glob("events.*"))) == 1
    assert json.loads((run / "config.json").read_text())["env"] == "cartpole"
    assert (run / "notes.txt").read_text() == "the user's own file"  # only a run's own entries are removed


def test_a_finished_run_is_refused_without_overwrite_and_replaced_with_it(tmp_path, capsys):
    run = tmp_path / "r"
    assert main(["train", *TINY, "--run-dir", str(run)]) == 0
    capsys.readouterr()
    assert main(["train", *TINY, "--run-dir", str(run)]) == 2
    err = capsys.readouterr().err.strip()
    assert f"--resume {run}" in err and "--overwrite" in err, err
    assert main(["train", *TINY, "--total-steps", "64", "--run-dir", str(run), "--overwrite"]) == 0
    assert [json.loads(x)["step"] for x in (run / "metrics.jsonl").read_text().splitlines()] == [64]
    assert [int(p.name.removeprefix("step_")) for p in (run / "checkpoints").iterdir()] == [64]


def test_overwrite_and_resume_together_are_refused(tmp_path, capsys):
    assert main(["train", "--resume", str(tmp_path), "--overwrite"]) == 2
    assert "--overwrite" in capsys.readouterr().err


def test_a_second_ctrl_c_before_the_first_checkpoint_says_there_is_nothing_to_resume(tmp_path, capsys, monkeypatch):
    def interrupted(self):
        raise KeyboardInterrupt

    monkeypatch.setattr(trainer_module.Trainer, "iteration", interrupted)
    run = tmp_path / "r"
    assert main(["train", *TINY, "--run-dir", str(run)]) == 130
    err = capsys.readouterr().err.strip()
    assert "nothing to resume" in err and "no checkpoint" in err, err
    assert "--resume" not in err and "step 0" not in err, err
    assert "--overwrite" in err, err  # what the user can do instead


def test_sigterm_names_the_planned_total_the_progress_shows(tmp_path, capsys, monkeypatch):
    real = trainer_module.Trainer.iteration

    def then_sigterm(self):
        row = real(self)
        os.kill(os.getpid(), signal.SIGTERM)
        return row

    monkeypatch.setattr(trainer_module.Trainer, "iteration", then_sigterm)
    # 100 steps round up to 2 updates of 64 steps: 128 planned.
    assert main(["train", *TINY, "--total-steps", "100", "--run-dir", str(tmp_path / "r")]) == 128 + signal.SIGTERM
    err = capsys.readouterr().err
    assert "at step 64 of 128;" in err, err


def test_resuming_a_finished_run_says_it_is_complete(tmp_path, capsys):
    run = tmp_path / "r"
    assert main(["train", *TINY, "--run-dir", str(run)]) == 0
    capsys.readouterr()
    rows = (run / "metrics.jsonl").read_text()
    assert main(["resume", str(run)]) == 0
    err = capsys.readouterr().err
    assert f"run '{run}' is complete: step 128 of total_steps 128" in err, err
    assert "--total-steps" in err  # how to train it longer
    assert (run / "metrics.jsonl").read_text() == rows


def _closed_pipe_run(args: list[str]) -> subprocess.CompletedProcess:
    read_end, write_end = os.pipe()
    os.close(read_end)  # the reader is gone before the first line, as `| head` can be
    try:
        return subprocess.run([sys.executable, "-m", "phalanx", *args], stdout=write_end, stderr=subprocess.PIPE,
                              text=True, timeout=120)
    finally:
        os.close(write_end)


@pytest.mark.parametrize("args", [["envs"], ["train", "--print-config"]])
def test_a_closed_pipe_ends_the_command_quietly(args):
    done = _closed_pipe_run(args)
    assert done.stderr == "", done.stderr
    assert done.returncode == 128 + signal.SIGPIPE


@pytest.mark.parametrize("command", ["eval", "check-env"])
def test_every_command_that_computes_takes_torch_threads_and_device(command):
    parser = build_parser()
    sub = next(a for a in parser._actions if a.dest == "command").choices[command]
    flags = {s for a in sub._actions for s in a.option_strings}
    assert {"--torch-threads", "--device"} <= flags


def test_eval_help_documents_every_flag():
    parser = build_parser()
    sub = next(a for a in parser._actions if a.dest == "command").choices["eval"]
    undocumented = [a.option_strings or a.dest for a in sub._actions if not a.help]
    assert not undocumented


def test_eval_takes_torch_threads_and_names_an_unknown_flag_as_one(tmp_path, capsys):
    run = tmp_path / "r"
    assert main(["train", *TINY, "--run-dir", str(run)]) == 0
    capsys.readouterr()
    assert main(["eval", str(run), "--episodes", "2", "--torch-threads", "1", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["episodes"] == 2
    assert main(["eval", str(run), "--episodes", "2", "--no-such-flag", "3"]) == 2
    err = capsys.readouterr().err.strip()
    assert "unknown option '--no-such-flag'" in err and "max_steps" in err, err
    assert "unknown env option" not in err


def test_resume_and_train_resume_take_the_same_flags(tmp_path, capsys):
    run = tmp_path / "r"
    assert main(["train", *TINY, "--run-dir", str(run)]) == 0
    capsys.readouterr()
    said = []
    for argv in (["resume", str(run), "--x", "1"], ["train", "--resume", str(run), "--x", "1"]):
        assert main(argv) == 2
        said.append(capsys.readouterr().err)
    assert said[0] == said[1] and "unknown option '--x'" in said[0], said
    assert main(["resume", str(run), "--total-steps", "192", "--progress", "false"]) == 0
    assert json.loads((run / "config.json").read_text())["total_steps"] == 192


def test_compare_without_evaluation_names_the_metric_it_lacks_and_one_it_has(tmp_path, capsys):
    for seed in (1, 2):
        assert main(["train", *TINY, "--seed", str(seed), "--run-dir", str(tmp_path / "runs" / f"s{seed}")]) == 0
    capsys.readouterr()
    assert main(["compare", str(tmp_path / "runs")]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1, err
    assert "eval_mean_return" in err and "--metric episode_return" in err, err


def test_compare_names_runs_of_one_seed_in_a_group_as_duplicates(tmp_path, capsys):
    for name in ("a", "b"):
        assert main(["train", *TINY, "--seed", "3", "--run-dir", str(tmp_path / "runs" / name)]) == 0
    capsys.readouterr()
    assert main(["compare", str(tmp_path / "runs"), "--metric", "episode_return"]) == 0
    out = capsys.readouterr().out
    assert "duplicate" in out and "seed 3" in out, out
    assert str(tmp_path / "runs" / "a") in out and str(tmp_path / "runs" / "b") in out, out
