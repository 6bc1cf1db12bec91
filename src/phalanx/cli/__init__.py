"""The `phalanx` command line, a shell over the modules that do the work:

    phalanx train      train a policy with PPO (every config key is also a --key value option)
    phalanx resume     continue a stopped run (train --resume RUN_DIR)
    phalanx eval       evaluate a run's policy against scripted teams, random play or league snapshots
    phalanx league     print a self-play run's rating table
    phalanx exploit    train a best response against a two-sided run's policy and score it (--exact: every line)
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
import os
import signal
import sys
from collections.abc import Sequence
from importlib.metadata import EntryPoint, entry_points
from typing import Any

from phalanx import devices
from phalanx.cli.exploit import cmd_exploit
from phalanx.cli.options import typed_env_options
from phalanx.cli.outputs import cmd_compare, cmd_envs, cmd_export, cmd_plot, cmd_sweep
from phalanx.cli.play import cmd_eval, cmd_league
from phalanx.cli.training import cmd_check_env, cmd_train
from phalanx.config import describe_keys, effective_defaults
from phalanx.errors import PhalanxError, Stopped, storage_reason
from phalanx.exploit import DEFAULT_EPISODES as EXPLOIT_EPISODES
from phalanx.exploit import DEFAULT_STEPS as EXPLOIT_STEPS
from phalanx.export import DEFAULT_OPSET
from phalanx.package import DEFAULT_EPISODES, DEFAULT_LICENSE, DEFAULT_SEED

COMMAND_GROUP = "phalanx.commands"


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
                    "for a league run, opponents for head-to-head matches: scripted names, random, snapshot:LATEST, snapshot:NAME; "
                    "for a turn-based PettingZoo env, module:callable players over its observation dict too (each played from "
                    "both seats, their illegal moves counted and not played)")
    _compute_flags(pe)
    pe.add_argument("--record", metavar="FILE", help="also write one episode as an animation (.gif, or .mp4 with imageio-ffmpeg); a turn-based "
                    "game's frames are captioned with whose turn it is and its moves go to FILE's stem + .moves.tsv")
    pxp = sub.add_parser("exploit", help="how much a best response wins against a two-sided run's policy",
                         description="Train a fresh best response against the run's policy, frozen and greedy (as eval "
                                     "plays it), from both seats of a turn-based game, and score it over its training and "
                                     "at the end; --exact walks every game against any opponent instead (small games).")
    pxp.add_argument("run_dir", nargs="?", help="the run whose policy is exploited (or --env and --scripted)")
    pxp.add_argument("--env", help="with --scripted: the env whose scripted policy is exploited")
    pxp.add_argument("--scripted", metavar="NAME", help="exploit a scripted policy of --env instead of a run (a baseline's "
                     "figure beside a trained policy's); needs --out")
    pxp.add_argument("--steps", type=int, default=EXPLOIT_STEPS, help=f"the best response's training steps [{EXPLOIT_STEPS:,}]")
    pxp.add_argument("--episodes", type=int, default=EXPLOIT_EPISODES,
                     help=f"greedy games a seat that score the trained best response [{EXPLOIT_EPISODES}]")
    pxp.add_argument("--seed", type=int, default=1, help="seed of the best response's training and its games [1]")
    pxp.add_argument("--out", metavar="DIR", help="the best response's run directory [RUN_DIR/exploit-sSEED]")
    pxp.add_argument("--overwrite", action="store_true", help="replace an earlier best response in --out")
    pxp.add_argument("--exact", action="store_true", help="no training: walk every game the greedy policy can meet "
                     "against any opponent, from each seat, and count them by outcome (tic-tac-toe)")
    pxp.add_argument("--json", action="store_true", help="print one JSON object")
    _compute_flags(pxp)
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
    px.add_argument("--license", metavar="ID", help="with --package: the card's license, a Hub license id "
                    f"(mit, apache-2.0, cc-by-4.0, other, ...) [{DEFAULT_LICENSE}]")
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
        if args.command == "exploit":
            return cmd_exploit(args)
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


__all__ = ["build_parser", "main", "typed_env_options"]
