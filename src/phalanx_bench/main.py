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
* ref      a minimal CleanRL-style PPO written in plain torch below, same env, sizes and update;
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
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import math
import os
import platform
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from functools import partial
from pathlib import Path
from typing import Any

import torch

from phalanx import devices
from phalanx.config import resolve
from phalanx.envs import make, registered, registry
from phalanx.errors import ConfigError, PhalanxError, one_line
from phalanx.slots import random_actions
from phalanx.trainer import Trainer
from phalanx_bench.reference import ReferencePPO

PPO_SETTINGS = {"num_epochs": 4, "num_minibatches": 8, "hidden_sizes": [64, 64], "clip_vloss": True}  # ReferencePPO's
DEFAULT_NUM_ENVS = {"cartpole": [8, 64, 512, 4096], "bucket_brigade": [64, 256, 1024, 4096]}
SB3_ROLLOUT = 2048 * 8  # SB3 defaults: n_steps 2048 per env, 8 envs
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


def _caps_text() -> str:
    return ", ".join(f"{k} {v}" for k, v in SUITE_MAX_ENVS.items())


class BenchError(PhalanxError):
    """A bad `phalanx bench` argument (printed as one line by the CLI)."""


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # one line, no usage dump
        raise BenchError(f"bench: {message}")


def _int_list(text: str) -> list[int]:
    try:
        vals = [int(v.replace("_", "")) for v in text.split(",") if v.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated positive integers, got {text!r}") from None
    if not vals or any(v < 1 for v in vals):
        raise argparse.ArgumentTypeError(f"expected comma-separated positive integers, got {text!r}")
    return vals


def _positive(kind: type) -> Callable[[str], Any]:
    def parse(text: str) -> Any:
        try:
            v = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a positive {kind.__name__}, got {text!r}") from None
        if not v > 0 or (isinstance(v, float) and not math.isfinite(v)):
            raise argparse.ArgumentTypeError(f"expected a positive {kind.__name__}, got {text!r}")
        return v

    parse.__name__ = kind.__name__
    return parse


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(
        prog="phalanx bench",
        description="Throughput benchmarks. Targets: cartpole (env, rollout and PPO training steps/s vs. references); "
                    "bucket_brigade (env, rollout and MAPPO training agent-steps/s of the 4-agent env, no references); "
                    "suite (env-only and training agent-steps/s, peak memory and the update-cycle profile of every "
                    "workload; writes DIR/bench.md and DIR/bench.png); profile (the update-cycle time split alone).",
    )
    p.add_argument("target", nargs="?", choices=TARGETS, help="what to benchmark")
    p.add_argument("--num-envs", type=_int_list, default=None, metavar="N[,N...]",
                   help="numbers of parallel envs to measure [cartpole: 8,64,512,4096; bucket_brigade: 64,256,1024,4096; "
                        "suite and profile: per workload, see bench/README.md]")
    p.add_argument("--steps", type=_positive(int), default=None,
                   help="rollout length per env (num_steps) [32; suite and profile: the workload's own]")
    p.add_argument("--seconds", type=_positive(float), default=2.5,
                   help="time budget of each measurement, after one warm-up iteration [2.5]")
    p.add_argument("--threads", "--torch-threads", type=_positive(int), default=None, help="torch CPU threads [torch's default]")
    p.add_argument("--device", default="cpu", help="torch device for phalanx and the reference [cpu]")
    p.add_argument("--compile", action="store_true",
                   help="cartpole: also measure the trainer with --compile (the update step as one graph); the "
                        "first iteration, which compiles, is timed apart")
    p.add_argument("--no-ref", dest="ref", action="store_false",
                   help="cartpole: skip the minimal pure-torch PPO reference (bucket_brigade has none)")
    p.add_argument("--sb3", action="store_true",
                   help="cartpole, suite: also measure Stable-Baselines3 PPO (defaults, 8 envs, CPU)")
    p.add_argument("--sb3-rollouts", type=_positive(int), default=2,
                   help="cartpole, suite: SB3 rollout+update cycles of 16384 steps to time [2]")
    p.add_argument("--scenario", default=None, metavar="NAME",
                   help="bucket_brigade: scenario (see `phalanx envs`) [default]")
    p.add_argument("--workloads", default=None, metavar="NAME[,NAME...]",
                   help="suite, profile: the workloads to run [all registered ones]")
    p.add_argument("--profile-envs", type=_positive(int), default=None, metavar="N",
                   help="suite: num_envs of the update-cycle profile [per workload, see bench/README.md]")
    p.add_argument("--no-profile", dest="profile", action="store_false", help="suite: skip the update-cycle profile")
    p.add_argument("--modes", default=None, metavar="MODE[,MODE...]",
                   help=f"suite: training variants timed beside eager: {', '.join(MODES)} "
                        f"[eager; on CUDA {CUDA_MODES}]")
    p.add_argument("--uncapped", action="store_true",
                   help=f"suite, profile: also measure num_envs above a workload's cap ({_caps_text()})")
    p.add_argument("--out", default=None, metavar="DIR",
                   help=f"suite: where bench.md and bench.png go [{DEFAULT_OUT}]; profile: write DIR/profile.md [none]")
    p.add_argument("--wait-idle", type=float, default=0.0, metavar="S",
                   help="before each measurement wait up to S seconds for other processes to go quiet [0]")
    p.add_argument("--json", nargs="?", const="-", default=None, metavar="FILE",
                   help="also write the results as JSON to FILE; without FILE print them as one JSON object on stdout "
                        "(and everything else on stderr)")
    return p


# -- timing ----------------------------------------------------------------------------------------
def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    elif device.type == "mps":
        torch.mps.synchronize()


class CpuMonitor:
    """How busy the machine was with *other* processes between start() and stop() (Linux /proc only).

    Returns the share of all cores used by others (0..1), or None where /proc/stat is missing.
    Benchmarks on a shared machine are meaningless above a few percent: torch's OpenMP threads
    wait for each other at every op, so one descheduled thread stalls the whole process.
    """

    def __init__(self) -> None:
        self._start: tuple[float, float, float] | None = None

    @staticmethod
    def _read() -> tuple[float, float, float] | None:
        try:
            with open("/proc/stat") as f:
                fields = [float(v) for v in f.readline().split()[1:]]
        except (OSError, ValueError):
            return None
        hz = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
        busy = (sum(fields) - fields[3] - (fields[4] if len(fields) > 4 else 0.0)) / hz  # minus idle, iowait
        t = os.times()
        return busy, t.user + t.system, time.perf_counter()

    def start(self) -> None:
        self._start = self._read()

    def stop(self) -> float | None:
        end = self._read()
        if self._start is None or end is None:
            return None
        busy, own, wall = (e - s for e, s in zip(end, self._start))
        if wall <= 0:
            return None
        return max(0.0, min(1.0, (busy - own) / (wall * (os.cpu_count() or 1))))


_WAIT_IDLE = 0.0  # set by --wait-idle


def wait_for_idle(limit: float, quiet: float = 0.05, probe: float = 0.5) -> None:
    """Wait up to `limit` seconds until other processes use less than `quiet` of the CPUs."""
    deadline = time.perf_counter() + limit
    while time.perf_counter() < deadline:
        mon = CpuMonitor()
        mon.start()
        time.sleep(probe)
        busy = mon.stop()
        if busy is None or busy < quiet:
            return


def measure(
    step: Callable[[], Any], steps_per_call: int, seconds: float, device: torch.device, warmup: int = 1
) -> dict[str, float]:
    """Calls `step` `warmup` times untimed, then in timed windows of ~0.25 s (at least one call each)
    until `seconds` have passed. `sps` is the fastest window (the least disturbed one), `mean_sps` the
    average over all windows, `others_busy` the share of the machine other processes used meanwhile."""
    w0 = time.perf_counter()
    for _ in range(warmup):
        step()
    _sync(device)
    warmup_seconds = time.perf_counter() - w0
    if _WAIT_IDLE > 0:
        wait_for_idle(_WAIT_IDLE)
    window = min(0.25, seconds)
    rates: list[float] = []
    calls = 0
    mon = CpuMonitor()
    mon.start()
    t0 = time.perf_counter()
    while True:
        w0 = time.perf_counter()
        n = 0
        while True:
            step()
            n += 1
            if n % 4 == 0 or steps_per_call >= 4096:
                _sync(device)
                if time.perf_counter() - w0 >= window:
                    break
        _sync(device)
        now = time.perf_counter()
        rates.append(n * steps_per_call / (now - w0))
        calls += n
        if now - t0 >= seconds:
            break
    dt = time.perf_counter() - t0
    return {"sps": max(rates), "mean_sps": calls * steps_per_call / dt, "seconds": dt, "iterations": calls,
            "windows": len(rates), "others_busy": mon.stop(), "warmup_seconds": warmup_seconds}


def measure_alternating(
    steps: dict[str, tuple[Callable[[], Any], int]], seconds: float, device: torch.device, warmup: int = 1
) -> dict[str, dict[str, Any]]:
    """Measures several contestants (name -> (step, steps per call)) turn by turn: each round times one
    window (~0.25 s, at least one call) of each, until every one has run `seconds`. A drift of the
    machine's speed then hits all alike, so the ratio of two contestants is the median over rounds of
    their rates' ratio (`ratios`), not a quotient of runs taken minutes apart. `sps` is each one's
    fastest window, as `measure` reports it."""
    warm: dict[str, float] = {}
    for name, (step, _) in steps.items():
        w0 = time.perf_counter()
        for _ in range(warmup):
            step()
        _sync(device)
        warm[name] = time.perf_counter() - w0
    if _WAIT_IDLE > 0:
        wait_for_idle(_WAIT_IDLE)
    rates: dict[str, list[float]] = {name: [] for name in steps}
    spent = dict.fromkeys(steps, 0.0)
    calls = dict.fromkeys(steps, 0)
    mon = CpuMonitor()
    mon.start()
    while min(spent.values()) < seconds:
        for name, (step, per_call) in steps.items():
            w0 = time.perf_counter()
            n = 0
            while True:
                step()
                n += 1
                _sync(device)
                if time.perf_counter() - w0 >= 0.25:
                    break
            dt = time.perf_counter() - w0
            rates[name].append(n * per_call / dt)
            spent[name] += dt
            calls[name] += n
    busy = mon.stop()
    return {name: {"sps": max(r), "mean_sps": calls[name] * steps[name][1] / spent[name], "seconds": spent[name],
                   "iterations": calls[name], "windows": len(r), "rates": r, "others_busy": busy,
                   "warmup_seconds": warm[name]} for name, r in rates.items()}


def median_ratio(a: dict[str, Any], b: dict[str, Any]) -> float:
    """The median over rounds of a's rate / b's rate (both from one `measure_alternating`)."""
    return statistics.median(x / y for x, y in zip(a["rates"], b["rates"]))


# -- phalanx measurements --------------------------------------------------------------------------
def bench_env(
    num_envs: int, seconds: float, device: torch.device, env_name: str = "cartpole", options: dict[str, Any] | None = None
) -> dict[str, float]:
    """Uniform random actions stepping the env alone; rates count agent steps (num_envs x num_agents per call)."""
    env = make(env_name, num_envs=num_envs, device=device, seed=0, **(options or {}))
    gen = torch.Generator(device=device)
    gen.manual_seed(0)
    env.reset(seed=0)
    try:
        return measure(lambda: env.step(random_actions(env, gen)), num_envs * env.num_agents, seconds, device, warmup=4)
    finally:
        env.close()


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


def bench_trainer(
    num_envs: int, num_steps: int | None, seconds: float, threads: int | None, device: str,
    config: Callable[..., Any] = phalanx_config, rollout: bool = True,
) -> tuple[dict | None, dict]:
    """(rollout, train) measurements of one Trainer built from `config(num_envs, num_steps, run_dir, threads, device)`;
    rollout is None with `rollout=False`. Rates count agent steps: num_envs x num_steps x num_agents per iteration."""
    with built_trainer(num_envs, num_steps, threads, device, config) as trainer:
        agent_steps = trainer.cfg.batch_size * trainer.A
        rolled = measure(trainer.collect, agent_steps, seconds, trainer.device) if rollout else None
        train = measure(trainer.iteration, agent_steps, seconds, trainer.device)
        train["most_envs"] = trainer.most_envs  # what fits in the device's free memory, by the trainer's own check
        train["update_chunks"] = trainer.hp.update_chunks
    return rolled, train


@contextlib.contextmanager
def built_trainer(num_envs: int, num_steps: int | None, threads: int | None, device: str,
                  config: Callable[..., Any] = phalanx_config) -> Iterator[Trainer]:
    """A Trainer of `config(...)` in a temporary run directory, closed and removed afterwards."""
    with tempfile.TemporaryDirectory(prefix="phalanx-bench-") as tmp:
        trainer = Trainer(config(num_envs, num_steps, tmp, threads, device))
        try:
            yield trainer
        finally:
            trainer.close()
            del trainer
            if torch.cuda.is_available():
                # The next row's buffer check reads the free memory: hand this row's cached blocks back.
                gc.collect()
                torch.cuda.empty_cache()


# -- minimal pure-torch PPO (the reference) --------------------------------------------------------
# -- Stable-Baselines3 -----------------------------------------------------------------------------
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


# -- driver ----------------------------------------------------------------------------------------
def _fmt(x: float | None) -> str:
    if x is None:
        return "-"
    if x >= 1e6:
        return f"{x / 1e6:.2f}M"
    if x >= 1e4:
        return f"{x / 1e3:.0f}k"
    if x >= 1e3:
        return f"{x / 1e3:.1f}k"
    return f"{x:.0f}"


COLUMNS = [("num_envs", 8), ("env", 9), ("rollout", 9), ("train", 9), ("ref train", 10), ("train/ref", 9), ("others", 6)]
BUSY_WARN = 0.10


def _line(values: list[str], columns: list[tuple[str, int]] = COLUMNS) -> str:
    return "  ".join(v.rjust(w) for v, (_, w) in zip(values, columns))


def _print_header(columns: list[tuple[str, int]]) -> None:
    header = _line([name for name, _ in columns], columns)
    print(header)
    print("-" * len(header), flush=True)


def _cpu_model() -> str:
    """The CPU's model name (/proc/cpuinfo on Linux), else what `platform` knows."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _machine(device: torch.device) -> dict[str, Any]:
    return {
        "platform": platform.platform(), "processor": platform.processor() or platform.machine(), "cpu_model": _cpu_model(),
        "cpu_count": os.cpu_count(), "torch": torch.__version__, "torch_threads": torch.get_num_threads(),
        "device": str(device), "python": platform.python_version(),
        "loadavg_at_start": os.getloadavg() if hasattr(os, "getloadavg") else None,
    }


def _others(*ms: dict | None) -> float | None:
    """The worst `others_busy` of a row's measurements (None where /proc/stat is missing)."""
    busy = [m["others_busy"] for m in ms if m and m["others_busy"] is not None]
    return max(busy) if busy else None


def _fmt_busy(x: float | None) -> str:
    return "-" if x is None else f"{x:.0%}"


def _warn_busy(rows: list[dict[str, Any]]) -> None:
    worst = max((r["others_busy"] or 0.0 for r in rows), default=0.0)
    if worst > BUSY_WARN:
        print(f"warning: other processes used up to {worst:.0%} of the CPUs during these measurements; "
              "the numbers are not reliable (torch's threads stall when one is descheduled); rerun on an idle machine")


def run_cartpole(args: argparse.Namespace) -> dict[str, Any]:
    device = devices.resolve_device(args.device)
    out: dict[str, Any] = {
        "target": "cartpole",
        "machine": _machine(device),
        "settings": {"num_steps": args.steps, **PPO_SETTINGS, "activation": "tanh", "seconds": args.seconds},
        "rows": [],
    }
    print(f"phalanx bench cartpole: {args.steps} steps x N envs per update, {PPO_SETTINGS['num_epochs']} epochs, "
          f"{PPO_SETTINGS['num_minibatches']} minibatches, 64x64 MLP; device {device}, torch {torch.__version__}, "
          f"{torch.get_num_threads()} threads")
    print("steps/s (env steps summed over envs, fastest 0.25 s window); train/ref = phalanx train / minimal pure-torch PPO,\n"
          "the median over rounds that time each in turn (and --compile with them);\n"
          "others = share of the CPUs other processes used meanwhile (should be ~0%)")
    print()
    _print_header(COLUMNS)
    compiled_lines = []
    for n in args.num_envs:
        env = bench_env(n, args.seconds, device)
        with contextlib.ExitStack() as stack:
            trainer = stack.enter_context(built_trainer(n, args.steps, args.threads, str(device)))
            steps = n * args.steps
            rollout = measure(trainer.collect, steps, args.seconds, trainer.device)
            contest = {"train": (trainer.iteration, steps)}
            if args.ref:
                ref_loop = ReferencePPO(n, args.steps, device)
                stack.callback(ref_loop.env.close)
                contest["ref"] = (ref_loop.iteration, steps)
            if args.compile:
                compiled = stack.enter_context(built_trainer(n, args.steps, args.threads, str(device),
                                                             partial(phalanx_config, compile=True)))
                contest["compiled"] = (compiled.iteration, steps)
            got = measure_alternating(contest, args.seconds, device)
        train, ref, comp = got["train"], got.get("ref"), got.get("compiled")
        ratio = median_ratio(train, ref) if ref else None
        row = {"num_envs": n, "env": env, "rollout": rollout, "train": train, "ref_train": ref, "train_over_ref": ratio,
               "others_busy": _others(env, rollout, train, ref, comp)}
        if comp:
            row["train_compiled"] = comp
            row["compiled_over_train"] = median_ratio(comp, train)
            versus = [f"{row['compiled_over_train']:.2f}x eager"]
            if ref:
                row["compiled_over_ref"] = median_ratio(comp, ref)
                versus.append(f"{row['compiled_over_ref']:.2f}x ref")
            compiled_lines.append(f"  --compile at {n} envs: train {_fmt(comp['sps'])} steps/s ({', '.join(versus)}); the first "
                                  f"iteration, which compiles, took {comp['warmup_seconds']:.1f} s")
        out["rows"].append(row)
        print(_line([str(n), _fmt(env["sps"]), _fmt(rollout["sps"]), _fmt(train["sps"]), _fmt(ref["sps"] if ref else None),
                     f"{ratio:.2f}x" if ratio else "-", _fmt_busy(row["others_busy"])]), flush=True)
    for line in compiled_lines:
        print(line, flush=True)
    _warn_busy(out["rows"])
    if args.sb3:
        best = max(out["rows"], key=lambda r: r["num_envs"])
        out["sb3"] = sb3_comparison(args.sb3_rollouts, best["num_envs"], best["train"]["sps"])
    return out


def sb3_comparison(rollouts: int, num_envs: int | None, train_sps: float | None) -> dict[str, Any] | None:
    """Time SB3 PPO (`bench_sb3`) and relate phalanx's cartpole training rate `train_sps` at `num_envs` to it.
    Prints what it finds; None where stable-baselines3 is not installed."""
    print()
    try:
        import stable_baselines3  # noqa: F401
    except ImportError:
        print("sb3: stable-baselines3 is not installed; install the bench extra: pip install -e '.[bench]'")
        return None
    if _WAIT_IDLE > 0:
        wait_for_idle(_WAIT_IDLE)
    print(f"sb3: timing PPO defaults on CartPole-v1 ({rollouts} x {SB3_ROLLOUT} steps, 8 envs, CPU)...", flush=True)
    sb3 = bench_sb3(rollouts)
    print(f"sb3 {sb3['version']} PPO (MlpPolicy, n_steps {sb3['n_steps']}, batch {sb3['batch_size']}, "
          f"{sb3['n_epochs']} epochs, {sb3['num_envs']} envs): {_fmt(sb3['sps'])} steps/s"
          + (f" (others used {sb3['others_busy']:.0%} of the CPUs)" if sb3["others_busy"] is not None else ""))
    # The comparison: Phalanx at SB3's own settings, timed over as many rollout + update cycles.
    same = bench_phalanx_cycles(sb3_settings_config, rollouts)
    sb3["phalanx_same_settings_sps"] = same
    sb3["phalanx_same_over_sb3"] = same / sb3["sps"]
    print(f"phalanx at SB3's settings (8 envs x 2048 steps, 10 epochs, minibatch 64, 64x64 tanh, lr 3e-4): "
          f"{_fmt(same)} steps/s = {sb3['phalanx_same_over_sb3']:.2f}x SB3")
    # Apart: what Phalanx's own larger batches add (a different configuration, not a like-for-like ratio).
    sb3["phalanx_num_envs"], sb3["phalanx_sps"] = num_envs, train_sps
    sb3["phalanx_over_sb3"] = train_sps / sb3["sps"] if train_sps else None
    if train_sps:
        print(f"phalanx at its bench settings ({num_envs} envs, {PPO_SETTINGS['num_epochs']} epochs, "
              f"{PPO_SETTINGS['num_minibatches']} minibatches): {_fmt(train_sps)} steps/s = {sb3['phalanx_over_sb3']:.1f}x SB3 "
              "(larger batches; not the same configuration)")
    return sb3


SB3_SETTINGS = {"num_envs": 8, "num_steps": 2048, "num_epochs": 10, "num_minibatches": 2048 * 8 // 64, "lr": 3e-4,
                "hidden_sizes": [64, 64], "activation": "tanh", "gamma": 0.99, "gae_lambda": 0.95, "clip_coef": 0.2,
                "ent_coef": 0.0, "vf_coef": 0.5, "max_grad_norm": 0.5, "anneal_lr": False, "norm_adv": True,
                "clip_vloss": False}


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
            _sync(trainer.device)
            return cycles * trainer.cfg.batch_size / (time.perf_counter() - t0)
        finally:
            trainer.close()


BB_COLUMNS = [("num_envs", 8), ("env", 9), ("rollout", 9), ("train", 9), ("others", 6)]


def run_bucket_brigade(args: argparse.Namespace) -> dict[str, Any]:
    device = devices.resolve_device(args.device)
    config = partial(bucket_brigade_config, scenario=args.scenario)
    cfg = config(args.num_envs[0], args.steps, "", args.threads, str(device)).to_dict()
    settings = {k: v for k, v in cfg.items() if k not in ("num_envs", "run_dir", "total_steps", "tensorboard", "progress")}
    num_agents = cfg["env_options"].get("num_agents", registry.spec("bucket_brigade").options["num_agents"].default)
    out: dict[str, Any] = {
        "target": "bucket_brigade",
        "machine": _machine(device),
        "settings": {**settings, "num_agents": num_agents, "seconds": args.seconds},
        "rows": [],
    }
    hidden = "x".join(str(h) for h in cfg["hidden_sizes"])
    print(f"phalanx bench bucket_brigade (scenario {args.scenario}, {num_agents} agents): {args.steps} steps x N envs per update, "
          f"{cfg['num_epochs']} epochs, {cfg['num_minibatches']} minibatches, {hidden} {cfg['activation']} MLP, "
          f"critic {cfg['critic']}, param_sharing {cfg['param_sharing']}, team_reward {cfg['team_reward']:g}; "
          f"device {device}, torch {torch.__version__}, {torch.get_num_threads()} threads")
    print("agent-steps/s (env steps x num_agents, summed over envs, fastest 0.25 s window);\n"
          "others = share of the CPUs other processes used meanwhile (should be ~0%)")
    print()
    _print_header(BB_COLUMNS)
    for n in args.num_envs:
        env = bench_env(n, args.seconds, device, "bucket_brigade", {"scenario": args.scenario})
        rollout, train = bench_trainer(n, args.steps, args.seconds, args.threads, str(device), config)
        row = {"num_envs": n, "env": env, "rollout": rollout, "train": train, "others_busy": _others(env, rollout, train)}
        out["rows"].append(row)
        print(_line([str(n), _fmt(env["sps"]), _fmt(rollout["sps"]), _fmt(train["sps"]), _fmt_busy(row["others_busy"])],
                    BB_COLUMNS), flush=True)
    _warn_busy(out["rows"])
    return out


# -- suite: every workload -------------------------------------------------------------------------
def workload_names() -> list[str]:
    """The registered workloads (the gym:/pz: prefix adapters are not), in the suite's order, then any others."""
    names = sorted(registered())
    return [n for n in SUITE_NUM_ENVS if n in names] + [n for n in names if n not in SUITE_NUM_ENVS]


def parse_workloads(text: str | None) -> list[str]:
    """`--workloads a,b` -> the names, checked against the registry (all of them when not given)."""
    allowed = workload_names()
    if text is None:
        return allowed
    picked = list(dict.fromkeys(w.strip() for w in text.split(",") if w.strip()))
    if not picked:
        raise BenchError(f"bench: unknown workload '{text}'; allowed: {', '.join(allowed)}")
    for w in picked:
        if w in allowed:
            continue
        try:  # a plugin (package.module:factory) or an entry point; the slow gym: / pz: adapters are not workloads
            if registry.is_prefix_name(w) or registry.check_name(w) is None:
                raise ConfigError(w)
        except ConfigError:
            raise BenchError(f"bench: unknown workload '{w}'; allowed: {', '.join(allowed)}, or package.module:factory") from None
    return picked


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


def parse_modes(text: str | None, device: str) -> list[str]:
    """`--modes a,b` -> the training variants to time (eager always first); default: eager, and on CUDA also
    --compile, --cuda-graphs and --cuda-graphs with bf16."""
    if text is None:
        text = CUDA_MODES if device.startswith("cuda") or (device == "auto" and torch.cuda.is_available()) else "eager"
    picked = [m.strip() for m in text.split(",") if m.strip()]
    for m in picked:
        if m not in MODES:
            raise BenchError(f"bench: unknown mode '{m}' in --modes; allowed: {', '.join(MODES)}")
    return ["eager"] + [m for m in dict.fromkeys(picked) if m != "eager"]


def _suite_num_envs(name: str, args: argparse.Namespace) -> list[int]:
    return list(args.num_envs or SUITE_NUM_ENVS.get(name, SUITE_FALLBACK_NUM_ENVS))


def _above_cap(name: str, num_envs: int, args: argparse.Namespace) -> str | None:
    """The note of a num_envs above the workload's cap (None where it may run)."""
    cap = SUITE_MAX_ENVS.get(name)
    if cap is None or num_envs <= cap or args.uncapped:
        return None
    return f"skipped: above {name}'s cap of {cap} envs (its rollout buffer is large; --uncapped runs it)"


# -- peak memory -----------------------------------------------------------------------------------
def _proc_status_kib(key: str) -> int | None:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(key + ":"):
                    return int(line.split()[1])
    except (OSError, ValueError, IndexError):
        return None
    return None


def _reset_peak_rss() -> bool:
    """Reset the process's peak resident set to its current one (Linux >= 4.0); False where not possible."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        return False
    return _proc_status_kib("VmHWM") is not None


def _maxrss_bytes() -> int:
    import resource

    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak if sys.platform == "darwin" else peak * 1024  # macOS: bytes; Linux: KiB


def _trim_heap() -> None:
    """Free what can be freed and hand glibc's free heap back to the OS, so the next baseline is the live set."""
    gc.collect()
    try:
        import ctypes

        ctypes.CDLL(None).malloc_trim(0)
    except (OSError, AttributeError):
        pass


class PeakMemory:
    """Peak memory of the block in `with PeakMemory(device) as mem:`; afterwards `mem.result` = {"bytes", "method"}.

    * "cuda_max_memory_allocated": `torch.cuda.max_memory_allocated` after `reset_peak_memory_stats`, the most
      bytes held by tensors at once (not the caching allocator's reserve, not the CUDA context).
    * "rss_peak_growth" (CPU, Linux): the process's peak resident set during the block (VmHWM, the figure
      `ru_maxrss` reports) minus its resident set at the start; the peak is reset through
      /proc/self/clear_refs and glibc's free heap trimmed first, so an earlier, larger measurement does not
      hide this one. It counts everything the block touched: env, model, optimizer, rollout buffer, temporaries.
    * "ru_maxrss_growth" (CPU where the peak cannot be reset): how far the block raised `ru_maxrss`; 0 when it
      stayed below an earlier peak, so only the largest measurement so far is exact.
    * "unavailable" (other devices): bytes None.
    """

    def __init__(self, device: torch.device):
        self.device = device
        self.result: dict[str, Any] = {"bytes": None, "method": "unavailable"}
        self._base = 0
        self._method = "unavailable"

    def __enter__(self) -> PeakMemory:
        _trim_heap()
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)
            self._method = "cuda_max_memory_allocated"
        elif self.device.type == "cpu" and _reset_peak_rss():
            self._method, self._base = "rss_peak_growth", (_proc_status_kib("VmRSS") or 0) * 1024
        elif self.device.type == "cpu":
            self._method, self._base = "ru_maxrss_growth", _maxrss_bytes()
        return self

    def __exit__(self, *exc: Any) -> bool:
        if self._method == "cuda_max_memory_allocated":
            _sync(self.device)
            peak = int(torch.cuda.max_memory_allocated(self.device))
        elif self._method == "rss_peak_growth":
            peak = max(0, (_proc_status_kib("VmHWM") or 0) * 1024 - self._base)
        elif self._method == "ru_maxrss_growth":
            peak = max(0, _maxrss_bytes() - self._base)
        else:
            peak = None
        self.result = {"bytes": peak, "method": self._method}
        return False


def _fmt_bytes(n: int | None) -> str:
    if n is None:
        return "-"
    if n >= 2**30:
        return f"{n / 2**30:.2f} GiB"
    return f"{n / 2**20:.0f} MiB" if n >= 10 * 2**20 else f"{n / 2**20:.1f} MiB"


# -- suite rows ------------------------------------------------------------------------------------
def suite_row(name: str, num_envs: int, args: argparse.Namespace, device: torch.device) -> dict[str, Any]:
    """Training and env-only agent-steps/s and the peak memory of `name` at `num_envs`. A row that cannot run
    (above the workload's cap, a rollout buffer that would not fit, a config the workload rejects, a failure)
    keeps None figures and says why in `note`."""
    row: dict[str, Any] = {"workload": name, "num_envs": num_envs, "env": None, "train": None, "peak_memory": None,
                           "others_busy": None, "note": _above_cap(name, num_envs, args)}
    if row["note"]:
        return row
    try:
        with PeakMemory(device) as mem:
            _, train = bench_trainer(num_envs, args.steps, args.seconds, args.threads, str(device),
                                     partial(workload_config, name), rollout=False)
            env = bench_env(num_envs, args.seconds, device, name)
    except ConfigError as e:  # e.g. the rollout buffer would exceed 80% of the free memory
        row["note"] = f"skipped: {e}"
        return row
    except Exception as e:  # one broken workload must not end a long suite; the note shows it
        row["note"] = f"failed: {type(e).__name__}: {e}"
        return row
    row.update(env=env, train=train, peak_memory=mem.result, others_busy=_others(env, train))
    row["modes"] = {"eager": {"train": train, "peak_memory": mem.result}}
    for mode in args.mode_list:
        if mode != "eager":
            row["modes"][mode] = _mode_row(name, num_envs, mode, args, device)
    if name == "cartpole" and args.ref:
        row["ref"] = _reference_row(num_envs, args, device)
    return row


def _mode_row(name: str, num_envs: int, mode: str, args: argparse.Namespace, device: torch.device) -> dict[str, Any]:
    """Training agent-steps/s and peak memory of one --modes variant; a refused or failing one keeps its note."""
    try:
        with PeakMemory(device) as mem:
            _, train = bench_trainer(num_envs, args.steps, args.seconds, args.threads, str(device),
                                     partial(workload_config, name, **MODES[mode]), rollout=False)
    except ConfigError as e:
        return {"train": None, "peak_memory": None, "note": f"n/a: {e}"}
    except Exception as e:  # noqa: BLE001 - one failing variant must not end the suite
        return {"train": None, "peak_memory": None, "note": f"failed: {one_line(e)}"}
    return {"train": train, "peak_memory": mem.result, "note": None}


def _reference_row(num_envs: int, args: argparse.Namespace, device: torch.device) -> dict[str, Any] | None:
    """The minimal pure-torch PPO loop at cartpole's own training settings (steps, epochs, minibatches, width)."""
    cfg = resolve({"env": "cartpole", **({"num_steps": args.steps} if args.steps else {})})
    ref = ReferencePPO(num_envs, cfg.num_steps, device, epochs=cfg.num_epochs, minibatches=cfg.num_minibatches,
                       hidden=cfg.hidden_sizes[0], clip_vloss=cfg.clip_vloss)
    try:
        return measure(ref.iteration, num_envs * cfg.num_steps, args.seconds, device)
    finally:
        ref.env.close()


def warm_up(name: str, num_envs: int, args: argparse.Namespace, device: torch.device) -> None:
    """One untimed training iteration of `name`, so that one-time costs (lazy imports, thread pools, kernel and
    allocator caches) fall outside the first row's rates and memory. Errors are left to the rows to report."""
    with contextlib.suppress(Exception), tempfile.TemporaryDirectory(prefix="phalanx-bench-") as tmp:
        trainer = Trainer(workload_config(name, num_envs, args.steps, tmp, args.threads, str(device)))
        try:
            trainer.iteration()
        finally:
            trainer.close()


SUITE_COLUMNS = [("workload", 14), ("num_envs", 8), ("env-only", 9), ("training", 9), ("peak mem", 10), ("others", 6)]


def _sps(m: dict | None) -> float | None:
    return m["sps"] if m else None


def _suite_line(row: dict[str, Any]) -> str:
    mem = row["peak_memory"]["bytes"] if row["peak_memory"] else None
    cells = [row["workload"], str(row["num_envs"]), _fmt(_sps(row["env"])), _fmt(_sps(row["train"])), _fmt_bytes(mem),
             _fmt_busy(row["others_busy"])]
    extra = [f"{m} {_fmt(_sps(v['train']))}" + (f" ({_fmt_bytes(v['peak_memory']['bytes'])})" if v["peak_memory"] else "")
             for m, v in row.get("modes", {}).items() if m != "eager"]
    if row.get("ref"):
        extra.append(f"minimal loop {_fmt(row['ref']['sps'])}")
    notes = [row["note"]] if row["note"] else []
    notes += [f"{m}: {v['note']}" for m, v in row.get("modes", {}).items() if v.get("note")]
    return _line(cells, SUITE_COLUMNS) + ("  " + "; ".join(extra) if extra else "") + ("  " + "; ".join(notes) if notes else "")


def _machine_line(m: dict[str, Any]) -> str:
    return (f"{m['cpu_model']}, {m['cpu_count']} CPUs, {m['torch_threads']} torch threads, torch {m['torch']}, "
            f"device {m['device']}, Python {m['python']}")


def _suite_sb3(rows: list[dict[str, Any]], rollouts: int) -> dict[str, Any] | None:
    """SB3 against the suite's cartpole training rate at its largest measured num_envs."""
    measured = [r for r in rows if r["workload"] == "cartpole" and r["train"]]
    best = max(measured, key=lambda r: r["num_envs"]) if measured else None
    return sb3_comparison(rollouts, best and best["num_envs"], best and best["train"]["sps"])


def run_suite(args: argparse.Namespace) -> dict[str, Any]:
    """`phalanx bench suite`: the rows of every workload, SB3 (--sb3), the profile, then bench.md and bench.png."""
    device = devices.resolve_device(args.device)
    out: dict[str, Any] = {
        "target": "suite", "machine": _machine(device),
        "settings": {"seconds": args.seconds, "num_steps": args.steps, "threads": args.threads, "device": str(device),
                     "uncapped": args.uncapped, "modes": args.mode_list},
        "workloads": {}, "rows": [], "sb3": None, "profile": [],
    }
    print(f"phalanx bench suite: {', '.join(args.workload_list)}; {_machine_line(out['machine'])}")
    print("agent-steps/s (env steps x num_agents, summed over envs, fastest 0.25 s window); training = collect + update "
          "with the workload's own training config; peak mem = peak memory growth of the row (see bench/README.md)\n")
    _print_header(SUITE_COLUMNS)
    for name in args.workload_list:
        out["workloads"][name] = workload_info(name, args.steps)
        warm_up(name, min(16, *_suite_num_envs(name, args)), args, device)
        for n in _suite_num_envs(name, args):
            if _WAIT_IDLE > 0:
                wait_for_idle(_WAIT_IDLE)
            row = suite_row(name, n, args, device)
            out["rows"].append(row)
            print(_suite_line(row), flush=True)
    _warn_busy(out["rows"])
    if args.sb3:
        out["sb3"] = _suite_sb3(out["rows"], args.sb3_rollouts)
    if args.profile:
        print()
        # --profile-envs, else the largest --num-envs, else each workload's default (PROFILE_NUM_ENVS)
        count = args.profile_envs or (max(args.num_envs) if args.num_envs else None)
        out["profile"] = run_profiles(args, device, [count] if count else None)
    out["files"] = write_suite_files(out, Path(args.out or DEFAULT_OUT))
    return out


# -- suite outputs ---------------------------------------------------------------------------------
def suite_markdown(result: dict[str, Any]) -> str:
    """bench.md: the machine line, the rows, the SB3 comparison and the profile."""
    m = result["machine"]
    lines = ["# phalanx bench suite", "", f"Machine: {_machine_line(m)}", "",
             f"Rates are agent-steps/s (env steps x num_agents, summed over envs; the fastest 0.25 s window of "
             f"{result['settings']['seconds']:g} s after one warm-up iteration). Training runs collect + update with "
             "the workload's own training config. Peak memory: "
             + _memory_text(result["rows"]) + " Fits: the largest num_envs whose buffers fit in 80% of the device's "
             "free memory, by the trainer's own check (and the pieces each minibatch runs in, update_chunks).", "",
             ]
    modes = [m for m in result["settings"].get("modes", ["eager"]) if m != "eager"]
    ref = any(r.get("ref") for r in result["rows"])
    head = ["workload", "agents", "steps", "model", "num_envs", "env-only", "training"] + modes + (["minimal loop"] if ref else [])
    lines += ["| " + " | ".join(head + ["peak memory", "fits", "note"]) + " |",
              "|---|--:|--:|---|" + "--:|" * (len(head) - 4) + "--:|--:|---|"]
    for r in result["rows"]:
        w = result["workloads"][r["workload"]]
        mem = r["peak_memory"]["bytes"] if r["peak_memory"] else None
        got = r.get("modes", {})
        cells = [_fmt(_sps(got[m]["train"])) if m in got else "" for m in modes]
        if ref:
            cells.append(_fmt(_sps(r.get("ref"))))
        mems = [_fmt_bytes(mem)] + [f"{m} {_fmt_bytes(got[m]['peak_memory']['bytes'])}" for m in modes
                                    if m in got and got[m]["peak_memory"]]
        notes = ([r["note"]] if r["note"] else []) + [f"{m}: {got[m]['note']}" for m in modes if m in got and got[m].get("note")]
        lines.append(f"| {r['workload']} | {w['num_agents']} | {w['num_steps']} | {w['model']} | {r['num_envs']} | "
                     f"{_fmt(_sps(r['env']))} | {_fmt(_sps(r['train']))} | " + "".join(f"{c} | " for c in cells)
                     + f"{', '.join(mems)} | {_fits(r)} | {'; '.join(notes)} |")
    sb3 = result.get("sb3")
    if sb3:
        ratio = f" = {sb3['phalanx_over_sb3']:.1f}x SB3" if sb3["phalanx_over_sb3"] else ""
        lines += ["", f"Stable-Baselines3 {sb3['version']} PPO (defaults, {sb3['num_envs']} envs, CPU) on CartPole-v1: "
                      f"{_fmt(sb3['sps'])} steps/s; phalanx cartpole training at {sb3['phalanx_num_envs']} envs: "
                      f"{_fmt(sb3['phalanx_sps'])} steps/s{ratio}."]
    if result.get("profile"):
        lines += ["", "## Update-cycle profile", "", profile_markdown(result["profile"])]
    return "\n".join(lines) + "\n"


def _fits(row: dict[str, Any]) -> str:
    """The largest num_envs whose run fits in 80% of the device's free memory, and the pieces each minibatch
    runs in where that is more than one (update_chunks)."""
    train = row["train"] or {}
    if train.get("most_envs") is None:
        return ""
    chunks = train.get("update_chunks", 1)
    return f"{train['most_envs']:,}" + (f" ({chunks} pieces)" if chunks > 1 else "")


def _memory_text(rows: list[dict[str, Any]]) -> str:
    methods = {r["peak_memory"]["method"] for r in rows if r["peak_memory"]}
    texts = {
        "rss_peak_growth": "growth of the process's peak resident set (VmHWM/ru_maxrss, reset before each row) over "
                           "its resident set at the row's start",
        "ru_maxrss_growth": "how far the row raised the process's ru_maxrss (0 when below an earlier peak)",
        "cuda_max_memory_allocated": "torch.cuda.max_memory_allocated during the row (tensors only)",
        "unavailable": "not measured on this device",
    }
    return "; ".join(texts[k] for k in sorted(methods)) + "." if methods else "-."


def write_plot(rows: list[dict[str, Any]], path: Path, title: str) -> bool:
    """bench.png: env-only and training agent-steps/s against num_envs, log-log, one line per workload.
    False where matplotlib is missing."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        from matplotlib.ticker import NullLocator
    except ImportError:
        return False
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.8))
    for ax, key, label in zip(axes, ("env", "train"), ("env only", "training")):
        for name in dict.fromkeys(r["workload"] for r in rows):
            pts = [(r["num_envs"], r[key]["sps"]) for r in rows if r["workload"] == name and r[key]]
            if pts:
                ax.plot(*zip(*pts), marker="o", label=name)
        if ax.lines:
            ax.legend(fontsize=8)
        ax.set(xscale="log", yscale="log", xlabel="num_envs", ylabel="agent-steps/s", title=label)
        counts = sorted({r["num_envs"] for r in rows})
        ax.set_xticks(counts, [str(c) for c in counts])
        ax.xaxis.set_minor_locator(NullLocator())
        ax.grid(True, which="both", alpha=0.3)
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True


def write_suite_files(result: dict[str, Any], out_dir: Path) -> dict[str, str | None]:
    """Print the Markdown table and write DIR/bench.md and DIR/bench.png; returns their paths."""
    out_dir.mkdir(parents=True, exist_ok=True)
    md = suite_markdown(result)
    print()
    print(md, end="")
    (out_dir / "bench.md").write_text(md)
    png = out_dir / "bench.png"
    plotted = write_plot(result["rows"], png, "phalanx bench suite: " + _machine_line(result["machine"]))
    print(f"\nwrote {out_dir / 'bench.md'}" + (f" and {png}" if plotted else " (no plot: matplotlib is not installed)"))
    return {"markdown": str(out_dir / "bench.md"), "plot": str(png) if plotted else None}


# -- update-cycle profile --------------------------------------------------------------------------
PROFILE_PARTS = [("env_step", "env step"), ("policy_forward", "policy forward"), ("opponents", "opponents"),
                 ("rollout_other", "rollout other"), ("gae", "GAE"), ("update", "update")]


def _timed_cycles(trainer: Trainer, seconds: float) -> tuple[int, float]:
    """(cycles, wall seconds) of training iterations run until `seconds` passed (at least one)."""
    cycles = 0
    _sync(trainer.device)
    t0 = time.perf_counter()
    while cycles == 0 or time.perf_counter() - t0 < seconds:
        trainer.iteration()
        cycles += 1
    _sync(trainer.device)
    return cycles, time.perf_counter() - t0


def profile_workload(name: str, num_envs: int, num_steps: int | None, seconds: float, threads: int | None,
                     device: torch.device) -> dict[str, Any]:
    """The time split of `name`'s collect+update cycle at `num_envs`, read from the trainer's own phase
    clock: one warm-up cycle, then cycles until `seconds` passed (at least one), every part averaged per
    cycle. `rollout_other` is the collect time outside the env step, the policy forwards and the opponents
    (buffers, normalisers, bookkeeping); `update` is the update time outside GAE (minibatch forward,
    backward, optimizer); the host read and logging fall into neither and count in the cycle."""
    with tempfile.TemporaryDirectory(prefix="phalanx-bench-") as tmp:
        trainer = Trainer(workload_config(name, num_envs, num_steps, tmp, threads, str(device)))
        try:
            trainer.iteration()  # warm-up
            clock = trainer.timer
            clock.reset()
            clock.enabled = True
            cycles, wall = _timed_cycles(trainer, seconds)
            clock.enabled = False
            shape = {"num_agents": trainer.A, "num_steps": trainer.cfg.num_steps}
        finally:
            trainer.close()
    sec = {k: v / cycles for k, v in clock.seconds.items()}
    part = {k: sec[k] for k in ("env_step", "policy_forward", "opponents", "gae")}
    part["rollout_other"] = sec["collect"] - part["env_step"] - part["policy_forward"] - part["opponents"]
    part["update"] = sec["update"] - part["gae"]
    cycle = wall / cycles
    return {"workload": name, "num_envs": num_envs, **shape, "cycles": cycles, "cycle_seconds": cycle,
            "agent_steps_per_cycle": num_envs * shape["num_steps"] * shape["num_agents"],
            "parts": {k: part[k] for k, _ in PROFILE_PARTS}, "fractions": {k: part[k] / cycle for k, _ in PROFILE_PARTS},
            "model_fraction": (part["policy_forward"] + part["update"]) / cycle, "note": None}


def profile_table(p: dict[str, Any]) -> str:
    """One workload's split as a plain-text table: seconds per cycle and share of the cycle per part."""
    if p["note"]:
        return f"{p['workload']} at {p['num_envs']} envs: {p['note']}"
    lines = [f"{p['workload']}: {p['num_envs']} envs x {p['num_steps']} steps x {p['num_agents']} agents, "
             f"{p['cycles']} cycle(s) of {p['cycle_seconds']:.3f} s",
             f"  {'part':<16}{'seconds':>9}{'share':>8}"]
    lines += [f"  {label:<16}{p['parts'][k]:>9.4f}{p['fractions'][k]:>8.1%}" for k, label in PROFILE_PARTS]
    lines.append(f"  {'cycle':<16}{p['cycle_seconds']:>9.4f}{1:>8.1%}")
    lines.append(f"  model compute (policy forward + update): {p['model_fraction']:.1%}")
    return "\n".join(lines)


def profile_markdown(profiles: list[dict[str, Any]]) -> str:
    """All workloads' splits as one Markdown table: seconds per cycle (share of the cycle) per part."""
    head = "| workload | num_envs | cycle | " + " | ".join(label for _, label in PROFILE_PARTS) + " | model compute |"
    lines = [head, "|---|--:|--:|" + "--:|" * (len(PROFILE_PARTS) + 1)]
    for p in profiles:
        if p["note"]:
            lines.append(f"| {p['workload']} | {p['num_envs']} | {p['note']} |" + " |" * (len(PROFILE_PARTS) + 1))
            continue
        cells = [f"{p['parts'][k]:.3f} s ({p['fractions'][k]:.0%})" for k, _ in PROFILE_PARTS]
        lines.append(f"| {p['workload']} | {p['num_envs']} | {p['cycle_seconds']:.3f} s | " + " | ".join(cells)
                     + f" | {p['model_fraction']:.0%} |")
    lines += ["", "Parts per cycle: env step (`env.step`), policy forward (the rollout's actor and critic forwards), "
                  "opponents (league/teammate actions), rollout other (buffers, normalisers, bookkeeping), GAE "
                  "(`compute_gae`), update (minibatch forward, backward, optimizer). Model compute = policy forward + update."]
    return "\n".join(lines)


def run_profiles(args: argparse.Namespace, device: torch.device, counts: list[int] | None) -> list[dict[str, Any]]:
    """Profile every workload of the run at `counts` (None: each workload's default, see PROFILE_NUM_ENVS);
    counts above a cap, buffers that do not fit and failures become rows with a note."""
    out = []
    for name in args.workload_list:
        for n in counts or [PROFILE_NUM_ENVS.get(name, PROFILE_FALLBACK_NUM_ENVS)]:
            p = {"workload": name, "num_envs": n, "note": _above_cap(name, n, args)}
            if not p["note"]:
                try:
                    p = profile_workload(name, n, args.steps, args.seconds, args.threads, device)
                except ConfigError as e:
                    p["note"] = f"skipped: {e}"
                except Exception as e:  # one broken workload must not end the run; the note shows it
                    p["note"] = f"failed: {type(e).__name__}: {e}"
            out.append(p)
            print(profile_table(p), flush=True)
    return out


def run_profile(args: argparse.Namespace) -> dict[str, Any]:
    """`phalanx bench profile`: the update-cycle split alone; with --out also DIR/profile.md."""
    device = devices.resolve_device(args.device)
    out: dict[str, Any] = {"target": "profile", "machine": _machine(device),
                           "settings": {"seconds": args.seconds, "num_steps": args.steps, "threads": args.threads,
                                        "device": str(device)}}
    print(f"phalanx bench profile: {', '.join(args.workload_list)}; {_machine_line(out['machine'])}\n")
    out["profile"] = run_profiles(args, device, args.num_envs)
    if args.out:
        path = Path(args.out) / "profile.md"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(f"# phalanx bench profile\n\nMachine: {_machine_line(out['machine'])}\n\n"
                        + profile_markdown(out["profile"]) + "\n")
        print(f"\nwrote {path}")
        out["files"] = {"markdown": str(path)}
    return out


def _check_bucket_brigade(args: argparse.Namespace) -> None:
    """Reject bad arguments before any measurement starts."""
    if args.sb3:
        raise BenchError("bench: --sb3 applies to the cartpole target only")
    if args.scenario is None:
        args.scenario = "default"
    scenarios = registry.spec("bucket_brigade").options["scenario"].choices  # the env's SCENARIOS, in order
    if args.scenario not in scenarios:
        raise BenchError(f"bench: unknown bucket_brigade scenario '{args.scenario}'; allowed: {', '.join(scenarios)}")
    for n in args.num_envs:  # the config checks (num_minibatches <= num_envs x steps, ...)
        try:
            bucket_brigade_config(n, args.steps, "", args.threads, args.device, args.scenario)
        except PhalanxError as e:
            raise BenchError(f"bench: {e}") from None


SUITE_ONLY = {"workloads": "--workloads", "out": "--out", "profile_envs": "--profile-envs", "uncapped": "--uncapped"}


def _check_classic(args: argparse.Namespace) -> None:
    """Reject bad arguments of the cartpole and bucket_brigade targets before any measurement starts."""
    for key, flag in SUITE_ONLY.items():
        if getattr(args, key) not in (None, False):
            raise BenchError(f"bench: {flag} applies to the suite and profile targets only")
    if not args.profile:
        raise BenchError("bench: --no-profile applies to the suite target only")
    if args.steps is None:
        args.steps = 32
    if args.num_envs is None:
        args.num_envs = list(DEFAULT_NUM_ENVS[args.target])
    if args.target == "bucket_brigade":
        _check_bucket_brigade(args)
        return
    if args.scenario is not None:
        raise BenchError("bench: --scenario applies to the bucket_brigade target only")
    mbs = PPO_SETTINGS["num_minibatches"]
    if min(args.num_envs) * args.steps < mbs:
        raise BenchError(
            f"bench: num_envs x steps must be at least {mbs} (the minibatch count); got {min(args.num_envs)} x {args.steps}"
        )


def _check_suite(args: argparse.Namespace) -> None:
    """Reject bad arguments of the suite and profile targets before any measurement starts."""
    if args.scenario is not None:
        raise BenchError("bench: --scenario applies to the bucket_brigade target only")
    if args.target == "profile":
        for flag, bad in (("--sb3", args.sb3), ("--profile-envs", args.profile_envs), ("--no-profile", not args.profile)):
            if bad:
                raise BenchError(f"bench: {flag} does not apply to the profile target")
    args.workload_list = parse_workloads(args.workloads)
    args.mode_list = parse_modes(args.modes, args.device)
    out = args.out or (DEFAULT_OUT if args.target == "suite" else None)
    if out is not None and Path(out).exists() and not Path(out).is_dir():
        raise BenchError(f"bench: --out '{out}' is not a directory")


def main(argv: list[str] | None = None) -> int:
    """`phalanx bench TARGET ...`; bad arguments raise BenchError (one line, exit status 2 from the CLI)."""
    args = build_parser().parse_args(list(sys.argv[1:] if argv is None else argv))
    if args.target is None and args.json in TARGETS:  # `bench --json suite`: the bare flag took the target
        args.target, args.json = args.json, "-"
    if args.target is None:
        raise BenchError(f"bench: needs a target: {', '.join(TARGETS)} (see `phalanx bench --help`)")
    if args.target in DEFAULT_NUM_ENVS:
        _check_classic(args)
    else:
        _check_suite(args)
    if args.threads:
        torch.set_num_threads(args.threads)
    if not (args.wait_idle >= 0 and math.isfinite(args.wait_idle)):
        raise BenchError(f"bench: --wait-idle must be >= 0, got {args.wait_idle}")
    global _WAIT_IDLE
    _WAIT_IDLE = args.wait_idle
    to_stdout = args.json == "-"
    if args.json and not to_stdout:
        parent = Path(args.json).expanduser().resolve().parent
        if not parent.is_dir():
            raise BenchError(f"bench: --json directory '{parent}' does not exist")
    runners = {"cartpole": run_cartpole, "bucket_brigade": run_bucket_brigade, "suite": run_suite, "profile": run_profile}
    t0 = time.perf_counter()
    # With a bare --json, stdout carries the JSON object alone: tables and progress go to stderr.
    with contextlib.redirect_stdout(sys.stderr) if to_stdout else contextlib.nullcontext():
        result = runners[args.target](args)
        result["wall_seconds"] = time.perf_counter() - t0
        if args.json and not to_stdout:
            Path(args.json).write_text(json.dumps(result, indent=2) + "\n")
            print(f"\nwrote {args.json}")
    if to_stdout:
        print(json.dumps(result), flush=True)
    return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
