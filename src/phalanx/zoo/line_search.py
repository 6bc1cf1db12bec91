"""A batched, full-width game-tree search for the k-in-a-line games (zoo/board_games.py): the scripted players
`tactics_1` ... `tactics_4` of tic-tac-toe and connect four, league members and sparring partners on the device.

`tactics_d` looks `d` plies ahead (its own move the first) and sees only the game's outcome: a win within its
horizon is taken, the soonest first, a loss within it avoided where it can be, the slowest where it cannot; every
other move is as good as any other, and the player picks among the equals uniformly at random. It has no
positional judgement at all, so it is a different player from the bench's searches (phalanx_bench/players/connect_four.py:
alpha-beta with a heuristic of open windows, the players a trained policy is judged against), and a policy that
trained with it has not met the bench's players under another name. What it teaches is tactics: against
`tactics_2` a move that lets the other side complete a line at once always loses.

The whole tree is expanded as tensors, n^d positions per copy (n moves: connect four's 7 columns, 2,401 positions
at d = 4), with no pruning and no host read: every copy searches in the same few ops. Positions are bitboards, one
int64 per side, column by column with a spare bit above each column (as in John Tromp's and Pascal Pons's solvers):
a line of k is k bits a fixed shift apart, and a dropped piece is the column's lowest free bit, found by one add.
"""

from __future__ import annotations

import torch

from phalanx.draws import Source, uniform

WIN = 1.0
# A win found one ply later is worth this much less, so that the soonest win (and the slowest loss) is preferred.
DECAY = 0.01
# A judged position's worth stays within +-JUDGED: below any win or loss the search finds.
JUDGED = 0.5
# Judging every leaf of a 4-ply tree costs some 15 times a 3-ply one's (2,401 boards a position): deeper searches
# see outcomes to their depth and judge the positions 3 plies deep.
JUDGED_PLIES = 3
# `threats_d` takes any move this close to the best judged one (about one point of its score), so its games vary.
EQUAL_JUDGEMENT = 0.02


def popcount(bits: torch.Tensor) -> torch.Tensor:
    """The set bits of each non-negative int64 (below 2 ** 62), in the usual parallel bit sums."""
    x = bits - ((bits >> 1) & 0x5555555555555555)
    x = (x & 0x3333333333333333) + ((x >> 2) & 0x3333333333333333)
    x = (x + (x >> 4)) & 0x0F0F0F0F0F0F0F0F
    x = x + (x >> 8)
    x = x + (x >> 16)
    x = x + (x >> 32)
    return x & 0x7F


class LineSearch:
    """k-in-a-line on a rows x cols board; `gravity`: a move is a column whose lowest empty cell takes the piece,
    else a cell. Boards come as the env keeps them ([M, cells] row by row from the top, 0 empty, 1 / 2 the two
    players' pieces) and are searched as bitboards (see the module docstring)."""

    def __init__(self, rows: int, cols: int, k: int, gravity: bool, device: torch.device | str = "cpu"):
        self.rows, self.cols, self.k, self.gravity = rows, cols, k, gravity
        self.height = rows + 1  # bits per column: the rows and a spare one, so no line wraps into the next column
        if cols * self.height > 62:
            raise ValueError(f"a {rows} x {cols} board needs {cols * self.height} bits; a bitboard holds 62")
        self.moves = cols if gravity else rows * cols
        # Cell (r, c), r from the top, is bit c * height + (rows - 1 - r).
        bit = [[c * self.height + (rows - 1 - r) for c in range(cols)] for r in range(rows)]
        as_tensor = lambda xs: torch.tensor(xs, dtype=torch.int64, device=device)  # noqa: E731
        self.cell_bits = as_tensor([1 << bit[r][c] for r in range(rows) for c in range(cols)])
        self.bottom = as_tensor([1 << (c * self.height) for c in range(cols)])
        self.column = as_tensor([((1 << rows) - 1) << (c * self.height) for c in range(cols)])
        self.full = int(sum(1 << b for row in bit for b in row))
        # The shifts of a line: up a column, along a row, and the two diagonals.
        self.shifts = (1, self.height, self.height - 1, self.height + 1)
        # For the positional judgement (`judge`): the cells on rows of odd height (counted from 1 at the bottom;
        # with gravity they decide who gets a threat), the centre column(s) and the columns beside them.
        self.odd_rows = int(sum(1 << bit[r][c] for r in range(rows) for c in range(cols) if (rows - 1 - r) % 2 == 0))
        mid = (cols - 1) / 2
        self.centre = int(sum(1 << bit[r][c] for r in range(rows) for c in range(cols) if abs(c - mid) < 1))
        self.near_centre = int(sum(1 << bit[r][c] for r in range(rows) for c in range(cols) if 1 <= abs(c - mid) < 2))

    def pieces(self, board: torch.Tensor, mark: torch.Tensor) -> torch.Tensor:
        """[M] int64: the bitboard of the pieces of `mark` [M] (1 or 2) on boards [M, cells]."""
        # A masked sum, not a matmul: CUDA has no integer matmul.
        return torch.where(board == mark.unsqueeze(1), self.cell_bits, 0).sum(-1)

    def bitboards(self, board: torch.Tensor, mark: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(the mover's pieces, the other's) [M] int64 of boards [M, cells] whose mover plays `mark` [M] (1 or 2)."""
        return self.pieces(board, mark), self.pieces(board, 3 - mark)

    def won(self, pieces: torch.Tensor) -> torch.Tensor:
        """Whether `pieces` (int64 bitboards) hold k in a line."""
        out = torch.zeros(pieces.shape, dtype=torch.bool, device=pieces.device)
        for s in self.shifts:
            line = pieces
            for i in range(1, self.k):
                line = line & (pieces >> (i * s))
            out |= line != 0
        return out

    def winning_cells(self, pieces: torch.Tensor) -> torch.Tensor:
        """The cells (bits) that would complete a line of k with `pieces`: for each line direction and each place the
        cell could take in the line, the other k - 1 cells held. Off-board bits (the spare row, past the last column)
        come out too; callers keep the playable cells only."""
        out = torch.zeros_like(pieces)
        for s in self.shifts:
            for j in range(self.k):
                line = torch.full_like(pieces, -1)
                for i in range(self.k):
                    if i != j:  # cell x + (i - j) * s held: bit x of pieces shifted back by that much
                        d = (i - j) * s
                        line = line & (pieces >> d if d > 0 else pieces << -d)
                out |= line
        return out

    def playable(self, taken: torch.Tensor) -> torch.Tensor:
        """The cells a move can fill next, given the `taken` ones."""
        if self.gravity:
            return (taken + self.bottom.sum()) & self.full  # each column's lowest free cell
        return ~taken & self.full

    def play(self, mine: torch.Tensor, theirs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Every move from each position [M]: -> (the piece each move adds [M, n] int64, legal [M, n])."""
        taken = (mine | theirs).unsqueeze(1)
        if self.gravity:
            piece = (taken + self.bottom) & self.column  # the column's lowest free bit; 0 where it is full
            return piece, piece != 0
        piece = self.cell_bits.expand(mine.shape[0], -1)
        return piece, (taken & piece) == 0

    def values(self, mine: torch.Tensor, theirs: torch.Tensor, depth: int, judged: bool = False) -> torch.Tensor:
        """[M, n]: each move's value for the player to move, searched `depth` plies (the move itself the first):
        +WIN - DECAY * (plies - 1) a win, the negation a loss; neither within the horizon: 0, or with `judged` the
        `judge`d worth of the position the horizon reaches (within +-JUDGED; judged at most JUDGED_PLIES deep,
        outcomes seen to `depth`); -inf illegal."""
        if judged and depth > JUDGED_PLIES:
            outcome = self.values(mine, theirs, depth)
            return torch.where(outcome.abs() > JUDGED, outcome, self.values(mine, theirs, JUDGED_PLIES, True))
        piece, legal = self.play(mine, theirs)
        after = mine.unsqueeze(1) | piece
        if depth == 2 and not judged:
            return self._two_plies(mine, theirs, piece, legal)
        won = self.won(after) & legal
        value = torch.where(won, WIN, 0.0)
        full = ((after | theirs.unsqueeze(1)) == self.full)
        if depth > 1:
            reply = self.values(theirs.unsqueeze(1).expand_as(after).reshape(-1), after.reshape(-1), depth - 1, judged)
            best = reply.max(-1).values.view(legal.shape)
            best = torch.where(torch.isfinite(best), best, 0.0)
            decided = best.abs() > JUDGED
            value = torch.where(won | full, value, -torch.where(decided, best - torch.sign(best) * DECAY, best))
        elif judged:
            worth = self.judge(theirs.unsqueeze(1).expand_as(after).reshape(-1), after.reshape(-1)).view(legal.shape)
            value = torch.where(won | full, value, -worth)
        return torch.where(legal, value, -torch.inf)

    def judge(self, mine: torch.Tensor, theirs: torch.Tensor) -> torch.Tensor:
        """[M] in (-JUDGED, JUDGED): the worth of positions for the player to move (`mine`) by their shape alone, on
        the bitboards: each side's lines of k that the other has no piece in, more for the fuller; its threats (empty
        cells that would complete a line), with gravity a threat on the rows that favour its owner counted twice (the
        first player's on odd rows from the bottom, the second's on even rows: whoever must fill the cell below a
        threat late in a game usually does); and its pieces in the centre columns."""
        taken = mine | theirs
        empty = ~taken & self.full
        mover_first = popcount(mine) == popcount(theirs)
        if self.gravity:
            mover_rows = torch.where(mover_first, self.odd_rows, self.full & ~self.odd_rows)
        else:
            mover_rows = torch.zeros_like(mine)
        score = torch.zeros(mine.shape, device=mine.device)
        for sign, own, other, rows in ((1.0, mine, theirs, mover_rows), (-1.0, theirs, mine, self.full & ~mover_rows)):
            threats = self.winning_cells(own) & empty
            worth = self.open_lines(own, other) + 4.0 * (popcount(threats) + popcount(threats & rows)).float()
            worth = worth + (2 * popcount(own & self.centre) + popcount(own & self.near_centre)).float()
            score = score + sign * worth
        return JUDGED * torch.tanh(score / 20.0)

    def open_lines(self, own: torch.Tensor, other: torch.Tensor) -> torch.Tensor:
        """[M] float: the lines of k holding none of `other`'s pieces, each worth 3 ** (pieces of `own` - 1) up to k - 2
        pieces (fuller ones are threats, counted apart). Counted bit-sliced: for each line direction, bit x of
        `at_least[j]` says the line from cell x on holds at least j of `own`'s pieces."""
        free = self.full & ~other
        total = torch.zeros(own.shape, device=own.device)
        for s in self.shifts:
            open_line = torch.full_like(own, -1)
            at_least = [torch.full_like(own, -1)] + [torch.zeros_like(own) for _ in range(self.k)]
            for i in range(self.k):
                open_line = open_line & (free >> (i * s))
                cell = own >> (i * s)
                for j in range(i + 1, 0, -1):
                    at_least[j] = at_least[j] | (at_least[j - 1] & cell)
            for j in range(1, self.k - 1):
                exactly = open_line & at_least[j] & ~at_least[j + 1]
                total = total + 3.0 ** (j - 1) * popcount(exactly).float()
        return total

    def _two_plies(self, mine: torch.Tensor, theirs: torch.Tensor, piece: torch.Tensor,
                   legal: torch.Tensor) -> torch.Tensor:
        """`values` at depth 2 without a tree (the leaves dominate a full-width search's cost): a move wins where its
        piece is one of the mover's winning cells, and loses where one of the other side's winning cells is playable
        after it (the cells playable before, less the piece, plus the cell above it). Positions hold no line yet."""
        taken = mine | theirs
        win = ((self.winning_cells(mine).unsqueeze(1) & piece) != 0) & legal
        full = (taken.unsqueeze(1) | piece) == self.full
        playable = self.playable(taken).unsqueeze(1) & ~piece
        if self.gravity:
            playable = playable | ((piece << 1) & self.full)
        lose = (self.winning_cells(theirs).unsqueeze(1) & playable) != 0
        value = torch.where(win, WIN, torch.where(full | ~lose, 0.0, -(WIN - DECAY)))
        return torch.where(legal, value, -torch.inf)

    def choose(self, board: torch.Tensor, mark: torch.Tensor, depth: int, draws: Source,
               judged: bool = False) -> torch.Tensor:
        """[M]: a best move of boards [M, cells] for the player of `mark` [M], uniformly at random among the equals
        (with `judged`, among the moves within EQUAL_JUDGEMENT of the best)."""
        value = self.values(*self.bitboards(board, mark), depth, judged)
        best = value.max(-1, keepdim=True).values
        margin = EQUAL_JUDGEMENT if judged else 1e-6
        score = torch.where(value >= best - margin, uniform(draws, tuple(value.shape), board.device), -1.0)
        return score.argmax(-1)
