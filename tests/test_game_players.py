"""The reference players of phalanx_bench.players (issue 50's proof): a perfect tic-tac-toe player and a depth-limited
connect-four search, plain callables over PettingZoo's observation dicts."""

import numpy as np
import pytest

pytest.importorskip("pettingzoo")
pytest.importorskip("pygame")  # PettingZoo's classic games import it

from pettingzoo.classic import connect_four_v3, tictactoe_v3  # noqa: E402

from phalanx_bench.players import connect_four, tictactoe  # noqa: E402
from phalanx_bench.players.play import play, random_player  # noqa: E402


def board(mine=(), theirs=(), rows=3, cols=3):
    """An observation dict with the mover's pieces at `mine`, the opponent's at `theirs` (flat indices)."""
    obs = np.zeros((rows * cols, 2), np.int8)
    obs[list(mine), 0] = 1
    obs[list(theirs), 1] = 1
    mask = (obs.sum(1) == 0).astype(np.int8)
    if rows == 6:  # connect four: a column is open while its top cell is empty
        mask = mask.reshape(rows, cols)[0].copy()
    return {"observation": obs.reshape(rows, cols, 2), "action_mask": mask}


def test_the_perfect_player_reads_the_game():
    assert tictactoe.move_values(0, 0) and max(tictactoe.move_values(0, 0).values()) == 0  # a draw from the start
    assert tictactoe.act(board(mine=(0, 1), theirs=(3, 4))) == 2  # it wins at once rather than block
    assert tictactoe.act(board(mine=(0, 8), theirs=(3, 4))) == 5  # it blocks the middle row
    assert tictactoe.act(board(mine=(0, 8), theirs=(4, 2))) == 6  # it blocks the diagonal


@pytest.mark.parametrize("seat", [0, 1])
def test_the_perfect_player_never_loses_to_random_play(seat):
    env = tictactoe_v3.env()
    first, second = env.possible_agents
    outcomes = []
    for game in range(150):
        players = {first: random_player(game), second: tictactoe.player(game)}
        if seat == 0:
            players = {first: tictactoe.player(game), second: random_player(game)}
        outcomes.append(play(env, players)[(first, second)[seat]])
    assert min(outcomes) >= 0, "a loss"
    assert sum(o > 0 for o in outcomes) > (120 if seat == 0 else 90)  # and it wins most of them


def test_the_perfect_player_draws_against_itself():
    env = tictactoe_v3.env()
    first, second = env.possible_agents
    assert play(env, {first: tictactoe.act, second: tictactoe.act}) == {first: 0.0, second: 0.0}
    for game in range(40):  # ties broken at random: other lines, still draws
        assert play(env, {first: tictactoe.player(game), second: tictactoe.player(1000 + game)}) == {first: 0.0, second: 0.0}


def test_the_search_wins_at_once_and_blocks_a_threat():
    c4 = dict(rows=6, cols=7)
    bottom = [35 + c for c in range(7)]
    three = board(mine=bottom[1:4], theirs=(28 + 1, 28 + 2), **c4)
    assert connect_four.player(1)(three) in (0, 4)  # four in the bottom row
    threat = board(mine=(bottom[5], bottom[6], 28 + 5), theirs=bottom[0:3], **c4)
    assert connect_four.player(2)(threat) == 3  # the opponent's three must be blocked
    assert max(connect_four.move_values(threat, 2).values()) > -connect_four.WIN // 2  # blocked, it is no loss
    assert connect_four.move_values(threat, 2)[4] < -connect_four.WIN // 2  # elsewhere, the opponent wins
    assert connect_four.player(1)(board(**c4)) == 3  # the centre on an empty board


def test_the_search_at_depth_4_beats_random_play():
    env = connect_four_v3.env()
    first, second = env.possible_agents
    wins = 0
    for game in range(40):
        search, rand = connect_four.player(4, seed=game), random_player(game)
        seats = {first: search, second: rand} if game % 2 == 0 else {first: rand, second: search}
        wins += play(env, seats)[first if game % 2 == 0 else second] > 0
    assert wins / 40 > 0.9


def test_a_board_the_mask_contradicts_and_an_illegal_move_are_refused():
    wrong = board(mine=(0,), theirs=(4,))
    wrong["action_mask"][0] = 1
    with pytest.raises(ValueError, match="the action_mask allows"):
        tictactoe.act(wrong)
    env = tictactoe_v3.env()
    first, second = env.possible_agents
    with pytest.raises(ValueError, match="which its action_mask forbids"):
        play(env, {first: lambda obs: 4, second: lambda obs: 4})


def test_the_study_score_interval_holds_its_mean_and_the_seed_spread():
    from phalanx_bench.studies.games import score_interval

    assert score_interval([(10, 0, 0), (10, 0, 0)]) == (1.0, 1.0, 1.0)
    mean, lo, hi = score_interval([(2, 4, 4), (8, 0, 2)])  # scores 0.4 and 0.8
    assert mean == pytest.approx(0.6)
    assert lo <= 0.45 and hi >= 0.75  # the two seeds differ: the interval spans them, not only one seed's games
    mean, lo, hi = score_interval([(100, 0, 100)] * 3)
    assert lo < 0.5 < hi and hi - lo < 0.15


def test_the_study_caption_names_the_training_levers_and_refuses_runs_that_differ_in_one():
    from phalanx.config import Config
    from phalanx_bench.studies.games import training_keys

    base = {k: v for k, v in vars(Config(env="connect_four")).items()}
    caption = training_keys([base, {**base, "seed": 2}])
    assert caption.startswith(f"lr {base['lr']}, gamma {base['gamma']}, lambda {base['gae_lambda']}, a batch of ")
    assert "mirrored" not in caption
    assert training_keys([{**base, "gamma": 1.0, "gae_lambda": 1.0, "mirror": True}]).endswith("(pfsp), mirrored")
    with pytest.raises(SystemExit, match="different settings of lr"):
        training_keys([base, {**base, "lr": 3e-3}])


def test_varied_players_break_ties_at_random_and_stay_perfect():
    first_moves = {tictactoe.varied(board()) for _ in range(40)}
    assert len(first_moves) > 1  # every square draws under perfect play
    env = tictactoe_v3.env()
    for seed in range(10):
        assert play(env, {"player_1": tictactoe.varied, "player_2": random_player(seed)}, seed=seed)["player_1"] >= 0
    values = connect_four.move_values(board(rows=6, cols=7), 2)
    assert {connect_four.varied_2(board(rows=6, cols=7)) for _ in range(10)} <= {c for c, v in values.items()
                                                                               if v == max(values.values())}


def test_every_perfect_line_is_walked_and_a_flawed_player_is_caught():
    for seat in ("first", "second"):
        perfect = tictactoe.against_every_perfect_line(tictactoe.act, seat)
        assert perfect["losses"] == perfect["illegal_moves"] == 0 and perfect["draws"] == perfect["lines"] > 1
    # Every square draws as an opening, so from the second seat the walk meets all nine first moves.
    seen = []

    def watching(observation):
        seen.append(observation["observation"][..., 1].sum())
        return tictactoe.act(observation)

    tictactoe.against_every_perfect_line(watching, "second")
    assert sum(1 for pieces in seen if pieces == 1) == 9

    def lowest_square(observation):
        return int(np.flatnonzero(observation["action_mask"])[0])

    flawed = tictactoe.against_every_perfect_line(lowest_square, "first")
    assert flawed["losses"] == flawed["lines"] > 0 and flawed["wins"] == 0
    line = flawed["losing_lines"][0]
    assert line[0] == 0 and len(line) % 2 == 0  # it opened at the corner and the perfect player moved last
    taken = tictactoe.against_every_perfect_line(lambda observation: 4, "first")  # replays the centre: a forfeit
    assert taken["illegal_moves"] == taken["losses"] == taken["lines"] and taken["losing_lines"][0][:2] == [4, 0]
