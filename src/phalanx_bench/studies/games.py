"""The turn-based games study (issue 50): trained runs of tic-tac-toe or connect four (several seeds) against the
reference players of `phalanx_bench.players`, from each seat, greedy; a Markdown table with 95% intervals.

    phalanx train --env pz:pettingzoo.classic.tictactoe_v3:env --opponents self_play:8,learner:2,random:1 \\
        --total-steps 1000000 --seed 1 --run-dir runs/games/ttt-s1 --torch-threads 1   # and seeds 2, 3
    python -m phalanx_bench.studies.games runs/games/ttt-s* --episodes 500 --out bench/results/games/tictactoe
    python -m phalanx_bench.studies.games bench/results/games/connect_four/probes/runs.jsonl.gz --each --episodes 200

`--each` gives every run its own table under its name: single-seed probes of different settings, kept in one pack.

Each run is evaluated with `phalanx eval RUN --vs <the game's players> --episodes E --json` (kept as
RUN/eval_games.json; an existing one is read, not redone). Per opponent and seat the table gives the games won,
drawn and lost over all seeds, each seed's losses, and the score (wins + draws / 2 per game) with a 95%
stratified bootstrap over seeds x games (seeds resampled, then each seed's games), so the seed-to-seed spread
counts as well as the game-to-game one. For tic-tac-toe a last row walks every game each seed's greedy policy
can meet against a perfect player taking any of its best moves (`against_every_perfect_line`, kept as
RUN/every_line.json): not a sample, so no interval. Training time is read from each run's metrics (first to last update,
plus the first update's own length, on the machine named in the table's caption). The table is the summary kept
beside a study's pack (phalanx_bench/packs.py), which holds every count it is made from.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import torch

from phalanx.policy import load
from phalanx_bench import packs
from phalanx_bench.players.tictactoe import against_every_perfect_line

TICTACTOE = ("phalanx_bench.players.tictactoe:act", "phalanx_bench.players.tictactoe:varied", "random")
CONNECT_FOUR = tuple(f"phalanx_bench.players.connect_four:varied_{d}" for d in range(1, 7)) + ("random",)
# The players' modules under their names before they moved into the package (issue 64: from a checkout's bench/games/):
# the evaluations kept in bench/results' packs (eval_games.json) are keyed by those names, read as the new ones.
MOVED = {"bench.games.tictactoe:": "phalanx_bench.players.tictactoe:",
         "bench.games.connect_four:": "phalanx_bench.players.connect_four:"}
TICTACTOE_NAMES = ("tictactoe", "pz:pettingzoo.classic.tictactoe_v3:env")
PLAYERS = {"tictactoe": TICTACTOE, "pz:pettingzoo.classic.tictactoe_v3:env": TICTACTOE,
           "connect_four": CONNECT_FOUR, "pz:pettingzoo.classic.connect_four_v3:env": CONNECT_FOUR}
SEATS = ("first", "second")


def evaluate(run: Path, episodes: int, threads: int) -> dict:
    out = run / "eval_games.json"
    if not out.exists():
        env = json.loads((run / "config.json").read_text())["env"]
        cmd = [sys.executable, "-m", "phalanx", "eval", str(run), "--vs", ",".join(PLAYERS[env]), "--episodes",
               str(episodes), "--torch-threads", str(threads), "--json"]
        done = subprocess.run(cmd, capture_output=True, text=True, check=False)
        if done.returncode != 0:
            raise SystemExit(f"{' '.join(cmd)} failed ({done.returncode}): {done.stderr.strip()}")
        out.write_text(done.stdout)
    kept = json.loads(out.read_text())
    kept["vs"] = {current_name(name): result for name, result in kept["vs"].items()}
    return kept


def current_name(player: str) -> str:
    """A player's name as `phalanx eval --vs` takes it now, for one a kept evaluation names as it was (MOVED)."""
    for old, new in MOVED.items():
        if player.startswith(old):
            return new + player.removeprefix(old)
    return player


def every_line(run: Path) -> dict | None:
    """Tic-tac-toe: the run's greedy policy against every line of perfect play, from each seat (kept as
    RUN/every_line.json); None for a results folder kept without it or a checkpoint."""
    out = run / "every_line.json"
    if not out.exists() and not (run / "checkpoints").is_dir():
        return None
    if not out.exists():
        policy = load(run)
        if policy.recurrent:
            raise SystemExit(f"{run}: a memory policy's answer depends on the game so far; walk its games with eval")

        def greedy(observation: dict) -> int:
            obs = torch.as_tensor(observation["observation"], dtype=torch.float32).reshape(1, 1, 3, 3, 2)
            mask = torch.as_tensor(observation["action_mask"], dtype=torch.bool).reshape(1, 1, 9)
            return int(policy.act(obs, greedy=True, mask=mask).reshape(-1)[0])

        out.write_text(json.dumps({seat: against_every_perfect_line(greedy, seat) for seat in SEATS}) + "\n")
    return json.loads(out.read_text())


def metrics(run: Path, up_to: int | None = None) -> list[dict]:
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines() if line.strip()]
    return [r for r in rows if up_to is None or r.get("step", 0) <= up_to]


def summary(run: Path) -> dict:
    """The run's trained steps (its latest checkpoint: what `phalanx eval RUN` plays), training seconds and illegal
    moves, kept as RUN/summary.json (read where it exists, so a results folder needs no checkpoints or metrics)."""
    kept = run / "summary.json"
    if kept.exists():
        return json.loads(kept.read_text())
    steps = max(int(p.name.split("_")[1]) for p in (run / "checkpoints").glob("step_*"))
    rows = metrics(run, steps)
    times = [r["time"] for r in rows if "time" in r]
    gaps = np.diff(times)
    usual = float(np.median(gaps)) if len(gaps) else float("nan")
    # A resumed run's rows hold the pause between its sessions: updates are counted at their own pace.
    seconds = float(gaps[gaps < 5 * usual].sum() + usual) if len(gaps) else float("nan")
    # Moves the mask forbade in training, where the env counts them (the built-in games' forfeits; PettingZoo's
    # adapter refuses one in one line, so a finished run played none): the update means, summed.
    counted = [r["env_illegal_moves"] for r in rows if "env_illegal_moves" in r]
    out = {"steps": steps, "training_seconds": seconds, "illegal_moves": sum(counted) if counted else None}
    kept.write_text(json.dumps(out) + "\n")
    return out


def score_interval(counts: list[tuple[int, int, int]], reps: int = 4000, seed: int = 0) -> tuple[float, float, float]:
    """Mean score over seeds (wins + draws / 2 per game) and its 95% stratified bootstrap interval."""
    rng = np.random.default_rng(seed)
    probs = [np.array(c, dtype=float) / max(sum(c), 1) for c in counts]
    mean = float(np.mean([(w + d / 2) / max(w + d + lo, 1) for w, d, lo in counts]))
    games = [sum(c) for c in counts]
    boot = np.empty(reps)
    # Python floats summed in order are numpy's mean of fewer than 8 numbers bit for bit (the kept studies remake
    # byte for byte), at a tenth of the time: np.mean's overhead on a few numbers was most of a 13-table study.
    for k in range(reps):
        total = 0.0
        for i in rng.integers(len(counts), size=len(counts)).tolist():
            w, d, _ = rng.multinomial(games[i], probs[i]).tolist()
            total += (w + d / 2) / max(games[i], 1)
        boot[k] = total / len(counts)
    lo, hi = np.percentile(boot, [2.5, 97.5])
    return mean, float(lo), float(hi)


# The training settings a study's caption names (each a lever of docs/EXPERIMENTS.md's ablations).
TRAINING_KEYS = ("lr", "gamma", "gae_lambda", "num_envs", "num_steps", "num_epochs", "pool_size", "pool_sampling",
                 "mirror")


def training_keys(configs: list[dict]) -> str:
    """The caption's training settings, the same in every run of a study: "lr 0.001, gamma 0.99, lambda 0.95, a
    batch of 256 envs x 32 steps, 4 epochs, a pool of 8 snapshots (pfsp)", and ", mirrored" where the runs trained on
    each board and its reflection (configs from before `mirror` existed did not)."""
    settings = {json.dumps([c.get(k) for k in TRAINING_KEYS]) for c in configs}
    if len(settings) != 1:
        raise SystemExit(f"runs trained with different settings of {', '.join(TRAINING_KEYS)}: {sorted(settings)}")
    c = configs[0]
    return (f"lr {c['lr']}, gamma {c['gamma']}, lambda {c['gae_lambda']}, a batch of {c['num_envs']} envs x "
            f"{c['num_steps']} steps, {c['num_epochs']} epochs, a pool of {c['pool_size']} snapshots "
            f"({c['pool_sampling']}){', mirrored' if c.get('mirror') else ''}")


def table(runs: list[Path], episodes: int, threads: int) -> str:
    configs = [json.loads((r / "config.json").read_text()) for r in runs]
    envs = {c["env"] for c in configs}
    if len(envs) != 1:
        raise SystemExit(f"runs of more than one game: {sorted(envs)}")
    env = envs.pop()
    evals = [evaluate(r, episodes, threads) for r in runs]
    seeds = [c["seed"] for c in configs]
    runs_summary = [summary(r) for r in runs]
    secs = [x["training_seconds"] for x in runs_summary]
    steps = sorted({x["steps"] for x in runs_summary})
    illegal = [x["illegal_moves"] for x in runs_summary]
    shown = "none counted" if all(i == 0 for i in illegal) else ", ".join(map(str, illegal))
    options = {json.dumps(c.get("env_options") or {}, sort_keys=True) for c in configs}
    if len(options) != 1:
        raise SystemExit(f"runs with different env options: {sorted(options)}")
    trained_on = configs[0].get("env_options") or {}
    shown_options = f" ({', '.join(f'{k} {v}' for k, v in sorted(trained_on.items()))})" if trained_on else ""
    rollouts, solved = configs[0].get("play_rollouts"), configs[0].get("play_solve_empties")
    play = ""
    if rollouts:
        table_read = (f", among the moves that keep the best outcome under perfect play where at most {solved} cells "
                      "are empty") if solved else ""
        play = f" (greedy play: the move whose {rollouts} games played on from each move the net likes score best{table_read})"
    lines = [f"{env}{shown_options}, seeds {', '.join(map(str, seeds))}, {', '.join(f'{s:,}' for s in steps)} steps, "
             f"{training_keys(configs)}, "
             f"opponents `{configs[0]['opponents'] or 'none (self-play: the learner in both slots)'}`; training "
             f"{min(secs) / 60:.1f}-{max(secs) / 60:.1f} min a run; illegal moves in training: {shown}; "
             f"{episodes} greedy games per seed and seat{play}",
             "", "| opponent | seat | won / drawn / lost (all seeds) | losses per seed | score [95% interval] |",
             "|---|---|---|---|---|"]
    # The game's players every run was evaluated against: a study kept from before a player was added remakes as made.
    for opponent in (p for p in PLAYERS[env] if all(p in e["vs"] for e in evals)):
        for seat in SEATS:
            counts = [(e["vs"][opponent][seat]["wins"], e["vs"][opponent][seat]["draws"], e["vs"][opponent][seat]["losses"])
                      for e in evals]
            mean, lo, hi = score_interval(counts)
            total = [sum(c[i] for c in counts) for i in range(3)]
            name = opponent.rsplit(":", 1)[-1] if ":" in opponent else opponent
            lines.append(f"| {name} | {seat} | {total[0]} / {total[1]} / {total[2]} | "
                         f"{', '.join(str(c[2]) for c in counts)} | {mean:.3f} [{lo:.3f}, {hi:.3f}] |")
    if env in TICTACTOE_NAMES:
        walks = [every_line(r) for r in runs]
        walked = [w for w in walks if w is not None]
        for seat in SEATS if walked else ():  # no row where no run was walked (kept without checkpoints or walks)
            total = [sum(w[seat][k] for w in walked) for k in ("wins", "draws", "losses")]
            lines.append(f"| every perfect line | {seat} | {total[0]} / {total[1]} / {total[2]} lines | "
                         f"{', '.join('-' if w is None else str(w[seat]['losses']) for w in walks)} | exhaustive"
                         f"{'' if len(walked) == len(walks) else ' (-: no checkpoint kept to walk)'} |")
    return "\n".join(lines) + "\n"


def each(runs: list[Path], episodes: int, threads: int) -> str:
    return "\n".join(f"## {run.name}\n\n{table([run], episodes, threads)}" for run in runs)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("runs", nargs="+", type=Path, help="run directories of one game (one per seed), or a pack of them "
                                                       "(phalanx_bench/packs.py: NAME.jsonl.gz)")
    ap.add_argument("--episodes", type=int, default=500, help="greedy games per seed, seat and opponent")
    ap.add_argument("--threads", type=int, default=1, help="torch threads of each evaluation")
    ap.add_argument("--each", action="store_true", help="a table per run, under its name, not one over all runs")
    ap.add_argument("--out", type=Path, help="write the table to OUT, its suffix .md (else print it)")
    args = ap.parse_args()
    with contextlib.ExitStack() as stack:
        runs = []
        for given in sorted(args.runs):
            runs += stack.enter_context(packs.unpacked(given)) if packs.is_pack(given) else [given]
        md = each(runs, args.episodes, args.threads) if args.each else table(runs, args.episodes, args.threads)
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.with_suffix(".md").write_text(md)
    print(md, end="")


if __name__ == "__main__":
    main()
