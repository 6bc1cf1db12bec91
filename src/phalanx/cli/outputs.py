"""`phalanx plot`, `envs`, `sweep`, `compare` and `export` (with --package)."""

from __future__ import annotations

import argparse
import json
from importlib.metadata import entry_points
from pathlib import Path

from phalanx import checkpoint as ckpt
from phalanx.cli.options import (
    at_least_one,
)
from phalanx.compare import compare
from phalanx.envs import make, registered, registry
from phalanx.errors import ConfigError, MissingExtraError
from phalanx.export import export_onnx, file_sizes, read_contract, require_export_extra, sidecar_path
from phalanx.package import DEFAULT_EPISODES, DEFAULT_LICENSE, DEFAULT_SEED, check_repo_id, push_to_hub, write_package
from phalanx.plot import plot_run, plot_runs
from phalanx.policy import load
from phalanx.sweep import open_sweep, read_spec, run_sweep


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
                            **({"min": o.min} if o.min is not None else {}), **({"max": o.max} if o.max is not None else {}),
                            **({"train_only": True} if o.train_only else {})}
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
    given = [f for f, v in (("--episodes", args.episodes), ("--seed", args.seed), ("--overwrite", args.overwrite or None),
                            ("--license", args.license)) if v is not None]
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
    at_least_one("export", episodes=episodes)
    if args.push_to_hub:
        check_repo_id(args.push_to_hub)  # before the evaluation: a bad id or a missing extra costs nothing
    report = write_package(args.run_dir, args.package, checkpoint=args.checkpoint, episodes=episodes,
                           seed=DEFAULT_SEED if args.seed is None else args.seed, opset=args.opset, overwrite=args.overwrite,
                           license=args.license or DEFAULT_LICENSE)
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
