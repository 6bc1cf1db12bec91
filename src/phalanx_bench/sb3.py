"""The comparison with Stable-Baselines3 (`--sb3`): SB3's PPO with its defaults on gymnasium CartPole-v1 (8 envs,
DummyVecEnv, CPU), and Phalanx at SB3's own settings over as many rollout + update cycles."""

from __future__ import annotations

import tempfile
import time
from collections.abc import Callable
from typing import Any

from phalanx.config import resolve
from phalanx.trainer import Trainer
from phalanx_bench.harness import CpuMonitor, settle, sync
from phalanx_bench.reports import fmt_sps
from phalanx_bench.workloads import PPO_SETTINGS

SB3_ROLLOUT = 2048 * 8  # SB3 defaults: n_steps 2048 per env, 8 envs
SB3_SETTINGS = {"num_envs": 8, "num_steps": 2048, "num_epochs": 10, "num_minibatches": 2048 * 8 // 64, "lr": 3e-4,
                "hidden_sizes": [64, 64], "activation": "tanh", "gamma": 0.99, "gae_lambda": 0.95, "clip_coef": 0.2,
                "ent_coef": 0.0, "vf_coef": 0.5, "max_grad_norm": 0.5, "anneal_lr": False, "norm_adv": True,
                "clip_vloss": False}


def bench_sb3(rollouts: int) -> dict[str, Any]:
    """SB3 PPO defaults on CartPole-v1, 8 DummyVecEnv envs, CPU: steps/s over `rollouts` full cycles."""
    import stable_baselines3
    from stable_baselines3 import PPO
    from stable_baselines3.common.callbacks import BaseCallback
    from stable_baselines3.common.env_util import make_vec_env

    marks: list[float] = []

    class Clock(BaseCallback):
        def _on_rollout_start(self) -> None:
            marks.append(time.perf_counter())

        def _on_step(self) -> bool:
            return True

        def _on_training_end(self) -> None:
            marks.append(time.perf_counter())

    mon = CpuMonitor()
    mon.start()
    venv = make_vec_env("CartPole-v1", n_envs=8, seed=0)
    model = PPO("MlpPolicy", venv, device="cpu", seed=0, verbose=0)
    steps_per_cycle = model.n_steps * model.n_envs
    model.learn(total_timesteps=steps_per_cycle * rollouts, callback=Clock())
    venv.close()
    # marks: the start of each rollout, then the end of training; every gap is one rollout + update.
    dt = marks[-1] - marks[0]
    cycles = len(marks) - 1
    return {
        "sps": cycles * steps_per_cycle / dt, "seconds": dt, "iterations": cycles, "version": stable_baselines3.__version__,
        "others_busy": mon.stop(), "num_envs": model.n_envs, "n_steps": model.n_steps, "batch_size": model.batch_size,
        "n_epochs": model.n_epochs,
    }


def sb3_comparison(rollouts: int, num_envs: int | None, train_sps: float | None) -> dict[str, Any] | None:
    """Time SB3 PPO (`bench_sb3`) and relate phalanx's cartpole training rate `train_sps` at `num_envs` to it.
    Prints what it finds; None where stable-baselines3 is not installed."""
    print()
    try:
        import stable_baselines3  # noqa: F401
    except ImportError:
        print("sb3: stable-baselines3 is not installed; install the bench extra: pip install -e '.[bench]'")
        return None
    settle()
    print(f"sb3: timing PPO defaults on CartPole-v1 ({rollouts} x {SB3_ROLLOUT} steps, 8 envs, CPU)...", flush=True)
    sb3 = bench_sb3(rollouts)
    print(f"sb3 {sb3['version']} PPO (MlpPolicy, n_steps {sb3['n_steps']}, batch {sb3['batch_size']}, "
          f"{sb3['n_epochs']} epochs, {sb3['num_envs']} envs): {fmt_sps(sb3['sps'])} steps/s"
          + (f" (others used {sb3['others_busy']:.0%} of the CPUs)" if sb3["others_busy"] is not None else ""))
    # The comparison: Phalanx at SB3's own settings, timed over as many rollout + update cycles.
    same = bench_phalanx_cycles(sb3_settings_config, rollouts)
    sb3["phalanx_same_settings_sps"] = same
    sb3["phalanx_same_over_sb3"] = same / sb3["sps"]
    print(f"phalanx at SB3's settings (8 envs x 2048 steps, 10 epochs, minibatch 64, 64x64 tanh, lr 3e-4): "
          f"{fmt_sps(same)} steps/s = {sb3['phalanx_same_over_sb3']:.2f}x SB3")
    # Apart: what Phalanx's own larger batches add (a different configuration, not a like-for-like ratio).
    sb3["phalanx_num_envs"], sb3["phalanx_sps"] = num_envs, train_sps
    sb3["phalanx_over_sb3"] = train_sps / sb3["sps"] if train_sps else None
    if train_sps:
        print(f"phalanx at its bench settings ({num_envs} envs, {PPO_SETTINGS['num_epochs']} epochs, "
              f"{PPO_SETTINGS['num_minibatches']} minibatches): {fmt_sps(train_sps)} steps/s = {sb3['phalanx_over_sb3']:.1f}x SB3 "
              "(larger batches; not the same configuration)")
    return sb3


def sb3_settings_config(run_dir: str):
    """Phalanx's cartpole config at Stable-Baselines3 PPO's defaults (what `bench_sb3` runs)."""
    return resolve({"env": "cartpole", **SB3_SETTINGS, "tensorboard": False, "progress": False, "run_dir": run_dir,
                    "total_steps": 10**12, "device": "cpu", "seed": 1})


def bench_phalanx_cycles(config: Callable[[str], Any], cycles: int) -> float:
    """Steps/s of `cycles` training iterations (collect + update) after one untimed one."""
    with tempfile.TemporaryDirectory(prefix="phalanx-bench-") as tmp:
        trainer = Trainer(config(tmp))
        try:
            trainer.iteration()
            t0 = time.perf_counter()
            for _ in range(cycles):
                trainer.iteration()
            sync(trainer.run.device)
            return cycles * trainer.run.cfg.batch_size / (time.perf_counter() - t0)
        finally:
            trainer.close()


def suite_sb3(rows: list[dict[str, Any]], rollouts: int) -> dict[str, Any] | None:
    """SB3 against the suite's cartpole training rate at its largest measured num_envs."""
    measured = [r for r in rows if r["workload"] == "cartpole" and r["train"]]
    best = max(measured, key=lambda r: r["num_envs"]) if measured else None
    return sb3_comparison(rollouts, best and best["num_envs"], best and best["train"]["sps"])
