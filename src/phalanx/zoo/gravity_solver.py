"""Connect four's endgames solved: each move's outcome under perfect play by both sides to the end of the game, by
alpha-beta negamax over bitboards with a transposition table (Pascal Pons' layout: a column of `rows` cells and one
empty bit above, so that a drop is an addition and four in a line is three shifts and ands).

A search that plays to the end is exact: its value of a position is the game's, whatever the table held before, so
the table is kept across searches and a greedy policy's play stays a function of the position alone. It is pure
Python (integers of rows x cols bits): on the positions of connect four games against the bench's 4-ply search, one
with 23 or 24 empty cells took 0.5 s at the median and up to 1.9 s (95k nodes) from an empty table on a shared core,
one with fewer a few milliseconds, and every empty cell more multiplies that, which is why play reads it only near
the end (config key `play_solve_empties`).

A weak solver: values are 1 (the mover wins), 0 (a draw), -1 (the mover loses), without the number of moves.
"""

from __future__ import annotations

# Positions the transposition table holds, at most; then it starts afresh (an entry is a few dozen bytes).
TABLE_SIZE = 1 << 21


class GravitySolver:
    """Four in a line on a board of `rows` x `cols` where a piece drops to the lowest empty cell of its column.

    A position is (mine, theirs): the mover's and the other side's pieces as bits, cell (row r from the top, column
    c) at bit c * (rows + 1) + (rows - 1 - r)."""

    def __init__(self, rows: int = 6, cols: int = 7):
        if rows < 4 and cols < 4:
            raise ValueError(f"a board of {rows} x {cols} holds no line of four")
        self.rows, self.cols = rows, cols
        self.height = rows + 1
        self.bottom = sum(1 << (c * self.height) for c in range(cols))
        self.full = self.bottom * ((1 << rows) - 1)
        self.columns = [((1 << rows) - 1) << (c * self.height) for c in range(cols)]
        centre = (cols - 1) / 2
        self.order = sorted(range(cols), key=lambda c: (abs(c - centre), c))  # the centre first: more cut-offs
        self.cells = rows * cols
        self.table: dict[int, tuple[int, int]] = {}
        self.nodes = 0

    def bit(self, row: int, col: int) -> int:
        """The bit of the cell in `row` (0 the top) and `col`."""
        return 1 << (col * self.height + self.rows - 1 - row)

    def _winning_cells(self, pieces: int, taken: int) -> int:
        """The empty cells that would complete a line of four for `pieces`."""
        found = (pieces << 1) & (pieces << 2) & (pieces << 3)  # a column: three below
        for step in (self.height, self.height - 1, self.height + 1):  # a row and the two diagonals
            pair = (pieces << step) & (pieces << 2 * step)
            found |= pair & (pieces << 3 * step)
            found |= pair & (pieces >> step)
            pair = (pieces >> step) & (pieces >> 2 * step)
            found |= pair & (pieces << step)
            found |= pair & (pieces >> 3 * step)
        return found & self.full & ~taken

    def _negamax(self, mine: int, taken: int, alpha: int, beta: int) -> int:
        """The value for the mover of a position where the last move did not end the game, within (alpha, beta)."""
        self.nodes += 1
        playable = (taken + self.bottom) & self.full
        if self._winning_cells(mine, taken) & playable:
            return 1
        theirs = mine ^ taken
        threats = self._winning_cells(theirs, taken)
        forced = playable & threats
        if forced:
            if forced & (forced - 1):
                return -1  # two cells to block at once
            playable = forced
        safe = playable & ~(threats >> 1)  # not under a cell the other side would then take
        if not safe:
            return -1
        if taken.bit_count() >= self.cells - 2:
            return 0  # neither of the last two cells completes a line: the mover's cannot (above), nor the other's
        key = mine + taken  # unique per position: the mover's pieces plus the lowest empty bit of each column
        low, high = self.table.get(key, (-1, 1))
        alpha, beta = max(alpha, low), min(beta, high)
        if alpha >= beta:
            return alpha
        start_alpha, start_beta = alpha, beta
        moves = []
        for rank, col in enumerate(self.order):
            move = safe & self.columns[col]
            if move:
                # Moves that leave more cells to win are tried first.
                moves.append((-self._winning_cells(mine | move, taken | move).bit_count(), rank, move))
        moves.sort()
        best = -1
        for _, _, move in moves:
            value = -self._negamax(theirs, taken | move, -beta, -alpha)
            if value > best:
                best = value
                if value > alpha:
                    alpha = value
                    if alpha >= beta:
                        break
        if len(self.table) >= TABLE_SIZE:
            self.table.clear()
        if best <= start_alpha:
            high = best
        elif best >= start_beta:
            low = best
        else:
            low = high = best
        self.table[key] = (low, high)
        return best

    def move_values(self, mine: int, theirs: int) -> list[int | None]:
        """Each column's outcome for the mover of (mine, theirs) under perfect play by both sides: 1 a win, 0 a draw,
        -1 a loss; None for a full column. The position must not have ended (no line of four, an empty cell)."""
        taken = mine | theirs
        playable = (taken + self.bottom) & self.full
        wins = self._winning_cells(mine, taken)
        values: list[int | None] = []
        for col in range(self.cols):
            move = playable & self.columns[col]
            if not move:
                values.append(None)
            elif move & wins:
                values.append(1)
            elif (taken | move).bit_count() == self.cells:
                values.append(0)
            else:
                values.append(-self._negamax(theirs, taken | move, -1, 1))
        return values


__all__ = ["GravitySolver", "TABLE_SIZE"]
