"""Reference teams for PettingZoo's MPE simple_spread (mpe2.simple_spread_v3, N=3, 25 steps, discrete actions):
a hand-written assignment heuristic and random play, scored as Phalanx scores a trained team (issue 51).

    python -m phalanx_bench.studies.spread --episodes 100 --seeds 1 2 3
    python -m phalanx_bench.studies.spread --runs runs/spread-s1 runs/spread-s2 runs/spread-s3 --out bench/results/spread/table
    python -m phalanx_bench.packs runs/spread bench/results/spread/runs.jsonl.gz --runs '*/eval_spread.json'   # to keep
    python -m phalanx_bench.studies.spread --runs bench/results/spread/runs.jsonl.gz --out bench/results/spread/table

With `--runs`, each trained run is scored too: `phalanx eval RUN --episodes E --json` (greedy; kept as
RUN/eval_spread.json), each seed's mean per-agent return, and the mean over seeds with a 95% stratified bootstrap
(seeds resampled, then each seed's episodes). A run given may be a pack of runs (phalanx_bench/packs.py: each run's
config.json and eval_spread.json), read as its folders were.

Each agent of the heuristic reads only its own observation ([own velocity, own position, landmarks relative to it,
the other agents relative to it, communication]): it rebuilds the whole layout around itself, finds the
assignment of agents to landmarks with the least summed distance (3! = 6 to try; every agent finds the same one,
the others being listed in agent order), and steers to its landmark with the one move (left, right, down, up or
none) that best meets a braking target (the offset less a share of its velocity). It knows nothing the policy
does not see and was written for the bench, apart from Phalanx and mpe2's code.

The score is the per-agent return: each agent's 25 rewards summed, averaged over the agents, then over episodes
(`phalanx eval RUN --json`'s `mean_agent_return`), with a 95% bootstrap interval over episodes.
"""

from __future__ import annotations

import argparse
import itertools
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
from mpe2 import simple_spread_v3

from phalanx_bench import packs

N = 3
# mpe2's discrete moves: 0 none, 1 left (-x), 2 right (+x), 3 down (-y), 4 up (+y).
MOVES = np.array([[0.0, 0.0], [-1.0, 0.0], [1.0, 0.0], [0.0, -1.0], [0.0, 1.0]])
BRAKING = 0.5  # seconds of the current velocity the target leads by: the agent slows as it arrives
CLOSE = 0.05  # within this of its target the agent stays put


def layout(observation: np.ndarray, index: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """From agent `index`'s observation: its velocity, every agent's position relative to it (agent order) and
    every landmark's."""
    velocity = observation[0:2]
    landmarks = observation[4:4 + 2 * N].reshape(N, 2)
    others = observation[4 + 2 * N:4 + 2 * N + 2 * (N - 1)].reshape(N - 1, 2)
    agents = np.insert(others, index, np.zeros(2), axis=0)
    return velocity, agents, landmarks


def assignment(agents: np.ndarray, landmarks: np.ndarray) -> tuple[int, ...]:
    """The landmark of each agent under the assignment of least summed distance (ties to the first found)."""
    dist = np.linalg.norm(agents[:, None, :] - landmarks[None, :, :], axis=-1)
    return min(itertools.permutations(range(N)), key=lambda p: sum(dist[a, p[a]] for a in range(N)))


def heuristic_move(observation: np.ndarray, index: int) -> int:
    velocity, agents, landmarks = layout(np.asarray(observation, dtype=np.float64), index)
    target = landmarks[assignment(agents, landmarks)[index]] - BRAKING * velocity
    if np.linalg.norm(target) < CLOSE:
        return 0
    return int(np.argmax(MOVES[1:] @ target)) + 1


def heuristic(observations: dict[str, Any], agents: list[str]) -> dict[str, int]:
    return {a: heuristic_move(observations[a], agents.index(a)) for a in observations}


def play(team: str, episodes: int, seed: int) -> np.ndarray:
    """Per-agent returns of `episodes` episodes of `team` ("heuristic" or "random"), seeded."""
    env = simple_spread_v3.parallel_env(N=N, max_cycles=25)
    rng = np.random.default_rng(seed)
    returns = np.zeros(episodes)
    for e in range(episodes):
        observations, _ = env.reset(seed=seed * 100_000 + e)
        order = list(env.possible_agents)
        total = 0.0
        while env.agents:
            if team == "heuristic":
                actions = heuristic(observations, order)
            else:
                actions = {a: int(rng.integers(5)) for a in env.agents}
            observations, rewards, _, _, _ = env.step(actions)
            total += sum(rewards.values())
        returns[e] = total / N
    env.close()
    return returns


def interval(values: np.ndarray, reps: int = 4000, seed: int = 0) -> tuple[float, float]:
    rng = np.random.default_rng(seed)
    means = rng.choice(values, size=(reps, len(values))).mean(1)
    lo, hi = np.percentile(means, [2.5, 97.5])
    return float(lo), float(hi)


def evaluated(run: Path, episodes: int) -> list[tuple[str, dict, dict]]:
    """(name, config, greedy evaluation) of a trained run (RUN/eval_spread.json, made where missing), or of each
    run of a pack."""
    if packs.is_pack(run):
        return [(f"{run}:{r['name']}", r["config.json"], r["eval_spread.json"]) for r in packs.runs(run)]
    out = run / "eval_spread.json"
    if not out.exists():
        cmd = [sys.executable, "-m", "phalanx", "eval", str(run), "--episodes", str(episodes), "--torch-threads", "1",
               "--json"]
        done = subprocess.run(cmd, capture_output=True, text=True, check=False)
        if done.returncode != 0:
            raise SystemExit(f"{' '.join(cmd)} failed ({done.returncode}): {done.stderr.strip()}")
        out.write_text(done.stdout)
    return [(str(run), json.loads((run / "config.json").read_text()), json.loads(out.read_text()))]


def agent_returns(evaluation: dict) -> np.ndarray:
    # The env's team return summed over the 3 agents: a per-agent return is its third.
    return np.asarray(evaluation["episode_returns"], dtype=float) / N


def stratified_interval(groups: list[np.ndarray], reps: int = 4000, seed: int = 0) -> tuple[float, float]:
    rng = np.random.default_rng(seed)
    boot = np.empty(reps)
    for k in range(reps):
        picked = rng.integers(len(groups), size=len(groups))
        boot[k] = np.mean([rng.choice(groups[i], size=len(groups[i])).mean() for i in picked])
    lo, hi = np.percentile(boot, [2.5, 97.5])
    return float(lo), float(hi)


def scores(trained: list[tuple[str, dict, dict]], episodes: int, seeds: list[int]) -> dict:
    """The trained runs' score (`evaluated`; none: no row) and the heuristic's and random play's over `seeds`."""
    out = {}
    if trained:
        groups = [agent_returns(e) for _, _, e in trained]
        configs = [c for _, c, _ in trained]
        lo, hi = stratified_interval(groups)
        out["trained"] = {"mean_agent_return": float(np.mean([g.mean() for g in groups])), "ci95": [lo, hi],
                          "per_seed": {str(c["seed"]): float(g.mean()) for c, g in zip(configs, groups)},
                          "episodes": int(sum(len(g) for g in groups)), "seeds": [c["seed"] for c in configs],
                          "runs": [name for name, _, _ in trained]}
    for team in ("heuristic", "random"):
        returns = np.concatenate([play(team, episodes, s) for s in seeds])
        lo, hi = interval(returns)
        out[team] = {"mean_agent_return": float(returns.mean()), "ci95": [lo, hi], "episodes": len(returns),
                     "seeds": seeds}
    return out


def table(out: dict) -> str:
    lines = ["| team | per-agent return [95% interval] | per seed | episodes |", "|---|---|---|---|"]
    for team, r in out.items():
        per_seed = ", ".join(f"{v:.2f}" for v in r["per_seed"].values()) if "per_seed" in r else "-"
        lines.append(f"| {team} | {r['mean_agent_return']:.2f} [{r['ci95'][0]:.2f}, {r['ci95'][1]:.2f}] | {per_seed} | "
                     f"{r['episodes']} (seeds {', '.join(map(str, r['seeds']))}) |")
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--episodes", type=int, default=100, help="episodes per seed")
    ap.add_argument("--seeds", type=int, nargs="+", default=[1, 2, 3])
    ap.add_argument("--json", action="store_true", help="print JSON")
    ap.add_argument("--runs", type=Path, nargs="*", default=[],
                    help="trained runs of simple_spread to score as well (run folders, or packs of them)")
    ap.add_argument("--out", type=Path, help="with --runs: write the table to OUT, suffixed .md and .json")
    args = ap.parse_args()
    out = scores([run for given in args.runs for run in evaluated(given, args.episodes)], args.episodes, args.seeds)
    if args.json:
        print(json.dumps(out))
        return
    table_md = table(out)
    print(table_md, end="")
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.with_suffix(".md").write_text(table_md)
        args.out.with_suffix(".json").write_text(json.dumps(out, indent=1) + "\n")


if __name__ == "__main__":
    main()
