"""`phalanx bench`'s arguments: the parser, and the checks that refuse a bad one in one line (BenchError) before
any measurement starts."""

from __future__ import annotations

import argparse
import math
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from phalanx.envs import registry
from phalanx.errors import ConfigError, PhalanxError
from phalanx_bench.workloads import (
    CUDA_MODES,
    DEFAULT_NUM_ENVS,
    DEFAULT_OUT,
    MODES,
    PPO_SETTINGS,
    TARGETS,
    bucket_brigade_config,
    caps_text,
    workload_names,
)


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
                   help=f"suite, profile: also measure num_envs above a workload's cap ({caps_text()})")
    p.add_argument("--out", default=None, metavar="DIR",
                   help=f"suite: where bench.md and bench.png go [{DEFAULT_OUT}]; profile: write DIR/profile.md [none]")
    p.add_argument("--wait-idle", type=float, default=0.0, metavar="S",
                   help="before each measurement wait up to S seconds for other processes to go quiet [0]")
    p.add_argument("--json", nargs="?", const="-", default=None, metavar="FILE",
                   help="also write the results as JSON to FILE; without FILE print them as one JSON object on stdout "
                        "(and everything else on stderr)")
    return p


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


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The checked arguments of `phalanx bench TARGET ...` (suite and profile: with `workload_list` and
    `mode_list`); a bad one raises BenchError."""
    args = build_parser().parse_args(list(sys.argv[1:] if argv is None else argv))
    if args.target is None and args.json in TARGETS:  # `bench --json suite`: the bare flag took the target
        args.target, args.json = args.json, "-"
    if args.target is None:
        raise BenchError(f"bench: needs a target: {', '.join(TARGETS)} (see `phalanx bench --help`)")
    if args.target in DEFAULT_NUM_ENVS:
        _check_classic(args)
    else:
        _check_suite(args)
    if not (args.wait_idle >= 0 and math.isfinite(args.wait_idle)):
        raise BenchError(f"bench: --wait-idle must be >= 0, got {args.wait_idle}")
    if args.json and args.json != "-":
        parent = Path(args.json).expanduser().resolve().parent
        if not parent.is_dir():
            raise BenchError(f"bench: --json directory '{parent}' does not exist")
    return args
