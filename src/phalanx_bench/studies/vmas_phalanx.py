"""The Phalanx side of `phalanx_bench.studies.vmas_vs_benchmarl`: Phalanx's runs on VMAS, its policies scored by
BenchMARL's evaluation protocol, random play and VMAS's own scripted policies by the same protocol.

Its modes run in processes of their own, started by vmas_vs_benchmarl (which never imports phalanx: see its
`phalanx_side`), with vmas_vs_benchmarl's options:

    python -m phalanx_bench.studies.vmas_phalanx --one phalanx navigation 1 --phalanx-frames 720000 --out OUT
    python -m phalanx_bench.studies.vmas_phalanx --one random passage 3 --out OUT
    python -m phalanx_bench.studies.vmas_phalanx --score RUN...          # each run's latest checkpoint: RUN/eval_benchmarl.json
    python -m phalanx_bench.studies.vmas_phalanx --heuristic transport --seeds 1,2
"""

from __future__ import annotations

import importlib
import json
import sys
import time
from pathlib import Path

import torch

from phalanx import checkpoint as ckpt
from phalanx import devices
from phalanx import runs as phalanx_runs
from phalanx.config import parse_text_layer, resolve
from phalanx.envs import make
from phalanx.evaluate import evaluate_policy
from phalanx.policy import load
from phalanx.trainer import Trainer
from phalanx_bench.studies.vmas_vs_benchmarl import check_threads, parser


def score(run_dir: Path, checkpoint: Path | None, episodes: int, device: str) -> float:
    """A Phalanx run's policy (`checkpoint`, or its latest) scored by BenchMARL's protocol: deterministic actions,
    `episodes` worlds side by side, each episode to its first done, on evaluation seed 10,000 + the run's seed."""
    cfg = phalanx_runs.load_run_config(run_dir)
    return benchmarl_protocol(load(run_dir, device=device, checkpoint=checkpoint), cfg.env, cfg.env_options, cfg.seed,
                              episodes, device)


def benchmarl_protocol(policy, env: str, env_options: dict, seed: int, episodes: int, device: str) -> float:
    """The mean per-agent return of `policy` (None: uniform random actions) over `episodes` worlds side by side, each
    episode to its first done, deterministic actions, evaluation seed 10,000 + `seed`."""
    res = evaluate_policy(policy, env, env_options, episodes=episodes, greedy=True, seed=10_000 + seed, device=device,
                          num_envs=episodes)
    return res["mean_agent_return"]


def run_phalanx(task: str, seed: int, frames: int, eval_every: int, episodes: int, device: str, out: Path,
                threads: int, settings: dict[str, str] | None = None) -> dict:
    # The process a user's `phalanx train` runs in: freed host memory kept for the next update (without it,
    # navigation's optimisation pass measured 1.27 s against 1.11 s, 2-core CPU).
    devices.tune_host_allocator()
    run_dir = out / "run"
    start = time.time()
    cfg = resolve({"env": f"vmas:{task}", "seed": seed, "total_steps": frames, "device": device, "run_dir": str(run_dir),
                   "checkpoint_every": eval_every, "keep_checkpoints": 1000, "progress": False, "tensorboard": False,
                   "torch_threads": threads}, parse_text_layer(settings or {}))  # --phalanx-set's text
    # `phalanx.train` with the trainer's phase clock on (on a CPU it reads the clock and nothing else).
    trainer = Trainer(cfg)
    try:
        ckpt.write_json_atomic(run_dir / "config.json", cfg.to_dict())
        trainer.run.timer.enabled = True
        trainer.train()
        batches = trainer.update_idx
        clock = dict(trainer.run.timer.seconds)
        used = {"collect": trainer.run.threads.collect, "update": trainer.run.threads.update}
    finally:
        trainer.close()
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    cfg = phalanx_runs.load_run_config(run_dir)
    curve = []
    for path in sorted((run_dir / "checkpoints").iterdir()):
        step = int(path.name.split("_")[-1])
        at = next(r for r in rows if r["step"] == step)
        curve.append({"frames": step, "time": at["time"] - start, "return": score(run_dir, path, episodes, device)})
    return {"curve": curve, "train_seconds": rows[-1]["time"] - start, "frames": rows[-1]["step"], "passes": cfg.num_epochs,
            "collect_seconds": clock["collect"] / batches, "update_seconds": clock["update"] / batches,
            "mappo_values": cfg.mappo_values, "torch_threads": used}


def run_random(task: str, seed: int, episodes: int, device: str) -> dict:
    """Uniform random actions over each agent's action box, evaluated by the same protocol as the libraries."""
    return {"return": benchmarl_protocol(None, f"vmas:{task}", {}, seed, episodes, device)}


def run_heuristic(task: str, seed: int, episodes: int, device: str) -> float:
    """VMAS's own scripted policy for `task` (vmas.scenarios.<task>.HeuristicPolicy, each agent on its own
    observation) by the same protocol: `episodes` worlds side by side, each to its first done, the reward summed and
    averaged over agents, evaluation seed 10,000 + `seed`."""
    heuristic = importlib.import_module(f"vmas.scenarios.{task}").HeuristicPolicy(continuous_action=True)
    env = make(f"vmas:{task}", num_envs=episodes, device=device, seed=10_000 + seed)
    rec = env.reset(seed=10_000 + seed)
    high = torch.as_tensor(env.action_space.high, device=rec.obs.device)
    total = torch.zeros(episodes, device=rec.obs.device)
    playing = torch.ones(episodes, dtype=torch.bool, device=rec.obs.device)
    while bool(playing.any()):
        actions = torch.stack([heuristic.compute_action(rec.obs[:, j], u_range=float(high[0]))
                               for j in range(env.num_agents)], dim=1)
        rec = env.step(actions)
        total += torch.where(playing, rec.reward.mean(-1), 0.0)
        playing &= ~(rec.terminated | rec.truncated).any(-1)
    return float(total.mean())


def main(argv: list[str] | None = None) -> int:
    p = parser()
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    if args.heuristic:
        for seed in (int(x) for x in args.seeds.split(",")):
            print(json.dumps({"task": args.heuristic, "policy": "vmas HeuristicPolicy", "seed": seed, "episodes": args.eval_episodes,
                              "return": run_heuristic(args.heuristic, seed, args.eval_episodes, args.device)}))
        return 0
    if args.score:
        for run_dir in args.score:
            result = {"run": str(run_dir), "episodes": args.eval_episodes, "return": score(run_dir, None, args.eval_episodes, args.device)}
            (run_dir / "eval_benchmarl.json").write_text(json.dumps(result, indent=1) + "\n")
            print(json.dumps(result))
        return 0
    check_threads(p, args)
    if not args.one or args.one[0] not in ("phalanx", "random"):
        p.error("give --one phalanx|random TASK SEED, --score RUN... or --heuristic TASK (vmas_vs_benchmarl runs the rest)")
    lib, task, seed = args.one[0], args.one[1], int(args.one[2])
    where = Path(args.out) / f"{lib}-{task}-{seed}"
    where.mkdir(parents=True, exist_ok=True)
    settings = dict(kv.split("=", 1) for kv in args.phalanx_set.split(",") if kv)
    if lib == "random":
        result = run_random(task, seed, args.eval_episodes, args.device)
    else:
        result = run_phalanx(task, seed, args.phalanx_frames, args.eval_every, args.eval_episodes, args.device, where,
                             args.threads, settings)
        result["settings"] = settings
    (where / "result.json").write_text(json.dumps({"library": lib, "task": task, "seed": seed, **result}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
