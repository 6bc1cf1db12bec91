"""PettingZoo AEC envs that put the action mask in the info dict (`infos[agent]["action_mask"]`) rather than the
observation dict: the `pz:` adapter takes it from there, with the same checks."""

import re
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

pytest.importorskip("pettingzoo")

from pettingzoo.test import api_test  # noqa: E402

from phalanx.cli import main  # noqa: E402
from phalanx.envs import ActionError, check_env, make  # noqa: E402
from phalanx.errors import EnvContractError  # noqa: E402

TESTS = Path(__file__).resolve().parent
if str(TESTS) not in sys.path:
    sys.path.insert(0, str(TESTS))  # makes `pz:pz_info_turns:make_env` importable

import pz_info_turns  # noqa: E402

IN_INFO = "pz:pz_info_turns:make_env"
IN_OBSERVATION = "pz:pz_turns:make_env"


def test_the_info_mask_game_passes_pettingzoos_api_test():
    api_test(pz_info_turns.make_env(), num_cycles=60)


def play(name, steps, seed):
    """Random legal moves through the adapter, the mask the record's: -> the records."""
    env = make(name, num_envs=3, seed=seed)
    gen = torch.Generator().manual_seed(seed)
    records = [env.reset()]
    for _ in range(steps):
        records.append(env.step(env.action_space.sample(3, 2, gen, "cpu", mask=records[-1].action_mask)))
    return env, records


def test_an_info_mask_game_passes_check_env_from_the_command_line(capsys):
    assert main(["check-env", IN_INFO, "--steps", "64", "--num-envs", "3"]) == 0
    assert "every rule of the env contract holds (3 envs x 2 slots" in capsys.readouterr().out


def test_a_mask_in_info_is_the_records_mask_as_one_in_the_observation_is():
    """The same game, its mask in the info dict or in the observation dict: the same records, move for move
    (before: the info mask was ignored, so the record held no mask and the observations differed in form)."""
    info_env, by_info = play(IN_INFO, 60, seed=3)
    _, by_obs = play(IN_OBSERVATION, 60, seed=3)
    assert info_env.action_masks  # known before the first reset: a loaded policy and the trainer read it there
    assert make(IN_INFO, num_envs=1).action_masks
    assert info_env.observation_space.shape == (2,)
    for a, b in zip(by_info, by_obs):
        assert a.action_mask is not None and torch.equal(a.action_mask, b.action_mask)
        for field in ("obs", "reward", "terminated", "truncated", "active", "final_obs"):
            assert torch.equal(getattr(a, field), getattr(b, field)), field
    assert sum(float(r.info["episode_length"].sum()) for r in by_info[1:]) > 0  # games ended (and restarted) on the way
    assert any(not bool(r.action_mask[i, int(r.active[i].nonzero())].all()) for r in by_info for i in range(3))


def test_an_illegal_move_by_the_info_mask_is_refused_in_one_line_and_never_played():
    env = make(IN_INFO, num_envs=1, seed=0)
    gen = torch.Generator().manual_seed(0)
    rec = env.reset()
    for _ in range(100):  # legal moves until the mover may not take all it could
        slot = int(rec.active[0].nonzero())
        row = rec.action_mask[0, slot, :pz_info_turns.TAKES[env.agent_names[slot]]]
        if not row.all():
            break
        rec = env.step(env.action_space.sample(1, 2, gen, "cpu", mask=rec.action_mask))
    agent, pile, illegal = env.agent_names[slot], env.envs[0].pile, int(np.flatnonzero(~row.numpy())[0])
    actions = torch.zeros(1, 2, dtype=torch.long)
    actions[0, slot] = illegal
    message = f"action {illegal} of {agent} is not allowed by its action_mask (allowed: {list(range(pile))})"
    with pytest.raises(ActionError, match=re.escape(message)):
        env.step(actions)
    assert env.envs[0].pile == pile


@pytest.mark.parametrize("broken,message", [
    ("mask_shape", "taker_0's info['action_mask'] must be bool or 0/1 integers of shape [3] (one per action of Discrete(3)); got int8 [4]"),
    ("mask_dtype", "taker_0's info['action_mask'] must be bool or 0/1 integers of shape [3] (one per action of Discrete(3)); got float32 [3]"),
    ("mask_empty", "taker_1's action_mask allows no action on its turn; a mask must leave the agent to move at least one action"),
    ("mask_missing", "taker_1's info['action_mask'] must be bool or 0/1 integers of shape [2] (one per action of Discrete(2)); "
                     "got no action_mask"),
])
def test_a_bad_mask_in_info_is_one_line_naming_the_env_and_agent(broken, message, capsys):
    with pytest.raises(EnvContractError, match="pz:pz_info_turns:make_env"):
        check_env(make(IN_INFO, num_envs=2, broken=broken), steps=16)
    assert main(["check-env", IN_INFO, "--broken", broken]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and message in err and "env 'pz:pz_info_turns:make_env'" in err, err


def test_players_read_the_info_mask_in_pettingzoos_observation_dict():
    """A player written against PettingZoo's observation dict (observation and action_mask) plays an info-mask game
    as it plays any other: `turn_observations` puts the info's mask beside the observation."""
    env = make(IN_INFO, num_envs=2, seed=1)
    rec = env.reset()
    for _ in range(20):
        actions = torch.zeros(2, 2, dtype=torch.long)
        for i, (slot, seen) in enumerate(env.turn_observations()):
            assert set(seen) == {"observation", "action_mask"}
            assert np.array_equal(seen["observation"], env.envs[i].observe(env.agent_names[slot]))
            own = rec.action_mask[i, slot, :len(seen["action_mask"])]  # taker_1's row is padded to taker_0's 3 actions
            assert own.tolist() == seen["action_mask"].astype(bool).tolist()
            actions[i, slot] = int(np.flatnonzero(seen["action_mask"])[-1])  # take as many as allowed
        rec = env.step(actions)
