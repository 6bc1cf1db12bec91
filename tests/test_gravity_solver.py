"""Connect four's endgame solver (zoo/gravity_solver.py) and the greedy play that reads it (play_solve_empties)."""

import functools
import json
import random

import pytest
import torch

from phalanx.config import resolve
from phalanx.envs import make
from phalanx.errors import ConfigError
from phalanx.models.registry import build_model
from phalanx.zoo.board_games import solved_outcomes
from phalanx.zoo.gravity_solver import GravitySolver
from phalanx_bench.players import connect_four as bench_c4

SOLVER = GravitySolver(6, 7)


def _line(pieces: int) -> bool:
    return any((m := pieces & (pieces >> s)) & (m >> 2 * s) for s in (1, 7, 6, 8))


def _drops(mine: int, theirs: int) -> list[tuple[int, int]]:
    taken = mine | theirs
    playable = (taken + SOLVER.bottom) & SOLVER.full
    return [(c, playable & SOLVER.columns[c]) for c in range(7) if playable & SOLVER.columns[c]]


@functools.lru_cache(maxsize=None)
def _brute(mine: int, theirs: int) -> int:
    """Plain negamax over every move to the end, no pruning, no ordering: the solver's reference."""
    moves = _drops(mine, theirs)
    if any(_line(mine | d) for _, d in moves):
        return 1
    return max(0 if ((mine | theirs | d).bit_count() == 42) else -_brute(theirs, mine | d) for _, d in moves)


def _random_position(rnd: random.Random, stones: int) -> tuple[int, int] | None:
    """A position after `stones` random moves, none of which ended the game (None where the walk had to end it)."""
    mine = theirs = 0
    while (mine | theirs).bit_count() < stones:
        quiet = [d for _, d in _drops(mine, theirs) if not _line(mine | d)]
        if not quiet:
            return None
        mine, theirs = theirs, mine | rnd.choice(quiet)
    return (mine, theirs) if _drops(mine, theirs) else None


def _reference_values(mine: int, theirs: int) -> list[int | None]:
    values: list[int | None] = [None] * 7
    for c, d in _drops(mine, theirs):
        values[c] = 1 if _line(mine | d) else 0 if (mine | theirs | d).bit_count() == 42 else -_brute(theirs, mine | d)
    return values


def test_the_solver_agrees_with_a_plain_negamax_to_the_end():
    """Every move's value on 150 random positions of 6 to 15 empty cells, against a search without cut-offs, tables
    or shortcuts (the forced blocks, the cells under a threat, the last two cells)."""
    rnd = random.Random(0)
    seen = set()
    checked = 0
    while checked < 150:
        position = _random_position(rnd, rnd.randint(27, 36))
        if position is None:
            continue
        got = SOLVER.move_values(*position)
        assert got == _reference_values(*position), position
        seen.update(v for v in got if v is not None)
        checked += 1
    assert seen == {-1, 0, 1}


def _board_obs(mine: int, theirs: int) -> torch.Tensor:
    """The mover's observation [6, 7, 2] of a solver position (row 0 the top)."""
    obs = torch.zeros(6, 7, 2)
    for r in range(6):
        for c in range(7):
            obs[r, c, 0] = float(bool(mine & SOLVER.bit(r, c)))
            obs[r, c, 1] = float(bool(theirs & SOLVER.bit(r, c)))
    return obs


def test_the_solvers_wins_and_losses_agree_with_the_bench_search_where_it_sees_them():
    """The bench's 4-ply search (written apart) finds a forced win or loss on some of 200 middle-game positions: the
    solver's value of each such move is the same outcome (deeper, it also finds more)."""
    rnd = random.Random(1)
    agreed = 0
    for _ in range(200):
        position = _random_position(rnd, rnd.randint(20, 26))
        if position is None:
            continue
        obs = _board_obs(*position)
        seen = bench_c4.move_values({"observation": obs.numpy(), "action_mask": (obs.sum(-1)[0] == 0).numpy()}, 4)
        solved = SOLVER.move_values(*position)
        for col, value in seen.items():
            if abs(value) > bench_c4.WIN // 2:
                assert solved[col] == (1 if value > 0 else -1), (position, col)
                agreed += 1
    assert agreed > 50


def test_solved_outcomes_read_the_boards_within_reach_and_leave_the_rest():
    """The tensor view: the solver's values on boards with at most `empties` empty cells that are the mover's, -1 for
    a full column, NaN on a board with more empty cells and on the slot that waits (more pieces of its own)."""
    rnd = random.Random(2)
    positions = []
    while len(positions) < 3:
        position = _random_position(rnd, 30)  # the mover (first player) to move: 15 pieces each
        if position is not None:
            positions.append(position)
    obs = torch.stack([_board_obs(*p) for p in positions] + [torch.zeros(6, 7, 2)])
    got = solved_outcomes(obs, rows=6, cols=7, empties=12)
    for i, position in enumerate(positions):
        assert got[i].tolist() == [-1.0 if v is None else float(v) for v in SOLVER.move_values(*position)]
    assert got[3].isnan().all()  # 42 empty cells
    waiting = obs[:1].flip(-1).clone()  # the other side's view, then a piece more of its own: it waits
    waiting[0, 0, 0, 0] = 1.0
    waiting[0, 0, 0, 1] = 0.0
    assert solved_outcomes(waiting, rows=6, cols=7, empties=12).isnan().all()
    assert solved_outcomes(obs.view(2, 2, 6, 7, 2), rows=6, cols=7, empties=12).shape == (2, 2, 7)


def _won_ending(rnd: random.Random, empties: int) -> tuple[int, int]:
    """A position with `empties` empty cells where the mover has a forced win and a move that throws it away."""
    while True:
        position = _random_position(rnd, 42 - empties)
        if position is None:
            continue
        values = SOLVER.move_values(*position)
        if 1 in values and any(v is not None and v < 1 for v in values):
            return position


def test_greedy_play_keeps_a_won_ending_and_sampled_moves_do_not_read_it():
    """play_solve_empties 16: on won endings (a forced win the 2-ply outcomes do not see, beside moves that lose it)
    greedy play chooses only winning moves, from an untrained net; sampled moves still may play any move the
    outcomes leave, and their log-prob is the update's. Beyond reach (more empty cells) nothing changes."""
    rnd = random.Random(3)
    env = make("connect_four", num_envs=1)
    cfg = {"env": "connect_four", "model": "board", "board_channels": 8, "exact_outcomes": True, "outcome_plies": 2,
           "play_outcome_plies": 0, "play_rollouts": 0}
    torch.manual_seed(0)
    solving = build_model(resolve({**cfg, "play_solve_empties": 16}), env)
    plain = build_model(resolve({**cfg, "play_solve_empties": 0}), env)
    plain.load_state_dict(solving.state_dict())
    assert plain.play_solved is None
    thrown = tried = 0
    while tried < 12:
        position = _won_ending(rnd, 14)
        obs = _board_obs(*position).view(1, 1, 6, 7, 2)
        mask = (obs[..., 0, :, :].sum(-1) == 0)
        wins = {c for c, v in enumerate(SOLVER.move_values(*position)) if v == 1}
        if set(plain.moves(obs, mask, greedy=True)[0, 0].nonzero().flatten().tolist()) <= wins:
            continue  # the 2-ply outcomes see this win already
        tried += 1
        greedy = solving.moves(obs, mask, greedy=True)[0, 0].nonzero().flatten().tolist()
        assert set(greedy) <= wins and greedy
        with torch.no_grad():
            assert int(solving.act(obs, greedy=True, mask=mask)[0][0, 0]) in wins
            thrown += int(plain.act(obs, greedy=True, mask=mask)[0][0, 0]) not in wins
        assert torch.equal(solving.moves(obs, mask), plain.moves(obs, mask))  # sampled moves: the outcomes only
    assert thrown > 0  # the net alone throws some of them away: the solver is what keeps them
    far = _board_obs(*_won_ending(rnd, 20)).view(1, 1, 6, 7, 2)
    far_mask = far[..., 0, :, :].sum(-1) == 0
    assert torch.equal(solving.moves(far, far_mask, greedy=True), plain.moves(far, far_mask, greedy=True))


def test_the_solver_is_refused_where_the_env_has_none_and_changes_no_training_step(tmp_path):
    """tictactoe has no solver: a one-line error naming the key and the value allowed. The key acts where the policy
    plays greedily only: runs with and without it train the same weights; a run written before the key existed
    plays without it; connect four's default is 24, and the exported graph leaves it out (its contract says so)."""
    from safetensors.torch import load_file

    import phalanx
    from phalanx import checkpoint as ckpt
    from phalanx.deployed import DeployedPolicy

    with pytest.raises(ConfigError, match="config key 'play_solve_empties' is 8 but env 'tictactoe' has no solver"):
        build_model(resolve({"env": "tictactoe", "model": "board", "exact_outcomes": True, "play_solve_empties": 8}),
                    make("tictactoe", num_envs=1))
    with pytest.raises(ConfigError, match="play_solve_empties"):
        resolve({"env": "connect_four", "play_solve_empties": 31})
    cfg = {"env": "connect_four", "model": "board", "board_channels": 4, "num_envs": 16, "num_steps": 8,
           "total_steps": 16 * 8 * 2, "opponents": "self_play:1,threats_2:1", "progress": False, "tensorboard": False,
           "exact_outcomes": True, "play_rollouts": 0}
    weights = []
    for empties in (0, 20):
        phalanx.train({**cfg, "play_solve_empties": empties, "run_dir": str(tmp_path / str(empties))})
        weights.append(load_file(str(ckpt.latest_checkpoint(tmp_path / str(empties)) / ckpt.WEIGHTS_FILE)))
    assert weights[0].keys() == weights[1].keys()
    assert all(torch.equal(weights[0][k], weights[1][k]) for k in weights[0])
    solving = phalanx.load(tmp_path / "20")
    assert solving.model.play_solved.keywords["empties"] == 20
    deployed = DeployedPolicy(solving)
    assert deployed.solver_left_out and deployed.policy.model.play_solved is None
    assert solving.model.play_solved is not None  # the run's own policy keeps it
    config = tmp_path / "20" / "config.json"
    written = json.loads(config.read_text())
    del written["play_solve_empties"]
    config.write_text(json.dumps(written))
    assert phalanx.load(tmp_path / "20").model.play_solved is None
    assert build_model(resolve({"env": "connect_four", "model": "board"}),
                       make("connect_four", num_envs=1)).play_solved.keywords["empties"] == 24
