"""Tic-tac-toe and connect four as batched torch envs: turn-based games with action masks, on the device.

PettingZoo's `tictactoe_v3` and `connect_four_v3` through the `pz:` adapter step each copy in Python (about
2,000 moves a second on a CPU core); these step every copy in a few tensor ops, so self-play reaches the
millions of games that strong play takes. Their rules and observations are PettingZoo's, move for move
(tests/test_board_games.py plays both side by side): players alternate, `player_1` (slot 0) first; a slot
observes [rows, cols, 2], its own pieces in plane 0 and the other's in plane 1 (row 0 at the top); k in a line
wins (+1, and -1 for the other), a full board draws (0). Tic-tac-toe's action is a square (0-8, row by row);
connect four's a column, the piece falling to its lowest empty cell. A move the mask forbids (a taken square, a
full column; a policy never plays one) loses for the mover, as a forfeit, and is counted in
`info["illegal_moves"]`: refusing it would take a host read.

They are also the examples of built-in envs with masks (docs/ENVIRONMENTS.md, Action masks): the record's
`action_mask` [N, 2, n] holds the legal moves for the slot to move and allows all for the slot that waits, and
`turn_observations()` gives the mover's observation as PettingZoo's dict, so the players of `phalanx_bench/players/`
(`phalanx eval --vs`) play them as they play PettingZoo's.

`opening_plies` K (training only: `phalanx eval` and the trainer's evaluations play from the empty board) starts
each game after k random legal moves, k uniform in 0..K, so that the learner meets positions its own and its
snapshots' favourite openings never reach: the lines a varied perfect player takes and a self-trained policy had
not seen (docs/EXPERIMENTS.md, Turn-based games). K stops short of the first ply that could win (2k - 2), so an
opening never decides a game by itself.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from phalanx.draws import Source
from phalanx.envs import draw
from phalanx.envs.base import StepRecord, VecEnv
from phalanx.envs.registry import EnvOption, EnvSpec, register
from phalanx.envs.spaces import Box, Discrete
from phalanx.errors import ConfigError
from phalanx.zoo.gravity_solver import GravitySolver
from phalanx.zoo.line_search import LineSearch


def afterstates(obs: torch.Tensor, rows: int, cols: int, gravity: bool) -> torch.Tensor:
    """Boards [..., rows, cols, 2] (the mover's pieces in plane 0, float) -> [..., n, rows, cols, 2]: the board after
    each move, the new piece in plane 0 (a full column's or a taken cell's board is left as it was: the mask forbids
    it). A pure function of the board (`VecEnv.afterstate_fn`)."""
    empty = 1.0 - obs.sum(-1).clamp_max(1.0)  # [..., rows, cols]
    if gravity:
        row = torch.arange(rows, device=obs.device, dtype=obs.dtype).unsqueeze(-1)  # [rows, 1]
        landing = (row == empty.sum(-2, keepdim=True) - 1).to(obs.dtype)  # [..., rows, cols]: each column's cell
        piece = landing.unsqueeze(-3) * torch.eye(cols, device=obs.device, dtype=obs.dtype).unsqueeze(-2)
    else:
        cells = rows * cols
        piece = torch.eye(cells, device=obs.device, dtype=obs.dtype).view(cells, rows, cols) * empty.unsqueeze(-3)
    return obs.unsqueeze(-4) + torch.stack([piece, torch.zeros_like(piece)], -1)


def move_outcomes(obs: torch.Tensor, search: LineSearch, plies: int) -> torch.Tensor:
    """Boards [..., rows, cols, 2] of the mover -> [..., n]: each move's outcome `plies` deep (`VecEnv.move_outcome_fn`:
    `search`'s values, on bitboards made from the planes; -1 for a move the board forbids)."""
    cells = obs.reshape(-1, search.rows * search.cols, obs.shape[-1]) > 0.5
    mine, theirs = (torch.where(cells[..., p], search.cell_bits, 0).sum(-1) for p in (0, 1))
    value = search.values(mine, theirs, plies).clamp_min(-1.0)
    return value.to(obs.dtype if obs.is_floating_point() else torch.float32).reshape(*obs.shape[:-3], -1)


# One solver per board size, shared by every model and copy (a model's snapshots would otherwise copy its table):
# its values are the game's, whichever positions it searched before.
_SOLVERS: dict[tuple[int, int], GravitySolver] = {}


def solved_outcomes(obs: torch.Tensor, rows: int, cols: int, empties: int) -> torch.Tensor:
    """Boards [..., rows, cols, 2] of the mover (gravity, four in a line) -> [..., cols]: each move's outcome under
    perfect play (`VecEnv.solved_outcome_fn`: 1 a win, 0 a draw, -1 a loss or a full column) where the board has at
    most `empties` empty cells and could be the mover's (no more pieces of its own than the other's), NaN elsewhere."""
    solver = _SOLVERS.get((rows, cols))
    if solver is None:
        solver = _SOLVERS[rows, cols] = GravitySolver(rows, cols)
    cells = obs.reshape(-1, rows * cols, obs.shape[-1]).detach().cpu() > 0.5
    bits = torch.tensor([solver.bit(r, c) for r in range(rows) for c in range(cols)])
    mine, theirs = (torch.where(cells[..., p], bits, 0).sum(-1) for p in (0, 1))
    own, other = cells[..., 0].sum(-1), cells[..., 1].sum(-1)
    values = torch.full((cells.shape[0], cols), torch.nan)
    for i in ((rows * cols - own - other <= empties) & (own <= other)).nonzero().squeeze(-1).tolist():
        values[i] = torch.tensor([-1.0 if v is None else float(v) for v in solver.move_values(int(mine[i]), int(theirs[i]))])
    dtype = obs.dtype if obs.is_floating_point() else torch.float32
    return values.to(device=obs.device, dtype=dtype).reshape(*obs.shape[:-3], cols)


class LineGameEnv(VecEnv):
    """N games of k in a line on a rows x cols board (see the module docstring): 2 slots taking turns, Discrete
    actions under a mask; `gravity`: an action is a column whose lowest empty cell takes the piece (connect four),
    else a cell (tic-tac-toe)."""

    num_agents = 2
    role_names = ("player",)
    capturable = True
    action_masks = True
    turn_based = True
    renders = True
    has_afterstates = True
    has_move_outcomes = True
    # The searches of zoo/line_search.py, d plies deep: `tactics_d` sees outcomes only, `threats_d` judges the
    # positions at its horizon too. League members and sparring partners.
    scripted_names = ("tactics_1", "tactics_2", "tactics_3", "tactics_4", "threats_1", "threats_2", "threats_3",
                      "threats_4", "random")
    rows: int
    cols: int
    k: int
    gravity: bool

    def __init__(self, num_envs: int = 1, device: torch.device | str = "cpu", seed: int | None = 0,
                 opening_plies: int = 0) -> None:
        if not 0 <= opening_plies <= self.most_opening_plies():
            raise ConfigError(f"{self.name} opening_plies must be in [0, {self.most_opening_plies()}] (a longer random "
                              f"opening could win by itself); got {opening_plies!r}")
        self.opening_plies = opening_plies
        self.num_envs = num_envs
        self.device = torch.device(device)
        self.roles = self.default_roles()
        self.observation_space = Box(low=0.0, high=1.0, shape=(self.rows, self.cols, 2))
        self.action_space = Discrete(self.cols if self.gravity else self.rows * self.cols)
        self._seed_generator(seed)
        # The two planes of a cell holding v (0 empty, 1 / 2 a slot's piece) as slot 0 sees it (row v) and as slot 1
        # does (row 3 + v): one embedding lookup a step, several times faster than stacking comparisons.
        self.planes = torch.tensor([[0.0, 0.0], [1.0, 0.0], [0.0, 1.0], [0.0, 0.0], [0.0, 1.0], [1.0, 0.0]],
                                   device=self.device)
        self.slot_rows = torch.tensor([0, 3], device=self.device).view(1, 2, 1)
        self.search = LineSearch(self.rows, self.cols, self.k, self.gravity, self.device)
        # board[n, cell]: 0 empty, 1 slot 0's piece, 2 slot 1's; turn[n]: the slot to move.
        self.board = torch.zeros(num_envs, self.rows * self.cols, dtype=torch.long, device=self.device)
        self.turn = torch.zeros(num_envs, dtype=torch.long, device=self.device)
        # The board each game ended on (`ended_frame`: a recording's last frame; the env resets it in the same step).
        self.final_board = self.board

    @property
    def mirror_actions(self) -> tuple[int, ...]:
        """Columns (connect four) or cells (tic-tac-toe) reflected left to right: the same game."""
        if self.gravity:
            return tuple(range(self.cols - 1, -1, -1))
        return tuple(r * self.cols + self.cols - 1 - c for r in range(self.rows) for c in range(self.cols))

    def afterstate_fn(self) -> Callable[[torch.Tensor], torch.Tensor]:
        """`afterstates` of this board (`VecEnv.afterstate_fn`)."""
        return functools.partial(afterstates, rows=self.rows, cols=self.cols, gravity=self.gravity)

    def move_outcome_fn(self, plies: int = 2) -> Callable[[torch.Tensor], torch.Tensor]:
        """`move_outcomes` on this board, `plies` deep (`VecEnv.move_outcome_fn`)."""
        return functools.partial(move_outcomes, search=self.search, plies=plies)

    def solved_outcome_fn(self, empties: int) -> Callable[[torch.Tensor], torch.Tensor]:
        """`solved_outcomes` on this board, of the positions with at most `empties` empty cells
        (`VecEnv.solved_outcome_fn`: connect four)."""
        if not self.has_solved_outcomes:
            return super().solved_outcome_fn(empties)
        return functools.partial(solved_outcomes, rows=self.rows, cols=self.cols, empties=empties)

    @classmethod
    def most_opening_plies(cls) -> int:
        """The longest random opening that cannot complete a line: the first mover's k-th piece is ply 2k - 1."""
        return 2 * cls.k - 2

    # -- views of the state -----------------------------------------------------------------------
    def _observe(self, board: torch.Tensor) -> torch.Tensor:
        """[N, 2, rows, cols, 2]: each slot's pieces in plane 0, the other's in plane 1 (PettingZoo's layout)."""
        seen = board.unsqueeze(1) + self.slot_rows  # [N, 2, cells]: each slot's row of `planes` for each cell
        return torch.nn.functional.embedding(seen, self.planes).view(-1, 2, self.rows, self.cols, 2)

    def _legal(self, board: torch.Tensor) -> torch.Tensor:
        """[N, n] bool: the legal moves (free cells; columns whose top cell is free)."""
        return board[:, : self.cols] == 0 if self.gravity else board == 0

    def _cell(self, board: torch.Tensor, move: torch.Tensor) -> torch.Tensor:
        """[N]: the cell a move fills (for a full column, its top cell, which is taken: a forfeit)."""
        if not self.gravity:
            return move
        # A column's empty cells are its top ones, so the lowest empty row is their count less one.
        empty = (board.view(-1, self.rows, self.cols) == 0).sum(1).gather(1, move.unsqueeze(1)).squeeze(1)
        return (empty - 1).clamp_min(0) * self.cols + move

    def _mask(self) -> torch.Tensor:
        """[N, 2, n]: the legal moves for the mover, every action for the slot that waits."""
        mover = torch.nn.functional.one_hot(self.turn, 2).bool().unsqueeze(-1)
        return self._legal(self.board).unsqueeze(1) | ~mover

    def _record(self, obs, final_obs, reward, ended, info) -> StepRecord:
        false = torch.zeros(self.num_envs, 2, dtype=torch.bool, device=self.device)
        return StepRecord(obs=obs, reward=reward, terminated=ended.unsqueeze(1).expand(-1, 2), truncated=false,
                          active=torch.nn.functional.one_hot(self.turn, 2).bool(), trial_end=false,
                          final_obs=final_obs, info=info, action_mask=self._mask())

    def _open(self, fresh: torch.Tensor) -> None:
        """Play the random opening of each fresh game (`fresh` [N]): k ~ U{0..opening_plies} legal moves,
        alternating from slot 0, on the device (a loop over plies, not over copies)."""
        plies = self.rng.randint(0, self.opening_plies + 1, (self.num_envs,), self.device)
        plies = torch.where(fresh, plies, 0)
        n = torch.arange(self.num_envs, device=self.device)
        for ply in range(self.opening_plies):
            playing = plies > ply
            legal = self._legal(self.board)
            # A uniform legal move: the argmax of uniform scores over the legal moves.
            move = torch.where(legal, self.rng.rand(tuple(legal.shape), self.device), -1.0).argmax(1)
            cell = self._cell(self.board, move)
            self.board[n, cell] = torch.where(playing, self.turn + 1, self.board[n, cell])
            self.turn = torch.where(playing, 1 - self.turn, self.turn)

    # -- protocol ---------------------------------------------------------------------------------
    def reset(self, seed: int | None = None) -> StepRecord:
        self._seed_generator(seed)
        self.board = torch.zeros_like(self.board)
        self.turn = torch.zeros_like(self.turn)
        if self.opening_plies:
            self._open(torch.ones(self.num_envs, dtype=torch.bool, device=self.device))
        obs = self._observe(self.board)
        zero = torch.zeros(self.num_envs, 2, device=self.device)
        return self._record(obs, obs, zero, torch.zeros(self.num_envs, dtype=torch.bool, device=self.device),
                            {"win": zero, "draw": zero, "illegal_moves": zero[:, 0]})

    def step(self, actions: torch.Tensor) -> StepRecord:
        actions = self.action_space.check(actions, self.num_envs, self.num_agents).to(self.device)
        move = actions.reshape(self.num_envs, 2).gather(1, self.turn.unsqueeze(1)).squeeze(1)
        illegal = ~self._legal(self.board).gather(1, move.unsqueeze(1)).squeeze(1)
        cell = self._cell(self.board, move).unsqueeze(1)
        mark = self.turn + 1
        board = self.board.scatter(1, cell, torch.where(illegal, self.board.gather(1, cell).squeeze(1), mark).unsqueeze(1))
        won = self.search.won(self.search.pieces(board, mark)) & ~illegal
        full = (board[:, : self.cols] != 0).all(-1) if self.gravity else (board != 0).all(-1)
        ended = won | illegal | full
        mover = torch.nn.functional.one_hot(self.turn, 2).float()
        # The mover's result: +1 a win, -1 a forfeit; the other's is its negation.
        result = won.float() - illegal.float()
        reward = result[:, None] * (2 * mover - 1)
        win = (reward > 0).float()
        draw = (ended & ~won & ~illegal).float()[:, None].expand(-1, 2)
        final_obs = self._observe(board)
        self.final_board = board
        self.board = torch.where(ended[:, None], 0, board)
        self.turn = torch.where(ended, 0, 1 - self.turn)
        if self.opening_plies:
            self._open(ended)
        # A game that ended starts on the empty board, all zeros, unless a random opening was played on it.
        restart = ended[:, None, None, None, None]
        obs = torch.where(restart, self._observe(self.board), final_obs) if self.opening_plies else \
            final_obs.masked_fill(restart, 0.0)
        return self._record(obs, final_obs, reward, ended, {"win": win, "draw": draw, "illegal_moves": illegal.float()})

    def scripted_actions(self, name: str, record: StepRecord, draws: Source) -> torch.Tensor:
        """[N, 2]: `tactics_d`'s or `threats_d`'s move for the slot to move (zoo/line_search.py), any move for the one that waits."""
        return self.scripted_actions_in(name, record, draws, None)

    def scripted_actions_in(self, name: str, record: StepRecord, draws: Source, rows: torch.Tensor | None) -> torch.Tensor:
        """`scripted_actions` searched in the copies `rows` alone (None: all), 0 in the others."""
        if name == "random":
            return self.action_space.sample(self.num_envs, 2, draws, self.device, mask=self._mask())
        if name not in self.scripted_names:
            raise KeyError(f"env '{self.name}' has no scripted policy '{name}'; known: {', '.join(self.scripted_names)}")
        kind, _, depth = name.rpartition("_")
        judged = kind == "threats"
        if rows is None:
            move = self.search.choose(self.board, self.turn + 1, int(depth), draws, judged)
        else:
            move = torch.zeros(self.num_envs, dtype=torch.long, device=self.device)
            move[rows] = self.search.choose(self.board[rows], self.turn[rows] + 1, int(depth), draws, judged)
        return torch.nn.functional.one_hot(self.turn, 2) * move.unsqueeze(1)

    def turn_observations(self) -> list[tuple[int, Any]]:
        """Per copy, the slot to move and its observation as PettingZoo gives it (int8 arrays)."""
        obs = self._observe(self.board).to(torch.int8).cpu().numpy()
        mask = self._mask().to(torch.int8).cpu().numpy()
        return [(int(s), {"observation": obs[i, s], "action_mask": np.ascontiguousarray(mask[i, s])})
                for i, s in enumerate(self.turn.tolist())]

    def _draw(self, board: list[int]) -> torch.Tensor:
        cell = 480 // max(self.rows, self.cols)
        img = draw.canvas(self.rows * cell, self.cols * cell, (235, 235, 228))
        for i, v in enumerate(board):
            r, c = divmod(i, self.cols)
            draw.outline_rect(img, c * cell, r * cell, (c + 1) * cell, (r + 1) * cell, (120, 120, 120), width=2)
            if v:
                draw.fill_circle(img, (c + 0.5) * cell, (r + 0.5) * cell, 0.38 * cell, draw.slot_color(v - 1))
        return draw.to_tensor(img)

    def render(self, env_index: int = 0) -> torch.Tensor:
        """Copy `env_index`'s board: slot 0's pieces in the first slot colour, slot 1's in the second."""
        return self._draw(self.board[env_index].tolist())

    def ended_frame(self, env_index: int = 0) -> torch.Tensor:
        """The board copy `env_index`'s last game ended on (the env has already reset it)."""
        return self._draw(self.final_board[env_index].tolist())

    def step_state(self) -> dict[str, torch.Tensor]:
        return {"board": self.board, "turn": self.turn}

    def load_step_state(self, state: dict[str, torch.Tensor]) -> None:
        self.board, self.turn = state["board"], state["turn"]


class TicTacToeEnv(LineGameEnv):
    """PettingZoo's tictactoe_v3: 3 in a line on 3 x 3, a move marks a cell (0-8, row by row)."""

    name, rows, cols, k, gravity = "tictactoe", 3, 3, 3, False


class ConnectFourEnv(LineGameEnv):
    """PettingZoo's connect_four_v3: 4 in a line on 6 x 7, a move drops a piece into a column (0-6)."""

    name, rows, cols, k, gravity = "connect_four", 6, 7, 4, True
    has_solved_outcomes = True  # zoo/gravity_solver.py


# Self-play league with the learner in both seats (league/seats.py); an entropy bonus keeps the learner and its
# snapshots varied enough to meet the lines that punish its mistakes (with none, PettingZoo's tic-tac-toe turned
# deterministic within 400k moves and lost to perfect play: docs/EXPERIMENTS.md, Turn-based games).
GAME_DEFAULTS = {"opponents": "self_play:8,learner:2,random:1", "ent_coef": 0.05, "num_envs": 256, "num_steps": 32,
                 "lr": 1e-3}



def opening_option(game: type[LineGameEnv]) -> EnvOption:
    return EnvOption(0, "each game starts after k random legal moves, k uniform in 0..this (training only: evaluations "
                        "play from the empty board)", min=0, max=game.most_opening_plies(), train_only=True)


register(
    EnvSpec(
        name="tictactoe",
        factory=TicTacToeEnv,
        reproduces="PettingZoo's tictactoe_v3, its rules and observations move for move",
        description="Tic-tac-toe, PettingZoo's rules and observations, batched in torch: 2 players taking turns, "
                    "Discrete(9) under an action mask, obs [3, 3, 2]",
        options={"opening_plies": opening_option(TicTacToeEnv)},
        # A random opening of up to 4 moves: without it seeds 1-3 at 10M moves lost 17-35 of 500 second-seat games to
        # a perfect player varying its lines; with it none lost a single line of perfect play (docs/EXPERIMENTS.md).
        train_defaults={**GAME_DEFAULTS, "hidden_sizes": [128, 128], "total_steps": 10_000_000,
                        "env_options": {"opening_plies": 4}},
    )
)
register(
    EnvSpec(
        name="connect_four",
        factory=ConnectFourEnv,
        reproduces="PettingZoo's connect_four_v3, its rules and observations move for move",
        description="Connect four, PettingZoo's rules and observations, batched in torch: 2 players taking turns, "
                    "Discrete(7) columns under an action mask, obs [6, 7, 2]",
        options={"opening_plies": opening_option(ConnectFourEnv)},
        # The board read as an image, each move by the board it makes and the game's outcomes two plies deep, and a
        # league with the searchers, most of them judging positions (threats_d); greedy play judges the moves the net
        # likes by 16 games played on from each, and solves the last 24 empty cells (a won ending the net drew is won);
        # random openings of up to 6 plies, the longest allowed, took the first seat against the 4-ply search from
        # 0.85 to 0.99 over seeds 1-3; a pool of every snapshot of the run (20), not the newest 8, keeps the lines
        # its early selves played in front of it (the 4-ply search: 0.82 / 0.46 -> 0.94 / 0.79 over seeds 1-3, 4 of 6
        # seats at 0.8, not 2): docs/EXPERIMENTS.md (issue 62) measures each lever alone.
        train_defaults={**GAME_DEFAULTS, "model": "board", "board_channels": 16, "board_blocks": 0, "lookahead": True,
                        "exact_outcomes": True, "outcome_plies": 2, "play_outcome_plies": 6, "play_rollouts": 16,
                        "play_solve_empties": 24, "pool_size": 20,
                        "total_steps": 10_000_000, "env_options": {"opening_plies": 6},
                        "opponents": "self_play:6,learner:2,random:1,tactics_1:1,tactics_2:2,threats_2:2,threats_3:2,threats_4:4"},
    )
)
