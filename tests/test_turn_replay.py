"""Recordings of turn-based games say whose turn it is: a caption on each frame and a move list beside the animation
(ply, agent, seat, action, reward), without a display."""

import csv

import numpy as np
import pytest

pytest.importorskip("pettingzoo")
pytest.importorskip("pygame")  # PettingZoo's classic games draw with it

from pettingzoo.classic import tictactoe_v3  # noqa: E402
from PIL import Image  # noqa: E402

from phalanx.cli import main  # noqa: E402
from phalanx.envs import make  # noqa: E402
from phalanx.record import Move, credit_moves, moves_text, record_episode, turn_captions  # noqa: E402

TICTACTOE = "pz:pettingzoo.classic.tictactoe_v3:env"
SIDE = 120  # a small board draws fast


def gif_frames(path):
    with Image.open(path) as im:
        out = []
        for k in range(im.n_frames):
            im.seek(k)
            out.append(np.asarray(im.convert("RGB")).astype(np.int16))
        return out


def read_moves(path):
    with open(path, newline="") as f:
        return list(csv.DictReader(f, delimiter="\t"))


def test_a_recorded_tictactoe_game_names_the_players_in_turn_and_its_moves_are_the_boards(tmp_path):
    """Before: `--record` refused tic-tac-toe ("cannot render, so it cannot be recorded")."""
    gif = tmp_path / "game.gif"
    info = record_episode(None, TICTACTOE, gif, {"screen_height": SIDE}, greedy=False, seed=4)
    rows = read_moves(tmp_path / "game.moves.tsv")
    assert info["moves"] == str(tmp_path / "game.moves.tsv") and info["steps"] == len(rows) >= 5
    assert list(rows[0]) == ["ply", "agent", "seat", "action", "reward"]
    assert [r["ply"] for r in rows] == [str(k) for k in range(1, len(rows) + 1)]
    assert [r["agent"] for r in rows] == [("player_1", "player_2")[k % 2] for k in range(len(rows))]
    assert [r["seat"] for r in rows] == [str(k % 2) for k in range(len(rows))]

    # PettingZoo's own game, played with the listed moves: each mover is the one listed, the game ends on the last
    # move, and each move's reward is what last() gives its player next (the winner +1, the loser -1 on its last).
    raw = tictactoe_v3.env(render_mode="rgb_array", screen_height=SIDE)
    raw.reset(seed=4)
    boards = [raw.render()]
    for k, r in enumerate(rows):
        assert raw.agent_selection == r["agent"] and not raw.terminations[r["agent"]]
        raw.step(int(r["action"]))
        boards.append(raw.render())
        assert all(raw.terminations.values()) == (k == len(rows) - 1)
    final = {a: float(raw.rewards[a]) for a in raw.agents}
    assert info["result"] == final and sorted(final.values()) in ([-1.0, 1.0], [0.0, 0.0])
    credited = {a: sum(float(r["reward"]) for r in rows if r["agent"] == a) for a in final}
    assert credited == final
    assert all(float(r["reward"]) == 0 for r in rows[:-2])  # tic-tac-toe pays at the end only

    # The animation: the start and one frame a move, the last the final position (drawn before the auto-reset),
    # each the board as PettingZoo draws it over a caption band.
    frames = gif_frames(gif)
    assert len(frames) == info["frames"] == len(rows) + 1
    for frame, board in zip(frames, boards):
        assert frame.shape[0] > SIDE and frame.shape[1] == SIDE
        top = frame[:SIDE]
        assert np.abs(top - board).mean() < 2.0  # the GIF's palette aside, the same image
    assert np.abs(frames[-1][:SIDE] - boards[-2]).mean() > 4 * np.abs(frames[-1][:SIDE] - boards[-1]).mean()
    bands = [f[SIDE:] for f in frames]
    assert all((band < 128).any() for band in bands)  # text on every band
    assert all(not np.array_equal(a, b) for a, b in zip(bands, bands[1:]))  # a caption of its own on every frame


def test_captions_say_who_moved_what_and_who_moves_next():
    moves = [Move(1, "player_1", 0, 4, 0.0), Move(2, "player_2", 1, 0, -1.0), Move(3, "player_1", 0, 8, 1.0)]
    names = ["player_1", "player_2"]
    assert turn_captions(moves, names, 0, [1, 0, None], "game over: player_1 +1, player_2 -1") == [
        ["start", "player_1 (seat 0) to move"],
        ["ply 1: player_1 (seat 0) played 4", "player_2 (seat 1) to move"],
        ["ply 2: player_2 (seat 1) played 0", "player_1 (seat 0) to move"],
        ["ply 3: player_1 (seat 0) played 8", "game over: player_1 +1, player_2 -1"],
    ]
    # A recording cut before the game's end names the next mover on its last frame.
    assert turn_captions(moves[:2], names, 0, [1, 0], None)[-1] == ["ply 2: player_2 (seat 1) played 0",
                                                                   "player_1 (seat 0) to move"]
    assert moves_text(moves).splitlines() == ["ply\tagent\tseat\taction\treward", "1\tplayer_1\t0\t4\t0",
                                              "2\tplayer_2\t1\t0\t-1", "3\tplayer_1\t0\t8\t1"]


def test_a_moves_reward_is_its_movers_rewards_up_to_its_next_move():
    """As the trainer credits them: a reward that reaches a seat on the other's turn belongs to the seat's last move;
    one before its first move to none."""
    movers = [0, 1, 0, 1, 0]
    rewards = [[-0.01, 0.05], [0.1, -0.01], [-0.01, 0.15], [0.05, -0.01], [1.0, -1.0]]
    assert credit_moves(movers, rewards) == pytest.approx([-0.01 + 0.1, -0.01 + 0.15, -0.01 + 0.05, -0.01 - 1.0, 1.0])


def test_eval_records_a_turn_based_game_from_the_command_line(tmp_path, capsys):
    run = tmp_path / "run"
    assert main(["train", "--env", TICTACTOE, "--screen-height", str(SIDE), "--total-steps", "64", "--num-envs", "2",
                 "--num-steps", "32", "--run-dir", str(run), "--progress", "false", "--tensorboard", "false"]) == 0
    capsys.readouterr()
    gif = tmp_path / "out" / "game.gif"
    assert main(["eval", str(run), "--episodes", "1", "--record", str(gif)]) == 0
    err = capsys.readouterr().err
    rows = read_moves(tmp_path / "out" / "game.moves.tsv")
    assert gif.is_file() and len(gif_frames(gif)) == len(rows) + 1
    assert f"its moves: {tmp_path / 'out' / 'game.moves.tsv'} (result: player_1 " in err
    assert [r["agent"] for r in rows][:2] == ["player_1", "player_2"]


def test_a_parallel_pettingzoo_env_records_to_its_last_frame(tmp_path):
    """Parallel envs draw too; no captions or move list (every agent moves every step)."""
    pytest.importorskip("mpe2")
    gif = tmp_path / "spread.gif"
    env = make("pz:mpe2.simple_spread_v3:parallel_env", max_cycles=6)
    assert env.renders and not env.turn_based
    info = record_episode(None, "pz:mpe2.simple_spread_v3:parallel_env", gif, {"max_cycles": 6}, greedy=False)
    assert info["steps"] == 6 and info["frames"] == 7 and "moves" not in info  # the start, then one a step
    assert not (tmp_path / "spread.moves.tsv").exists()
    frames = gif_frames(gif)  # the GIF merges equal frames in a row (MPE's first step moves nobody)
    assert not np.array_equal(frames[-1], frames[-2])


@pytest.mark.parametrize("env_name", ["tictactoe", TICTACTOE])
def test_eval_records_the_game_against_the_vs_player_and_says_the_learners_return(env_name, tmp_path, capsys):
    """`--record` with `--vs module:callable` ended in a KeyError traceback on a built-in game and recorded the learner
    against itself on a `pz:` one, and the "return" it printed summed only the mover's rewards (1.00 for a game the
    recorded player lost). Now the first --vs player is the recorded opponent, named, and the return is the learner's
    side's, as the moves file's result says (issue 63; failed on main first)."""
    run = tmp_path / "run"
    size = ["--screen-height", str(SIDE)] if env_name == TICTACTOE else []
    assert main(["train", "--env", env_name, *size, "--total-steps", "64", "--num-envs", "2", "--num-steps", "32",
                 "--run-dir", str(run), "--progress", "false", "--tensorboard", "false"]) == 0
    capsys.readouterr()
    gif = tmp_path / "game.gif"
    assert main(["eval", str(run), "--episodes", "1", "--vs", "phalanx_bench.players.tictactoe:act", "--record", str(gif)]) == 0
    err = capsys.readouterr().err
    assert gif.is_file() and "against phalanx_bench.players.tictactoe:act" in err, err
    rows = read_moves(tmp_path / "game.moves.tsv")
    learner_seat = rows[0]["agent"]  # the learner takes the first seat in a recording
    result = {name: float(r) for name, r in (part.rsplit(" ", 1) for part in
                                              err.split("(result: ", 1)[1].split(")", 1)[0].split(", "))}
    assert result[learner_seat] <= 0  # an untrained policy never beats perfect play
    assert f"return {result[learner_seat]:.2f}" in err, err
