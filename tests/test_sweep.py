"""phalanx sweep and phalanx compare: configurations x seeds in parallel processes, killed and resumed,
summarised over seeds with bootstrap intervals; the same sweep on a local Ray instance."""

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import pytest

from phalanx import checkpoint as ckpt
from phalanx.cli import main
from phalanx.compare import bootstrap_ci, iqm
from phalanx.errors import ConfigError
from phalanx.runs import read_metrics
from phalanx.sweep import check_spec, open_sweep

SPEC = """\
base: {env: cartpole, total_steps: 8192, num_envs: 8, num_steps: 64, num_minibatches: 2, checkpoint_every: 512,
       eval_episodes: 3, tensorboard: false, torch_threads: 1}
grid: {lr: [0.001, 0.003]}
seeds: [1, 2]
"""


def _sweep_cmd(spec: Path, d: Path, *extra: str) -> list[str]:
    return [sys.executable, "-m", "phalanx", "sweep", str(spec), "--dir", str(d), "--workers", "2", *extra]


def test_sweep_in_parallel_processes_survives_a_kill_and_compare_summarises_it(tmp_path):
    spec, d = tmp_path / "spec.yaml", tmp_path / "sweep"
    spec.write_text(SPEC)
    proc = subprocess.Popen(_sweep_cmd(spec, d), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True)
    # Kill the sweep and its runs once a run is part-way: it has a checkpoint and has not finished.
    deadline = time.time() + 240
    while time.time() < deadline:
        partway = [r for r in (d / "runs").glob("*") if ckpt.list_checkpoints(r) and not (r / "eval.json").exists()]
        if partway:
            break
        time.sleep(0.05)
    assert partway, "no run got part-way within 4 minutes"
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    killed_at = time.time()
    saved_step = int(ckpt.list_checkpoints(partway[0])[-1].name[-12:])
    before = json.loads((d / "sweep.json").read_text())["trials"]
    assert any(t["status"] != "done" for t in before)
    kept = {t["name"]: (d / "runs" / t["name"] / "metrics.jsonl").stat().st_mtime for t in before if t["status"] == "done"}
    killed = partway[0].name

    out = subprocess.run(_sweep_cmd(spec, d), capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stdout + out.stderr
    trials = json.loads((d / "sweep.json").read_text())["trials"]
    assert [t["status"] for t in trials] == ["done"] * 4 and {t["seed"] for t in trials} == {1, 2}
    assert all(isinstance(t["result"], float) for t in trials)
    for name, mtime in kept.items():  # finished runs were kept, not trained again
        assert (d / "runs" / name / "metrics.jsonl").stat().st_mtime == mtime
    # The run killed part-way resumed from its checkpoint: every update logged once, to the end, and the
    # updates up to the checkpoint are the ones logged before the kill (not trained again).
    rows = read_metrics(d / "runs" / killed)
    assert [r["step"] for r in rows] == list(range(512, 8193, 512))
    assert saved_step >= 512 and all(r["time"] < killed_at for r in rows if r["step"] <= saved_step)

    assert main(["compare", str(d), "--out", str(tmp_path / "cmp")]) == 0
    result = json.loads((tmp_path / "cmp" / "compare.json").read_text())
    groups = {g["config"]: g for g in result["groups"]}
    assert set(groups) == {"lr=0.001", "lr=0.003"}
    for g in groups.values():
        assert g["seeds"] == [1, 2] and len(g["scores"]) == 2
        assert g["mean_ci"][0] <= g["mean"] <= g["mean_ci"][1]
        assert min(g["scores"]) <= g["iqm"] <= max(g["scores"])
    md = (tmp_path / "cmp" / "compare.md").read_text()
    assert "| lr=0.001 | 1,2 |" in md and "95% CI" in md
    png = tmp_path / "cmp" / "curves.png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000


def test_sweep_spec_errors_are_one_line(tmp_path):
    for spec, match in (({"grid": {"lr": [1e-3]}, "random": {"lr": [1e-3]}}, "give one of grid, random or optuna"),
                        ({"grid": {"no_such_key": [1]}}, r"grid.no_such_key: not a config key"),
                        ({"random": {"lr": {"log_uniform": [0, 1]}}, "trials": 2}, "log_uniform: low > 0"),
                        ({"random": {"lr": [1e-3]}}, "'trials' must be a positive integer"),
                        ({"seeds": "1,2"}, "'seeds' must be a non-empty list"),
                        ({"sedes": [1]}, "spec key 'sedes' is unknown")):
        with pytest.raises(ConfigError, match=match) as err:
            check_spec(spec)
        assert "\n" not in str(err.value)
    bad = {"base": {"env": "cartpole", "lr": -1.0}}
    with pytest.raises(ConfigError, match="lr"):
        open_sweep(tmp_path / "bad", check_spec(bad))
    assert not (tmp_path / "bad").exists()
    spec = tmp_path / "spec.yaml"
    spec.write_text(SPEC)
    open_sweep(tmp_path / "s", check_spec({"base": {"env": "cartpole"}}))
    assert main(["sweep", str(spec), "--dir", str(tmp_path / "s")]) == 2  # the directory holds another sweep


def test_random_and_optuna_sweeps_draw_within_their_ranges(tmp_path):
    pytest.importorskip("optuna")
    for kind in ("random", "optuna"):
        spec = check_spec({"base": {"env": "cartpole", "total_steps": 256, "num_envs": 4, "num_steps": 32,
                                    "num_minibatches": 2, "eval_episodes": 2, "tensorboard": False, "torch_threads": 1},
                           kind: {"lr": {"log_uniform": [1e-4, 1e-2]}, "num_epochs": {"int": [1, 3]}},
                           "trials": 3, "seeds": [1]})
        (tmp_path / f"{kind}.json").write_text(json.dumps(spec))
        assert main(["sweep", str(tmp_path / f"{kind}.json"), "--dir", str(tmp_path / kind), "--workers", "2"]) == 0
        trials = json.loads((tmp_path / kind / "sweep.json").read_text())["trials"]
        assert len(trials) == 3 and all(t["status"] == "done" for t in trials)
        assert all(1e-4 <= t["values"]["lr"] <= 1e-2 and 1 <= t["values"]["num_epochs"] <= 3 for t in trials)
        assert len({t["values"]["lr"] for t in trials}) == 3
    assert (tmp_path / "optuna" / "optuna.journal").stat().st_size > 0


def test_iqm_and_stratified_bootstrap():
    assert iqm(np.array([0.0, 1, 2, 3, 4, 5, 6, 100])) == pytest.approx(3.5)  # the middle half: 2, 3, 4, 5
    x = np.arange(20, dtype=float)
    lo, hi = bootstrap_ci(x, lambda a: float(a.mean()))
    assert lo < x.mean() < hi and hi - lo < 10
    # Stratified: each task's column is resampled within itself, so a constant column never mixes with the other.
    two = np.stack([np.full(10, 5.0), np.full(10, -5.0)], 1)
    assert bootstrap_ci(two, lambda a: float(a[:, 0].mean())) == (5.0, 5.0)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.slow
def test_the_same_sweep_runs_on_a_local_ray_instance(tmp_path):
    pytest.importorskip("ray")
    ray_cli = shutil.which("ray", path=str(Path(sys.executable).parent))
    if ray_cli is None:
        pytest.skip("the ray command is not installed beside this Python")
    port = _free_port()
    env = {**os.environ, "RAY_USAGE_STATS_ENABLED": "0"}
    temp = tempfile.mkdtemp(prefix="ray", dir="/tmp")  # Ray's socket paths must stay under 108 bytes
    start = subprocess.run([ray_cli, "start", "--head", f"--port={port}", "--num-cpus=2", "--include-dashboard=false",
                            f"--temp-dir={temp}"], capture_output=True, text=True, timeout=180, env=env)
    assert start.returncode == 0, start.stdout + start.stderr
    try:
        spec, d = tmp_path / "spec.yaml", tmp_path / "sweep"
        # Two trials, one a worker: each is a fresh `phalanx train` process, and Ray's start is most of the time.
        spec.write_text(SPEC.replace("total_steps: 8192", "total_steps: 1024").replace("seeds: [1, 2]", "seeds: [1]"))
        out = subprocess.run(_sweep_cmd(spec, d, "--backend", "ray", "--address", f"127.0.0.1:{port}"),
                             capture_output=True, text=True, timeout=600, env=env)
        assert out.returncode == 0, out.stdout + out.stderr
        trials = json.loads((d / "sweep.json").read_text())["trials"]
        assert [t["status"] for t in trials] == ["done"] * 2
        assert all(read_metrics(d / "runs" / t["name"])[-1]["step"] == 1024 for t in trials)
        assert main(["compare", str(d), "--out", str(tmp_path / "cmp")]) == 0
    finally:
        subprocess.run([ray_cli, "stop", "--force"], capture_output=True, timeout=120, env=env)
        shutil.rmtree(temp, ignore_errors=True)


def test_a_sweep_spec_with_a_quoted_number_is_refused_before_any_trial_runs(tmp_path, capsys):
    """The trials read their keys from files, which must hold typed values: a spec whose base has `num_envs: "8"`
    passed the sweep's own check and then failed in every trial's log."""
    spec = tmp_path / "spec.yaml"
    spec.write_text('base: {env: cartpole, num_envs: "8"}\nseeds: [1]\n')
    assert main(["sweep", str(spec), "--dir", str(tmp_path / "s")]) == 2
    err = capsys.readouterr().err
    assert "config key 'num_envs'" in err and "must be int" in err, err
    assert not (tmp_path / "s").exists()


def test_a_trial_that_failed_before_its_first_checkpoint_runs_again_afresh(tmp_path):
    """A failed trial's run directory holds its metrics but no checkpoint; the retry starts it afresh (a new
    run refuses a directory holding an earlier run's files unless told to overwrite)."""
    spec = check_spec({"base": {"env": "cartpole", "total_steps": 128, "num_envs": 4, "num_steps": 16,
                                "eval_episodes": 0, "tensorboard": False, "torch_threads": 1}, "seeds": [1]})
    sweep = open_sweep(tmp_path / "s", spec)
    run = sweep.run_dir(sweep.trials[0])
    run.mkdir(parents=True)
    (run / "metrics.jsonl").write_text('{"step": 64}\n')
    (run / "env_crash.txt").write_text("Traceback\n")
    sweep.trials[0].status = "failed"
    sweep.save()
    assert main(["sweep", "--dir", str(tmp_path / "s"), "--workers", "1"]) == 0
    assert [r["step"] for r in read_metrics(run)] == [64, 128]
    assert not (run / "env_crash.txt").exists()
