"""Learning checks on budgets that run in seconds (pendulum: about a minute) on CPU."""

import pytest

import phalanx
from phalanx.evaluate import evaluate_policy


@pytest.mark.slow
def test_pendulum_default_config_improves_far_beyond_random(tmp_path):
    random = evaluate_policy(None, "pendulum", episodes=32, seed=4, greedy=False)
    assert random["mean_return"] < -1000
    result = phalanx.train(env="pendulum", total_steps=500_000, seed=2, run_dir=tmp_path / "r", progress=False, tensorboard=False)
    trained = evaluate_policy(result.policy, "pendulum", episodes=32, seed=4)
    assert trained["mean_return"] > -400, trained
