"""The env contract: `check_env` names each broken rule in one line, the trainer refuses a broken env
before it creates anything, and the spaces refuse bad actions."""

import pytest
import torch

from phalanx.cli import main
from phalanx.envs import ActionError, Box, Discrete, MultiDiscrete, check_env, make, registered
from phalanx.errors import EnvContractError, MissingExtraError
from tests import contract_envs as ce


def test_a_contract_keeping_env_passes():
    check_env(ce.GoodEnv(4))
    check_env(ce.Stacked(4), steps=40)  # frame_stack: its stacks move and restart by the rule


@pytest.mark.parametrize("name", sorted(registered()))
def test_every_builtin_env_keeps_the_contract(name):
    try:
        env = make(name, num_envs=3, seed=0)
    except MissingExtraError as e:  # a tuned gym task whose simulator is an optional package (Box2D)
        pytest.skip(str(e))
    check_env(env, steps=24)


def test_trial_nav_keeps_the_contract_across_episode_ends():
    """Its episodes are up to 3 trials long: 24 steps end none. At the episode's end the wrapper flagged the slots
    parked since their own end `terminated` again (`phalanx check-env trial_nav --steps 300` failed at step 223)."""
    check_env(make("trial_nav", num_envs=4, seed=7), steps=300, seed=7)


@pytest.mark.parametrize("name", sorted(ce.BROKEN))
def test_check_env_names_the_broken_rule_in_one_line(name):
    cls, message = ce.BROKEN[name]
    with pytest.raises(EnvContractError) as info:
        check_env(cls(4))
    text = str(info.value)
    assert message in text, text
    assert "\n" not in text and text.startswith("env 'good': ")


@pytest.mark.parametrize("name", ["reward_per_env", "float_terminated", "gym_tuple", "float64_obs", "missing_roles", "no_state_dict"])
def test_train_refuses_a_broken_env_with_one_line_and_leaves_nothing(tmp_path, capsys, name):
    run = tmp_path / "run"
    code = main(["train", "--env", f"tests.contract_envs:{name}", "--total-steps", "64", "--num-envs", "4", "--num-steps", "8",
                 "--progress", "false", "--tensorboard", "false", "--run-dir", str(run)])
    err = capsys.readouterr().err.strip()
    assert code == 2
    assert err.count("\n") == 0 and err.startswith("phalanx: error: env "), err
    assert ce.BROKEN[name][1] in err
    assert not run.exists()


def test_check_env_command(capsys):
    assert main(["check-env", "cartpole", "--steps", "16"]) == 0
    assert "every rule of the env contract holds" in capsys.readouterr().out
    assert main(["check-env", "tests.contract_envs:gym_tuple"]) == 2
    assert "got tuple" in capsys.readouterr().err
    assert main(["check-env", "cartpole", "--max-steps", "50", "--steps", "8"]) == 0
    assert main(["check-env", "cartpole", "--nope", "1"]) == 2
    assert "env options of 'cartpole': max_steps" in capsys.readouterr().err


def test_spaces_refuse_bad_actions():
    d = Discrete(2)
    assert d.check(torch.tensor([[1], [0]]), 2, 1).shape == (2, 1)
    assert d.check(torch.tensor([1, 0]), 2, 1).shape == (2, 1)  # single agent: [N] is [N, 1]
    with pytest.raises(ActionError, match=r"actions must lie in \[0, 2\) for Discrete\(2\); got 7"):
        d.check(torch.tensor([[7], [0]]), 2, 1)
    with pytest.raises(ActionError, match="integer dtype for Discrete.2.; got float32"):
        d.check(torch.tensor([[0.7], [0.0]]), 2, 1)
    with pytest.raises(ActionError, match=r"shape \[2, 3\]"):
        d.check(torch.zeros(2, 2, dtype=torch.long), 2, 3)
    m = MultiDiscrete((2, 5))
    with pytest.raises(ActionError, match=r"actions\[\.\.\., 1\] must lie in \[0, 5\).*got 5"):
        m.check(torch.tensor([[[1, 5]]]), 1, 1)
    b = Box.uniform(-1, 1, (3,))
    with pytest.raises(ActionError, match="floating dtype"):
        b.check(torch.zeros(1, 1, 3, dtype=torch.long), 1, 1)


@pytest.mark.parametrize("name", ["cartpole", "trial_nav", "bucket_brigade"])
def test_builtin_envs_refuse_out_of_range_and_float_discrete_actions(name):
    env = make(name, num_envs=2, seed=0)
    env.reset(seed=0)
    space = env.action_space
    shape = (2, env.num_agents, *space.shape)
    high = space.n if isinstance(space, Discrete) else max(space.nvec)
    with pytest.raises(ActionError, match="must lie in"):
        env.step(torch.full(shape, high, dtype=torch.long))
    with pytest.raises(ActionError, match="integer dtype"):
        env.step(torch.full(shape, 0.7))
