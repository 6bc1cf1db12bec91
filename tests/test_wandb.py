"""--wandb true: every update's metrics also go to Weights & Biases (offline here: nothing leaves the machine)."""

import time

import pytest

import phalanx
from phalanx.errors import ConfigError


def test_wandb_offline_run_logs_every_update_and_resume_continues_it(tmp_path, monkeypatch):
    wandb = pytest.importorskip("wandb")
    monkeypatch.setenv("WANDB_SILENT", "true")
    logged: list[tuple[int, set]] = []
    real_init = wandb.init

    def spying_init(**kwargs):  # the real W&B run, with what Phalanx hands its log() noted
        run = real_init(**kwargs)
        real_log = run.log

        def log(data, step=None, **kw):
            logged.append((step, set(data)))
            return real_log(data, step=step, **kw)

        run.log = log
        return run

    monkeypatch.setattr(wandb, "init", spying_init)
    cfg = dict(env="cartpole", total_steps=4 * 256, num_envs=4, num_steps=64, num_minibatches=2, progress=False,
               tensorboard=False, eval_episodes=0, wandb=True, wandb_mode="offline", wandb_project="phalanx-test")
    phalanx.train(run_dir=tmp_path / "r", max_updates=2, **cfg)
    run_id = (tmp_path / "r" / "wandb_id").read_text()
    wandb_dir = tmp_path / "r" / "wandb"
    part_file = f"offline-run-*-{run_id}/run-{run_id}.wandb"
    [first] = wandb_dir.glob(part_file)
    assert _written(first) > 1000  # W&B wrote the first part to disk
    # W&B names a run's folder by the second it started, so a resume within the same second reuses it.
    first.parent.rename(tmp_path / "first_part")
    phalanx.train(resume=tmp_path / "r")
    assert (tmp_path / "r" / "wandb_id").read_text() == run_id  # the resumed run continues the same W&B run
    assert [step for step, _ in logged] == [256, 512, 768, 1024]
    assert all({"charts/episode_return", "losses/policy_loss", "charts/sps"} <= keys for _, keys in logged)
    [second] = wandb_dir.glob(part_file)
    assert _written(second) > 1000  # and the resumed part


def _written(path, seconds: float = 30.0) -> int:
    """The file's size once W&B's writer (its own process, which `finish` may return before under load: the
    suite saw 7 bytes once on a busy 2-core machine) has put more than its header there, or the deadline passed."""
    deadline = time.monotonic() + seconds
    while path.stat().st_size <= 1000 and time.monotonic() < deadline:
        time.sleep(0.1)
    return path.stat().st_size


def test_wandb_mode_is_checked(tmp_path):
    with pytest.raises(ConfigError, match="wandb_mode"):
        phalanx.train(env="cartpole", wandb=True, wandb_mode="cloud", run_dir=tmp_path / "r")
