"""Exported policies, proven play for play: every built-in workload (and a gym and a PettingZoo env) trained
briefly, exported with `phalanx export`, and played by onnxruntime in lockstep with `phalanx.load(RUN)` for at
least 20 whole episodes; then the file sizes and onnxruntime against `Policy.act` per step at batch 1 and 1,024.

    pip install -e '.[export]'
    python -m phalanx_bench.export_lockstep --out bench/results/export              # every row (about 10 min on 2 cores)
    python -m phalanx_bench.export_lockstep --rows cartpole,trial_nav-lstm --out /tmp/x

Writes OUT/lockstep.json (every row: episodes, steps, episode starts, trial ends, action mismatches, the largest
difference per output, file sizes), OUT/speed.json and OUT/table.md. Timing: one torch thread and one onnxruntime
thread, the two callers alternating call for call (so a busy machine slows both alike), median of `--calls` calls
after 20 warm-up calls each; a memory policy carries its memory in both.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

from phalanx import checkpoint as ckpt
from phalanx.deployed import DeployedPolicy
from phalanx.envs import make
from phalanx.export import export_onnx, file_sizes, lockstep, onnx_session
from phalanx.policy import load
from phalanx.trainer import train
from phalanx_bench.checkout import RESULTS

# Short training: the weights only have to be a run's (normalisers and all), not good. Episodes are cut short
# where the env allows it, so 20 whole episodes (trials included) pass in seconds.
TRAIN = {"num_envs": 8, "num_steps": 64, "num_minibatches": 2, "num_epochs": 2, "torch_threads": 1, "seed": 1,
         "progress": False, "tensorboard": False, "eval_episodes": 0, "total_steps": 1024}
ROWS: dict[str, dict] = {
    "cartpole": {"env": "cartpole"},
    "pendulum": {"env": "pendulum"},
    "bucket_brigade": {"env": "bucket_brigade"},
    "drone_swarm": {"env": "drone_swarm"},
    "trial_nav-transformer": {"env": "trial_nav", "model": "transformer"},
    "trial_nav-lstm": {"env": "trial_nav", "model": "lstm"},
    "pixel_goal": {"env": "pixel_goal"},
    "pixel_goal-lstm": {"env": "pixel_goal", "model": "lstm"},
    "duel-mlp": {"env": "duel", "model": "mlp"},
    "duel-strategy": {"env": "duel", "model": "strategy"},
    # The board model with its exact outcomes (2 plies) in the graph; greedy play's 6-ply horizon (connect four's
    # default play_outcome_plies) searches 2,401 positions a decision and is not timed here.
    "connect_four": {"env": "connect_four", "play_outcome_plies": 2},
    "gym:CartPole-v1": {"env": "gym:CartPole-v1"},
    "pz:simple_spread": {"env": "pz:mpe2.simple_spread_v3:parallel_env", "env_options": {"max_cycles": 25}},
}
# One row per model kind: mlp, transformer, lstm, cnn, cnn + lstm, strategy, role_attention, board.
SPEED_ROWS = ("cartpole", "trial_nav-transformer", "trial_nav-lstm", "pixel_goal", "pixel_goal-lstm", "duel-strategy",
              "drone_swarm", "connect_four")


def prove(row: str, work: Path, episodes: int, lockstep_envs: int) -> dict:
    run = work / row.replace(":", "_")
    train({**TRAIN, **ROWS[row]}, run_dir=str(run))
    onnx = export_onnx(load(run), run / "export" / "policy.onnx")
    result = lockstep(run, onnx, episodes=episodes, num_envs=lockstep_envs, seed=7)
    sizes = file_sizes(onnx, ckpt.latest_checkpoint(run))
    return {"row": row, **result, "sizes": sizes}


def speed(row: str, work: Path, batch: int, calls: int) -> dict:
    run = work / row.replace(":", "_")
    policy = load(run)
    session = onnx_session(run / "export" / "policy.onnx", threads=1)
    deployed = DeployedPolicy(policy)
    env = make(policy.config.env, num_envs=batch, seed=3, **policy.config.env_options)
    record = env.reset(seed=3)
    env.close()
    obs, mask = record.obs, record.action_mask
    A = obs.shape[1]
    feeds = {"obs": obs.numpy()}
    if deployed.masked:
        feeds["action_mask"] = mask.numpy()
    if deployed.recurrent:
        feeds["episode_start"] = np.zeros((batch, A), dtype=bool)
        feeds["active"] = np.ones((batch, A), dtype=bool)
        feeds.update({f"memory.{k}": v.expand(batch, A, *v.shape).numpy().copy() for k, v in deployed.initial_memory.items()})
    carried = [n for n in (o.name for o in session.get_outputs()) if n.startswith("next_memory.")]

    def run_onnx() -> None:
        out = session.run(None, feeds)
        for name, value in zip((o.name for o in session.get_outputs()), out):
            if name in carried:
                feeds["memory." + name[len("next_memory."):]] = value

    def run_torch() -> None:
        policy.act(obs, greedy=True, mask=mask)

    times: dict[str, list[float]] = {"onnxruntime": [], "policy.act": []}
    for _ in range(20):
        run_onnx()
        run_torch()
    for _ in range(calls):
        for name, fn in (("onnxruntime", run_onnx), ("policy.act", run_torch)):
            start = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - start)
    med = {k: statistics.median(v) * 1e6 for k, v in times.items()}
    return {"row": row, "batch": batch, "median_us": med, "ratio": med["policy.act"] / med["onnxruntime"]}


def table(proofs: list[dict], speeds: list[dict]) -> str:
    lines = ["Lockstep: onnxruntime beside `phalanx.load(RUN)` (greedy), the same observations each step.", "",
             "| row | model | episodes | steps | slots x steps | episode starts | trial ends | action mismatches | "
             "largest difference (output) | onnx / safetensors (kB) |", "|---|---|--:|--:|--:|--:|--:|--:|---|---|"]
    for p in proofs:
        name, worst = max(p["max_abs_diff"].items(), key=lambda kv: kv[1]) if p["max_abs_diff"] else ("-", 0.0)
        s = p["sizes"]
        lines.append(f"| {p['row']} | {p['model']} | {p['episodes']} | {p['steps']} | {p['slot_steps']} | {p['episode_starts']} | "
                     f"{p['trial_ends']} | {p['action_mismatches']} | {worst:.1e} ({name}) | "
                     f"{s['onnx'] / 1000:.1f} / {s['safetensors'] / 1000:.1f} |")
    lines += ["", "Per step on the CPU, one thread each, alternating; median of the calls (microseconds).", "",
              "| row | batch | onnxruntime | policy.act | policy.act / onnxruntime |", "|---|--:|--:|--:|--:|"]
    for s in speeds:
        lines.append(f"| {s['row']} | {s['batch']:,} | {s['median_us']['onnxruntime']:,.0f} | {s['median_us']['policy.act']:,.0f} | "
                     f"{s['ratio']:.2f}x |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rows", default=",".join(ROWS), help="comma list of rows [all]")
    p.add_argument("--episodes", type=int, default=20, help="whole episodes in lockstep per row [20]")
    p.add_argument("--lockstep-envs", type=int, default=4, help="envs played side by side in lockstep [4]")
    p.add_argument("--calls", type=int, default=200, help="timed calls per side [200]")
    p.add_argument("--out", default=str(RESULTS / "export"), help="[bench/results/export]")
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    proofs, speeds = [], []
    with tempfile.TemporaryDirectory() as tmp:
        for row in args.rows.split(","):
            proofs.append(prove(row, Path(tmp), args.episodes, args.lockstep_envs))
            print(f"{row}: {proofs[-1]['episodes']} episodes, {proofs[-1]['action_mismatches']} action mismatches", flush=True)
        for row in [r for r in SPEED_ROWS if r in args.rows.split(",")]:
            for batch in (1, 1024):
                speeds.append(speed(row, Path(tmp), batch, args.calls))
    (out / "lockstep.json").write_text(json.dumps(proofs, indent=1) + "\n")
    (out / "speed.json").write_text(json.dumps(speeds, indent=1) + "\n")
    text = table(proofs, speeds)
    (out / "table.md").write_text(text)
    print(text)
    return 0 if all(p["actions_identical"] for p in proofs) else 1


if __name__ == "__main__":
    sys.exit(main())
