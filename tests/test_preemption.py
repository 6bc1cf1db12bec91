"""Preemption: SIGTERM (how schedulers stop jobs) and Ctrl-C end a run after its update with a checkpoint,
one line saying where and how to resume, and the conventional exit status; checkpoints also come on a
wall-clock interval, so a long run stopped early has one to resume."""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

import phalanx
from phalanx import checkpoint as ckpt

UPDATE = 8 * 16
ARGS = ["--env", "cartpole", "--total-steps", str(UPDATE * 60), "--num-envs", "8", "--num-steps", "16", "--num-epochs", "2",
        "--num-minibatches", "2", "--checkpoint-every", str(UPDATE * 1000), "--seed", "11", "--progress", "false",
        "--tensorboard", "false", "--torch-threads", "1"]
CMD = [sys.executable, "-m", "phalanx", "train"]


def _params(run: Path) -> dict[str, torch.Tensor]:
    return load_file(str(ckpt.latest_checkpoint(run) / "model.safetensors"))


def _updates_logged(run: Path) -> int:
    log = run / "metrics.jsonl"
    return len(log.read_text().splitlines()) if log.exists() else 0


@pytest.mark.parametrize("signum,status", [(signal.SIGTERM, 143), (signal.SIGINT, 130)])
def test_a_signal_mid_run_saves_says_where_and_resumes_bit_identically(tmp_path, signum, status):
    """A real `phalanx train` process gets the signal after a few updates: it finishes the update, writes a
    checkpoint (none would exist otherwise: step checkpoints are far apart), prints one line naming the run
    directory and the resume command, exits 128 + signal; `--resume` ends where an uninterrupted run ends.
    (Before: SIGTERM ended the process with 143, nothing printed and nothing saved; Ctrl-C saved nothing
    and named the run directory `RUN_DIR`.)"""
    stopped = tmp_path / "stopped"
    proc = subprocess.Popen(CMD + ARGS + ["--run-dir", str(stopped)], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                            text=True)
    deadline = time.time() + 120
    while time.time() < deadline and _updates_logged(stopped) < 3:
        time.sleep(0.01)
    proc.send_signal(signum)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == status, err
    lines = err.strip().splitlines()
    # Ctrl-C says at once what happens next (a line of its own), then the run's one closing line.
    assert len(lines) == (2 if signum == signal.SIGINT else 1), err
    assert signum != signal.SIGINT or lines[0].startswith("Ctrl-C: stopping after this update")
    line = lines[-1]
    assert f"phalanx: stopped by {signal.Signals(signum).name} at step" in line
    assert f"resume with `phalanx train --resume {stopped}`" in line
    saved = ckpt.list_checkpoints(stopped)
    assert len(saved) == 1 and 0 < int(saved[-1].name.split("_")[1]) < UPDATE * 60, "stopped mid-run, saved then"
    subprocess.run(CMD + ["--resume", str(stopped)], check=True, capture_output=True, timeout=300)
    full = phalanx.train(run_dir=tmp_path / "full", env="cartpole", total_steps=UPDATE * 60, num_envs=8, num_steps=16,
                         num_epochs=2, num_minibatches=2, seed=11, progress=False, tensorboard=False, torch_threads=1)
    a, b = _params(full.run_dir), _params(stopped)
    for k in a:
        assert torch.equal(a[k], b[k]), k


def test_checkpoints_come_on_a_wall_clock_interval(tmp_path):
    """`checkpoint_minutes`: with step checkpoints far apart, a run still saves when the interval has passed
    since the last save (here: after every update), and with 0 only at its end."""
    common = dict(env="cartpole", total_steps=UPDATE * 4, num_envs=8, num_steps=16, num_minibatches=2, progress=False,
                  tensorboard=False, checkpoint_every=UPDATE * 1000, keep_checkpoints=10)
    timed = phalanx.train(run_dir=tmp_path / "timed", checkpoint_minutes=1e-9, **common)
    assert [int(p.name.split("_")[1]) for p in ckpt.list_checkpoints(timed.run_dir)] == [UPDATE * i for i in range(1, 5)]
    untimed = phalanx.train(run_dir=tmp_path / "untimed", checkpoint_minutes=0, **common)
    assert [int(p.name.split("_")[1]) for p in ckpt.list_checkpoints(untimed.run_dir)] == [UPDATE * 4]


def test_the_first_ctrl_c_says_at_once_what_happens_next(capfd):
    """A first Ctrl-C printed nothing until the update ended (a user presses it again, losing the update): now it says
    at once that the run stops after this update with a checkpoint, and how to stop at once (issue 63; failed on main
    first). A second one interrupts."""
    import os
    import signal as signals

    from phalanx import runs

    with runs.stop_signals(announce=True) as stop:
        os.kill(os.getpid(), signals.SIGINT)
        assert stop.signum == signals.SIGINT
        err = capfd.readouterr().err
        assert "stopping after this update" in err and "checkpoint" in err and "Ctrl-C again" in err, err
        with pytest.raises(KeyboardInterrupt):
            os.kill(os.getpid(), signals.SIGINT)
    with runs.stop_signals(announce=False) as stop:  # the other ranks of a torchrun stay quiet
        os.kill(os.getpid(), signals.SIGINT)
        assert stop.signum == signals.SIGINT and capfd.readouterr().err == ""
    with runs.stop_signals(announce=True) as stop:  # a scheduler's SIGTERM: its log ends on the run's one line
        os.kill(os.getpid(), signals.SIGTERM)
        assert stop.signum == signals.SIGTERM and capfd.readouterr().err == ""
