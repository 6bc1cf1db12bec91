"""Turn-based games through training and evaluation (issue 50): a reward that reaches a slot on a turn it sat out
counts for it (episode statistics, evaluation) and is credited to its last move (algo/gae.py); tic-tac-toe trains
from the command line without an illegal move."""

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
    # against random play as each seat. Random play against random play: the first player wins 58.5% of those
    # games and loses 31.5%. Measured on seeds 1-3: as first player 83-86% won and 9-12% lost; seed 1 as second
    # player won 53.5% and lost 37.5%. The margins below leave room for another machine's arithmetic.
    import phalanx

    result = phalanx.train(env=TICTACTOE, total_steps=30_000, seed=1, num_envs=16, num_steps=64, run_dir=tmp_path / "r",
                           progress=False, tensorboard=False)
    baseline = evaluate_policy(None, TICTACTOE, episodes=200, seed=5, opponent="random", greedy=False)
    assert (baseline["wins"], baseline["losses"]) == (117, 63)  # the games below are drawn from the same seed
    first = evaluate_policy(result.policy, TICTACTOE, episodes=200, seed=5, opponent="random")
    assert first["wins"] >= 150 and first["losses"] <= 32, first  # random: 117 and 63
    second = evaluate_policy(None, TICTACTOE, episodes=200, seed=5, opponent=result.policy)  # random moves first
    assert second["losses"] >= 1.3 * baseline["losses"] and second["wins"] <= 0.85 * baseline["wins"], second
