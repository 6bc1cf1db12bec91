"""Image observations through the trainer: uint8 buffers, the memory check, eval figures, recordings."""

import json

import pytest
import torch

import phalanx
from phalanx import devices
from phalanx.buffer import buffer_bytes, buffer_specs
from phalanx.cli import main
from phalanx.config import resolve
from phalanx.envs import make
from phalanx.errors import ConfigError
from phalanx.models.registry import build_model
from phalanx.rollout import StepMode
from phalanx.trainer import Trainer

TINY = dict(env="pixel_goal", num_envs=4, num_steps=8, num_epochs=1, num_minibatches=2, cnn_channels=[4, 8, 8],
            cnn_dense=32, progress=False, tensorboard=False)


def test_uint8_buffers_and_memory_estimate(tmp_path):
    t = Trainer(resolve(dict(TINY, run_dir=str(tmp_path / "r"))))
    try:
        frames = t.run.buffer["frames"]  # a 4-frame stack: each frame stored once, 8 steps + 3 older frames
        assert "obs" not in t.run.buffer and frames.dtype == torch.uint8 and frames.shape == (8 + 3, 4, 1, 72, 80)
        assert buffer_bytes(buffer_specs(t.run.cfg.num_steps, t.run.env, t.run.model)) == sum(b.numel() * b.element_size() for b in t.run.buffer.values())
        stats = t.collect()
        assert int(t.run.buffer["frames"].max()) <= 3 and int(t.run.buffer["frames"].max()) > 0
        assert torch.isfinite(stats["ep_return_sum"])
        before = [p.detach().clone() for p in t.run.model.parameters()]
        metrics = t.update()
        assert all(torch.isfinite(v).all() for v in metrics.values())
        assert any(not torch.equal(a, b) for a, b in zip(before, t.run.model.parameters()))
    finally:
        t.close()


def test_refuses_buffers_that_do_not_fit(tmp_path, monkeypatch):
    monkeypatch.setattr(devices, "free_memory_bytes", lambda device: 10 * 2**20)
    with pytest.raises(ConfigError, match=r"lower num_envs \(64: at most 9 fit with num_steps 128\) or num_steps$"):
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


def _observed_and_rebuilt(t: Trainer, collects: int) -> tuple[torch.Tensor, torch.Tensor, int]:
    """The observations the rollout acted on over its last collect, as the env returned them and as the update
    gathers them from the frames stored once; and how many stacks restarted."""
    seen, step = [], t.run.env.step

    def recording(actions):
        rec = step(actions)
        seen.append(rec.obs.clone())
        return rec

    t.run.env.step = recording
    for _ in range(collects):
        first = t.run.rollout.record.obs.clone()
        seen.clear()
        t.collect()
    adv, ret, trained = t.run.buffer.advantages(t.run.rollout.acts_after(), t.gae)
    batch = t.run.buffer.ppo_batch(adv, ret, t.run.buffer["values"], trained, None)
    rebuilt = batch.index(torch.arange(len(batch)))  # through index, as a minibatch is
    return torch.stack([first, *seen[:-1]]).flatten(0, 1), rebuilt.obs, int(t.run.buffer["stack_restarts"].sum())


@pytest.mark.parametrize("captured", [False, True])
def test_frames_stored_once_rebuild_the_observations_bit_for_bit(tmp_path, captured):
    """Stacks that go on, start afresh at episode ends (a 7-step time limit truncates: auto-resets; the goal
    terminates some) and carry over from one collect to the next, eagerly and in the captured step."""
    cfg = dict(TINY, num_steps=24, env_options={"max_steps": 7, "k": 1})
    t = Trainer(resolve(dict(cfg, run_dir=str(tmp_path / "r"))))
    try:
        observed, rebuilt, restarts = _observed_and_rebuilt(t, collects=2)
        assert restarts >= 4 * 3 and rebuilt.dtype == torch.uint8
        assert torch.equal(observed, rebuilt)
        if captured:  # the same draws replayed in the captured step (its env cannot be watched from inside)
            c = Trainer(resolve(dict(cfg, run_dir=str(tmp_path / "c"))), step_mode=StepMode(compiled=True, backend="aot_eager"))
            try:
                c.collect()
                c.collect()
                adv, ret, trained = c.run.buffer.advantages(c.run.rollout.acts_after(), c.gae)
                batch = c.run.buffer.ppo_batch(adv, ret, c.run.buffer["values"], trained, None)
                assert torch.equal(batch.index(torch.arange(len(batch))).obs, observed)
            finally:
                c.close()
    finally:
        t.close()


def test_the_stored_frames_take_a_quarter_of_the_stacks_bytes(tmp_path):
    """The buffer check's own figure at pixel_goal's default config: each 4-frame observation was stored whole."""
    cfg = resolve(dict(env="pixel_goal", num_envs=65_536, total_steps=10**12, run_dir=str(tmp_path / "r")))
    env = make("pixel_goal", num_envs=4)
    model = build_model(cfg, env)
    frames = buffer_bytes(buffer_specs(cfg.num_steps, env, model, cfg.num_envs))
    whole = cfg.num_steps * cfg.num_envs * 4 * 72 * 80  # the uint8 stacks alone, as stored before
    rest = frames - (cfg.num_steps + 3) * cfg.num_envs * 72 * 80
    assert frames <= (whole + rest) / 3.5 and frames / 2**20 <= 52_000
