"""A batched, full-width game-tree search for the k-in-a-line games (zoo/board_games.py): the scripted players
`tactics_1` ... `tactics_4` of tic-tac-toe and connect four, league members and sparring partners on the device.

`tactics_d` looks `d` plies ahead (its own move the first) and sees only the game's outcome: a win within its
horizon is taken, the soonest first, a loss within it avoided where it can be, the slowest where it cannot; every
other move is as good as any other, and the player picks among the equals uniformly at random. It has no
positional judgement at all, so it is a different player from the bench's searches (bench/games/connect_four.py:
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

    def values(self, mine: torch.Tensor, theirs: torch.Tensor, depth: int) -> torch.Tensor:
        """[M, n]: each move's value for the player to move, searched `depth` plies (the move itself the first):
        +WIN - DECAY * (plies - 1) a win, the negation a loss, 0 neither within the horizon; -inf illegal."""
        piece, legal = self.play(mine, theirs)
        after = mine.unsqueeze(1) | piece
        if depth == 2:
            return self._two_plies(mine, theirs, piece, legal)
        won = self.won(after) & legal
        value = torch.where(won, WIN, 0.0)
        if depth > 1:
            full = ((after | theirs.unsqueeze(1)) == self.full)
            reply = self.values(theirs.unsqueeze(1).expand_as(after).reshape(-1), after.reshape(-1), depth - 1)
            best = reply.max(-1).values.view(legal.shape)
            best = torch.where(torch.isfinite(best), best, 0.0)
            value = torch.where(won | full, value, -(best - torch.sign(best) * DECAY))
        return torch.where(legal, value, -torch.inf)

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

    def choose(self, board: torch.Tensor, mark: torch.Tensor, depth: int, draws: Source) -> torch.Tensor:
        """[M]: a best move of boards [M, cells] for the player of `mark` [M], uniformly at random among the equals."""
        value = self.values(*self.bitboards(board, mark), depth)
        best = value.max(-1, keepdim=True).values
        score = torch.where(value >= best - 1e-6, uniform(draws, tuple(value.shape), board.device), -1.0)
        return score.argmax(-1)
