"""The board games' batched search players (`tactics_d`, zoo/line_search.py): the wins and losses they see agree with
the bench's independently written alpha-beta search, and they play as their depth says."""

import pytest
import torch

from phalanx import train
from phalanx.draws import Draws
from phalanx.envs import make
from phalanx.evaluate import evaluate_seats
from phalanx.slots import random_actions
from phalanx.zoo.line_search import popcount
from phalanx_bench.players import connect_four as bench_c4
from tests.board_positions import win_and_block

WIN_FLOOR = bench_c4.WIN - 10  # the bench scores a win found at ply p as WIN - p, positions by a heuristic far below


def random_positions(name: str, n: int, plies: int, seed: int = 0):
    """The env after `plies` random moves in each of `n` copies (games that ended start again)."""
    env = make(name, num_envs=n, seed=seed)
    draws = Draws(torch.Generator().manual_seed(seed))
    rec = env.reset(seed=seed)
    for _ in range(plies):
        rec = env.step(random_actions(env, draws, rec.action_mask))
    return env, rec, draws


@pytest.mark.parametrize("depth,positions", [(1, 300), (2, 300), (3, 300), (4, 100)])
def test_connect_four_wins_and_losses_agree_with_the_bench_search(depth, positions):
    env, rec, _ = random_positions("connect_four", positions, 14, seed=depth)
    values = env.search.values(*env.search.bitboards(env.board, env.turn + 1), depth)
    turns = env.turn_observations()
    checked = 0
    for i, (slot, obs) in enumerate(turns):
        theirs = bench_c4.move_values(obs, depth)
        for col in range(7):
            if col not in theirs:
                assert values[i, col] == -torch.inf
                continue
            bench_win, bench_loss = theirs[col] >= WIN_FLOOR, theirs[col] <= -WIN_FLOOR
            assert bool(values[i, col] > 0.5) == bench_win, (i, col, theirs, values[i].tolist())
            assert bool(values[i, col] < -0.5) == bench_loss, (i, col, theirs, values[i].tolist())
            if bench_win or bench_loss:  # the same number of plies: the bench's WIN - p, ours 1 - 0.01 (p - 1)
                plies = bench_c4.WIN - abs(theirs[col])
                assert abs(abs(float(values[i, col])) - (1 - 0.01 * (plies - 1))) < 1e-5
                checked += 1
    assert checked > positions // 6  # the positions hold wins and losses to compare, not only quiet moves


def test_tactics_take_a_win_and_block_one():
    env = make("connect_four", num_envs=2, seed=0)
    env.reset(seed=0)
    win_and_block(env)  # copy 0: column 3 wins; copy 1: only column 6 stops the other side
    draws = Draws(torch.Generator().manual_seed(0))
    for _ in range(20):
        moves = env.scripted_actions("tactics_2", None, draws)
        assert moves[:, 0].tolist() == [3, 6]
        assert env.scripted_actions("tactics_1", None, draws)[0, 0] == 3


def match_score(name: str, strong: str, weak: str, games: int = 400) -> float:
    """`strong`'s score (wins plus half the draws) against `weak` over `games` batched games, half from each seat."""
    env = make(name, num_envs=games, seed=1)
    draws = Draws(torch.Generator().manual_seed(1))
    rec = env.reset(seed=1)
    strong_slot = torch.arange(games) % 2  # copy i: the strong player is slot i % 2
    score = torch.full((games,), -1.0)
    while bool((score < 0).any()):
        a = env.scripted_actions(strong, rec, draws)
        b = env.scripted_actions(weak, rec, draws) if weak != "random" else random_actions(env, draws, rec.action_mask)
        rec = env.step(torch.where(torch.nn.functional.one_hot(strong_slot, 2).bool(), a, b))
        ended = rec.terminated[:, 0] & (score < 0)
        won = rec.info["win"][torch.arange(games), strong_slot]
        score = torch.where(ended, won + 0.5 * rec.info["draw"][:, 0], score)
    return float(score.mean())


@pytest.mark.parametrize("name", ["tictactoe", "connect_four"])
def test_deeper_searches_beat_shallower_ones_and_random_play(name):
    """tactics_2 against random play, and tactics_3 against tactics_1, 400 games each, half of them from each seat:
    the deeper side scores above 0.8 (wins plus half the draws)."""
    for strong, weak in (("tactics_2", "random"), ("tactics_3", "tactics_1")):
        score = match_score(name, strong, weak)
        assert score > 0.8, (name, strong, weak, score)


def test_judging_the_horizon_beats_an_equal_depth_that_sees_outcomes_only():
    """threats_2 (outcomes two plies deep, the positions there judged by their lines and threats) against tactics_2
    (the same outcomes, every other move equal), 200 connect four games, half from each seat: above 0.8 (0.93 when
    written). Without the judgement the two are the same player and score 0.5."""
    assert match_score("connect_four", "threats_2", "tactics_2", games=200) > 0.8


def test_judged_searches_still_take_a_win_and_block_one():
    env = make("connect_four", num_envs=2, seed=0)
    env.reset(seed=0)
    win_and_block(env)
    draws = Draws(torch.Generator().manual_seed(0))
    for name in ("threats_1", "threats_2", "threats_3"):
        for _ in range(5):
            assert env.scripted_actions(name, None, draws)[:, 0].tolist()[0] == 3
            if name != "threats_1":  # one ply does not see the other side's reply
                assert env.scripted_actions(name, None, draws)[:, 0].tolist() == [3, 6]


def test_popcount_counts_the_set_bits():
    bits = torch.randint(0, 2 ** 62, (500,), dtype=torch.int64, generator=torch.Generator().manual_seed(0))
    assert popcount(bits).tolist() == [bin(int(b)).count("1") for b in bits]


@pytest.mark.parametrize("name", ["tictactoe", "connect_four"])
def test_open_lines_and_threats_agree_with_a_count_over_every_line(name):
    """The judgement's bit-sliced terms, against a plain walk over every line of k on the boards: the lines with none
    of the other side's pieces holding j of one's own (1 <= j <= k - 2, weighted 3 ** (j - 1)), and the empty cells
    that would complete a line."""
    env, _, _ = random_positions(name, 60, 4 if name == "tictactoe" else 12, seed=7)
    search = env.search
    mine, theirs = search.bitboards(env.board, env.turn + 1)
    rows, cols, k = search.rows, search.cols, search.k
    lines = [[(r + i * dr, c + i * dc) for i in range(k)] for r in range(rows) for c in range(cols)
             for dr, dc in ((0, 1), (1, 0), (1, 1), (1, -1))
             if all(0 <= r + i * dr < rows and 0 <= c + i * dc < cols for i in range(k))]
    got_lines = search.open_lines(mine, theirs)
    got_threats = popcount(search.winning_cells(mine) & ~(mine | theirs) & search.full)
    for m in range(60):
        board = env.board[m].view(rows, cols)
        own, other = int(env.turn[m]) + 1, 2 - int(env.turn[m])
        expected, threats = 0.0, set()
        for line in lines:
            held = [int(board[r, c]) for r, c in line]
            if other in held:
                continue
            j = held.count(own)
            if 1 <= j <= k - 2:
                expected += 3.0 ** (j - 1)
            if j == k - 1:
                threats |= {cell for cell, v in zip(line, held) if v == 0}
        assert float(got_lines[m]) == expected, m
        assert int(got_threats[m]) == len(threats), m


def test_a_league_with_a_searcher_teaches_connect_four_tactics(tmp_path):
    """400k moves against tactics_1 and tactics_2 (the flat net: 25-50 s on a core): the greedy learner then wins most games
    against tactics_2 as first player and a good share as second. Seed 1 scored 74 and 48 of 100; the self-play league
    (self_play:8,learner:2,random:1) at the same budget and seed scored 18 and 10, so the margins below hold only
    where the searcher taught what self-play did not."""
    # The flat net it was measured with (connect four's defaults since read the board through a residual net that
    # looks ahead, 6x slower a move; they have their own figures in docs/EXPERIMENTS.md).
    result = train(env="connect_four", opponents="tactics_1:1,tactics_2:2", total_steps=400_000, num_envs=128,
                   num_steps=16, seed=1, run_dir=str(tmp_path / "run"), progress=False, tensorboard=False, torch_threads=1,
                   model="mlp", hidden_sizes=[256, 256], lookahead=False, exact_outcomes=False, env_options={})
    seats = evaluate_seats(result.policy, "connect_four", "tactics_2", episodes=100, seed=5)
    assert seats["first"]["wins"] >= 55, seats["first"]
    assert seats["second"]["wins"] >= 30, seats["second"]


@pytest.mark.parametrize("name,plies", [("tictactoe", 2), ("connect_four", 2), ("connect_four", 4)])
def test_move_outcomes_read_off_the_boards_are_the_searchs_values(name, plies):
    """`move_outcome_fn` (what a model with exact_outcomes runs, from a slot's observation alone) gives the search's
    values of the env's own board for the slot to move, from either seat; -1 where the move is illegal."""
    env, rec, _ = random_positions(name, 400, 5 if name == "tictactoe" else 14, seed=3)
    mover = env.turn
    assert 0 < int(mover.sum()) < 400  # both seats to move somewhere
    outcome = env.move_outcome_fn(plies)(rec.obs[torch.arange(400), mover])
    values = env.search.values(*env.search.bitboards(env.board, mover + 1), plies)
    assert torch.equal(outcome, values.clamp_min(-1.0))
    assert int((outcome > 0.5).sum()) > 10 and int((outcome[torch.isfinite(values)] < -0.5).sum()) > 10
