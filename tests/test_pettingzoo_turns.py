"""Turn-based PettingZoo (AEC) envs through the `pz:` adapter: one slot moves at a time, rewards as `last()` gives
them, the observation dict's action_mask as the record's mask, illegal moves refused."""

import sys
from pathlib import Path

import numpy as np
import pytest
import torch

pytest.importorskip("pettingzoo")
pytest.importorskip("pygame")  # PettingZoo's classic games import it

from pettingzoo.classic import connect_four_v3, tictactoe_v3  # noqa: E402
from pettingzoo.test import api_test  # noqa: E402

from phalanx.cli import main  # noqa: E402
from phalanx.envs import ActionError, Discrete, check_env, make  # noqa: E402
from phalanx.errors import EnvContractError  # noqa: E402

TESTS = Path(__file__).resolve().parent
if str(TESTS) not in sys.path:
    sys.path.insert(0, str(TESTS))  # makes `pz:pz_turns:make_env` importable

import pz_turns  # noqa: E402

TICTACTOE = "pz:pettingzoo.classic.tictactoe_v3:env"
CONNECT_FOUR = "pz:pettingzoo.classic.connect_four_v3:env"
TURNS = "pz:pz_turns:make_env"


@pytest.mark.parametrize("factory", [pz_turns.make_env, lambda: pz_turns.make_env(truncate_at=3), tictactoe_v3.env,
                                     connect_four_v3.env])
def test_the_aec_envs_of_these_tests_pass_pettingzoos_api_test(factory):
    api_test(factory(), num_cycles=60)


@pytest.mark.parametrize("name,steps", [(TICTACTOE, 64), (CONNECT_FOUR, 200), (TURNS, 64)])
def test_turn_based_envs_pass_check_env_from_the_command_line(name, steps, capsys):
    """Before: PettingZoo's aec_to_parallel assertion ended `phalanx check-env` (and train) in a traceback."""
    assert main(["check-env", name, "--steps", str(steps), "--num-envs", "3"]) == 0
    assert "every rule of the env contract holds (3 envs x 2 slots" in capsys.readouterr().out


def test_one_slot_moves_at_a_time_on_its_observation_and_mask():
    env = make(TICTACTOE, num_envs=2, seed=0)
    assert env.turn_based and env.action_space == Discrete(9) and env.observation_space.shape == (3, 3, 2)
    rec = env.reset()
    assert rec.active.tolist() == [[True, False], [True, False]]
    assert rec.action_mask.shape == (2, 2, 9) and rec.action_mask.all()  # an empty board; the idle slot's row allows all
    moves = torch.tensor([[4, 0], [0, 0]])
    rec = env.step(moves)
    assert rec.active.tolist() == [[False, True], [False, True]]
    assert rec.action_mask[0, 1].tolist() == [i != 4 for i in range(9)] and rec.action_mask[:, 0].all()
    assert rec.action_mask[1, 1].tolist() == [i != 0 for i in range(9)]
    raw = env.envs[0].observe("player_2")
    assert torch.equal(rec.obs[0, 1], torch.from_numpy(raw["observation"].astype(np.float32)))
    assert (rec.obs[:, 0] == 0).all()  # the slot that waits observes nothing
    assert (rec.reward == 0).all() and not (rec.terminated | rec.truncated).any()


def test_an_illegal_move_is_refused_in_one_line_and_never_played():
    env = make(TICTACTOE, num_envs=1, seed=0)
    env.reset()
    env.step(torch.tensor([[4, 0]]))
    board = list(env.envs[0].unwrapped.board.squares)
    with pytest.raises(ActionError, match=r"action 4 of player_2 is not allowed by its action_mask \(allowed: \[0, 1, 2, 3, 5, 6, 7, 8\]\)"):
        env.step(torch.tensor([[0, 4]]))
    assert list(env.envs[0].unwrapped.board.squares) == board
    rec = env.step(torch.tensor([[0, 0]]))  # a legal move still plays
    assert rec.active.tolist() == [[True, False]]


def play_randomly(env, steps, seed):
    """Random legal moves through the adapter: -> the records, and each copy's moves [(slot, action)] in order."""
    gen = torch.Generator().manual_seed(seed)
    rec = env.reset()
    records, moves = [rec], [[] for _ in range(env.num_envs)]
    for _ in range(steps):
        actions = env.action_space.sample(env.num_envs, env.num_agents, gen, "cpu", mask=rec.action_mask)
        for i in range(env.num_envs):
            s = int(rec.active[i].nonzero())
            moves[i].append((s, int(actions[i, s])))
        rec = env.step(actions)
        records.append(rec)
    return records, moves


def credited_per_move(records, i, slot):
    """The adapter's rewards of one slot grouped as the trainer credits them: each game's rewards before the slot's
    first move, then the rewards from each of its moves up to its next move or its end."""
    games, before, chunks = [], 0.0, []
    for prev, rec in zip(records, records[1:]):
        if prev.active[i, slot]:
            chunks.append(0.0)
        if chunks:
            chunks[-1] += float(rec.reward[i, slot])
        else:
            before += float(rec.reward[i, slot])
        if rec.terminated[i, slot] or rec.truncated[i, slot]:
            games.append((before, chunks))
            before, chunks = 0.0, []
    return games


def last_rewards(factory, seed, moves, names):
    """PettingZoo's own loop (agent_iter and last()) on the same moves: per agent and game, the reward last() gives at
    each of the agent's turns and at its end."""
    raw = factory()
    raw.reset(seed=seed)
    per_agent = {a: [] for a in names}
    games = {a: [] for a in names}
    queue = list(moves)
    while queue:
        for agent in raw.agent_iter():
            _, reward, terminated, truncated, _ = raw.last()
            per_agent[agent].append(float(reward))
            if terminated or truncated:
                games[agent].append(per_agent[agent])
                per_agent[agent] = []
                raw.step(None)
                continue
            if not queue:
                break
            slot, action = queue.pop(0)
            assert names[slot] == agent
            raw.step(action)
        else:
            raw.reset()
    return games


@pytest.mark.parametrize("name,factory", [(TURNS, pz_turns.make_env), (TICTACTOE, tictactoe_v3.env)])
def test_rewards_are_last_rewards_credited_to_the_agents_last_move(name, factory):
    """Rewards that reach an agent on the other's turn (pz_turns pays every move to both) sum, move by move, to what
    PettingZoo's last() gives the agent at its next turn or its end."""
    env = make(name, num_envs=3, seed=11)
    records, moves = play_randomly(env, 60, seed=5)
    for i in range(env.num_envs):
        reference = last_rewards(factory, 11 + i, moves[i], env.agent_names)
        for slot, agent in enumerate(env.agent_names):
            ours = credited_per_move(records, i, slot)
            theirs = reference[agent][: len(ours)]
            assert len(ours) == len(theirs) >= 2
            for (before, chunks), at_turns in zip(ours, theirs):
                assert before == pytest.approx(at_turns[0], abs=1e-6)
                assert chunks == pytest.approx(at_turns[1:], abs=1e-6)


def test_agents_with_different_spaces_are_padded_and_truncations_keep_the_last_observation():
    env = make(TURNS, num_envs=1, seed=0, truncate_at=3)
    assert env.action_space == Discrete(3, slot_n=(3, 2)) and env.observation_space.shape == (2,)
    rec = env.reset()
    rec = env.step(torch.tensor([[0, 0]]))  # taker_0 takes one stone
    pile = env.envs[0].unwrapped.pile
    assert rec.obs[0, 1].tolist() == pytest.approx([pile / 12, 0.0])  # taker_1 sees the pile alone, zero-padded
    assert rec.action_mask[0, 1].tolist() == [True, True, False]  # its third action does not exist
    rec = env.step(torch.tensor([[0, 0]]))
    rec = env.step(torch.tensor([[0, 0]]))  # the third move: the game is cut
    assert rec.truncated[0].tolist() == [True, True] and not rec.terminated.any()
    assert rec.final_obs[0, 1].tolist() == pytest.approx([(pile - 2) / 12, 0.0])
    assert rec.final_obs[0, 0].tolist() == pytest.approx([(pile - 2) / 12, 3 / 20])
    assert rec.info["episode_length"].tolist() == [3.0]


@pytest.mark.parametrize("broken,message", [
    ("selection", "breaks PettingZoo's AEC API: agent_selection 'nobody' is not one of its live agents ['taker_0', 'taker_1']"),
    ("last", "breaks PettingZoo's AEC API: last() must return (observation, reward, termination, truncation, info); got tuple of 4"),
    ("mask_shape", "taker_0's observation['action_mask'] must be bool or 0/1 integers of shape [3] (one per action of Discrete(3)); got int8 [4]"),
    ("mask_dtype", "taker_0's observation['action_mask'] must be bool or 0/1 integers of shape [3] (one per action of Discrete(3)); got float32 [3]"),
    ("mask_empty", "taker_1's action_mask allows no action on its turn; a mask must leave the agent to move at least one action"),
])
def test_a_turn_based_env_that_breaks_the_rules_is_one_line(broken, message, capsys):
    with pytest.raises(EnvContractError):
        check_env(make(TURNS, num_envs=2, broken=broken), steps=16)
    assert main(["check-env", TURNS, "--broken", broken]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and message in err, err


def test_training_on_tictactoe_ends_without_a_traceback(tmp_path, capsys):
    """It ended in PettingZoo's to_parallel assertion; the policy now plays under the board's action mask, so the run
    trains to its end (an illegal move would end it in one line)."""
    code = main(["train", "--env", TICTACTOE, "--total-steps", "256", "--num-envs", "2", "--num-steps", "32",
                 "--run-dir", str(tmp_path / "run"), "--progress", "false", "--tensorboard", "false"])
    err = capsys.readouterr().err.strip()
    assert "Traceback" not in err
    assert code == 0, err


def test_multi_dimensional_boxes_map_with_their_bounds():
    """Before: a gymnasium Box of more than one axis (a [3, 3, 2] board, a [4, 4, 3] image) was refused, its bounds
    read flat ("Box low of shape [18] does not broadcast to shape [3, 3, 2]")."""
    from gymnasium import spaces as gs

    from phalanx.envs.adapters.gym import _map_action_space, _map_obs_space

    low = np.zeros((4, 4, 3), np.float32)
    high = np.arange(48, dtype=np.float32).reshape(4, 4, 3) + 1
    space, flatten = _map_obs_space(gs.Box(low, high, dtype=np.float32))
    assert not flatten and space.shape == (4, 4, 3)
    assert torch.equal(space.high_tensor(), torch.from_numpy(high))
    act = _map_action_space(gs.Box(-low - 1, high, dtype=np.float32), "x")
    assert act.shape == (4, 4, 3) and torch.equal(act.low_tensor(), torch.from_numpy(-low - 1))


def test_turn_observations_give_players_pettingzoos_own_dicts():
    """A player written against PettingZoo (the observation dict with its action_mask) can move through the adapter."""
    env = make(CONNECT_FOUR, num_envs=2, seed=0)
    rec = env.reset()
    for _ in range(30):
        actions = torch.zeros(2, 2, dtype=torch.long)
        for i, (slot, seen) in enumerate(env.turn_observations()):
            assert rec.active[i, slot] and set(seen) == {"observation", "action_mask"}
            assert rec.action_mask[i, slot].tolist() == seen["action_mask"].astype(bool).tolist()
            actions[i, slot] = int(np.flatnonzero(seen["action_mask"])[-1])  # the rightmost open column
        rec = env.step(actions)


def test_a_game_with_boolean_planes_loads_as_zero_one_floats(capsys):
    """PettingZoo's go_v5 (and chess_v6) declare bool Box observations; check-env failed on them with a line naming
    neither the env nor the space ("Box low must be ... not bool"). They load as 0 / 1 floats (issue 63; failed on
    main first)."""
    name = "pz:pettingzoo.classic.go_v5:env"
    env = make(name, num_envs=2, board_size=5)
    assert env.observation_space.dtype == torch.float32 and tuple(env.observation_space.shape) == (5, 5, 17)
    rec = env.reset(seed=0)
    assert rec.obs.dtype == torch.float32 and set(rec.obs.unique().tolist()) <= {0.0, 1.0}
    check_env(make(name, num_envs=2, board_size=5), steps=16)
    assert main(["check-env", name, "--board-size", "5", "--steps", "8"]) == 0
