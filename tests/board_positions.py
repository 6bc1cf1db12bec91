"""Connect four positions the board-game tests share."""

from __future__ import annotations

import torch


def win_and_block(env) -> None:
    """Two copies of connect four `env` set up with slot 0 to move. Copy 0: three of its pieces in the bottom row
    (columns 0-2): column 3 wins. Copy 1: slot 1 has three in column 6: only column 6 stops it."""
    board = torch.zeros(2, 42, dtype=torch.long)
    board[0, [35, 36, 37]] = 1
    board[0, [28, 29, 30]] = 2
    board[1, [41, 34, 27]] = 2
    board[1, [35, 36, 28]] = 1
    env.board, env.turn = board, torch.zeros(2, dtype=torch.long)
