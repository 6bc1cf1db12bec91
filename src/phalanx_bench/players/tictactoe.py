"""A perfect tic-tac-toe player: full negamax over the game tree, memoised (5,478 positions), written for the
bench apart from Phalanx and PettingZoo's game code.

    phalanx eval RUN --vs phalanx_bench.players.tictactoe:act

`act(observation)` takes PettingZoo's tictactoe_v3 observation dict ({"observation": [3, 3, 2] with the
mover's marks in plane 0 and the opponent's in plane 1, "action_mask": [9]}) and returns a square 0-8 that
the mask allows. Among equally good moves it takes the fastest win, else the slowest loss, then the lowest
square; `player(seed)` breaks the remaining ties at random, for varied games. It never loses: a test plays it
against random play and against itself.

`against_every_perfect_line(act, seat)` is the exhaustive form of "never loses to perfect play": it walks every
game a deterministic player (a greedy policy) can meet from a seat when its opponent may take any of its best
moves, the whole tree that games against `varied` sample from.
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
# `phalanx eval RUN --vs phalanx_bench.players.tictactoe:varied`.
varied = player(seed=0)


def observation(mine: int, theirs: int) -> dict[str, Any]:
    """PettingZoo's observation dict for the mover holding the squares of `mine` (bits) against `theirs`."""
    board = np.zeros((9, 2), np.int8)
    for i in range(9):
        board[i] = (mine >> i & 1, theirs >> i & 1)
    return {"observation": board.reshape(3, 3, 2), "action_mask": (board.sum(1) == 0).astype(np.int8)}


def against_every_perfect_line(act: Callable[[dict[str, Any]], int], seat: str) -> dict[str, Any]:
    """Every game `act` (deterministic: it is asked each position once) plays from `seat` ("first" or "second")
    against a perfect player taking each of its best moves in turn: {"lines", "wins", "draws", "losses",
    "losing_lines" (each a list of squares in the order played), "illegal_moves"}."""
    if seat not in ("first", "second"):
        raise ValueError(f"seat must be first or second, got {seat!r}")
    counts = {"lines": 0, "wins": 0, "draws": 0, "losses": 0, "illegal_moves": 0}
    losing: list[list[int]] = []
    answers: dict[tuple[int, int], int] = {}

    def walk(own: int, other: int, own_turn: bool, moves: list[int]) -> None:
        ended = "wins" if _won(own) else "losses" if _won(other) else "draws" if own | other == FULL else None
        if ended:
            counts["lines"] += 1
            counts[ended] += 1
            if ended == "losses":
                losing.append(moves)
            return
        if own_turn:
            if (own, other) not in answers:
                answers[own, other] = int(act(observation(own, other)))
            square = answers[own, other]
            if not 0 <= square < 9 or (own | other) >> square & 1:  # a forfeit, as the envs score one
                counts["illegal_moves"] += 1
                counts["lines"] += 1
                counts["losses"] += 1
                losing.append([*moves, square])
                return
            walk(own | 1 << square, other, False, [*moves, square])
            return
        values = move_values(other, own)
        best = max(values.values())
        for square, value in values.items():
            if value == best:
                walk(own, other | 1 << square, True, [*moves, square])

    walk(0, 0, seat == "first", [])
    return {**counts, "losing_lines": losing}
