"""Reference teams for PettingZoo's MPE simple_spread (mpe2.simple_spread_v3, N=3, 25 steps, discrete actions):
a hand-written assignment heuristic and random play, scored as Phalanx scores a trained team (issue 51).

    python -m bench.mpe.spread --episodes 100 --seeds 1 2 3

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
from typing import Any

import numpy as np
from mpe2 import simple_spread_v3

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


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--episodes", type=int, default=100, help="episodes per seed")
    ap.add_argument("--seeds", type=int, nargs="+", default=[1, 2, 3])
    ap.add_argument("--json", action="store_true", help="print JSON")
    args = ap.parse_args()
    out = {}
    for team in ("heuristic", "random"):
        returns = np.concatenate([play(team, args.episodes, s) for s in args.seeds])
        lo, hi = interval(returns)
        out[team] = {"mean_agent_return": float(returns.mean()), "ci95": [lo, hi], "episodes": len(returns),
                     "seeds": args.seeds}
    if args.json:
        print(json.dumps(out))
        return
    for team, r in out.items():
        print(f"{team:<10} per-agent return {r['mean_agent_return']:.2f} [{r['ci95'][0]:.2f}, {r['ci95'][1]:.2f}] "
              f"({r['episodes']} episodes, seeds {', '.join(map(str, r['seeds']))})")


if __name__ == "__main__":
    main()
