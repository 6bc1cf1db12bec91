"""The `phalanx` command line, a shell over the modules that do the work:

    phalanx train      train a policy with PPO (every config key is also a --key value option)
    phalanx resume     continue a stopped run (train --resume RUN_DIR)
    phalanx eval       evaluate a run's policy against scripted teams, random play or league snapshots
    phalanx league     print a self-play run's rating table
    phalanx plot       return and losses against steps, of one run or several
    phalanx envs       list the environments, their spaces and options
    phalanx check-env  check an env against the env contract (docs/ENVIRONMENTS.md)
    phalanx sweep      train configurations x seeds in parallel processes or on Ray; resumable
    phalanx compare    mean, IQM and 95% bootstrap CIs over seeds per configuration; curves with bands
    phalanx export     write a run's policy as an ONNX graph, or with --package a folder to share
    phalanx bench      throughput benchmarks (src/phalanx_bench, added through the `phalanx.commands` entry points)
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import signal
import sys
from collections.abc import Sequence
from importlib.metadata import EntryPoint, entry_points
from pathlib import Path
from typing import Any

import torch
import yaml

from phalanx import checkpoint as ckpt
from phalanx import devices, runs
from phalanx.compare import compare
from phalanx.config import FIELDS, describe_keys, effective_defaults, load_file, resolve, sources
from phalanx.envs import make, registered, registry
from phalanx.envs.check import check_env
from phalanx.errors import CheckpointError, ConfigError, MissingExtraError, PhalanxError, Stopped, storage_reason
from phalanx.evaluate import evaluate_policy
from phalanx.export import DEFAULT_OPSET, export_onnx, file_sizes, read_contract, require_export_extra, sidecar_path
from phalanx.league import LEAGUE_FILE, Ratings, load_snapshot
from phalanx.logs import return_label
from phalanx.package import DEFAULT_EPISODES, DEFAULT_SEED, check_repo_id, push_to_hub, write_package
from phalanx.plot import ClosingPlot, plot_run, plot_runs
from phalanx.policy import load
from phalanx.record import record_episode
from phalanx.sweep import open_sweep, read_spec, run_sweep
from phalanx.trainer import train


class _Parser(argparse.ArgumentParser):
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        # An abbreviated flag (--torch-thread) would be taken for a flag, or for an env option of the same
        # beginning: a flag is spelled out, and one that is not is reported as unknown.
        super().__init__(*args, allow_abbrev=False, **kwargs)

    def error(self, message: str) -> None:  # one line, exit 2, no usage dump
        print(f"phalanx: error: {message}", file=sys.stderr)
        raise SystemExit(2)


def _train_parser(sub: Any, env: str | None = None) -> argparse.ArgumentParser:
    """`env`: the --env given before --help, whose own training defaults the help then shows."""
    p = sub.add_parser(
        "train", help="train a policy", description="Train a policy with PPO. Every config key below is also a --key value option.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--config", help="YAML or TOML file of config keys")
    p.add_argument("--resume", metavar="RUN_DIR", help="continue a stopped run from its last checkpoint")
    p.add_argument("--overwrite", action="store_true",
                   help="start afresh in a --run-dir that holds an earlier run: its files are deleted (yours are kept)")
    p.add_argument("--print-config", action="store_true",
                   help="print the resolved config, each key with the layer it came from, and exit")
    defaults = {}
    if env is not None:
        try:
            defaults = effective_defaults(env)
        except PhalanxError:
            env = None  # an unknown env is refused with one line when the command runs
    keys = p.add_argument_group(f"config keys (default{f' with --env {env}' if env else ''} in brackets)")
    for key, typ, default, help_ in describe_keys():
        if key == "env_options":
            continue
        flag = "--" + key.replace("_", "-")
        default = defaults.get(key, default)
        shown = ",".join(map(str, default)) if isinstance(default, list) else default
        keys.add_argument(flag, dest=key, metavar=typ.upper(), default=None, help=f"{help_} [{shown!s}]".replace("%", "%%"))
    p.epilog = "Env options (e.g. --scenario for bucket_brigade) are passed as --option value; see `phalanx envs`."
    return p


def _parse_env_options(extra: list[str]) -> dict[str, str]:
    opts: dict[str, str] = {}
    i = 0
    while i < len(extra):
        tok = extra[i]
        if not tok.startswith("--"):
            raise PhalanxError(f"unexpected argument '{tok}'")
        key = tok[2:]
        if "=" in key:
            key, value = key.split("=", 1)
            i += 1
        else:
            if i + 1 >= len(extra):
                raise PhalanxError(f"option '--{key}' needs a value")
            value = extra[i + 1]
            i += 2
        opts[key.replace("-", "_")] = value
    return opts


def refuse_unknown_options(env_name: str, env_opts: dict[str, Any], not_what: str) -> None:
    """An option that is neither the command's own flag (`not_what`) nor one the env declares, named as the
    unknown flag it is, with both lists to choose from."""
    s = registry.check_name(env_name)
    if s is None or s.free_options:
        return
    for k in env_opts:
        if k not in s.options:
            allowed = ", ".join(sorted(s.options)) or "none"
            raise PhalanxError(f"unknown option '--{k.replace('_', '-')}' (not {not_what}; env options of '{env_name}': "
                               f"{allowed})")


def typed_env_options(env_name: str, env_opts: dict[str, str], not_what: str = "a config key") -> dict[str, Any]:
    """Env options from the command line: declared ones, and a plugin factory's that its signature types
    (`registry.option_types`), as they are (the registry coerces them); the other keyword arguments of gym /
    pz constructors and plugin factories typed as YAML reads them (25 -> int), which the factory's
    signature (or the adapter) refuses where it does not take them."""
    s = registry.check_name(env_name)
    if s is None or s.free_options:
        typed = registry.option_types(env_name)
        return {k: v if k in typed else yaml.safe_load(v) for k, v in env_opts.items()}
    refuse_unknown_options(env_name, env_opts, not_what)
    return env_opts


def cmd_check_env(args: argparse.Namespace, extra: list[str]) -> int:
    _at_least_one("check-env", num_envs=args.num_envs, steps=args.steps)
    _apply_compute_flags("check-env", args)
    given = typed_env_options(args.env, _parse_env_options(extra), "a check-env flag")
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
    overrides = {k: v for k, v in vars(args).items() if k in FIELDS and v is not None}
    env_opts = _parse_env_options(extra)
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
        print(f"tensorboard:    tensorboard --logdir {result.run_dir / 'tb'}")
        # In a terminal the prompt comes back before the plot is drawn; a script reading the output gets the
        # file before the command returns.
        if sys.stdout.isatty():
            print(f"learning curve: {closing_plot.draw(result.run_dir, wait=False)} (drawn in the background)")
        else:
            print(f"learning curve: {closing_plot.draw(result.run_dir)}")
    agents = result.policy.model.num_agents
    if "step" in m:
        print(f"trained:        to step {m['step']:,} in {_duration(m['elapsed_s'])} ({m['run_sps']:,.0f} steps/s on "
              "average)")
    if "recent_return" in m:
        print(f"training {return_label(agents)}: {m['recent_return']:.2f} (mean of the last updates' episodes, as the "
              "progress showed)")
    if "eval_mean_return" in m:
        team = "" if agents == 1 else f" (team: {agents} slots summed)"
        print(f"greedy eval return{team}: {m['eval_mean_return']:.2f} over {int(m['eval_episodes'])} episodes")
    return 0


def _duration(seconds: float) -> str:
    """12.3 s, 4 min 05 s, 2 h 03 min."""
    if seconds < 60:
        return f"{seconds:.1f} s"
    minutes, sec = divmod(round(seconds), 60)
    if minutes < 60:
        return f"{minutes} min {sec:02d} s"
    return f"{minutes // 60} h {minutes % 60:02d} min"


def _at_least_one(command: str, **counts: int) -> None:
    for name, value in counts.items():
        if value < 1:
            raise ConfigError(f"{command} --{name.replace('_', '-')} must be >= 1, got {value}")


def cmd_eval(args: argparse.Namespace, extra: list[str] | None = None) -> int:
    _at_least_one("eval", episodes=args.episodes)
    _apply_compute_flags("eval", args)
    policy = load(args.run_dir, device=args.device)
    cfg = policy.config
    # Env options given here (e.g. --approach-weight 0: the reward without a training-only term) override the run's.
    given = _parse_env_options(extra or [])
    refuse_unknown_options(cfg.env, given, "an eval flag (`phalanx eval --help`)")
    overrides = registry.resolve_options(cfg.env, given)
    if overrides:
        cfg = dataclasses.replace(cfg, env_options={**cfg.env_options, **overrides})
    common = dict(env_options=cfg.env_options, episodes=args.episodes, seed=args.seed, device=policy.device)
    if args.record:
        opponent = None
        if cfg.opponents:  # a league run: the first --vs opponent, else the env's first scripted one
            names = [v.strip() for v in (args.vs or "").split(",") if v.strip()]
            opponent = names[0] if names else "random"
        info = record_episode(policy, cfg.env, args.record, cfg.env_options, greedy=not args.sample, seed=args.seed,
                              opponent=opponent, device=policy.device)
        print(f"recorded {info['steps']} steps ({info['frames']} frames, return {info['return']:.2f}) to {info['path']}",
              file=sys.stderr)
    res = evaluate_policy(policy, cfg.env, greedy=not args.sample, teammates=cfg.teammates, **common)
    other_mode = "greedy_play" if args.sample else "sampled_play"
    if not cfg.opponents:  # greedy and sampled play side by side: one number can hide the policy
        other = evaluate_policy(policy, cfg.env, greedy=args.sample, teammates=cfg.teammates, **common)
        res[other_mode] = {k: v for k, v in other.items()
                           if k.startswith("mean_") or k in ("success_rate", "median_steps_to_goal")}
    res["checkpoint_step"] = policy.step
    if not args.vs:
        if args.json:
            print(json.dumps(res))
            return 0
        mode = "greedy" if res["greedy"] else "sampled"
        print(f"{cfg.env} ({mode}, {res['episodes']} episodes; {_evaluated(args.run_dir, policy.step)})")
        names = _return_names(policy.model.num_agents)
        for k, v in res.items():
            if isinstance(v, float) and k in names and names[k] is None:
                continue
            if isinstance(v, float):
                print(f"  {names.get(k) or k:<26} {v:.3f}")
            elif isinstance(v, dict):
                print(f"  {k.replace('_', ' ')}: " + ", ".join(f"{names.get(a) or a} {b:.3f}" for a, b in v.items()
                                                              if a not in names or names[a] is not None))
        return 0
    if cfg.opponents:
        return _eval_head_to_head(args, policy, common)
    table = {"learned": res}
    for name in [v.strip() for v in args.vs.split(",") if v.strip()]:
        table[name] = evaluate_policy(None if name == "random" else name, cfg.env, greedy=False, **common)
    if args.json:
        print(json.dumps(table))
        return 0
    # The env's own copies of return and length would repeat columns.
    skip = ("mean_return", "mean_agent_return", "mean_length", "mean_team_return", "mean_nights")
    extra = sorted({k for r in table.values() for k in r if k.startswith("mean_") and k not in skip})
    cols = ["mean_return", "mean_agent_return", *extra, "mean_length"]
    heads = ["team return" if policy.model.num_agents > 1 else "return", "per agent", *[k[5:] for k in extra], "length"]
    print(f"{cfg.env} {cfg.env_options or ''} ({args.episodes} episodes each; learned = {'sampled' if args.sample else 'greedy'}, "
          f"{_evaluated(args.run_dir, policy.step)})")
    widths = [_col_width(h) for h in heads]
    print(f"{'policy':<18}" + "".join(f"{h:>{w}}" for h, w in zip(heads, widths)))
    rows = list(table.items())
    if other_mode in res:
        rows.insert(1, (f"learned, {other_mode.split('_')[0]}", res[other_mode]))
    for name, r in rows:
        print(f"{name:<18}" + "".join(f"{r.get(c, float('nan')):>{w}.2f}" for c, w in zip(cols, widths)))
    return 0


def _evaluated(run_dir: str, step: int | None) -> str:
    return f"checkpoint of step {step:,} in {run_dir}" if step is not None else f"latest checkpoint in {run_dir}"


def _return_names(num_agents: int) -> dict[str, str | None]:
    """How `eval` prints the return keys: whether each is a team's (slots summed) or one agent's; None: not
    printed (with one slot the per-agent return repeats the return)."""
    if num_agents == 1:
        return {"mean_return": "mean return", "median_return": "median return", "std_return": "std of return",
                "mean_agent_return": None}
    return {"mean_return": "mean team return", "median_return": "median team return", "std_return": "std of team return",
            "mean_agent_return": "mean return per agent"}


def _col_width(head: str) -> int:
    """Table column width: at least 16, and always two spaces before a long heading."""
    return max(16, len(head) + 2)


def _eval_head_to_head(args: argparse.Namespace, policy: Any, common: dict[str, Any]) -> int:
    """A league run: the learner against each --vs opponent; the games also update the ratings."""

    cfg, run_dir = policy.config, Path(args.run_dir)
    league_path = run_dir / LEAGUE_FILE
    state = json.loads(league_path.read_text()) if league_path.is_file() else None
    snapshots = sorted((o["step"], o["name"]) for o in (state or {}).get("opponents", []) if o["kind"] == "snapshot")
    table: dict[str, Any] = {}
    for name in [v.strip() for v in args.vs.split(",") if v.strip()]:
        opponent: Any = name
        if name.startswith("snapshot:"):
            want = name.split(":", 1)[1]
            if want == "LATEST":
                if not snapshots:
                    raise PhalanxError(f"run '{run_dir}' has no league snapshots for '{name}'")
                want = snapshots[-1][1]
            opponent = load_snapshot(run_dir, want, policy)
            name = want
        table[name] = r = evaluate_policy(policy, cfg.env, greedy=not args.sample, opponent=opponent, **common)
        if state is not None and name != "random" and "wins" in r:
            ratings = Ratings.from_json(state["ratings"])
            ratings.record_counts(name, r["wins"], r["draws"], r["losses"])
            state["ratings"] = ratings.to_json()
            r["learner_rating"] = ratings.players["learner"].ordinal
            r["opponent_rating"] = ratings.players[name].ordinal
    if state is not None:
        ckpt.write_json_atomic(league_path, state)
    if args.json:
        print(json.dumps({"vs": table}))
        return 0
    print(f"{cfg.env}: learner ({'sampled' if args.sample else 'greedy'}, {_evaluated(args.run_dir, policy.step)}) vs each "
          f"opponent, {args.episodes} matches each")
    extra = sorted({k for r in table.values() for k in r if k.startswith("mean_") and k not in
                    ("mean_return", "mean_agent_return", "mean_length", "mean_win", "mean_draw", "mean_loss")})
    widths = [_col_width(k[5:]) for k in extra]
    print(f"{'opponent':<24}{'win':>6}{'draw':>6}{'loss':>6}{'win rate [95% CI]':>22}" + "".join(f"{k[5:]:>{w}}" for k, w in zip(extra, widths)))
    for name, r in table.items():
        lo, hi = r["win_rate_ci95"]
        ci = f"{r['win_rate']:.2f} [{lo:.2f}, {hi:.2f}]"
        print(f"{name:<24}{r['wins']:>6}{r['draws']:>6}{r['losses']:>6}{ci:>22}"
              + "".join(f"{r.get(k, float('nan')):>{w}.2f}" for k, w in zip(extra, widths)))
    return 0


def cmd_league(args: argparse.Namespace) -> int:
    run_dir = Path(args.run_dir)
    path = run_dir / LEAGUE_FILE
    try:
        state = json.loads(path.read_text())
    except FileNotFoundError:
        try:
            _, _, meta = ckpt.load_checkpoint(ckpt.latest_checkpoint(run_dir))
        except CheckpointError:
            raise PhalanxError(f"'{run_dir}' has no league (train with --opponents to make one)") from None
        if "league" not in meta:
            raise PhalanxError(f"'{run_dir}' has no league (train with --opponents to make one)") from None
        state = meta["league"]
    except json.JSONDecodeError as e:
        raise PhalanxError(f"league file '{path}' is not valid JSON: {e}") from None
    rows = Ratings.from_json(state["ratings"]).table()
    pool = {o["name"]: o for o in state["opponents"]}
    for r in rows:
        o = pool.get(r["name"])
        r["status"] = "learner" if r["name"] == "learner" else (
            "scripted" if o and o["kind"] == "scripted" else
            "pinned" if o and o["pinned"] else "pool" if o and not o["retired"] else "retired")
    if args.json:
        print(json.dumps({"step": state["step"], "ratings": rows}))
        return 0
    print(f"league of {run_dir} at step {state['step']:,} (rating = mu - 3 sigma, OpenSkill Plackett-Luce)")
    print(f"{'name':<26}{'status':>9}{'rating':>9}{'mu':>8}{'sigma':>8}{'games':>8}{'learner win rate vs it':>24}")
    for r in rows:
        wr = "" if r["learner_win_rate"] is None else f"{r['learner_win_rate']:.2f}"
        print(f"{r['name']:<26}{r['status']:>9}{r['rating']:>9.2f}{r['mu']:>8.2f}{r['sigma']:>8.2f}{r['games']:>8}{wr:>24}")
    return 0


def cmd_plot(args: argparse.Namespace) -> int:
    dirs = [Path(d) for d in args.run_dir]
    if len(dirs) == 1:
        print(plot_run(dirs[0], Path(args.out) if args.out else None))
    else:
        print(plot_runs(dirs, Path(args.out or "learning_curves.png")))
    return 0


def cmd_envs(args: argparse.Namespace) -> int:
    rows = []
    for ep in entry_points(group=registry.ENTRY_POINT_GROUP):  # installed plugins are listed too
        registry.spec(ep.name)
    for name, s in sorted(registered().items()):
        try:
            env = make(name, num_envs=1)
        except MissingExtraError as e:  # listed all the same, with what it needs
            rows.append({"name": name, "description": s.description, "unavailable": str(e)})
            continue
        rows.append({
            "name": name, "description": s.description, "agents": env.num_agents, "scripted": list(env.scripted_names),
            "roles": list(env.role_names), "state": env.state_space.describe() if env.state_space is not None else None,
            "observation": env.observation_space.describe(), "action": env.action_space.describe(),
            "options": {k: {"default": o.default, "help": o.help, **({"choices": list(o.choices)} if o.choices else {}),
                            **({"min": o.min} if o.min is not None else {}), **({"max": o.max} if o.max is not None else {})}
                        for k, o in s.options.items()},
        })
        env.close()
    if args.json:
        print(json.dumps(rows, indent=2))
        return 0
    for r in rows:
        print(f"{r['name']}: {r['description']}")
        if "unavailable" in r:
            print(f"  unavailable here: {r['unavailable']}")
            continue
        print(f"  agents {r['agents']}  observation {r['observation']}  action {r['action']}")
        if r["state"]:
            print(f"  global state {r['state']}  roles {', '.join(r['roles'])}")
        if r["scripted"]:
            print(f"  scripted policies (--vs, --teammates): {', '.join(r['scripted'])}")
        for k, o in r["options"].items():
            ch = f" (one of {', '.join(map(str, o['choices']))})" if "choices" in o else ""
            if "max" in o:
                ch += f" (in [{o.get('min', '-inf')}, {o['max']}])"
            elif "min" in o:
                ch += f" (>= {o['min']})"
            print(f"  --{k.replace('_', '-')} [{o['default']}]: {o['help']}{ch}")
    print("gym:<id>: any installed gymnasium environment through its vector API (slow path)")
    print("pz:<module>:<factory>: any PettingZoo ParallelEnv (slow path)")
    print("vmas:<scenario>: any VMAS scenario on the run's device; scenario options as --option value (vmas extra)")
    print("package.module:factory: your own env, imported on use (docs/ENVIRONMENTS.md; check it with `phalanx check-env`)")
    return 0


def cmd_sweep(args: argparse.Namespace) -> int:
    if args.workers < 1:
        raise ConfigError(f"--workers must be at least 1; got {args.workers}")
    spec = read_spec(args.spec) if args.spec else None
    sw = run_sweep(open_sweep(Path(args.dir), spec), workers=args.workers, backend=args.backend, address=args.address,
                   echo=lambda line: print(line, flush=True))
    failed = [t.name for t in sw.trials if t.status != "done"]
    print(f"sweep {args.dir}: {len(sw.trials) - len(failed)} of {len(sw.trials)} runs finished"
          + (f"; failed: {', '.join(failed)} (see {args.dir}/logs; run the sweep again to retry)" if failed else "")
          + f"; `phalanx compare {args.dir}` summarises them")
    return 1 if failed else 0


def cmd_compare(args: argparse.Namespace) -> int:
    result = compare(args.paths, metric=args.metric, out_dir=Path(args.out) if args.out else None)
    if args.json:
        print(json.dumps({k: v for k, v in result.items() if k != "table"}))
    else:
        print(result["table"] + f"\nwrote {result['markdown']}, {Path(result['markdown']).with_suffix('.json')} and {result['plot']}")
    return 0


def cmd_export(args: argparse.Namespace) -> int:
    require_export_extra()  # before anything is loaded: the one line names the extra to install
    if args.package is not None or args.push_to_hub:
        return _export_package(args)
    given = [f for f, v in (("--episodes", args.episodes), ("--seed", args.seed), ("--overwrite", args.overwrite or None))
             if v is not None]
    if given:
        raise ConfigError(f"export {', '.join(given)}: these go with --package DIR (the evaluation in its model card)")
    run_dir = Path(args.run_dir)
    policy = load(run_dir, checkpoint=args.checkpoint)
    checkpoint = Path(args.checkpoint) if args.checkpoint else ckpt.latest_checkpoint(run_dir)
    path = export_onnx(policy, Path(args.out) if args.out else run_dir / "export" / "policy.onnx", opset=args.opset)
    sizes, terms = file_sizes(path, checkpoint), read_contract(path)
    print(f"wrote {path} ({terms['exporter']}, opset {terms['opset']}) and its I/O contract {sidecar_path(path)}")
    print(f"size: {sizes['onnx'] / 1e3:,.1f} kB, beside {sizes['safetensors'] / 1e3:,.1f} kB of weights in "
          f"{checkpoint / 'model.safetensors'}")
    return 0


def _export_package(args: argparse.Namespace) -> int:
    """export --package DIR [--push-to-hub REPO_ID]: the folder to share (phalanx.package)."""
    if args.package is None:
        raise ConfigError("export --push-to-hub needs --package DIR: the folder it writes and uploads")
    if args.out:
        raise ConfigError("export --out and --package: the package holds its graph as DIR/policy.onnx; give one of them")
    episodes = DEFAULT_EPISODES if args.episodes is None else args.episodes
    _at_least_one("export", episodes=episodes)
    if args.push_to_hub:
        check_repo_id(args.push_to_hub)  # before the evaluation: a bad id or a missing extra costs nothing
    report = write_package(args.run_dir, args.package, checkpoint=args.checkpoint, episodes=episodes,
                           seed=DEFAULT_SEED if args.seed is None else args.seed, opset=args.opset, overwrite=args.overwrite)
    first = report["table"]["rows"][0]
    lo, hi = first["ci95"]
    print(f"wrote {report['dir']}: {', '.join(report['files'])}")
    print(f"{first['policy']} ({first['play']}): mean return {first['mean_return']:.2f}, 95% interval [{lo:.2f}, {hi:.2f}] "
          f"over {first['episodes']} episodes; the table against the env's baselines is in {report['dir'] / 'README.md'}")
    if not report["replay"].endswith(".gif"):
        print(report["replay"])
    if args.push_to_hub:
        print(f"uploaded to {push_to_hub(report['dir'], args.push_to_hub)}")
    return 0


COMMAND_GROUP = "phalanx.commands"


def plugin_commands() -> dict[str, EntryPoint]:
    """Subcommands other packages add through the `phalanx.commands` entry-point group (name ->
    `main(argv) -> exit status`); `phalanx bench` is one, from the phalanx_bench package."""
    return {ep.name: ep for ep in entry_points(group=COMMAND_GROUP)}


def _env_before_help(argv: list[str]) -> str | None:
    """`phalanx train --env X ... --help`: X, so the help shows X's own defaults."""
    if argv[:1] != ["train"] or not ({"-h", "--help"} & set(argv)):
        return None
    for i, tok in enumerate(argv):
        if tok == "--env" and i + 1 < len(argv):
            return argv[i + 1]
        if tok.startswith("--env="):
            return tok.split("=", 1)[1]
    return None


def build_parser(argv: Sequence[str] = ()) -> argparse.ArgumentParser:
    """The `phalanx` parser; `argv` only for `train --env X --help`, whose help shows X's own defaults."""
    parser = _Parser(prog="phalanx", description="Phalanx: on-device PPO for single- and multi-agent environments.")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)
    _train_parser(sub, _env_before_help(list(argv)))
    pr = sub.add_parser("resume", help="continue a stopped run (same as train --resume RUN_DIR)",
                        description="Continue a stopped run from its last checkpoint: `phalanx resume RUN_DIR [--key value ...]` "
                                    "is `phalanx train --resume RUN_DIR [--key value ...]` (a larger --total-steps trains longer).")
    pr.add_argument("run_dir", help="the run directory to continue")
    pe = sub.add_parser("eval", help="evaluate a run's policy",
                        epilog="Env options (see `phalanx envs`) given as --option value override the run's for this evaluation.")
    pe.add_argument("run_dir", help="the run directory whose latest checkpoint is evaluated")
    pe.add_argument("--episodes", type=int, default=20, help="episodes to play (each mode, each opponent) [20]")
    mode = pe.add_mutually_exclusive_group()
    mode.add_argument("--greedy", action="store_true", default=True, help="act greedily (default)")
    mode.add_argument("--sample", action="store_true", help="sample actions from the policy")
    pe.add_argument("--json", action="store_true", help="print one JSON object")
    pe.add_argument("--seed", type=int, default=12345, help="seed of the evaluation envs and the sampled actions [12345]")
    pe.add_argument("--vs", metavar="NAMES", help="comma list of scripted teams (see `phalanx envs`) and/or random to compare against; "
                    "for a league run, opponents for head-to-head matches: scripted names, random, snapshot:LATEST, snapshot:NAME")
    _compute_flags(pe)
    pe.add_argument("--record", metavar="FILE", help="also write one episode as an animation (.gif, or .mp4 with imageio-ffmpeg)")
    pl = sub.add_parser("league", help="print a self-play run's rating table")
    pl.add_argument("run_dir", help="a run trained with --opponents")
    pl.add_argument("--json", action="store_true", help="print one JSON object")
    pp = sub.add_parser("plot", help="write a PNG of return and losses against steps (several runs: one line each)")
    pp.add_argument("run_dir", nargs="+", help="one or more run directories")
    pp.add_argument("--out", help="output PNG (default RUN_DIR/plots/learning_curve.png; several runs: ./learning_curves.png)")
    pn = sub.add_parser("envs", help="list environments, spaces and options")
    pn.add_argument("--json", action="store_true", help="print JSON instead of the list")
    pc = sub.add_parser("check-env", help="check an env against the env contract (docs/ENVIRONMENTS.md)",
                        epilog="Env options are passed as --option value. Exit status 2 and one line at the first broken rule.")
    pc.add_argument("env", help="a registered name, gym:<id>, pz:<module>:<fn> or package.module:factory")
    pc.add_argument("--num-envs", type=int, default=4, help="envs stepped together [4]")
    pc.add_argument("--steps", type=int, default=64, help="random steps of the full check [64]")
    pc.add_argument("--seed", type=int, default=7, help="seed of the envs and the random actions [7]")
    _compute_flags(pc)
    ps = sub.add_parser("sweep", help="train configurations x seeds in parallel processes (or on Ray); resumable",
                        epilog="The spec: see `phalanx.sweep` (base, grid | random | optuna, trials, seeds, metric). "
                               "Run it again with the same --dir to resume: finished runs are kept.")
    ps.add_argument("spec", nargs="?", help="YAML, TOML or JSON sweep spec (omit to resume the sweep in --dir)")
    ps.add_argument("--dir", required=True, help="sweep directory (sweep.json, runs/, logs/)")
    ps.add_argument("--workers", type=int, default=2, help="runs at a time [2]")
    ps.add_argument("--backend", choices=("local", "ray"), default="local", help="local processes or Ray tasks [local]")
    ps.add_argument("--address", default=None, help="Ray cluster address [auto]")
    pm = sub.add_parser("compare", help="mean, IQM and 95%% bootstrap CIs over seeds per configuration; curves with bands")
    pm.add_argument("paths", nargs="+", help="run directories, sweep directories or folders of runs")
    pm.add_argument("--metric", default="eval_mean_return",
                    help="eval_<key> from eval.json (e.g. eval_mean_return), or a metrics.jsonl key (its last value)")
    pm.add_argument("--out", default=None, help="where compare.md, compare.json and curves.png go [SWEEP/compare for one sweep or folder; "
                    "else a compare folder beside the runs]")
    pm.add_argument("--json", action="store_true", help="print the JSON instead of the table")
    px = sub.add_parser("export", help="write a run's policy as an ONNX graph (docs/EXPORT.md; the export extra)",
                        description="Write a run's policy as an ONNX graph: raw observations (and memory) in, greedy env "
                                    "actions, distribution parameters, value (and next memory) out; contract in docs/EXPORT.md.")
    px.add_argument("run_dir", help="the run directory whose policy is exported")
    px.add_argument("--checkpoint", metavar="PATH", help="a checkpoint directory of the run [its latest]")
    px.add_argument("--out", metavar="FILE", help="the .onnx file to write; its contract goes beside it as .json "
                    "[RUN_DIR/export/policy.onnx]")
    px.add_argument("--opset", type=int, default=DEFAULT_OPSET, help=f"ONNX opset [{DEFAULT_OPSET}]")
    px.add_argument("--package", metavar="DIR", help="write a folder to share instead: policy.onnx, the weights, config and a "
                    "model card (README.md, Hugging Face Hub format) with the evaluation against the env's baselines, the "
                    "learning curve and a replay (docs/EXPORT.md, 'Sharing a policy')")
    px.add_argument("--episodes", type=int, help=f"with --package: episodes per row of the evaluation [{DEFAULT_EPISODES}]")
    px.add_argument("--seed", type=int, help=f"with --package: seed of the evaluation and the replay [{DEFAULT_SEED}]")
    px.add_argument("--overwrite", action="store_true", help="with --package: replace the package's files in a folder that "
                    "holds some (other files are kept)")
    px.add_argument("--push-to-hub", metavar="REPO_ID", help="with --package: upload the folder to this Hugging Face Hub "
                    "model repository (the hub extra; the token of `hf auth login` or HF_TOKEN)")
    for name, ep in plugin_commands().items():
        sub.add_parser(name, help=f"from {ep.value.split(':')[0]} (see `phalanx {name} --help`)", add_help=False)
    return parser


def _compute_flags(p: argparse.ArgumentParser) -> None:
    """--device and --torch-threads, as `train` takes them, for every command that runs a model or an env."""
    p.add_argument("--device", default="cpu", help="torch device: cpu, cuda, cuda:N, mps or auto [cpu]")
    p.add_argument("--torch-threads", type=int, default=0, metavar="N",
                   help="torch CPU threads (0: torch's default) [0]")


def _apply_compute_flags(command: str, args: argparse.Namespace) -> None:
    if args.torch_threads < 0:
        raise ConfigError(f"{command} --torch-threads must be >= 0 (0: torch's default), got {args.torch_threads}")
    if args.torch_threads:
        torch.set_num_threads(args.torch_threads)


def _quiet_closed_pipe() -> int:
    """The reader of our output left (`phalanx envs | head -3`): no error, as git and ls end; what is still
    buffered goes nowhere, so the interpreter's last flush cannot fail either."""
    with contextlib.suppress(OSError, ValueError):
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
    return 128 + signal.SIGPIPE


def main(argv: Sequence[str] | None = None) -> int:
    try:
        code = _run_command(list(sys.argv[1:] if argv is None else argv))
        sys.stdout.flush()
        return code
    except BrokenPipeError:
        return _quiet_closed_pipe()


def _run_command(argv: list[str]) -> int:
    devices.tune_host_allocator()
    if argv[:1] == ["resume"] and len(argv) > 1 and not argv[1].startswith("-"):
        # One way to resume: `resume RUN ...` is `train --resume RUN ...`, flags and all.
        argv = ["train", "--resume", argv[1], *argv[2:]]
    parser = build_parser(argv)
    plugins = plugin_commands()
    if argv[:1] and argv[0] in plugins:
        # A plugin command has its own parser; hand it everything after the word.
        try:
            return plugins[argv[0]].load()(argv[1:])
        except PhalanxError as e:
            print(f"phalanx: error: {e}", file=sys.stderr)
            return 2
    try:
        args, extra = parser.parse_known_args(argv)
        if extra and args.command not in ("train", "eval", "check-env"):
            parser.error(f"unrecognized arguments: {' '.join(extra)}")
        if args.command == "train":
            return cmd_train(args, extra)
        if args.command == "eval":
            return cmd_eval(args, extra)
        if args.command == "league":
            return cmd_league(args)
        if args.command == "plot":
            return cmd_plot(args)
        if args.command == "envs":
            return cmd_envs(args)
        if args.command == "check-env":
            return cmd_check_env(args, extra)
        if args.command == "sweep":
            return cmd_sweep(args)
        if args.command == "compare":
            return cmd_compare(args)
        if args.command == "export":
            return cmd_export(args)
    except PhalanxError as e:
        print(f"phalanx: error: {e}", file=sys.stderr)
        return 2
    except BrokenPipeError:
        raise
    except OSError as e:  # a path the command was given or writes to: one line, not a traceback
        where = f"'{e.filename}': " if e.filename else ""
        print(f"phalanx: error: {where}{storage_reason(e)}", file=sys.stderr)
        return 2
    except Stopped as e:
        print(f"phalanx: {e}", file=sys.stderr)
        return 128 + e.signum
    except KeyboardInterrupt:
        print("phalanx: interrupted", file=sys.stderr)
        return 130
    return 1


if __name__ == "__main__":
    sys.exit(main())
