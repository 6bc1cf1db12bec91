"""A single-agent Phalanx env for other libraries: gymnasium's VectorEnv (same-step autoreset) and a
Stable-Baselines3 VecEnv that SB3's PPO trains on."""

import numpy as np
import pytest
import torch

from phalanx.envs import make, to_gymnasium, to_sb3
from phalanx.errors import ConfigError


def test_gymnasium_vector_export_keeps_boundaries():
    env = to_gymnasium(make("cartpole", num_envs=4, seed=0, max_steps=10))
    obs, info = env.reset(seed=3)
    assert obs.shape == (4, 4) and obs.dtype == np.float32 and info == {}
    assert env.single_action_space.n == 2 and env.observation_space.shape == (4, 4)
    twin = make("cartpole", num_envs=4, seed=0, max_steps=10)
    twin.reset(seed=3)
    truncated_seen = False
    for _ in range(12):
        actions = np.zeros(4, dtype=np.int64)
        obs, reward, term, trunc, info = env.step(actions)
        rec = twin.step(torch.zeros(4, 1, dtype=torch.long))
        np.testing.assert_array_equal(obs, rec.obs[:, 0].numpy())
        np.testing.assert_array_equal(term, rec.terminated[:, 0].numpy())
        np.testing.assert_array_equal(trunc, rec.truncated[:, 0].numpy())
        done = term | trunc
        if done.any():
            np.testing.assert_array_equal(info["_final_obs"], done)
            for i in np.flatnonzero(done):
                np.testing.assert_array_equal(info["final_obs"][i], rec.final_obs[i, 0].numpy())
        truncated_seen |= bool(trunc.any())
    assert truncated_seen  # the 10-step limit is a truncation, not a termination


def test_exports_refuse_multi_agent_envs():
    with pytest.raises(ConfigError, match="single-agent env; 'bucket_brigade' has 4 agent slots"):
        to_gymnasium(make("bucket_brigade", num_envs=2))


def test_sb3_ppo_trains_on_a_phalanx_env():
    """SB3's PPO, 16k steps on 8 Phalanx cartpoles (~8 s): its sampled return rises from random play's
    (~22) to well above it."""
    sb3 = pytest.importorskip("stable_baselines3")
    from stable_baselines3.common.evaluation import evaluate_policy

    venv = to_sb3(make("cartpole", num_envs=8, seed=0))
    model = sb3.PPO("MlpPolicy", venv, n_steps=128, batch_size=256, n_epochs=4, learning_rate=1e-3, seed=0, device="cpu")
    before, _ = evaluate_policy(model, venv, n_eval_episodes=16, deterministic=False, warn=False)
    model.learn(total_timesteps=16384)
    after, _ = evaluate_policy(model, venv, n_eval_episodes=16, deterministic=False, warn=False)
    assert before < 40 and after > 4 * before, (before, after)


def test_sb3_export_marks_time_limits():
    pytest.importorskip("stable_baselines3")
    venv = to_sb3(make("cartpole", num_envs=2, seed=0, max_steps=5))
    venv.seed(1)
    venv.reset()
    for _ in range(5):
        venv.step_async(np.zeros(2, dtype=np.int64))
        obs, reward, done, infos = venv.step_wait()
    assert done.all() and all(i["TimeLimit.truncated"] for i in infos)
    assert infos[0]["terminal_observation"].shape == (4,)


def test_gym_import_takes_constructor_options_and_processes_from_the_command_line(tmp_path):
    """`--max-episode-steps 40` reaches gym.make typed as an int; `--vectorization-mode async` steps
    the copies in their own processes."""
    import json

    from phalanx.cli import main

    run = tmp_path / "g"
    assert main(["train", "--env", "gym:CartPole-v1", "--max-episode-steps", "40", "--vectorization-mode", "async",
                 "--total-steps", "512", "--num-envs", "2", "--num-steps", "64", "--progress", "false", "--tensorboard", "false",
                 "--run-dir", str(run)]) == 0
    cfg = json.loads((run / "config.json").read_text())
    assert cfg["env_options"] == {"max_episode_steps": 40, "vectorization_mode": "async"}
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    assert all(r["episode_length"] <= 40 for r in rows if "episode_length" in r)
    assert main(["train", "--env", "gym:CartPole-v1", "--vectorization-mode", "forked", "--total-steps", "64"]) == 2
