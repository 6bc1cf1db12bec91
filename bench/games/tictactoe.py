"""A perfect tic-tac-toe player: full negamax over the game tree, memoised (5,478 positions), written for the
bench apart from Phalanx and PettingZoo's game code.

    phalanx eval RUN --vs bench.games.tictactoe:act

`act(observation)` takes PettingZoo's tictactoe_v3 observation dict ({"observation": [3, 3, 2] with the
mover's marks in plane 0 and the opponent's in plane 1, "action_mask": [9]}) and returns a square 0-8 that
the mask allows. Among equally good moves it takes the fastest win, else the slowest loss, then the lowest
square; `player(seed)` breaks the remaining ties at random, for varied games. It never loses: a test plays it
against random play and against itself.
"""

from __future__ import annotations

import functools
import random
from collections.abc import Callable
from typing import Any

import numpy as np

# Rows, columns and diagonals of a 3 x 3 board numbered 0-8 row by row; the same set read column by column.
LINES = ((0, 1, 2), (3, 4, 5), (6, 7, 8), (0, 3, 6), (1, 4, 7), (2, 5, 8), (0, 4, 8), (2, 4, 6))
LINE_BITS = tuple(sum(1 << i for i in line) for line in LINES)
FULL = (1 << 9) - 1


def _won(bits: int) -> bool:
    return any(bits & line == line for line in LINE_BITS)


@functools.cache
def _value(mine: int, theirs: int) -> int:
    """The game's value for the player to move (mine) under perfect play: 10 - plies to a win, negated for a
    loss, 0 for a draw."""
    if _won(theirs):
        return -10 + bin(mine | theirs).count("1") // 2  # the opponent won: later is less bad
    if mine | theirs == FULL:
        return 0
    return max(-_value(theirs, mine | 1 << square) for square in range(9) if not (mine | theirs) >> square & 1)


def move_values(mine: int, theirs: int) -> dict[int, int]:
    """Each free square's value for the player to move, under perfect play after it."""
    return {square: -_value(theirs, mine | 1 << square) for square in range(9) if not (mine | theirs) >> square & 1}


def _position(observation: dict[str, Any]) -> tuple[int, int, np.ndarray]:
    board = np.asarray(observation["observation"]).reshape(9, 2)
    mine = sum(1 << i for i in range(9) if board[i, 0])
    theirs = sum(1 << i for i in range(9) if board[i, 1])
    legal = np.flatnonzero(np.asarray(observation["action_mask"]))
    free = [i for i in range(9) if not (mine | theirs) >> i & 1]
    if sorted(legal.tolist()) != free:
        raise ValueError(f"the action_mask allows {legal.tolist()} but the free squares are {free}")
    return mine, theirs, legal


def best_moves(observation: dict[str, Any]) -> list[int]:
    """Every square of the best value for the player to move."""
    mine, theirs, _ = _position(observation)
    values = move_values(mine, theirs)
    best = max(values.values())
    return [square for square, v in values.items() if v == best]


def act(observation: dict[str, Any]) -> int:
    """The best move, ties to the lowest square."""
    return best_moves(observation)[0]


def player(seed: int | None = None) -> Callable[[dict[str, Any]], int]:
    """A perfect player that picks among equally good moves at random (seeded)."""
    rng = random.Random(seed)
    return lambda observation: rng.choice(best_moves(observation))


# A perfect player with its ties broken at random (seed 0), for evaluations whose games should differ:
# `phalanx eval RUN --vs bench.games.tictactoe:varied`.
varied = player(seed=0)
