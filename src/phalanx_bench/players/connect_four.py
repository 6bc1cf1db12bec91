"""A depth-limited connect-four search for the bench: negamax with alpha-beta over bitboards, to `depth` plies,
scoring the positions it stops at with a simple heuristic (open windows of four, the centre column), written
apart from Phalanx and PettingZoo's game code.

    phalanx eval RUN --vs phalanx_bench.players.connect_four:depth_4

`player(depth)(observation)` (and `depth_1` ... `depth_6`) take PettingZoo's connect_four_v3 observation dict
({"observation": [6, 7, 2], row 0 at the top, the mover's pieces in plane 0, the opponent's in plane 1,
"action_mask": [7]}) and return a column 0-6 that the mask allows. A win within `depth` plies is always found,
the soonest first; ties go to the column nearest the centre, or at random where `seed` is given.
"""

from __future__ import annotations

import functools
import random
from collections.abc import Callable
from typing import Any

import numpy as np

ROWS, COLS = 6, 7
ORDER = (3, 2, 4, 1, 5, 0, 6)  # centre first: alpha-beta cuts more, and ties go to the centre
WIN = 1_000_000


def _bit(row: int, col: int) -> int:
    return 1 << (row * COLS + col)


def _windows() -> list[int]:
    out = []
    for r in range(ROWS):
        for c in range(COLS):
            for dr, dc in ((0, 1), (1, 0), (1, 1), (1, -1)):
                cells = [(r + k * dr, c + k * dc) for k in range(4)]
                if all(0 <= rr < ROWS and 0 <= cc < COLS for rr, cc in cells):
                    out.append(sum(_bit(rr, cc) for rr, cc in cells))
    return out


WINDOWS = _windows()  # the 69 lines of four
CENTRE = sum(_bit(r, 3) for r in range(ROWS))


def _won(bits: int) -> bool:
    return any(bits & w == w for w in WINDOWS)


def _score(mine: int, theirs: int) -> int:
    """The heuristic value for `mine`: windows of four only one side holds, weighted by how full they are."""
    score = 3 * (mine & CENTRE).bit_count() - 3 * (theirs & CENTRE).bit_count()
    for w in WINDOWS:
        a, b = (mine & w).bit_count(), (theirs & w).bit_count()
        if b == 0:
            score += (0, 1, 4, 16, 0)[a]
        elif a == 0:
            score -= (0, 1, 4, 18, 0)[b]  # the opponent's threats weigh a little more
    return score


def _drop(mine: int, theirs: int, col: int) -> int | None:
    """The bit a piece dropped in `col` lands on (the lowest empty row; row 0 is the top), None where full."""
    for row in range(ROWS - 1, -1, -1):
        b = _bit(row, col)
        if not (mine | theirs) & b:
            return b
    return None


def _negamax(mine: int, theirs: int, depth: int, alpha: int, beta: int, ply: int) -> int:
    if _won(theirs):
        return -WIN + ply
    moves = [(c, b) for c in ORDER if (b := _drop(mine, theirs, c)) is not None]
    if not moves:
        return 0
    if depth == 0:
        return _score(mine, theirs)
    best = -WIN - 1
    for _, b in moves:
        value = -_negamax(theirs, mine | b, depth - 1, -beta, -alpha, ply + 1)
        best = max(best, value)
        alpha = max(alpha, value)
        if alpha >= beta:
            break
    return best


def _position(observation: dict[str, Any]) -> tuple[int, int, list[int]]:
    board = np.asarray(observation["observation"]).reshape(ROWS, COLS, 2)
    mine = sum(_bit(r, c) for r in range(ROWS) for c in range(COLS) if board[r, c, 0])
    theirs = sum(_bit(r, c) for r in range(ROWS) for c in range(COLS) if board[r, c, 1])
    legal = np.flatnonzero(np.asarray(observation["action_mask"])).tolist()
    open_cols = [c for c in range(COLS) if _drop(mine, theirs, c) is not None]
    if sorted(legal) != open_cols:
        raise ValueError(f"the action_mask allows columns {legal} but the open columns are {open_cols}")
    return mine, theirs, legal


def move_values(observation: dict[str, Any], depth: int) -> dict[int, int]:
    """Each legal column's value for the player to move, searched `depth` plies deep (the move itself the first)."""
    mine, theirs, _ = _position(observation)
    return dict(_values(mine, theirs, depth))


@functools.lru_cache(maxsize=1 << 20)
def _values(mine: int, theirs: int, depth: int) -> tuple[tuple[int, int], ...]:
    """`move_values` of a position, kept: a greedy learner's games against a search repeat, and a 6-ply search in
    pure Python takes a good part of a second a move."""
    return tuple((c, -_negamax(theirs, mine | b, depth - 1, -WIN - 1, WIN + 1, 1))
                 for c in ORDER if (b := _drop(mine, theirs, c)) is not None)


def player(depth: int = 4, seed: int | None = None) -> Callable[[dict[str, Any]], int]:
    """A player searching `depth` plies (1-6 in the bench); ties to the centre, or at random with a seed."""
    if depth < 1:
        raise ValueError(f"depth must be at least 1; got {depth}")
    rng = None if seed is None else random.Random(seed)

    def act(observation: dict[str, Any]) -> int:
        values = move_values(observation, depth)
        best = max(values.values())
        tied = [c for c, v in values.items() if v == best]  # in centre-first order
        return tied[0] if rng is None else rng.choice(tied)

    return act


depth_1, depth_2, depth_3, depth_4, depth_5, depth_6 = (player(d) for d in (1, 2, 3, 4, 5, 6))
# The same searches with their ties broken at random (seeded by depth), for evaluations whose games should differ:
# `phalanx eval RUN --vs phalanx_bench.players.connect_four:varied_4`.
varied_1, varied_2, varied_3, varied_4, varied_5, varied_6 = (player(d, seed=d) for d in (1, 2, 3, 4, 5, 6))
