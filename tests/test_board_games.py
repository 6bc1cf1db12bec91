"""The built-in tic-tac-toe and connect four (zoo/board_games.py): PettingZoo's games, move for move, batched in
torch with masks."""

import numpy as np
import pytest
import torch

from phalanx.cli import main
from phalanx.envs import make
from phalanx.slots import random_actions


@pytest.mark.parametrize("name,games", [("tictactoe", 60), ("connect_four", 40)])
def test_they_play_pettingzoos_games_move_for_move(name, games):
    pytest.importorskip("pettingzoo")
    pytest.importorskip("pygame")
    from pettingzoo.classic import connect_four_v3, tictactoe_v3

    env = make(name, num_envs=1, seed=0)
    rng = np.random.default_rng(0)
    outcomes = set()
    rec = env.reset(seed=0)  # and after each game the env's auto-reset starts the next
    for game in range(games):
        pz = (tictactoe_v3 if name == "tictactoe" else connect_four_v3).env()
        pz.reset(seed=game)
        returns = dict.fromkeys(pz.possible_agents, 0.0)
        for agent in pz.agent_iter():
            observation, reward, terminated, truncated, _ = pz.last()
            returns[agent] += reward
            if terminated or truncated:
                pz.step(None)
                continue
            slot = pz.possible_agents.index(agent)
            assert rec.active[0].tolist() == [slot == 0, slot == 1]
            assert np.array_equal(rec.obs[0, slot].numpy(), observation["observation"].astype(np.float32))
            assert np.array_equal(rec.action_mask[0, slot].numpy(), observation["action_mask"].astype(bool))
            assert rec.action_mask[0, 1 - slot].all()  # the slot that waits is allowed everything
            move = int(rng.choice(np.flatnonzero(observation["action_mask"])))
            pz.step(move)
            actions = torch.zeros(1, 2, dtype=torch.long)
            actions[0, slot] = move
            rec = env.step(actions)
            for i, a in enumerate(pz.possible_agents):
                if rec.reward[0, i]:
                    assert pz.rewards[a] == float(rec.reward[0, i])
        final = (float(rec.info["win"][0, 0]) - float(rec.info["win"][0, 1]))
        first, second = pz.possible_agents
        assert final == returns[first] == -returns[second]
        assert bool(rec.terminated[0].all()) and float(rec.info["draw"][0, 0]) == float(final == 0)
        outcomes.add(final)
    assert outcomes >= {-1.0, 1.0}


def test_a_move_to_a_taken_square_forfeits_and_is_counted():
    env = make("tictactoe", num_envs=2, seed=0)
    env.reset(seed=0)
    env.step(torch.tensor([[4, 0], [0, 0]]))  # slot 0 takes the centre in both games
    rec = env.step(torch.tensor([[0, 4], [0, 1]]))  # game 0: slot 1 plays the centre again
    assert rec.reward.tolist() == [[1.0, -1.0], [0.0, 0.0]]
    assert rec.terminated.tolist() == [[True, True], [False, False]]
    assert rec.info["illegal_moves"].tolist() == [1.0, 0.0] and rec.info["win"][0].tolist() == [1.0, 0.0]
    assert rec.active.tolist() == [[True, False], [True, False]]  # game 0 starts afresh, game 1 is slot 0's turn
    assert (rec.obs[0] == 0).all()


def test_random_play_wins_loses_and_draws_as_the_game_is_known_to():
    env = make("tictactoe", num_envs=4000, seed=1)
    rec = env.reset(seed=1)
    gen = torch.Generator().manual_seed(1)
    win, draw = torch.zeros(2), 0.0
    for _ in range(9):  # every game of the first batch ends within 9 moves
        rec = env.step(random_actions(env, gen, rec.action_mask))
        win += rec.info["win"].sum(0)
        draw += float(rec.info["draw"][:, 0].sum())
    # Random against random: the first player wins 58.5% of games, the second 28.8%, 12.7% are drawn.
    assert win[0] / 4000 == pytest.approx(0.585, abs=0.03)
    assert win[1] / 4000 == pytest.approx(0.288, abs=0.03)
    assert draw / 4000 == pytest.approx(0.127, abs=0.02)


def test_check_env_holds_and_the_players_of_the_bench_play_it(capsys):
    assert main(["check-env", "tictactoe", "--steps", "200"]) == 0
    env = make("tictactoe", num_envs=3, seed=0)
    env.reset(seed=0)
    turns = env.turn_observations()
    assert [slot for slot, _ in turns] == [0, 0, 0]
    assert turns[0][1]["observation"].shape == (3, 3, 2) and turns[0][1]["action_mask"].tolist() == [1] * 9


def test_a_piece_falls_to_the_lowest_empty_cell_and_a_full_column_forfeits():
    env = make("connect_four", num_envs=1, seed=0)
    rec = env.reset(seed=0)
    for ply in range(6):  # the players fill column 3, alternating
        assert rec.action_mask[0, ply % 2, 3]
        rec = env.step(torch.tensor([[3, 3]]))
        assert rec.reward.tolist() == [[0.0, 0.0]]
    # Slot 0's view of column 3, row 0 at the top: its pieces in rows 5, 3, 1, the other's in 4, 2, 0.
    assert rec.obs[0, 0, :, 3, 0].tolist() == [0.0, 1.0, 0.0, 1.0, 0.0, 1.0]
    assert rec.obs[0, 0, :, 3, 1].tolist() == [1.0, 0.0, 1.0, 0.0, 1.0, 0.0]
    assert not rec.action_mask[0, 0, 3] and rec.action_mask[0, 0].sum() == 6
    rec = env.step(torch.tensor([[3, 0]]))
    assert rec.reward.tolist() == [[-1.0, 1.0]] and rec.info["illegal_moves"].tolist() == [1.0]


def test_four_in_a_row_wins_in_every_direction():
    env = make("connect_four", num_envs=3, seed=0)
    env.reset(seed=0)
    # Game 0 across the bottom row, game 1 up column 0, game 2 a diagonal; the other player answers in column 6
    # (game 2: builds the steps for the diagonal).
    plans = [([0, 1, 2, 3], [6, 6, 6]), ([0, 0, 0, 0], [6, 6, 6]), ([0, 1, 2, 2, 3, 3], [1, 2, 3, 5, 3])]
    moves = [[m for pair in zip(mine, theirs + [0]) for m in pair][: 2 * len(mine) - 1] for mine, theirs in plans]
    won = [None, None, None]
    for ply in range(max(len(m) for m in moves)):
        actions = torch.tensor([[m[ply] if ply < len(m) else 0] * 2 for m in moves])
        rec = env.step(actions)
        for g in range(3):
            if ply == len(moves[g]) - 1:
                won[g] = rec.reward[g].tolist()
    assert won == [[1.0, -1.0]] * 3


def test_the_league_learns_tictactoe_from_both_seats_and_eval_meets_each_opponent_from_both(tmp_path, capsys):
    # 65k moves at the env's league defaults but 64 envs (about 10 s on one CPU), then 400 greedy games a seat against
    # random play. Random play against random play wins 58.5% of games as first player and 28.8% as second; seed 1
    # won 93% as first and 69% as second (losses 23 and 125 of 400; 95% and 78% before the random opening of the
    # defaults, which spends part of this small budget on positions no game from the empty board reaches).
    run = tmp_path / "run"
    assert main(["train", "--env", "tictactoe", "--total-steps", "65536", "--num-envs", "64", "--seed", "1",
                 "--torch-threads", "1", "--run-dir", str(run), "--progress", "false", "--tensorboard", "false"]) == 0
    capsys.readouterr()
    assert main(["eval", str(run), "--vs", "random", "--episodes", "400", "--torch-threads", "1", "--json"]) == 0
    vs = __import__("json").loads(capsys.readouterr().out)["vs"]["random"]
    assert vs["first"]["win_rate"] > 0.80 and vs["second"]["win_rate"] > 0.55, vs
    assert vs["first"]["episodes"] == vs["second"]["episodes"] == 400


@pytest.mark.parametrize("name", ["tictactoe", "connect_four"])
def test_a_recorded_game_ends_on_its_final_position_with_alternating_moves(name, tmp_path):
    pytest.importorskip("PIL")
    from PIL import Image

    from phalanx.record import record_episode

    info = record_episode(None, name, tmp_path / "g.gif", seed=2)
    lines = (tmp_path / "g.moves.tsv").read_text().splitlines()[1:]
    seats = [int(line.split("\t")[2]) for line in lines]
    assert seats == [k % 2 for k in range(len(seats))] and len(seats) == info["steps"]
    assert info["frames"] == info["steps"] + 1  # the start, then one frame a move, the last the final position
    gif = Image.open(tmp_path / "g.gif")
    gif.seek(gif.n_frames - 1)
    last = np.asarray(gif.convert("RGB"))
    board = last[: last.shape[1] * (6 if name == "connect_four" else 3) // (7 if name == "connect_four" else 3)]
    background = np.array([235, 235, 228])
    pieces_drawn = (np.abs(board.astype(int) - background).sum(-1) > 60).mean()
    assert pieces_drawn > 0.1  # the final position is drawn, not the reset board


@pytest.mark.parametrize("name", ["tictactoe", "connect_four"])
def test_a_random_opening_plays_up_to_k_legal_moves_from_the_empty_board_and_decides_no_game(name):
    most = 4 if name == "tictactoe" else 6  # the first mover's k-th piece is ply 2k - 1: no opening can win
    env = make(name, num_envs=4000, seed=3, opening_plies=most)
    rec = env.reset(seed=3)
    pieces = (env.board != 0).sum(1)
    assert torch.bincount(pieces, minlength=most + 1)[: most + 1].min() > 4000 / (most + 1) * 0.8  # k uniform in 0..K
    assert int(pieces.max()) == most
    first, second = (env.board == 1).sum(1), (env.board == 2).sum(1)
    assert ((first - second) == pieces % 2).all()  # alternating from slot 0
    assert (env.turn == pieces % 2).all() and (rec.active[:, 0] == (pieces % 2 == 0)).all()
    if name == "connect_four":  # pieces rest on the bottom or on another piece
        cells = env.board.reshape(-1, 6, 7)
        assert ((cells[:, :-1] != 0) <= (cells[:, 1:] != 0)).all()
    assert torch.equal(rec.action_mask[torch.arange(4000), env.turn], env.board[:, : 7] == 0 if name == "connect_four"
                       else env.board == 0)
    # Games that end start again after a fresh random opening; no game ever ends inside one.
    gen = torch.Generator().manual_seed(3)
    fresh_pieces = []
    for _ in range(12):
        rec = env.step(random_actions(env, gen, rec.action_mask))
        ended = rec.terminated[:, 0]
        fresh_pieces.append((env.board[ended] != 0).sum(1))
        assert rec.info["illegal_moves"].sum() == 0
    fresh = torch.cat(fresh_pieces)
    assert len(fresh) > 500 and set(fresh.tolist()) == set(range(most + 1))
    boards = []
    for seed in (3, 3, 4):  # the env's seed fixes its openings
        game = make(name, num_envs=4000, seed=seed, opening_plies=most)
        game.reset(seed=seed)
        boards.append(game.board)
    assert torch.equal(boards[0], boards[1]) and not torch.equal(boards[0], boards[2])


def test_an_opening_long_enough_to_win_is_refused_in_one_line(capsys):
    assert main(["train", "--env", "tictactoe", "--opening-plies", "5", "--total-steps", "64"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "opening_plies" in err and "[0, 4]" in err, err


def test_eval_plays_from_the_empty_board_unless_given_the_training_opening(tmp_path, capsys):
    # A greedy policy against the deterministic perfect player replays one game a seat from the empty board;
    # the run's random opening (training only) would vary them.
    run = tmp_path / "run"
    assert main(["train", "--env", "tictactoe", "--opening-plies", "4", "--total-steps", "2048", "--num-envs", "16",
                 "--num-steps", "16", "--seed", "1", "--torch-threads", "1", "--run-dir", str(run), "--progress", "false",
                 "--tensorboard", "false"]) == 0
    capsys.readouterr()

    def outcomes(*flags):
        assert main(["eval", str(run), "--vs", "phalanx_bench.players.tictactoe:act", "--episodes", "40", "--json", *flags]) == 0
        vs = __import__("json").loads(capsys.readouterr().out)["vs"]["phalanx_bench.players.tictactoe:act"]
        return [max(vs[seat][k] for k in ("wins", "draws", "losses")) for seat in ("first", "second")]

    assert outcomes() == [40, 40]
    assert min(outcomes("--opening-plies", "4")) < 40


def test_evaluations_leave_out_only_the_options_the_env_marks_training_only():
    from phalanx.envs import registry

    assert registry.evaluation_options("tictactoe", {"opening_plies": 3}) == {}
    assert registry.evaluation_options("drone_swarm", {"approach_weight": 0.5}) == {"approach_weight": 0.5}
