"""A look-ahead at play time for board policies: each candidate move judged by games the policy plays on from it
(Tesauro and Galperin's on-line policy improvement by Monte Carlo search), as pure tensor functions.

A greedy policy answers each position one way, and on connect four the net's one-move reading loses lines longer
than its tactics (docs/EXPERIMENTS.md, issue 62); its value head judges the middle game poorly (a search on it, or
a tree search of 64 walks guided by it, gained less: the same document). Games played on by the policy itself see
what the policy will do after the move, to the end. `rollout_values` plays `rollouts` games from the board each
candidate move makes, both sides moving as training samples them (the net among the moves the exact outcomes
leave), all copies of all boards at once, one ply a step, and scores the move by their mean result.

The sampling noise is a hash of the position, the move, the game's number and the ply, so a position is judged
the same way in any batch: a greedy policy with the search still plays a position one way, and a search remembers
its move per position (models/board.py). It changes no training step: rollouts sample from the net as trained.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

# 31-bit multiplicative hashing (products stay below 2 ** 62: no int64 overflow on any device).
_MASK = (1 << 31) - 1
_MULTIPLIERS = (1103515245, 1274126177, 2654435761 & _MASK)


def position_keys(boards: torch.Tensor) -> torch.Tensor:
    """[B, P] int64: each plane of boards [B, H, W, P] (0 / 1) as the bits of its cells, row by row (42 cells fit)."""
    bits = 2 ** torch.arange(boards[0, ..., 0].numel(), device=boards.device)
    return torch.stack([(boards[..., p].flatten(1) > 0.5).long() @ bits for p in range(boards.shape[-1])], 1)


def hashed(values: torch.Tensor) -> torch.Tensor:
    """[M] in [0, 2 ** 31): a mix of the int64 columns of `values` [M, C]."""
    h = torch.zeros(values.shape[0], dtype=torch.long, device=values.device)
    for c in range(values.shape[1]):
        for part in (values[:, c] & _MASK, (values[:, c] >> 31) & _MASK):
            h = (h * _MULTIPLIERS[0] + part + 12345) & _MASK
            h = h ^ (h >> 15)
            h = (h * _MULTIPLIERS[1]) & _MASK
            h = h ^ (h >> 13)
    return h


def hashed_uniform(seeds: torch.Tensor, ply: int, n: int) -> torch.Tensor:
    """[M, n] uniform in (0, 1): the noise of games `seeds` [M] at `ply`, one draw per move."""
    move = torch.arange(n, device=seeds.device)
    cols = torch.stack([seeds.unsqueeze(1).expand(-1, n), torch.full_like(seeds, ply).unsqueeze(1).expand(-1, n),
                        move.expand(len(seeds), -1)], -1).reshape(-1, 3)
    return ((hashed(cols).view(-1, n).double() + 0.5) / (1 << 31)).float()


def rollout_values(
    boards: torch.Tensor,
    candidates: torch.Tensor,
    wins: torch.Tensor,
    play: Callable[[torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]],
    successors: Callable[[torch.Tensor], torch.Tensor],
    rollouts: int,
) -> torch.Tensor:
    """Each candidate move's mean result [B, n] for the player to move on `boards` [B, H, W, P] (the mover's pieces
    in plane 0) over `rollouts` games played on from the board it makes; -inf where `candidates` [B, n] is false.

    `wins` [B, n]: the moves that complete a line (the game ends at once, won). `play(boards [M, H, W, P], noise
    [M, n])` -> (the board the mover's move makes, the new piece in plane 0; whether it completes a line), sampling
    with the uniform `noise`. `successors(boards)` -> [B, n, H, W, P]: the board after each move. A result is +1 a
    win, -1 a loss, 0 a draw; every game is played to its end."""
    B, n = candidates.shape
    cells = boards[0].numel() // boards.shape[-1]
    pairs = candidates.nonzero()  # [K, 2]: the (board, move) pairs played on
    games = successors(boards)[pairs[:, 0], pairs[:, 1]].repeat_interleave(rollouts, 0)
    keys = position_keys(boards)[pairs[:, 0]]
    number = torch.arange(rollouts, device=boards.device).repeat(len(pairs)).unsqueeze(1)
    seeds = hashed(torch.cat([keys.repeat_interleave(rollouts, 0), pairs[:, 1:].repeat_interleave(rollouts, 0), number], 1))
    won_at_once = wins[pairs[:, 0], pairs[:, 1]].repeat_interleave(rollouts, 0)
    result = torch.where(won_at_once, 1.0, 0.0)  # for the root's mover
    playing = ~won_at_once & (games.flatten(1).sum(-1) < cells)
    board = games.flip(-1)  # the other side to move, its pieces in plane 0
    sign, ply = -1.0, 0  # the mover's result counts `sign` toward the root mover's
    while bool(playing.any()):
        at = playing.nonzero().squeeze(-1)
        made, won = play(board[at], hashed_uniform(seeds[at], ply, n))
        result[at] = torch.where(won, sign, 0.0)
        board[at] = made.flip(-1)
        playing[at] = ~won & (made.flatten(1).sum(-1) < cells)
        sign, ply = -sign, ply + 1
    values = torch.full((B, n), -torch.inf, device=boards.device)
    values[pairs[:, 0], pairs[:, 1]] = result.view(-1, rollouts).mean(-1)
    return values


__all__ = ["hashed", "hashed_uniform", "position_keys", "rollout_values"]
