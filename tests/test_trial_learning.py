"""A memory policy adapts within an episode: it scores more in trial 1 than in trial 0."""

import pytest

import phalanx
from phalanx.evaluate import evaluate_policy

TINY = {"trials": 2, "num_agents": 1, "coplayers": 0}


@pytest.mark.slow
def test_lstm_adapts_across_trials_on_a_tiny_trial_nav(tmp_path):
    result = phalanx.train(
        env="trial_nav", env_options=TINY, model="lstm", lstm_hidden=64, num_envs=64, num_steps=28, num_minibatches=4,
        lr=1e-3, ent_coef=0.01, total_steps=250_000, seed=1, run_dir=tmp_path / "r", progress=False, tensorboard=False,
    )
    ev = evaluate_policy(result.policy, "trial_nav", TINY, episodes=400, seed=2)
    # One exit of four can be checked per trial: trial 0 is a guess (~0.25); remembering the failed
    # exit and trying another raises trial 1 toward 0.5.
    assert ev["mean_trial_0_score"] < 0.4
    assert ev["mean_ada_delta_trial_1_minus_0"] > 0.1, ev
