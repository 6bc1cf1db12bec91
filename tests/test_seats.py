"""The learner in both seats of a two-sided game (league/seats.py, issue 50 point 3): the env's sides swap per copy,
game after game; the league counts games and rates the learner per seat; a callable written outside Phalanx is a
league opponent."""

import json

import pytest
import torch

pytest.importorskip("pettingzoo")
pytest.importorskip("pygame")  # PettingZoo's classic games import it

from phalanx.cli import main  # noqa: E402
from phalanx.config import resolve  # noqa: E402
from phalanx.envs import make  # noqa: E402
from phalanx.errors import ConfigError  # noqa: E402
from phalanx.league import parse_mix  # noqa: E402
from phalanx.league.ratings import LOSS, WIN, Ratings  # noqa: E402
from phalanx.league.seats import SwappedSides, wants_swapped_sides  # noqa: E402
from phalanx.slots import random_actions  # noqa: E402

TICTACTOE = "pz:pettingzoo.classic.tictactoe_v3:env"
MOVES: list[int] = []


def first_free(observation):
    """A league opponent written outside Phalanx: the lowest free square (recorded)."""
    move = int(observation["action_mask"].nonzero()[0][0])
    MOVES.append(move)
    return move


def test_the_sides_swap_per_copy_and_alternate_game_after_game():
    env = SwappedSides(make(TICTACTOE, num_envs=4, seed=3))
    rec = env.reset(seed=3)
    # Odd copies start in the second seat: there the opponent's slot (1) moves first.
    assert rec.active[:, 0].tolist() == [True, False, True, False]
    assert rec.active[:, 1].tolist() == [False, True, False, True]
    gen = torch.Generator().manual_seed(0)
    seats_played: list[list[float]] = [[] for _ in range(4)]
    for _ in range(200):
        swapped_before = env.swapped.clone()
        rec = env.step(random_actions(env, gen, rec.action_mask))
        inner = env.env_record
        for i in range(4):
            # The step's rewards and flags as the env's own slots had them, by the seating it was played in.
            own = [1, 0] if swapped_before[i] else [0, 1]
            assert rec.reward[i].tolist() == inner.reward[i, own].tolist()
            assert rec.terminated[i].tolist() == inner.terminated[i, own].tolist()
            assert rec.info["seat"][i, 0] == float(swapped_before[i])
            ended = bool(inner.terminated[i].all() | inner.truncated[i].all())
            assert bool(env.swapped[i]) == (bool(swapped_before[i]) ^ ended)
            if ended:
                seats_played[i].append(float(rec.info["seat"][i, 0]))
                # The next game's first move is the first seat's, which is now the other slot.
                assert rec.active[i].tolist() == ([False, True] if env.swapped[i] else [True, False])
    for i, seats in enumerate(seats_played):
        assert len(seats) >= 10
        assert seats == [float((i + k) % 2) for k in range(len(seats))]  # alternating, from the copy's first seat


def test_actions_reach_the_env_in_its_own_slots():
    env = SwappedSides(make(TICTACTOE, num_envs=2, seed=0))
    env.reset(seed=0)
    # Copy 0: the learner (slot 0) moves first, to square 4; copy 1: the opponent (slot 1) moves first, to square 8.
    actions = torch.tensor([[4, 0], [0, 8]])
    env.step(actions)
    boards = [o for _, o in env.env.turn_observations()]
    # After the first move the second player to move sees the first player's mark in its plane 1.
    assert boards[0]["observation"][1, 1, 1] == 1 and boards[1]["observation"][2, 2, 1] == 1
    assert [slot for slot, _ in env.turn_observations()] == [1, 0]  # the learner's layout: copy 1's learner to move


def test_seats_auto_swaps_turn_based_games_only_and_both_refuses_unlike_sides():
    assert wants_swapped_sides("auto", make(TICTACTOE, num_envs=1))
    assert not wants_swapped_sides("first", make(TICTACTOE, num_envs=1))
    duel = make("duel", num_envs=2)
    assert not wants_swapped_sides("auto", duel)  # simultaneous: runs keep their layout
    with pytest.raises(ConfigError, match="config key 'seats' is 'both' but env 'cartpole' has 1 agent slot"):
        wants_swapped_sides("both", make("cartpole", num_envs=1))
    with pytest.raises(ConfigError, match="config key 'seats' must be one of auto, first, both"):
        resolve({"env": TICTACTOE, "seats": "second"})


def test_ratings_per_seat_rate_the_seat_and_the_learner_but_the_opponent_once():
    seated, plain = Ratings(), Ratings()
    for code in (WIN, LOSS, WIN):
        seated.record("bot", code, seat="first")
        plain.record("bot", code)
    assert seated.players["bot"] == plain.players["bot"]
    assert seated.players["learner"] == plain.players["learner"]
    assert seated.players["learner@first"].games == 3 and "learner@second" not in seated.players
    seated.record("bot", LOSS, seat="second")
    assert seated.players["learner@second"].mu < seated.players["learner@first"].mu


def test_an_outside_callable_is_named_in_the_mix_with_or_without_a_weight():
    assert parse_mix("self_play:8,mypkg.bots:act,other.mod:play:2.5,random:1", ()) == [
        ("self_play", 8.0), ("mypkg.bots:act", 1.0), ("other.mod:play", 2.5), ("random", 1.0)]
    with pytest.raises(ConfigError, match="weight of 'self_play' must be a number"):
        parse_mix("self_play:x", ())


def test_league_on_tictactoe_plays_both_seats_rates_each_and_takes_an_outside_opponent(tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(str(__import__("pathlib").Path(__file__).parent))
    MOVES.clear()
    run = tmp_path / "run"
    code = main(["train", "--env", TICTACTOE, "--opponents", "self_play:2,random:1,test_seats:first_free:1",
                 "--total-steps", "4096", "--num-envs", "8", "--num-steps", "64", "--run-dir", str(run),
                 "--progress", "false", "--tensorboard", "false"])
    assert code == 0
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    last = rows[-1]
    for key in ("league_win_rate_random_first", "league_win_rate_random_second", "league_rating_first",
                "league_rating_second", "league_win_rate_test_seats:first_free"):
        assert any(key in r for r in rows), key
    assert 0.3 < last["env_seat"] < 0.7  # about half the learner's games from the second seat
    ratings = json.loads((run / "league" / "league.json").read_text())["ratings"]
    assert ratings["learner@first"]["games"] > 20 and ratings["learner@second"]["games"] > 20
    assert ratings["test_seats:first_free"]["games"] > 5
    assert MOVES, "the outside opponent was never asked for a move"
    assert last["league_illegal_moves_test_seats:first_free"] == 0.0


def test_an_outside_league_opponent_that_cannot_load_or_play_here_is_one_line_before_the_run(tmp_path, capsys):
    for opponents, message in [
        ("self_play:1,nosuch_module_x:act", "config key 'opponents' 'nosuch_module_x:act': cannot import 'nosuch_module_x'"),
    ]:
        run = tmp_path / "r"
        code = main(["train", "--env", TICTACTOE, "--opponents", opponents, "--total-steps", "1024", "--run-dir", str(run)])
        assert code == 2
        err = capsys.readouterr().err
        assert message in err and err.count("error") == 1 and "Traceback" not in err, err
        assert not run.exists()
    code = main(["train", "--env", "duel", "--opponents", "self_play:1,phalanx_bench.players.tictactoe:act", "--total-steps", "8192",
                 "--run-dir", str(tmp_path / "d")])
    assert code == 2
    assert "a callable opponent plays turn-based PettingZoo envs" in capsys.readouterr().err


def crashes_on_its_third_move(observation):
    MOVES.append(-1)
    if len(MOVES) >= 3:
        raise ValueError("engine lost its book")
    return int(observation["action_mask"].nonzero()[0][0])


def test_an_outside_league_opponent_that_raises_ends_the_run_in_one_line(tmp_path, monkeypatch, capsys):
    monkeypatch.syspath_prepend(str(__import__("pathlib").Path(__file__).parent))
    MOVES.clear()
    run = tmp_path / "run"
    code = main(["train", "--env", TICTACTOE, "--opponents", "test_seats:crashes_on_its_third_move", "--total-steps", "4096",
                 "--num-envs", "8", "--num-steps", "64", "--run-dir", str(run), "--progress", "false",
                 "--tensorboard", "false"])
    err = capsys.readouterr().err
    assert code == 2, err
    assert "opponent test_seats:crashes_on_its_third_move raised on env copy" in err
    assert "ValueError: engine lost its book" in err and "Traceback" not in err
