"""The gymnasium adapter (`--env gym:<id>`) against gymnasium's own vector stepping, same envs and actions.

Each round times `--steps` vector steps of gymnasium's `SyncVectorEnv` (same-step autoreset, numpy
actions, what a gymnasium user steps) and of Phalanx's `GymVecEnv` (torch actions in, torch records out:
observations, final observations, rewards, flags, episode statistics), one after the other, each first in
every other round, with the same pre-drawn random actions. Reports microseconds per vector step and the
adapter's time over gymnasium's (below 1: the adapter is faster), median over rounds.

    python -m phalanx_bench.gym_adapter                                  # CartPole-v1 and Acrobot-v1, 4 and 8 envs
    python -m phalanx_bench.gym_adapter --envs Acrobot-v1 --num-envs 4 --rounds 9 --out bench/results/gym_adapter
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import gymnasium as gym
import numpy as np
import torch
from gymnasium.vector import AutoresetMode, SyncVectorEnv

from phalanx.envs.adapters.gym import GymVecEnv


def measure(env_id: str, num_envs: int, steps: int, rounds: int, seed: int) -> dict:
    raw = SyncVectorEnv([lambda: gym.make(env_id) for _ in range(num_envs)], autoreset_mode=AutoresetMode.SAME_STEP)
    ours = GymVecEnv(env_id, num_envs, seed=seed)
    raw.reset(seed=[seed + i for i in range(num_envs)])
    ours.reset()
    n = int(raw.single_action_space.n)
    actions = np.random.default_rng(seed).integers(0, n, size=(steps, num_envs))
    torch_actions = torch.as_tensor(actions).unsqueeze(-1)

    def step_raw() -> float:
        t0 = time.perf_counter()
        for t in range(steps):
            raw.step(actions[t])
        return (time.perf_counter() - t0) / steps * 1e6

    def step_ours() -> float:
        t0 = time.perf_counter()
        for t in range(steps):
            ours.step(torch_actions[t])
        return (time.perf_counter() - t0) / steps * 1e6

    step_raw(), step_ours()  # warm-up
    pairs = []
    for i in range(rounds):
        # Each side first in every other round, so a drift of the machine's speed favours neither.
        r, o = (step_raw(), step_ours()) if i % 2 == 0 else tuple(reversed((step_ours(), step_raw())))
        pairs.append((r, o))
    raw.close()
    ours.close()
    ratios = [o / r for r, o in pairs]
    return {"env_id": env_id, "num_envs": num_envs, "steps": steps, "rounds": rounds,
            "gymnasium_us": round(statistics.median(r for r, _ in pairs), 1),
            "phalanx_us": round(statistics.median(o for _, o in pairs), 1),
            "ratios": [round(x, 3) for x in ratios], "median_ratio": round(statistics.median(ratios), 3)}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--envs", default="CartPole-v1,Acrobot-v1")
    p.add_argument("--num-envs", default="4,8")
    p.add_argument("--steps", type=int, default=2000)
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=None, help="folder for results.json and results.md")
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    rows = [measure(e, int(n), args.steps, args.rounds, args.seed)
            for e in args.envs.split(",") if e for n in args.num_envs.split(",") if n]
    lines = [f"{args.rounds} rounds of {args.steps} vector steps, in alternation, torch {torch.__version__}, gymnasium "
             f"{gym.__version__}, one torch thread; Phalanx's adapter time over gymnasium's SyncVectorEnv.", "",
             "| env | envs | gymnasium us/step | Phalanx us/step | per round | median |", "|---|--:|--:|--:|---|--:|"]
    for r in rows:
        lines.append(f"| {r['env_id']} | {r['num_envs']} | {r['gymnasium_us']:.1f} | {r['phalanx_us']:.1f} | "
                     f"{', '.join(format(x, '.2f') for x in r['ratios'])} | **{r['median_ratio']:.2f}** |")
    print("\n".join(lines))
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "results.json").write_text(json.dumps(rows, indent=1))
        (out / "results.md").write_text("\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
