"""What `phalanx bench` measures: its targets, the numbers of envs per workload, the --modes variants, and the
trainer config of each measurement (cartpole at the reference's settings, bucket_brigade as trained, every
workload with its own training defaults)."""

from __future__ import annotations

from typing import Any

from phalanx.config import resolve
from phalanx.envs import make, registered

PPO_SETTINGS = {"num_epochs": 4, "num_minibatches": 8, "hidden_sizes": [64, 64], "clip_vloss": True}  # ReferencePPO's
DEFAULT_NUM_ENVS = {"cartpole": [8, 64, 512, 4096], "bucket_brigade": [64, 256, 1024, 4096]}
TARGETS = [*DEFAULT_NUM_ENVS, "suite", "profile"]

# The suite's default num_envs per workload, chosen so that one training iteration (num_envs x the
# workload's own num_steps x num_agents agent steps) stays within ~10 s on a 2-core CPU; and the
# num_envs of its update-cycle profile. A workload registered later without an entry gets the fallbacks.
SUITE_NUM_ENVS = {
    "cartpole": [64, 256, 1024, 4096, 16384],
    "pendulum": [64, 256, 1024, 4096],
    "bucket_brigade": [64, 256, 1024, 4096],
    "trial_nav": [64, 256, 1024],
    "drone_swarm": [64, 256, 1024],
    "pixel_goal": [16, 64, 256],
    "duel": [64, 256, 1024],
    "tictactoe": [256, 1024, 4096],
    "connect_four": [256, 1024, 4096],
}
SUITE_FALLBACK_NUM_ENVS = [64, 256, 1024]
PROFILE_NUM_ENVS = {"cartpole": 4096, "pendulum": 4096, "bucket_brigade": 4096, "pixel_goal": 64}
PROFILE_FALLBACK_NUM_ENVS = 1024

# num_envs above a cap are skipped with a note unless --uncapped: pixel_goal's rollout buffer keeps
# each uint8 72x80 frame once (5.8 KB per agent step), but the CNN update's activations grow with the minibatch.
SUITE_MAX_ENVS = {"pixel_goal": 1024}

# Training variants the suite can time beside eager (--modes): config keys each sets.
MODES: dict[str, dict[str, Any]] = {
    "eager": {},
    "compile": {"compile": True},
    "graphs": {"cuda_graphs": True},
    "compile+graphs": {"compile": True, "cuda_graphs": True},
    "bf16": {"precision": "bf16"},
    "graphs+bf16": {"cuda_graphs": True, "precision": "bf16"},
    "compile+bf16": {"compile": True, "precision": "bf16"},
    "compile+graphs+bf16": {"compile": True, "cuda_graphs": True, "precision": "bf16"},
}
CUDA_MODES = "eager,compile,graphs,graphs+bf16"
DEFAULT_OUT = "bench/results"


def caps_text() -> str:
    return ", ".join(f"{k} {v}" for k, v in SUITE_MAX_ENVS.items())


def phalanx_config(num_envs: int, num_steps: int, run_dir: str, threads: int | None, device: str, compile: bool = False):
    return resolve({
        "env": "cartpole", "num_envs": num_envs, "num_steps": num_steps, **PPO_SETTINGS,
        "tensorboard": False, "progress": False, "run_dir": run_dir, "total_steps": 10**12,
        "torch_threads": threads or 0, "device": device, "seed": 1, "compile": compile,
    })


def bucket_brigade_config(num_envs: int, num_steps: int, run_dir: str, threads: int | None, device: str,
                          scenario: str = "default"):
    """The trainer config used for bucket_brigade training (the env's train_defaults fill in the rest)."""
    return resolve({
        "env": "bucket_brigade", "env_options": {"scenario": scenario}, "num_envs": num_envs, "num_steps": num_steps,
        "critic": "mappo", "param_sharing": "shared_id", "norm_reward": True, "team_reward": 1.0,
        "tensorboard": False, "progress": False, "run_dir": run_dir, "total_steps": 10**12,
        "torch_threads": threads or 0, "device": device, "seed": 1,
    })


def workload_names() -> list[str]:
    """The registered workloads (the gym:/pz: prefix adapters are not), in the suite's order, then any others."""
    names = sorted(registered())
    return [n for n in SUITE_NUM_ENVS if n in names] + [n for n in names if n not in SUITE_NUM_ENVS]


def workload_config(name: str, num_envs: int, num_steps: int | None, run_dir: str, threads: int | None, device: str,
                    **extra: Any):
    """The config `name` trains with (its train_defaults over the schema defaults) at `num_envs`; `num_steps`
    None keeps the workload's own rollout length; `extra` sets other keys (a --modes variant)."""
    layer: dict[str, Any] = {
        "env": name, "num_envs": num_envs, "tensorboard": False, "progress": False, "run_dir": run_dir,
        "total_steps": 10**12, "torch_threads": threads or 0, "device": device, "seed": 1, **extra,
    }
    if num_steps is not None:
        layer["num_steps"] = num_steps
    return resolve(layer)


def workload_info(name: str, num_steps: int | None) -> dict[str, Any]:
    """The agents per env and the training settings that shape the workload's cost (for the table and the JSON)."""
    env = make(name, num_envs=1)
    try:
        num_agents = env.num_agents
    finally:
        env.close()
    cfg = resolve({"env": name, **({"num_steps": num_steps} if num_steps else {})}).to_dict()
    keys = ("num_steps", "model", "hidden_sizes", "num_epochs", "num_minibatches", "critic", "param_sharing", "opponents")
    return {"num_agents": num_agents, **{k: cfg[k] for k in keys}}
