"""Reference players for turn-based games (issue 50): opponents written for the bench, apart from Phalanx and from
PettingZoo's own game code (pure Python and numpy: nothing here imports phalanx), to measure trained policies against
players no one tuned them to.

Each is a plain callable over PettingZoo's observation dict (`{"observation": ..., "action_mask": ...}`, the mover's
pieces in plane 0) that returns an action the mask allows: the form `phalanx eval RUN --vs module:callable` and
`--opponents module:callable:weight` take, e.g. `phalanx eval RUN --vs phalanx_bench.players.connect_four:depth_4`.

| module | player | callables |
|---|---|---|
| `tictactoe` | perfect tic-tac-toe: negamax over the whole game tree, memoised; fastest win, slowest loss | `act` (ties to the lowest square), `varied` and `player(seed)` (ties at random), `against_every_perfect_line` |
| `connect_four` | connect four searched `depth` plies (negamax, alpha-beta, bitboards) with a heuristic of open windows of four and the centre column | `depth_1` ... `depth_6`, `varied_1` ... `varied_6` (ties at random), `player(depth, seed)` |
| `play` | whole games of a PettingZoo AEC env between such callables; a random player | `play(env, {agent: player}, seed)`, `random_player(seed)` |

The studies that play trained runs against them are `phalanx_bench.studies.games` and `phalanx_bench.studies.transfer`;
MPE simple_spread's reference team (an assignment heuristic) is `phalanx_bench.studies.spread`.

`tests/test_game_players.py` checks them: the perfect player never loses to random play (150 games in each seat) and
draws against itself (41 games, ties broken at random); the search blocks and wins at once, and at depth 4 beats
random play in more than 90% of 40 games (it won all 40; about 60 ms a game on one CPU). Each player checks that the
mask it gets matches the board it reads.
"""
