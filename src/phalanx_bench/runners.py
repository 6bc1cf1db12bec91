"""The runners of `phalanx bench`, one per target: cartpole (env, rollout and training steps/s against the minimal
loop), bucket_brigade, suite (every workload, its --modes variants, peak memory) and profile (the update-cycle
split read from the trainer's own phase clock). Each returns the result that --json writes."""

from __future__ import annotations

import argparse
import contextlib
import gc
import tempfile
import time
from collections.abc import Callable, Iterator
from functools import partial
from pathlib import Path
from typing import Any

import torch

from phalanx import devices
from phalanx.config import resolve
from phalanx.envs import make, registry
from phalanx.errors import ConfigError, one_line
from phalanx.slots import random_actions
from phalanx.trainer import Trainer
from phalanx_bench.harness import PeakMemory, machine_info, measure, measure_alternating, median_ratio, settle, sync, worst_others
from phalanx_bench.reference import ReferencePPO
from phalanx_bench.reports import (
    BB_COLUMNS,
    COLUMNS,
    PROFILE_PARTS,
    SUITE_COLUMNS,
    fmt_busy,
    fmt_sps,
    machine_line,
    print_header,
    profile_markdown,
    profile_table,
    suite_line,
    table_line,
    warn_busy,
    write_suite_files,
)
from phalanx_bench.sb3 import sb3_comparison, suite_sb3
from phalanx_bench.workloads import (
    DEFAULT_OUT,
    MODES,
    PPO_SETTINGS,
    PROFILE_FALLBACK_NUM_ENVS,
    PROFILE_NUM_ENVS,
    SUITE_FALLBACK_NUM_ENVS,
    SUITE_MAX_ENVS,
    SUITE_NUM_ENVS,
    bucket_brigade_config,
    phalanx_config,
    workload_config,
    workload_info,
)


def bench_env(
    num_envs: int, seconds: float, device: torch.device, env_name: str = "cartpole", options: dict[str, Any] | None = None
) -> dict[str, float]:
    """Uniform random actions stepping the env alone, only moves its mask allows where it has one (a forfeited game
    would be shorter than a played one); rates count agent steps (num_envs x num_agents per call: a two-player game's
    moves per second are half of them)."""
    env = make(env_name, num_envs=num_envs, device=device, seed=0, **(options or {}))
    gen = torch.Generator(device=device)
    gen.manual_seed(0)
    last = [env.reset(seed=0)]

    def step() -> None:
        last[0] = env.step(random_actions(env, gen, last[0].action_mask))

    try:
        return measure(step, num_envs * env.num_agents, seconds, device, warmup=4)
    finally:
        env.close()


def bench_trainer(
    num_envs: int, num_steps: int | None, seconds: float, threads: int | None, device: str,
    config: Callable[..., Any] = phalanx_config, rollout: bool = True,
) -> tuple[dict | None, dict]:
    """(rollout, train) measurements of one Trainer built from `config(num_envs, num_steps, run_dir, threads, device)`;
    rollout is None with `rollout=False`. Rates count agent steps: num_envs x num_steps x num_agents per iteration."""
    with built_trainer(num_envs, num_steps, threads, device, config) as trainer:
        agent_steps = trainer.run.cfg.batch_size * trainer.run.env.num_agents
        rolled = measure(trainer.collect, agent_steps, seconds, trainer.run.device) if rollout else None
        train = measure(trainer.iteration, agent_steps, seconds, trainer.run.device)
        train["most_envs"] = trainer.run.most_envs  # what fits in the device's free memory, by the trainer's own check
        train["update_chunks"] = trainer.run.step_hp.update_chunks
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


def run_cartpole(args: argparse.Namespace) -> dict[str, Any]:
    device = devices.resolve_device(args.device)
    out: dict[str, Any] = {
        "target": "cartpole",
        "machine": machine_info(device),
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
    print_header(COLUMNS)
    compiled_lines = []
    for n in args.num_envs:
        env = bench_env(n, args.seconds, device)
        with contextlib.ExitStack() as stack:
            trainer = stack.enter_context(built_trainer(n, args.steps, args.threads, str(device)))
            steps = n * args.steps
            rollout = measure(trainer.collect, steps, args.seconds, trainer.run.device)
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
               "others_busy": worst_others(env, rollout, train, ref, comp)}
        if comp:
            row["train_compiled"] = comp
            row["compiled_over_train"] = median_ratio(comp, train)
            versus = [f"{row['compiled_over_train']:.2f}x eager"]
            if ref:
                row["compiled_over_ref"] = median_ratio(comp, ref)
                versus.append(f"{row['compiled_over_ref']:.2f}x ref")
            compiled_lines.append(f"  --compile at {n} envs: train {fmt_sps(comp['sps'])} steps/s ({', '.join(versus)}); the first "
                                  f"iteration, which compiles, took {comp['warmup_seconds']:.1f} s")
        out["rows"].append(row)
        print(table_line([str(n), fmt_sps(env["sps"]), fmt_sps(rollout["sps"]), fmt_sps(train["sps"]), fmt_sps(ref["sps"] if ref else None),
                     f"{ratio:.2f}x" if ratio else "-", fmt_busy(row["others_busy"])]), flush=True)
    for line in compiled_lines:
        print(line, flush=True)
    warn_busy(out["rows"])
    if args.sb3:
        best = max(out["rows"], key=lambda r: r["num_envs"])
        out["sb3"] = sb3_comparison(args.sb3_rollouts, best["num_envs"], best["train"]["sps"])
    return out


def run_bucket_brigade(args: argparse.Namespace) -> dict[str, Any]:
    device = devices.resolve_device(args.device)
    config = partial(bucket_brigade_config, scenario=args.scenario)
    cfg = config(args.num_envs[0], args.steps, "", args.threads, str(device)).to_dict()
    settings = {k: v for k, v in cfg.items() if k not in ("num_envs", "run_dir", "total_steps", "tensorboard", "progress")}
    num_agents = cfg["env_options"].get("num_agents", registry.spec("bucket_brigade").options["num_agents"].default)
    out: dict[str, Any] = {
        "target": "bucket_brigade",
        "machine": machine_info(device),
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
    print_header(BB_COLUMNS)
    for n in args.num_envs:
        env = bench_env(n, args.seconds, device, "bucket_brigade", {"scenario": args.scenario})
        rollout, train = bench_trainer(n, args.steps, args.seconds, args.threads, str(device), config)
        row = {"num_envs": n, "env": env, "rollout": rollout, "train": train, "others_busy": worst_others(env, rollout, train)}
        out["rows"].append(row)
        print(table_line([str(n), fmt_sps(env["sps"]), fmt_sps(rollout["sps"]), fmt_sps(train["sps"]), fmt_busy(row["others_busy"])],
                    BB_COLUMNS), flush=True)
    warn_busy(out["rows"])
    return out


def _suite_num_envs(name: str, args: argparse.Namespace) -> list[int]:
    return list(args.num_envs or SUITE_NUM_ENVS.get(name, SUITE_FALLBACK_NUM_ENVS))


def _above_cap(name: str, num_envs: int, args: argparse.Namespace) -> str | None:
    """The note of a num_envs above the workload's cap (None where it may run)."""
    cap = SUITE_MAX_ENVS.get(name)
    if cap is None or num_envs <= cap or args.uncapped:
        return None
    return f"skipped: above {name}'s cap of {cap} envs (its rollout buffer is large; --uncapped runs it)"


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
    row.update(env=env, train=train, peak_memory=mem.result, others_busy=worst_others(env, train))
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


def run_suite(args: argparse.Namespace) -> dict[str, Any]:
    """`phalanx bench suite`: the rows of every workload, SB3 (--sb3), the profile, then bench.md and bench.png."""
    device = devices.resolve_device(args.device)
    out: dict[str, Any] = {
        "target": "suite", "machine": machine_info(device),
        "settings": {"seconds": args.seconds, "num_steps": args.steps, "threads": args.threads, "device": str(device),
                     "uncapped": args.uncapped, "modes": args.mode_list},
        "workloads": {}, "rows": [], "sb3": None, "profile": [],
    }
    print(f"phalanx bench suite: {', '.join(args.workload_list)}; {machine_line(out['machine'])}")
    print("agent-steps/s (env steps x num_agents, summed over envs, fastest 0.25 s window); training = collect + update "
          "with the workload's own training config; peak mem = peak memory growth of the row (see bench/README.md)\n")
    print_header(SUITE_COLUMNS)
    for name in args.workload_list:
        out["workloads"][name] = workload_info(name, args.steps)
        warm_up(name, min(16, *_suite_num_envs(name, args)), args, device)
        for n in _suite_num_envs(name, args):
            settle()
            row = suite_row(name, n, args, device)
            out["rows"].append(row)
            print(suite_line(row), flush=True)
    warn_busy(out["rows"])
    if args.sb3:
        out["sb3"] = suite_sb3(out["rows"], args.sb3_rollouts)
    if args.profile:
        print()
        # --profile-envs, else the largest --num-envs, else each workload's default (PROFILE_NUM_ENVS)
        count = args.profile_envs or (max(args.num_envs) if args.num_envs else None)
        out["profile"] = run_profiles(args, device, [count] if count else None)
    out["files"] = write_suite_files(out, Path(args.out or DEFAULT_OUT))
    return out


def _timed_cycles(trainer: Trainer, seconds: float) -> tuple[int, float]:
    """(cycles, wall seconds) of training iterations run until `seconds` passed (at least one)."""
    cycles = 0
    sync(trainer.run.device)
    t0 = time.perf_counter()
    while cycles == 0 or time.perf_counter() - t0 < seconds:
        trainer.iteration()
        cycles += 1
    sync(trainer.run.device)
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
            clock = trainer.run.timer
            clock.reset()
            clock.enabled = True
            cycles, wall = _timed_cycles(trainer, seconds)
            clock.enabled = False
            shape = {"num_agents": trainer.run.env.num_agents, "num_steps": trainer.run.cfg.num_steps}
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
    out: dict[str, Any] = {"target": "profile", "machine": machine_info(device),
                           "settings": {"seconds": args.seconds, "num_steps": args.steps, "threads": args.threads,
                                        "device": str(device)}}
    print(f"phalanx bench profile: {', '.join(args.workload_list)}; {machine_line(out['machine'])}\n")
    out["profile"] = run_profiles(args, device, args.num_envs)
    if args.out:
        path = Path(args.out) / "profile.md"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(f"# phalanx bench profile\n\nMachine: {machine_line(out['machine'])}\n\n"
                        + profile_markdown(out["profile"]) + "\n")
        print(f"\nwrote {path}")
        out["files"] = {"markdown": str(path)}
    return out


RUNNERS: dict[str, Callable[[argparse.Namespace], dict[str, Any]]] = {
    "cartpole": run_cartpole, "bucket_brigade": run_bucket_brigade, "suite": run_suite, "profile": run_profile,
}
