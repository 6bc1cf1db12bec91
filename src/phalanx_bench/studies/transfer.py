"""A best response trained against one policy, played against another: does a search at play time close the holes
a best response finds in the net alone? (issue 62)

    phalanx exploit runs/c4-s1-net --steps 500000            # the net alone (play_rollouts 0 in its config)
    python -m phalanx_bench.studies.transfer runs/c4-s1-net/exploit-s1 runs/c4-s1 --episodes 200

plays the best response (greedy and sampled) against the second run's greedy policy (as `phalanx eval` plays it, its
play search included) from both seats, and prints the best response's score per seat (wins plus half the draws per
game, with the 95% Wilson interval of `phalanx exploit`) as one JSON object.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from phalanx.envs.registry import evaluation_options
from phalanx.exploit import final_scores
from phalanx.policy import load


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("best_response", type=Path, help="the best response's run directory (phalanx exploit's --out)")
    ap.add_argument("target", type=Path, help="the run whose greedy policy it plays")
    ap.add_argument("--episodes", type=int, default=200, help="games a seat and mode")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--threads", type=int, default=1, help="torch threads")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    best, target = load(args.best_response), load(args.target)
    target.fixed_greedy = True
    env = target.config.env
    options = evaluation_options(env, target.config.env_options)
    out = {"best_response": str(args.best_response), "target": str(args.target), "target_step": target.step,
           "target_play_rollouts": target.config.play_rollouts, "episodes": args.episodes}
    for mode in ("sampled", "greedy"):
        out[mode] = final_scores(best, target, env, options, True, greedy=mode == "greedy", episodes=args.episodes,
                                 seed=args.seed, device="cpu")
    print(json.dumps(out))


if __name__ == "__main__":
    main()
