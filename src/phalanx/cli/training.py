"""`phalanx train` (and resume), `--print-config` and `phalanx check-env`."""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import Any

from phalanx import devices, runs
from phalanx.cli.options import (
    apply_compute_flags,
    at_least_one,
    duration,
    parse_env_options,
    typed_env_options,
)
from phalanx.config import FIELDS, load_file, parse_text_layer, resolve, sources
from phalanx.envs import make, registry
from phalanx.envs.check import check_env
from phalanx.logs import return_label
from phalanx.plot import ClosingPlot
from phalanx.trainer import train


def cmd_check_env(args: argparse.Namespace, extra: list[str]) -> int:
    at_least_one("check-env", num_envs=args.num_envs, steps=args.steps)
    apply_compute_flags("check-env", args)
    given = typed_env_options(args.env, parse_env_options(extra), "a check-env flag")
    options = registry.resolve_options(args.env, given) if given else {}
    env = make(args.env, num_envs=args.num_envs, device=devices.resolve_device(args.device), seed=args.seed, **options)
    try:
        check_env(env, steps=args.steps, seed=args.seed)
    finally:
        env.close()
    print(f"env '{args.env}': every rule of the env contract holds ({args.num_envs} envs x {env.num_agents} slots, "
          f"{args.steps} random steps, seed {args.seed}, {env.device})")
    return 0


def print_config(file_layer: dict[str, Any], cli_layer: dict[str, Any]) -> int:
    """--print-config: the config a run would get, key = value  # where it came from."""
    cfg = resolve(file_layer or None, cli_layer)
    where = sources(cfg, file_layer, cli_layer)
    width = max(len(k) for k in FIELDS)
    for key, value in cfg.to_dict().items():
        print(f"{key:<{width}} = {json.dumps(value)}  # {where[key]}")
    return 0


def cmd_train(args: argparse.Namespace, extra: list[str]) -> int:
    overrides = parse_text_layer({k: v for k, v in vars(args).items() if k in FIELDS and v is not None})
    env_opts = parse_env_options(extra)
    layers: dict[str, Any] = load_file(args.config) if args.config else {}
    env_name = overrides.get("env", layers.get("env"))
    if env_name is None:  # env options are typed against the env they are for: a resumed run's own
        env_name = runs.load_run_config(Path(args.resume)).env if args.resume and extra else FIELDS["env"].default
    if env_opts:
        overrides["env_options"] = {**layers.get("env_options", {}), **typed_env_options(env_name, env_opts)}
    if args.print_config:
        return print_config(layers, overrides)
    if int(os.environ.get("RANK", "0")) != 0:  # torchrun: rank 0 reports
        train(layers or None, resume=args.resume, overwrite=args.overwrite, **overrides)
        return 0
    with ClosingPlot() as closing_plot:
        result = train(layers or None, resume=args.resume, overwrite=args.overwrite, **overrides)
        m = result.metrics
        print(f"run directory:  {result.run_dir}")
        if result.config.tensorboard:
            print(f"tensorboard:    tensorboard --logdir {result.run_dir / 'tb'}")
        # In a terminal the prompt comes back before the plot is drawn; a script reading the output gets the
        # file before the command returns.
        if sys.stdout.isatty():
            print(f"learning curve: {closing_plot.draw(result.run_dir, wait=False)} (drawn in the background)")
        else:
            print(f"learning curve: {closing_plot.draw(result.run_dir)}")
    agents = result.policy.model.num_agents
    if "step" in m:
        print(f"trained:        to step {m['step']:,} in {duration(m['elapsed_s'])} ({m['run_sps']:,.0f} steps/s on "
              "average)")
    if "recent_return" in m:
        print(f"training {return_label(agents)}: {m['recent_return']:.2f} (mean of the last updates' episodes, as the "
              "progress showed)")
    if "eval_mean_return" in m:
        team = "" if agents == 1 else f" (team: {agents} slots summed)"
        print(f"greedy eval return{team}: {m['eval_mean_return']:.2f} over {int(m['eval_episodes'])} episodes")
    return 0
