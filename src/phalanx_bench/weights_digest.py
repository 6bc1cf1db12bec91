"""The weights' SHA-256 after a few updates of every workload on seed 1: a refactor that claims "behaviour
unchanged" prints the same table before and after (issue 49).

    python -m phalanx_bench.weights_digest --out bench/results/weights_digest/before.json
    python -m phalanx_bench.weights_digest --out after.json --against bench/results/weights_digest/before.json

Each row trains `--updates` updates of a small configuration (few envs, short rollouts) through `phalanx.train`
on one torch thread, then hashes the saved checkpoint's model.safetensors tensors in name order.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
import tempfile
from pathlib import Path

import torch
from safetensors.torch import load_file

from phalanx.trainer import train

SMALL = {"num_envs": 4, "num_steps": 32, "num_minibatches": 2, "num_epochs": 2, "torch_threads": 1, "seed": 1,
         "progress": False, "tensorboard": False, "eval_episodes": 0}
ROWS: dict[str, dict] = {
    "cartpole": {"env": "cartpole"},
    "pendulum": {"env": "pendulum"},
    "bucket_brigade": {"env": "bucket_brigade"},
    "bucket_brigade-ippo": {"env": "bucket_brigade", "critic": "ippo"},
    "drone_swarm": {"env": "drone_swarm"},
    "trial_nav-transformer": {"env": "trial_nav", "model": "transformer"},
    "trial_nav-lstm": {"env": "trial_nav", "model": "lstm"},
    "pixel_goal": {"env": "pixel_goal"},
    "duel-mlp": {"env": "duel", "model": "mlp"},
    "duel-strategy": {"env": "duel", "model": "strategy"},
    "gym-cartpole": {"env": "gym:CartPole-v1"},
    "cartpole-compile": {"env": "cartpole", "compile": True},
    "trial_nav-compile": {"env": "trial_nav", "compile": True},
    "duel-compile": {"env": "duel", "compile": True},
}


def digest(run_dir: Path) -> str:
    last = sorted((run_dir / "checkpoints").iterdir())[-1]
    tensors = load_file(str(last / "model.safetensors"))
    h = hashlib.sha256()
    for name in sorted(tensors):
        h.update(name.encode())
        h.update(tensors[name].contiguous().view(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rows", default=",".join(ROWS), help="comma list of rows [all]")
    p.add_argument("--updates", type=int, default=3)
    p.add_argument("--out", required=True, help="JSON file of row -> digest")
    p.add_argument("--against", help="a JSON file of an earlier run: exit 1 where a digest differs")
    args = p.parse_args(argv)
    out: dict[str, str] = {}
    for row in args.rows.split(","):
        with tempfile.TemporaryDirectory() as tmp:
            cfg = {**SMALL, **ROWS[row]}
            steps = cfg["num_envs"] * cfg["num_steps"] * args.updates
            train(cfg, run_dir=str(Path(tmp) / "run"), total_steps=steps)
            out[row] = digest(Path(tmp) / "run")
        print(f"{row:<24} {out[row]}", flush=True)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(out, indent=1) + "\n")
    if args.against:
        before = json.loads(Path(args.against).read_text())
        differ = [r for r in out if r in before and before[r] != out[r]]
        print("same as before" if not differ else f"differ from before: {', '.join(differ)}")
        return 1 if differ else 0
    return 0


if __name__ == "__main__":
    sys.exit(main())
