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
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import sys
import tempfile
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

import torch
from torch import nn

from phalanx.errors import PhalanxError

PPO_SETTINGS = {"num_epochs": 4, "num_minibatches": 8, "hidden_sizes": [64, 64]}
DEFAULT_NUM_ENVS = {"cartpole": [8, 64, 512, 4096], "bucket_brigade": [64, 256, 1024, 4096]}
SB3_ROLLOUT = 2048 * 8  # SB3 defaults: n_steps 2048 per env, 8 envs


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
                    "bucket_brigade (env, rollout and MAPPO training agent-steps/s of the 4-agent env, no references).",
    )
    p.add_argument("target", nargs="?", choices=list(DEFAULT_NUM_ENVS), help="what to benchmark")
    p.add_argument("--num-envs", type=_int_list, default=None, metavar="N[,N...]",
                   help="numbers of parallel envs to measure [cartpole: 8,64,512,4096; bucket_brigade: 64,256,1024,4096]")
    p.add_argument("--steps", type=_positive(int), default=32, help="rollout length per env (num_steps) [32]")
    p.add_argument("--seconds", type=_positive(float), default=2.5,
                   help="time budget of each measurement, after one warm-up iteration [2.5]")
    p.add_argument("--threads", type=_positive(int), default=None, help="torch CPU threads [torch's default]")
    p.add_argument("--device", default="cpu", help="torch device for phalanx and the reference [cpu]")
    p.add_argument("--no-ref", dest="ref", action="store_false",
                   help="cartpole: skip the minimal pure-torch PPO reference (bucket_brigade has none)")
    p.add_argument("--sb3", action="store_true", help="cartpole: also measure Stable-Baselines3 PPO (defaults, 8 envs, CPU)")
    p.add_argument("--sb3-rollouts", type=_positive(int), default=2,
                   help="cartpole: SB3 rollout+update cycles of 16384 steps to time [2]")
    p.add_argument("--scenario", default=None, metavar="NAME",
                   help="bucket_brigade: scenario (see `phalanx envs`) [default]")
    p.add_argument("--wait-idle", type=float, default=0.0, metavar="S",
                   help="before each measurement wait up to S seconds for other processes to go quiet [0]")
    p.add_argument("--json", metavar="FILE", help="also write the results as JSON")
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
    for _ in range(warmup):
        step()
    _sync(device)
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
            "windows": len(rates), "others_busy": mon.stop()}


# -- phalanx measurements --------------------------------------------------------------------------
def bench_env(
    num_envs: int, seconds: float, device: torch.device, env_name: str = "cartpole", options: dict[str, Any] | None = None
) -> dict[str, float]:
    """Uniform random actions stepping the env alone; rates count agent steps (num_envs x num_agents per call)."""
    from phalanx.envs import make
    from phalanx.evaluate import random_actions

    env = make(env_name, num_envs=num_envs, device=device, seed=0, **(options or {}))
    gen = torch.Generator(device=device)
    gen.manual_seed(0)
    env.reset(seed=0)
    try:
        return measure(lambda: env.step(random_actions(env, gen)), num_envs * env.num_agents, seconds, device, warmup=4)
    finally:
        env.close()


def phalanx_config(num_envs: int, num_steps: int, run_dir: str, threads: int | None, device: str):
    from phalanx.config import resolve

    return resolve({
        "env": "cartpole", "num_envs": num_envs, "num_steps": num_steps, **PPO_SETTINGS,
        "tensorboard": False, "progress": False, "run_dir": run_dir, "total_steps": 10**12,
        "torch_threads": threads or 0, "device": device, "seed": 1,
    })


def bucket_brigade_config(num_envs: int, num_steps: int, run_dir: str, threads: int | None, device: str,
                          scenario: str = "default"):
    """The trainer config used for bucket_brigade training (the env's train_defaults fill in the rest)."""
    from phalanx.config import resolve

    return resolve({
        "env": "bucket_brigade", "env_options": {"scenario": scenario}, "num_envs": num_envs, "num_steps": num_steps,
        "critic": "mappo", "param_sharing": "shared_id", "norm_reward": True, "team_reward": 1.0,
        "tensorboard": False, "progress": False, "run_dir": run_dir, "total_steps": 10**12,
        "torch_threads": threads or 0, "device": device, "seed": 1,
    })


def bench_trainer(
    num_envs: int, num_steps: int, seconds: float, threads: int | None, device: str, config: Callable[..., Any] = phalanx_config
) -> tuple[dict, dict]:
    """(rollout, train) measurements of one Trainer built from `config(num_envs, num_steps, run_dir, threads, device)`.
    Rates count agent steps: num_envs x num_steps x num_agents per iteration."""
    from phalanx.train import Trainer

    with tempfile.TemporaryDirectory(prefix="phalanx-bench-") as tmp:
        cfg = config(num_envs, num_steps, tmp, threads, device)
        trainer = Trainer(cfg)
        try:
            dev = trainer.device
            batch = cfg.batch_size
            agent_steps = batch * trainer.A
            rollout = measure(trainer.collect, agent_steps, seconds, dev)

            def iteration() -> None:
                stats = trainer.collect()
                trainer.global_step += batch
                metrics = trainer.update()
                trainer.update_idx += 1
                # The trainer's one host read per update.
                torch.stack([metrics["loss"].float(), stats["episodes"].float()]).tolist()

            train = measure(iteration, agent_steps, seconds, dev)
        finally:
            trainer.close()
    return rollout, train


# -- minimal pure-torch PPO (the reference) --------------------------------------------------------
class _RefAgent(nn.Module):
    def __init__(self, obs_dim: int, n_actions: int, hidden: int = 64):
        super().__init__()

        def layer(i: int, o: int, gain: float = math.sqrt(2)) -> nn.Linear:
            lin = nn.Linear(i, o)
            nn.init.orthogonal_(lin.weight, gain)
            nn.init.zeros_(lin.bias)
            return lin

        self.actor = nn.Sequential(
            layer(obs_dim, hidden), nn.Tanh(), layer(hidden, hidden), nn.Tanh(), layer(hidden, n_actions, 0.01)
        )
        self.critic = nn.Sequential(layer(obs_dim, hidden), nn.Tanh(), layer(hidden, hidden), nn.Tanh(), layer(hidden, 1, 1.0))


class ReferencePPO:
    """CleanRL's ppo.py reduced to its tensors, on the phalanx cartpole env (no logging, no truncation bootstrap)."""

    def __init__(self, num_envs: int, num_steps: int, device: torch.device, seed: int = 1,
                 epochs: int = 4, minibatches: int = 8, lr: float = 2.5e-4, gamma: float = 0.99, lam: float = 0.95):
        from phalanx.envs import make

        torch.manual_seed(seed)
        self.N, self.T, self.dev = num_envs, num_steps, device
        self.epochs, self.minibatches, self.gamma, self.lam = epochs, minibatches, gamma, lam
        self.env = make("cartpole", num_envs=num_envs, device=device, seed=seed)
        self.agent = _RefAgent(4, 2).to(device)
        self.opt = torch.optim.Adam(self.agent.parameters(), lr=lr, eps=1e-5)
        T, N = num_steps, num_envs
        self.obs = torch.zeros(T, N, 4, device=device)
        self.actions = torch.zeros(T, N, dtype=torch.long, device=device)
        self.logprobs = torch.zeros(T, N, device=device)
        self.rewards = torch.zeros(T, N, device=device)
        self.dones = torch.zeros(T, N, device=device)
        self.values = torch.zeros(T, N, device=device)
        rec = self.env.reset(seed=seed)
        self.next_obs = rec.obs[:, 0]
        self.next_done = torch.zeros(N, device=device)

    @torch.no_grad()
    def collect(self) -> None:
        agent = self.agent
        for t in range(self.T):
            self.obs[t] = self.next_obs
            self.dones[t] = self.next_done
            logits = agent.actor(self.next_obs)
            action = torch.multinomial(torch.softmax(logits, -1), 1).squeeze(-1)
            self.actions[t] = action
            self.logprobs[t] = torch.log_softmax(logits, -1).gather(-1, action.unsqueeze(-1)).squeeze(-1)
            self.values[t] = agent.critic(self.next_obs).squeeze(-1)
            rec = self.env.step(action.unsqueeze(-1))
            self.rewards[t] = rec.reward[:, 0]
            self.next_obs = rec.obs[:, 0]
            self.next_done = (rec.terminated | rec.truncated)[:, 0].float()

    def update(self) -> torch.Tensor:
        agent, T = self.agent, self.T
        with torch.no_grad():
            next_value = agent.critic(self.next_obs).squeeze(-1)
            adv = torch.zeros_like(self.rewards)
            last = torch.zeros_like(next_value)
            for t in reversed(range(T)):
                nonterm = 1.0 - (self.next_done if t == T - 1 else self.dones[t + 1])
                nv = next_value if t == T - 1 else self.values[t + 1]
                delta = self.rewards[t] + self.gamma * nv * nonterm - self.values[t]
                last = delta + self.gamma * self.lam * nonterm * last
                adv[t] = last
            ret = adv + self.values
        b_obs, b_act, b_logp = self.obs.reshape(-1, 4), self.actions.reshape(-1), self.logprobs.reshape(-1)
        b_adv, b_ret, b_val = adv.reshape(-1), ret.reshape(-1), self.values.reshape(-1)
        size = b_obs.shape[0]
        mb = size // self.minibatches
        for _ in range(self.epochs):
            perm = torch.randperm(size, device=self.dev)
            for start in range(0, mb * self.minibatches, mb):
                idx = perm[start:start + mb]
                logits = agent.actor(b_obs[idx])
                logp_all = torch.log_softmax(logits, -1)
                newlogp = logp_all.gather(-1, b_act[idx].unsqueeze(-1)).squeeze(-1)
                entropy = -(logp_all.exp() * logp_all).sum(-1)
                newv = agent.critic(b_obs[idx]).squeeze(-1)
                ratio = (newlogp - b_logp[idx]).exp()
                a = b_adv[idx]
                a = (a - a.mean()) / (a.std(correction=0) + 1e-8)
                pg = torch.max(-a * ratio, -a * ratio.clamp(0.8, 1.2)).mean()
                v_clip = b_val[idx] + (newv - b_val[idx]).clamp(-0.2, 0.2)
                v_loss = 0.5 * torch.max((newv - b_ret[idx]) ** 2, (v_clip - b_ret[idx]) ** 2).mean()
                loss = pg - 0.0 * entropy.mean() + 0.5 * v_loss
                self.opt.zero_grad(set_to_none=True)
                loss.backward()
                nn.utils.clip_grad_norm_(agent.parameters(), 0.5)
                self.opt.step()
        return loss.detach()

    def iteration(self) -> None:
        self.collect()
        self.update().item()


def bench_reference(num_envs: int, num_steps: int, seconds: float, device: torch.device) -> dict[str, float]:
    ref = ReferencePPO(num_envs, num_steps, device)
    try:
        return measure(ref.iteration, num_envs * num_steps, seconds, device)
    finally:
        ref.env.close()


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


def _machine(device: torch.device) -> dict[str, Any]:
    return {
        "platform": platform.platform(), "processor": platform.processor() or platform.machine(),
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
    from phalanx import runs

    device = runs.resolve_device(args.device)
    out: dict[str, Any] = {
        "target": "cartpole",
        "machine": _machine(device),
        "settings": {"num_steps": args.steps, **PPO_SETTINGS, "activation": "tanh", "seconds": args.seconds},
        "rows": [],
    }
    print(f"phalanx bench cartpole: {args.steps} steps x N envs per update, {PPO_SETTINGS['num_epochs']} epochs, "
          f"{PPO_SETTINGS['num_minibatches']} minibatches, 64x64 MLP; device {device}, torch {torch.__version__}, "
          f"{torch.get_num_threads()} threads")
    print("steps/s (env steps summed over envs, fastest 0.25 s window); train/ref = phalanx train / minimal pure-torch PPO;\n"
          "others = share of the CPUs other processes used meanwhile (should be ~0%)")
    print()
    _print_header(COLUMNS)
    for n in args.num_envs:
        env = bench_env(n, args.seconds, device)
        rollout, train = bench_trainer(n, args.steps, args.seconds, args.threads, str(device))
        ref = bench_reference(n, args.steps, args.seconds, device) if args.ref else None
        ratio = train["sps"] / ref["sps"] if ref else None
        row = {"num_envs": n, "env": env, "rollout": rollout, "train": train, "ref_train": ref, "train_over_ref": ratio,
               "others_busy": _others(env, rollout, train, ref)}
        out["rows"].append(row)
        print(_line([str(n), _fmt(env["sps"]), _fmt(rollout["sps"]), _fmt(train["sps"]), _fmt(ref["sps"] if ref else None),
                     f"{ratio:.2f}x" if ratio else "-", _fmt_busy(row["others_busy"])]), flush=True)
    _warn_busy(out["rows"])
    if args.sb3:
        print()
        try:
            import stable_baselines3  # noqa: F401
        except ImportError:
            print("sb3: stable-baselines3 is not installed; install the bench extra: pip install -e '.[bench]'")
            out["sb3"] = None
        else:
            if _WAIT_IDLE > 0:
                wait_for_idle(_WAIT_IDLE)
            print(f"sb3: timing PPO defaults on CartPole-v1 ({args.sb3_rollouts} x {SB3_ROLLOUT} steps, 8 envs, CPU)...",
                  flush=True)
            sb3 = bench_sb3(args.sb3_rollouts)
            best = max(out["rows"], key=lambda r: r["num_envs"])
            sb3["phalanx_num_envs"] = best["num_envs"]
            sb3["phalanx_over_sb3"] = best["train"]["sps"] / sb3["sps"]
            out["sb3"] = sb3
            print(f"sb3 {sb3['version']} PPO (MlpPolicy, n_steps {sb3['n_steps']}, batch {sb3['batch_size']}, "
                  f"{sb3['n_epochs']} epochs, {sb3['num_envs']} envs): {_fmt(sb3['sps'])} steps/s"
                  + (f" (others used {sb3['others_busy']:.0%} of the CPUs)" if sb3["others_busy"] is not None else ""))
            print(f"phalanx train at {best['num_envs']} envs: {_fmt(best['train']['sps'])} steps/s = "
                  f"{sb3['phalanx_over_sb3']:.1f}x SB3")
    return out


BB_COLUMNS = [("num_envs", 8), ("env", 9), ("rollout", 9), ("train", 9), ("others", 6)]


def run_bucket_brigade(args: argparse.Namespace) -> dict[str, Any]:
    from phalanx import runs
    from phalanx.envs import registry

    device = runs.resolve_device(args.device)
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


def _check_bucket_brigade(args: argparse.Namespace) -> None:
    """Reject bad arguments before any measurement starts."""
    from phalanx.envs.bucket_brigade import SCENARIOS

    if args.sb3:
        raise BenchError("bench: --sb3 applies to the cartpole target only")
    if args.scenario is None:
        args.scenario = "default"
    if args.scenario not in SCENARIOS:
        raise BenchError(f"bench: unknown bucket_brigade scenario '{args.scenario}'; allowed: {', '.join(SCENARIOS)}")
    for n in args.num_envs:  # the config checks (num_minibatches <= num_envs x steps, ...)
        try:
            bucket_brigade_config(n, args.steps, "", args.threads, args.device, args.scenario)
        except PhalanxError as e:
            raise BenchError(f"bench: {e}") from None


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(list(sys.argv[1:] if argv is None else argv))
    if args.target is None:
        raise BenchError(f"bench: needs a target: {' or '.join(DEFAULT_NUM_ENVS)} (see `phalanx bench --help`)")
    if args.num_envs is None:
        args.num_envs = list(DEFAULT_NUM_ENVS[args.target])
    if args.target == "bucket_brigade":
        _check_bucket_brigade(args)
    else:
        if args.scenario is not None:
            raise BenchError("bench: --scenario applies to the bucket_brigade target only")
        mbs = PPO_SETTINGS["num_minibatches"]
        if min(args.num_envs) * args.steps < mbs:
            raise BenchError(
                f"bench: num_envs x steps must be at least {mbs} (the minibatch count); got {min(args.num_envs)} x {args.steps}"
            )
    if args.threads:
        torch.set_num_threads(args.threads)
    if not (args.wait_idle >= 0 and math.isfinite(args.wait_idle)):
        raise BenchError(f"bench: --wait-idle must be >= 0, got {args.wait_idle}")
    global _WAIT_IDLE
    _WAIT_IDLE = args.wait_idle
    if args.json:
        parent = Path(args.json).expanduser().resolve().parent
        if not parent.is_dir():
            raise BenchError(f"bench: --json directory '{parent}' does not exist")
    t0 = time.perf_counter()
    result = run_bucket_brigade(args) if args.target == "bucket_brigade" else run_cartpole(args)
    result["wall_seconds"] = time.perf_counter() - t0
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2) + "\n")
        print(f"\nwrote {args.json}")
    return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
