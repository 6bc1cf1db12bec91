"""`phalanx bench`: throughput of the env, the rollout and the full PPO loop, against references.

    phalanx bench cartpole [--num-envs 8,64,512,4096] [--steps 32] [--seconds 2.5] [--threads N]
                           [--sb3] [--wait-idle S] [--json FILE]
    phalanx bench bucket_brigade [--num-envs 64,256,1024,4096] [--steps 32] [--seconds 2.5]
                                 [--scenario NAME] [--threads N] [--wait-idle S] [--json FILE]

For each number of envs it measures, in steps per second (env steps summed over envs; the fastest
0.25 s window after one warm-up iteration, so a brief disturbance by another process does not count):

* env      random actions stepping the torch env alone (no policy);
* rollout  `Trainer.collect()` alone: policy forward, env step, value forward, buffer writes;
* train    `Trainer.collect()` + `Trainer.update()` (GAE and the PPO epochs);
* ref      a minimal CleanRL-style PPO in plain torch (reference.py), same env, sizes and update;
* ratio    train / ref;
* others   the share of the CPUs that other processes used meanwhile (a shared machine spoils the
           numbers: torch's OpenMP threads wait for each other at every op).

`--sb3` adds Stable-Baselines3 PPO with its defaults on gymnasium CartPole-v1 (8 envs, DummyVecEnv,
CPU) and compares the largest phalanx configuration to it.

`bucket_brigade` measures the same env / rollout / train columns (and `others`) on the 4-agent
cooperative env with the trainer config used to train it (MAPPO critic, shared parameters with an
agent id, reward normalisation, fully shared team reward), in *agent* steps per second: env steps x
num_agents. It has no reference columns.

`suite` runs every registered workload (cartpole, pendulum, bucket_brigade, trial_nav, drone_swarm,
pixel_goal, duel) with its own training defaults and writes a Markdown table and a plot:

    phalanx bench suite [--workloads a,b,...] [--num-envs N[,N...]] [--steps T] [--seconds S] [--sb3]
                        [--profile-envs N] [--no-profile] [--uncapped] [--out DIR] [--json [FILE]]

Per workload and number of envs: env-only and training agent-steps/s and the peak memory of the
measurement (CPU: growth of the peak resident set; CUDA: torch.cuda.max_memory_allocated). Then,
unless --no-profile, the time split of one collect+update cycle per workload, also on its own:

    phalanx bench profile [--workloads a,b,...] [--num-envs N[,N...]] [--steps T] [--seconds S] [--json [FILE]]

`--json` alone prints the result as one JSON object on stdout (everything else goes to stderr);
`--json FILE` writes it to FILE.

The package by job: arguments.py (the parser and its checks), workloads.py (what each target measures),
harness.py (timing, CPU contention, peak memory), runners.py (one runner per target), sb3.py (the
Stable-Baselines3 comparison), reports.py (tables, bench.md, bench.png), reference.py (the minimal loop).
"""

from __future__ import annotations

import contextlib
import json
import sys
import time
from pathlib import Path

import torch

from phalanx_bench import harness
from phalanx_bench.arguments import parse_args
from phalanx_bench.runners import RUNNERS


def main(argv: list[str] | None = None) -> int:
    """`phalanx bench TARGET ...`; bad arguments raise BenchError (one line, exit status 2 from the CLI)."""
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    harness.set_wait_idle(args.wait_idle)
    to_stdout = args.json == "-"
    t0 = time.perf_counter()
    # With a bare --json, stdout carries the JSON object alone: tables and progress go to stderr.
    with contextlib.redirect_stdout(sys.stderr) if to_stdout else contextlib.nullcontext():
        result = RUNNERS[args.target](args)
        result["wall_seconds"] = time.perf_counter() - t0
        if args.json and not to_stdout:
            Path(args.json).write_text(json.dumps(result, indent=2) + "\n")
            print(f"\nwrote {args.json}")
    if to_stdout:
        print(json.dumps(result), flush=True)
    return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
