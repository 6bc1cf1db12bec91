"""`phalanx export`: every model kind and action space as an ONNX graph that onnxruntime plays in lockstep with
`Policy.act` (docs/EXPORT.md), and the bad input it refuses in one line."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

import phalanx
from phalanx.cli import main
from phalanx.deployed import DeployedPolicy, memory_from_model, memory_to_model

TESTS = Path(__file__).resolve().parent
if str(TESTS) not in sys.path:
    sys.path.insert(0, str(TESTS))  # makes `pz:pz_tiny:...` importable

# One update of a tiny model: built and barely trained, so every test trains in a fraction of a second.
TINY = dict(num_envs=2, num_steps=16, total_steps=32, num_minibatches=1, num_epochs=1, progress=False, tensorboard=False,
            eval_episodes=0, hidden_sizes=[8, 8], lstm_hidden=8, tf_width=8, tf_heads=2, tf_layers=1, tf_horizon=4,
            strategy_history=4, cnn_channels=[4, 8, 8], cnn_dense=16)

# name -> (config; what it covers). Short episodes (env options) so 20 of them take a few dozen steps.
CASES = {
    "mlp-cartpole": dict(env="cartpole", model="mlp", norm_obs=True, env_options={"max_steps": 30}),  # Discrete, obs normalised
    "mlp-pendulum": dict(env="pendulum", model="mlp", env_options={"max_steps": 10}),  # Box
    "mlp-bucket_brigade": dict(env="bucket_brigade", model="mlp", env_options={"max_nights": 6}),  # MultiDiscrete, MAPPO
    "mlp-pz_mixed": dict(env="pz:pz_tiny:make_mixed", model="mlp"),  # Discrete with per-slot counts, a slot that leaves
    "cnn-pixel_goal": dict(env="pixel_goal", model="cnn", env_options={"max_steps": 6}),  # uint8 frame stacks
    "lstm-pixel_goal": dict(env="pixel_goal", model="lstm", env_options={"max_steps": 6}),  # CNN encoder + LSTM
    "lstm-cartpole": dict(env="cartpole", model="lstm", env_options={"max_steps": 30}),
    "transformer-trial_nav": dict(env="trial_nav", model="transformer", env_options={"trials": 2, "max_trial_steps": 3}),
    "strategy-duel": dict(env="duel", model="strategy", env_options={"time_limit": 12}),
    "role_attention-drone_swarm": dict(env="drone_swarm", model="role_attention", env_options={"max_steps": 8}),  # Box, MAPPO
}


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """name -> the run directory of CASES[name], trained once for the module."""
    made: dict[str, Path] = {}

    def get(name: str) -> Path:
        if name not in made:
            run = tmp_path_factory.mktemp("export") / name
            phalanx.train({**TINY, **CASES[name], "run_dir": str(run)})
            made[name] = run
        return made[name]

    return get


def test_policy_act_plays_an_image_memory_model(trained):
    # Policy.act sized the memory from the preprocessed observation's leading axes, which for pixels [N, A, C, H, W]
    # are N * A * C * H, not the N * A slots.
    policy = phalanx.load(trained("lstm-pixel_goal"))
    env = phalanx.make("pixel_goal", num_envs=3, seed=0, max_steps=6)
    rec = env.reset(seed=0)
    actions = policy.act(rec.obs, reset=torch.zeros(3, 1, dtype=torch.bool), active=rec.active)
    assert actions.shape == (3, 1)
    assert policy.memory.batch_size == 3
