"""Phalanx against Stable-Baselines3 PPO on gymnasium envs, whole process, at identical settings.

Each pair runs `phalanx train --env gym:<id> ...` and the same PPO in SB3 (this file with `--sb3 TASK`),
one after the other, in alternation, as a user would start them (imports, env creation, training,
Phalanx's checkpoints, logs and closing plot included). Wall-clock and CPU seconds of each process; the
ratios are SB3's time over Phalanx's, per pair, and their medians. Both packages are byte-compiled
first, as pip leaves an installed one.

    python -m phalanx_bench.vs_sb3                               # both tasks, 3 pairs each
    python -m phalanx_bench.vs_sb3 --tasks acrobot --pairs 5 --threads 1 --out bench/results/vs_sb3

Tasks (the settings each side gets, written out in TASKS below):
- acrobot: gym:Acrobot-v1 at CleanRL's ppo.py settings (4 envs x 128 steps, 4 epochs of 4 minibatches,
  lr 2.5e-4 annealed, clipped value loss, entropy 0.01, 64x64 tanh), 50k steps.
- cartpole: gym:CartPole-v1 at SB3's PPO defaults (8 envs x 2048 steps, 10 epochs of minibatch 64,
  lr 3e-4 constant, no value clipping, entropy 0), 3 updates (49,152 steps).

Both sides get the same torch thread count (`--threads`, default 1: SB3's fastest at these batch sizes).
Needs stable-baselines3 (`pip install -e '.[bench]'`).
"""

from __future__ import annotations

import argparse
import compileall
import importlib.util
import json
import os
import platform
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

TASKS: dict[str, dict] = {
    "acrobot": {
        "env_id": "Acrobot-v1", "total_steps": 50_000, "num_envs": 4, "num_steps": 128, "num_epochs": 4, "minibatch": 128,
        "lr": 2.5e-4, "anneal_lr": True, "clip_vloss": True, "ent_coef": 0.01, "gamma": 0.99, "gae_lambda": 0.95,
        "source": "CleanRL ppo.py defaults",
    },
    "cartpole": {
        "env_id": "CartPole-v1", "total_steps": 3 * 8 * 2048, "num_envs": 8, "num_steps": 2048, "num_epochs": 10, "minibatch": 64,
        "lr": 3e-4, "anneal_lr": False, "clip_vloss": False, "ent_coef": 0.0, "gamma": 0.99, "gae_lambda": 0.95,
        "source": "Stable-Baselines3 PPO defaults",
    },
}


def phalanx_cmd(task: dict, run_dir: str, threads: int, seed: int) -> list[str]:
    batch = task["num_envs"] * task["num_steps"]
    flags = {
        "env": f"gym:{task['env_id']}", "total_steps": task["total_steps"], "num_envs": task["num_envs"],
        "num_steps": task["num_steps"], "num_epochs": task["num_epochs"], "num_minibatches": batch // task["minibatch"],
        "lr": task["lr"], "anneal_lr": str(task["anneal_lr"]).lower(), "clip_vloss": str(task["clip_vloss"]).lower(),
        "ent_coef": task["ent_coef"], "gamma": task["gamma"], "gae_lambda": task["gae_lambda"], "clip_coef": 0.2,
        "vf_coef": 0.5, "max_grad_norm": 0.5, "hidden_sizes": "64,64", "activation": "tanh", "torch_threads": threads,
        "seed": seed, "run_dir": run_dir, "device": "cpu",
    }
    cmd = [sys.executable, "-m", "phalanx", "train"]
    for k, v in flags.items():
        cmd += [f"--{k.replace('_', '-')}", str(v)]
    return cmd


def sb3_train(name: str, threads: int, seed: int) -> None:
    """The SB3 side: what a user writes to train this task with SB3's PPO (one process)."""
    from stable_baselines3 import PPO
    from stable_baselines3.common.env_util import make_vec_env

    torch.set_num_threads(threads)
    task = TASKS[name]
    env = make_vec_env(task["env_id"], n_envs=task["num_envs"], seed=seed)
    lr = task["lr"]
    model = PPO(
        "MlpPolicy", env, n_steps=task["num_steps"], batch_size=task["minibatch"], n_epochs=task["num_epochs"],
        learning_rate=(lambda progress: lr * progress) if task["anneal_lr"] else lr,
        clip_range_vf=0.2 if task["clip_vloss"] else None, ent_coef=task["ent_coef"], gamma=task["gamma"],
        gae_lambda=task["gae_lambda"], clip_range=0.2, vf_coef=0.5, max_grad_norm=0.5,
        policy_kwargs={"net_arch": [64, 64], "activation_fn": torch.nn.Tanh}, seed=seed, device="cpu", verbose=0,
    )
    model.learn(total_timesteps=task["total_steps"])


def timed(cmd: list[str], env: dict[str, str]) -> tuple[float, float]:
    """(wall-clock s, CPU s: user + system) of the process. On a virtual machine whose host takes CPU
    time away (steal), the wall clock swings by tens of percent between runs; the CPU time much less."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    t0 = time.perf_counter()
    out = subprocess.run(cmd, capture_output=True, text=True, env=env)
    wall = time.perf_counter() - t0
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if out.returncode != 0:
        raise SystemExit(f"vs_sb3: {' '.join(cmd[:6])} ... failed (exit {out.returncode}): {out.stderr.strip()[-500:]}")
    return wall, (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)


def timed_side_by_side(cmds: list[list[str]], env: dict[str, str], cores: list[int]) -> list[tuple[float, float]]:
    """As `timed`, for processes started together, each pinned to its own core: a slow spell of the
    machine (a busy neighbour on the host) then slows both alike, so their ratio holds still."""
    t0 = time.perf_counter()
    procs = [subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=env,
                              preexec_fn=lambda core=core: os.sched_setaffinity(0, {core}))
             for cmd, core in zip(cmds, cores)]
    results: dict[int, tuple[float, float]] = {}
    while len(results) < len(procs):
        pid, status, usage = os.wait4(-1, 0)
        results[pid] = (time.perf_counter() - t0, usage.ru_utime + usage.ru_stime)
        proc = next(p for p in procs if p.pid == pid)
        if os.waitstatus_to_exitcode(status) != 0:
            raise SystemExit(f"vs_sb3: {' '.join(proc.args[:6])} ... failed: {proc.stderr.read().strip()[-500:]}")
    return [results[p.pid] for p in procs]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tasks", default="acrobot,cartpole")
    p.add_argument("--pairs", type=int, default=3)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--out", default=None, help="folder for results.json and results.md")
    p.add_argument("--side-by-side", action="store_true",
                   help="run each pair's two processes at once, each on its own core (swapped every pair), "
                        "instead of one after the other: steadier ratios on a machine whose speed drifts")
    p.add_argument("--sb3", default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.sb3:
        sb3_train(args.sb3, args.threads, args.seed)
        return 0
    tasks = [t for t in args.tasks.split(",") if t]
    unknown = [t for t in tasks if t not in TASKS]
    if unknown:
        print(f"vs_sb3: unknown task {unknown[0]!r}; allowed: {', '.join(TASKS)}", file=sys.stderr)
        return 2
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    # Both sides' packages byte-compiled, as pip leaves an installed package: an editable install under
    # PYTHONDONTWRITEBYTECODE would compile Phalanx's source in every run (0.45 s) and SB3's in none.
    for package in ("phalanx", "stable_baselines3"):
        spec = importlib.util.find_spec(package)
        for folder in (spec.submodule_search_locations or []) if spec else []:
            compileall.compile_dir(folder, quiet=1)
    cores = sorted(os.sched_getaffinity(0))
    if args.side_by_side and len(cores) < 2:
        print("vs_sb3: --side-by-side needs 2 CPUs; this process may use 1", file=sys.stderr)
        return 2
    rows = []
    for name in tasks:
        task = TASKS[name]
        pairs = []
        for i in range(args.pairs):
            def run_phalanx() -> tuple[float, float]:
                with tempfile.TemporaryDirectory() as tmp:
                    return timed(phalanx_cmd(task, f"{tmp}/run", args.threads, args.seed), env)

            def run_sb3() -> tuple[float, float]:
                return timed([sys.executable, "-m", "phalanx_bench.vs_sb3", "--sb3", name, "--threads", str(args.threads), "--seed", str(args.seed)], env)

            if args.side_by_side:
                with tempfile.TemporaryDirectory() as tmp:
                    pinned = cores[:2] if i % 2 == 0 else cores[1::-1]
                    ours, theirs = timed_side_by_side(
                        [phalanx_cmd(task, f"{tmp}/run", args.threads, args.seed),
                         [sys.executable, "-m", "phalanx_bench.vs_sb3", "--sb3", name, "--threads", str(args.threads), "--seed", str(args.seed)]],
                        env, pinned)
            # Each side goes first in every other pair, so a drift of the machine's speed favours neither.
            elif i % 2 == 0:
                ours, theirs = run_phalanx(), run_sb3()
            else:
                theirs, ours = run_sb3(), run_phalanx()
            pairs.append({"phalanx_s": round(ours[0], 2), "sb3_s": round(theirs[0], 2), "speedup": round(theirs[0] / ours[0], 3),
                          "phalanx_cpu_s": round(ours[1], 2), "sb3_cpu_s": round(theirs[1], 2),
                          "cpu_speedup": round(theirs[1] / ours[1], 3)})
            print(f"{name} pair {i + 1}: phalanx {ours[0]:.1f} s ({ours[1]:.1f} CPU), sb3 {theirs[0]:.1f} s ({theirs[1]:.1f} CPU), "
                  f"{theirs[0] / ours[0]:.2f}x wall, {theirs[1] / ours[1]:.2f}x CPU", flush=True)
        rows.append({"task": name, **task, "pairs": pairs,
                     "median_speedup": round(statistics.median(p["speedup"] for p in pairs), 3),
                     "median_cpu_speedup": round(statistics.median(p["cpu_speedup"] for p in pairs), 3)})
    machine = {"cpus": len(os.sched_getaffinity(0)), "cpu": platform.processor() or platform.machine(),
               "torch": torch.__version__, "python": platform.python_version(), "threads": args.threads}
    lines = [f"Whole process, {machine['cpus']} CPUs, torch {machine['torch']}, {args.threads} torch thread(s) each, "
             f"seed {args.seed}, {args.pairs} pairs "
             + ("side by side (both at once, each pinned to its own core, cores swapped every pair)" if args.side_by_side
                else "in alternation (each side first in every other pair)")
             + "; SB3's time over Phalanx's, wall clock and CPU time (user + system).", "",
             "| task | settings | steps | Phalanx s (median) | SB3 s (median) | SB3 / Phalanx per pair | median | CPU time: median |",
             "|---|---|--:|--:|--:|---|--:|--:|"]
    for r in rows:
        ps = r["pairs"]
        lines.append(f"| gym:{r['env_id']} | {r['source']} | {r['total_steps']:,} | {statistics.median(p['phalanx_s'] for p in ps):.1f} | "
                     f"{statistics.median(p['sb3_s'] for p in ps):.1f} | {', '.join(format(p['speedup'], '.2f') for p in ps)} | "
                     f"**{r['median_speedup']:.2f}x** | {r['median_cpu_speedup']:.2f}x |")
    print("\n".join(lines))
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "results.json").write_text(json.dumps({"machine": machine, "rows": rows}, indent=1))
        (out / "results.md").write_text("\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
