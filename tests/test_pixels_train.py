"""Image observations through the trainer: uint8 buffers, the memory check, eval figures, recordings."""

import json

import pytest
import torch

import phalanx
from phalanx import runs
from phalanx.cli import main
from phalanx.config import resolve
from phalanx.errors import ConfigError
from phalanx.rollout import buffer_bytes, buffer_specs
from phalanx.trainer import Trainer

TINY = dict(env="pixel_goal", num_envs=4, num_steps=8, num_epochs=1, num_minibatches=2, cnn_channels=[4, 8, 8],
            cnn_dense=32, progress=False, tensorboard=False)


def test_uint8_buffers_and_memory_estimate(tmp_path):
    t = Trainer(resolve(dict(TINY, run_dir=str(tmp_path / "r"))))
    try:
        obs = t.rollout.buf["obs"]
        assert obs.dtype == torch.uint8 and obs.shape == (8, 4, 1, 4, 72, 80)
        assert buffer_bytes(buffer_specs(t.cfg, t.env, t.model)) == sum(b.numel() * b.element_size() for b in t.rollout.buf.values())
        stats = t.collect()
        assert t.rollout.buf["obs"].dtype == torch.uint8 and int(t.rollout.buf["obs"].max()) <= 3 and int(t.rollout.buf["obs"].max()) > 0
        assert torch.isfinite(stats["ep_return_sum"])
        before = [p.detach().clone() for p in t.model.parameters()]
        metrics = t.update()
        assert all(torch.isfinite(v).all() for v in metrics.values())
        assert any(not torch.equal(a, b) for a, b in zip(before, t.model.parameters()))
    finally:
        t.close()


def test_refuses_buffers_that_do_not_fit(tmp_path, monkeypatch):
    monkeypatch.setattr(runs, "free_memory_bytes", lambda device: 10 * 2**20)
    with pytest.raises(ConfigError, match=r"lower num_envs \(64\) or num_steps \(128\)"):
        Trainer(resolve(dict(TINY, num_envs=64, num_steps=128, run_dir=str(tmp_path / "r"))))


def test_cnn_needs_images_and_no_obs_norm(tmp_path):
    with pytest.raises(ConfigError, match="flat observations"):
        phalanx.train(env="cartpole", model="cnn", run_dir=tmp_path / "a", progress=False)
    with pytest.raises(ConfigError, match="'norm_obs' must be false"):
        phalanx.train(run_dir=tmp_path / "b", norm_obs=True, total_steps=32, **TINY)


def test_eval_reports_goal_figures_and_records(tmp_path, capsys):
    run = tmp_path / "r"
    phalanx.train(run_dir=run, total_steps=64, **TINY)
    assert main(["eval", str(run), "--episodes", "4", "--json", "--vs", "random"]) == 0
    out = json.loads(capsys.readouterr().out)
    learned = out["learned"]
    for k in ("success_rate", "median_steps_to_goal", "mean_return"):
        assert k in learned and k in learned["sampled_play"] and k in out["random"]
    gif = tmp_path / "ep.gif"
    assert main(["eval", str(run), "--episodes", "2", "--record", str(gif)]) == 0
    from PIL import Image

    with Image.open(gif) as im:
        assert im.n_frames > 1 and im.size == (80, 72)
    assert main(["eval", str(run), "--episodes", "2", "--record", str(tmp_path / "ep.avi")]) == 2


@pytest.mark.parametrize("env", ["duel", "cartpole"])
def test_record_other_workloads(tmp_path, env):
    from phalanx.record import record_episode

    info = record_episode(None, env, tmp_path / "x.gif", max_steps=20)
    assert info["frames"] > 1 and (tmp_path / "x.gif").stat().st_size > 0


def test_record_a_gym_env_from_the_command_line(tmp_path, monkeypatch):
    """gymnasium draws Acrobot's frames (render_mode rgb_array, asked for only when recording)."""
    pytest.importorskip("pygame")
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(tmp_path))  # pygame's display check, headless
    run = tmp_path / "acro"
    assert main(["train", "--env", "gym:Acrobot-v1", "--total-steps", "256", "--num-envs", "2", "--num-steps", "64",
                 "--progress", "false", "--tensorboard", "false", "--run-dir", str(run)]) == 0
    gif = tmp_path / "acro.gif"
    assert main(["eval", str(run), "--episodes", "1", "--record", str(gif)]) == 0
    from PIL import Image

    with Image.open(gif) as im:
        assert im.n_frames > 10 and im.size == (500, 500)
