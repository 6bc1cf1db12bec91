"""Turn-based games through training and evaluation (issue 50): a reward that reaches a slot on a turn it sat out
counts for it (episode statistics, evaluation) and is credited to its last move (algo/gae.py); tic-tac-toe trains
from the command line without an illegal move."""

import re
from pathlib import Path

import pytest

pytest.importorskip("pettingzoo")
pytest.importorskip("pygame")  # PettingZoo's classic games import it

from phalanx.cli import main  # noqa: E402
from phalanx.evaluate import evaluate_policy  # noqa: E402

TICTACTOE = "pz:pettingzoo.classic.tictactoe_v3:env"


def test_the_losers_reward_on_the_winners_turn_counts_in_evaluation():
    # Random against random: every decided game pays +1 and -1, the -1 on the winner's turn. Counted, the two
    # sides' returns sum to 0 in every game; dropped, every decided game summed to +1.
    out = evaluate_policy(None, TICTACTOE, episodes=40, greedy=False, seed=3)
    assert out["episodes"] == 40
    assert all(r == 0.0 for r in out["episode_returns"]), out["episode_returns"]
    vs = evaluate_policy(None, TICTACTOE, episodes=40, greedy=False, seed=4, opponent="random")
    assert vs["losses"] > 0 and vs["wins"] > 0, vs
    assert set(vs["episode_returns"]) <= {-1.0, 0.0, 1.0}
    assert vs["episode_returns"].count(-1.0) == vs["losses"] and vs["episode_returns"].count(1.0) == vs["wins"], vs


def test_tictactoe_trains_from_the_command_line_without_an_illegal_move(tmp_path, capsys):
    # The adapter refuses an illegal move in one line (exit 2): a run that ends 0 played none.
    code = main(["train", "--env", TICTACTOE, "--total-steps", "2048", "--num-envs", "4", "--num-steps", "64",
                 "--run-dir", str(tmp_path / "run"), "--progress", "false", "--tensorboard", "false"])
    err = capsys.readouterr().err
    assert code == 0, err
    assert "Traceback" not in err


def test_training_statistics_count_both_players_episodes_and_the_losers_reward(tmp_path):
    # Self-play (the learner in both seats): each game ends for both players, the loser on the winner's turn.
    # Counted on the step it came (a turn the loser sat out), its episode and its -1 are the loser's; before, the
    # loser's episode was not counted at all.
    from phalanx.config import resolve
    from phalanx.trainer import Trainer

    trainer = Trainer(resolve({"env": TICTACTOE, "num_envs": 4, "num_steps": 64, "run_dir": str(tmp_path / "r"),
                               "progress": False, "tensorboard": False}))
    try:
        stats = trainer.collect()
    finally:
        trainer.close()
    games = int(stats["team_episodes"])
    assert games >= 8
    assert int(stats["episodes"]) == 2 * games  # both seats' episodes
    assert float(stats["ep_return_sum"]) == 0.0 and float(stats["team_return_sum"]) == 0.0  # +1 and -1 each game


def test_self_play_on_tictactoe_beats_random_play_clearly_in_both_seats(tmp_path):
    # The learner plays both seats against itself for 30k moves (about 15 s on 2 CPUs), then plays 200 games, greedy,
    # against random play from each seat. Random play against random play: the first player wins 117 of those games
    # and loses 63. Seed 1 as first player won 171 and lost 20, as second won 121 and lost 65 (seeds 2 and 3 as
    # first: 168 / 18 and 166 / 18). The margins below leave room for another machine's arithmetic.
    import phalanx
    from phalanx.evaluate import evaluate_seats

    result = phalanx.train(env=TICTACTOE, total_steps=30_000, seed=1, num_envs=16, num_steps=64, run_dir=tmp_path / "r",
                           progress=False, tensorboard=False)
    baseline = evaluate_seats(None, TICTACTOE, "random", greedy=False, episodes=200, seed=5)
    assert (baseline["first"]["wins"], baseline["first"]["losses"]) == (117, 63)  # the same seeds below
    assert (baseline["second"]["wins"], baseline["second"]["losses"]) == (63, 117)
    seats = evaluate_seats(result.policy, TICTACTOE, "random", episodes=200, seed=5)
    assert seats["first"]["wins"] >= 150 and seats["first"]["losses"] <= 32, seats
    assert seats["second"]["wins"] >= 95 and seats["second"]["losses"] <= 90, seats


def _first_square(observation):
    return 0  # illegal once square 0 is taken


def _raises(observation):
    raise ValueError("engine crashed")


def test_an_outside_callable_plays_both_seats_and_its_illegal_moves_are_counted_not_played():
    import torch

    from phalanx.envs import make
    from phalanx.errors import ConfigError, PhalanxError
    from phalanx.evaluate import evaluate_seats
    from phalanx.slots import OutsidePlayer, outside_player

    perfect = outside_player("phalanx_bench.players.tictactoe:act")  # written for the bench, apart from Phalanx
    vs_random = evaluate_policy(None, TICTACTOE, episodes=60, greedy=False, seed=1, opponent=perfect)
    assert vs_random["wins"] == 0 and vs_random["losses"] > 30, vs_random  # it never loses to random play
    assert perfect.moves > 0 and perfect.illegal == 0
    stubborn = OutsidePlayer(_first_square, "tests:first_square")
    seats = evaluate_seats(None, TICTACTOE, stubborn, greedy=False, episodes=20, seed=2)
    assert seats["first"]["episodes"] == seats["second"]["episodes"] == 20  # the games went on
    assert 0 < seats["opponent_illegal_moves"] < seats["opponent_moves"], seats
    with pytest.raises(PhalanxError, match="--vs tests:raises raised on env copy 0: ValueError: engine crashed"):
        evaluate_policy(None, TICTACTOE, episodes=4, seed=1, opponent=OutsidePlayer(_raises, "tests:raises"))
    for spec, message in (("nomodule_xyz:act", "cannot import 'nomodule_xyz'"),
                          ("phalanx_bench.players.tictactoe:nothing", "has no 'nothing'"),
                          ("phalanx_bench.players.tictactoe:LINES", "is a tuple, not a callable"), ("act", "module:attr")):
        with pytest.raises(ConfigError, match=message):
            outside_player(spec)
    cartpole = make("cartpole", num_envs=1)
    with pytest.raises(ConfigError, match="turn-based PettingZoo envs"):
        OutsidePlayer(_first_square, "x").actions(cartpole, cartpole.reset(), torch.Generator())


def test_eval_vs_a_callable_plays_both_seats_from_the_command_line(tmp_path, capsys):
    import json

    run = str(tmp_path / "run")
    assert main(["train", "--env", TICTACTOE, "--total-steps", "512", "--num-envs", "4", "--num-steps", "64",
                 "--run-dir", run, "--progress", "false", "--tensorboard", "false"]) == 0
    capsys.readouterr()
    assert main(["eval", run, "--vs", "phalanx_bench.players.tictactoe:act,random", "--episodes", "10", "--json"]) == 0
    table = json.loads(capsys.readouterr().out)["vs"]
    perfect = table["phalanx_bench.players.tictactoe:act"]
    assert perfect["first"]["wins"] == perfect["second"]["wins"] == 0  # perfect play never loses
    assert perfect["opponent_illegal_moves"] == 0 and perfect["opponent_moves"] > 0
    assert table["random"]["first"]["episodes"] == table["random"]["second"]["episodes"] == 10
    assert main(["eval", run, "--vs", "phalanx_bench.players.tictactoe:act", "--episodes", "4"]) == 0
    out = capsys.readouterr().out
    assert "first" in out and "second" in out and "0 of" in out
    for bad, message in (("nomodule_xyz:act", "cannot import 'nomodule_xyz'"),
                         ("phalanx_bench.players.tictactoe:nothing", "has no 'nothing'")):
        assert main(["eval", run, "--vs", bad, "--episodes", "2"]) == 2
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1 and message in err and "Traceback" not in err, err


def test_eval_vs_a_snapshot_beside_an_outside_player_plays_both_seats(tmp_path, capsys):
    """`--vs snapshot:LATEST,module:callable` on a game was refused ("unknown opponent 'snapshot:LATEST' ...; allowed:
    random, ..., random, snapshot:LATEST") where either alone played: now both are met from each seat, and an unknown
    name lists each allowed name once (issue 63; failed on main first)."""
    import json

    run = str(tmp_path / "run")
    assert main(["train", "--env", "tictactoe", "--total-steps", "2048", "--num-envs", "8", "--num-steps", "32",
                 "--opponents", "self_play:1", "--pool-size", "2", "--run-dir", run, "--progress", "false",
                 "--tensorboard", "false"]) == 0
    capsys.readouterr()
    assert main(["eval", run, "--vs", "snapshot:LATEST,phalanx_bench.players.tictactoe:act", "--episodes", "6", "--json"]) == 0
    table = json.loads(capsys.readouterr().out)["vs"]
    snapshot = next(name for name in table if name.startswith("snapshot_"))
    assert table[snapshot]["first"]["episodes"] == table[snapshot]["second"]["episodes"] == 6
    assert table["phalanx_bench.players.tictactoe:act"]["first"]["episodes"] == 6
    assert main(["eval", run, "--vs", "nobody", "--episodes", "2"]) == 2
    err = capsys.readouterr().err.strip()
    allowed = err.split("allowed: ", 1)[1]
    names = [n.strip() for n in allowed.replace(" or ", ", ").split(",")]
    assert len(names) == len(set(names)), err


def test_league_lists_the_learners_seat_ratings_as_the_learner(tmp_path, capsys):
    """`phalanx league RUN` listed `learner@first` / `learner@second` (the learner rated per seat) as "retired"
    (issue 63; failed on main first)."""
    import json

    run = str(tmp_path / "run")
    assert main(["train", "--env", "tictactoe", "--total-steps", "2048", "--num-envs", "8", "--num-steps", "32",
                 "--opponents", "self_play:1,random:1", "--run-dir", run, "--progress", "false",
                 "--tensorboard", "false"]) == 0
    capsys.readouterr()
    assert main(["league", run, "--json"]) == 0
    status = {r["name"]: r["status"] for r in json.loads(capsys.readouterr().out)["ratings"]}
    assert status["learner@first"] == status["learner@second"] == "learner seat", status
    assert status["learner"] == "learner" and status["random"] == "scripted"


def _tiny_game_run(tmp_path, *extra: str) -> tuple[int, str]:
    run = str(tmp_path / "run")
    return main(["train", "--env", "tictactoe", "--total-steps", "512", "--num-envs", "4", "--num-steps", "64",
                 "--run-dir", run, "--progress", "false", "--tensorboard", "false", *extra]), run


@pytest.mark.parametrize("bot,shown", [("returns_text", r"'\d' \(str\)"), ("returns_none", r"None \(NoneType\)"),
                                       ("returns_float", r"\d\.0 \(float\)")])
def test_an_outside_player_returning_no_action_index_is_refused_in_one_line(bot, shown, tmp_path, capsys, monkeypatch):
    """A bot returning "3", None or 2.0 was reported as "121 of 121 illegal moves" with random play's results: the
    return type is wrong, and the line says so (issue 63; failed on main first)."""
    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parent))
    code, run = _tiny_game_run(tmp_path)
    assert code == 0
    capsys.readouterr()
    assert main(["eval", run, "--vs", f"bad_bots:{bot}", "--episodes", "2"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and re.search(f"--vs bad_bots:{bot} returned {shown}", err), err
    assert "must return an action index" in err


def test_an_outside_opponent_that_raises_in_training_leaves_its_traceback_and_the_resume_hint(tmp_path, capsys,
                                                                                               monkeypatch):
    """An opponent that raised during training ended in a line labelled "config key 'opponents'" with no traceback
    file and no word on resuming (an env crash gets both): now it gets both (issue 63; failed on main first)."""
    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parent))
    import bad_bots

    bad_bots.calls["n"] = 0
    code, run = _tiny_game_run(tmp_path, "--opponents", "bad_bots:raises_later")
    assert code == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1, err
    assert "opponent bad_bots:raises_later raised" in err and "the bot's table has no entry" in err, err
    trace = Path(run) / "opponent_crash.txt"
    assert f"traceback in '{trace}'" in err and "raises_later" in trace.read_text()
    assert "no checkpoint was written yet" in err


def test_eval_of_a_game_answers_does_it_beat_random_from_each_seat_and_counts_repeated_games_once(tmp_path, capsys):
    """`phalanx eval RUN` of a game printed self-play figures (team return 0.00); `mean_length` counted plies where
    training's episode_length counts a slot's moves; and one game repeated 50 times got an interval as if the games
    were independent (issue 63; each failed on main first). Now: each seat against random play and the env's own
    players, the distinct games counted, a repeated game shown as one game, and lengths as training counts them."""
    import json

    from phalanx.evaluate import evaluate_policy
    from phalanx.policy import load

    code, run = _tiny_game_run(tmp_path)
    assert code == 0
    capsys.readouterr()
    assert main(["eval", run, "--episodes", "6", "--json"]) == 0
    table = json.loads(capsys.readouterr().out)["vs"]
    assert list(table) == ["random", *(f"{kind}_{d}" for kind in ("tactics", "threats") for d in (1, 2, 3, 4))]
    assert all(table[n][seat]["episodes"] == 6 for n in table for seat in ("first", "second"))
    # bench's perfect player breaks ties by a fixed order: against the greedy policy every game is the same one
    assert main(["eval", run, "--vs", "phalanx_bench.players.tictactoe:act", "--episodes", "5"]) == 0
    out = capsys.readouterr().out
    assert "(one game)" in out and "[0." not in out.split("phalanx_bench.players.tictactoe:act", 1)[1].split("distinct:")[0]
    one = evaluate_policy(load(run), "tictactoe", episodes=8)
    assert one["distinct_games"] == 1  # greedy self-play: one game, eight times
    assert one["mean_length"] * 2 == pytest.approx(one["mean_plies"], abs=1.0)  # a slot's moves, about half the plies
