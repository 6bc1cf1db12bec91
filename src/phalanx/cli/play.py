"""`phalanx eval` (against scripted teams, random play, league snapshots or players written outside Phalanx) and
`phalanx league`."""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path
from typing import Any

from phalanx import checkpoint as ckpt
from phalanx.cli.options import (
    apply_compute_flags,
    at_least_one,
    parse_env_options,
    refuse_unknown_options,
)
from phalanx.envs import make, registry
from phalanx.errors import CheckpointError, PhalanxError
from phalanx.evaluate import evaluate_policy, evaluate_seats
from phalanx.league import LEAGUE_FILE, Ratings, load_snapshot
from phalanx.policy import load
from phalanx.record import record_episode
from phalanx.slots import is_outside_name, outside_player


def cmd_eval(args: argparse.Namespace, extra: list[str] | None = None) -> int:
    at_least_one("eval", episodes=args.episodes)
    apply_compute_flags("eval", args)
    policy = load(args.run_dir, device=args.device)
    cfg = policy.config
    # Env options given here (e.g. --approach-weight 0: the reward without a training-only term) override the run's;
    # those the env marks training-only (a random opening) are left at their defaults unless given.
    given = parse_env_options(extra or [])
    refuse_unknown_options(cfg.env, given, "an eval flag (`phalanx eval --help`)")
    overrides = registry.resolve_options(cfg.env, given)
    played = {**registry.evaluation_options(cfg.env, cfg.env_options), **overrides}
    if played != cfg.env_options:
        cfg = dataclasses.replace(cfg, env_options=played)
    common = dict(env_options=cfg.env_options, episodes=args.episodes, seed=args.seed, device=policy.device)
    if args.record:
        # The first --vs player is the recorded opponent; a league run without --vs meets random play.
        names = [v.strip() for v in (args.vs or "").split(",") if v.strip()]
        label = names[0] if names else "random" if cfg.opponents else None
        opponent: Any = label
        if label is not None and label.startswith("snapshot:"):
            label, opponent = _snapshot(label, Path(args.run_dir), policy)
        elif label is not None and is_outside_name(label):
            opponent = outside_player(label)
        info = record_episode(policy, cfg.env, args.record, cfg.env_options, greedy=not args.sample, seed=args.seed,
                              opponent=opponent, device=policy.device)
        against = f" against {label}: the learner's return {info['return']:.2f}" if label else \
            f", return {info['return']:.2f}"
        print(f"recorded {info['steps']} steps ({info['frames']} frames) to {info['path']}{against}", file=sys.stderr)
        if "moves" in info:  # a turn-based game: who played what, move by move
            result = ", ".join(f"{name} {r:+g}" for name, r in info["result"].items())
            print(f"its moves: {info['moves']} (result: {result})", file=sys.stderr)
    names = [v.strip() for v in (args.vs or "").split(",") if v.strip()]
    game = _game_players(cfg)
    if not names and game:  # a game: does it beat random play and the env's own players, from each seat?
        names = game
    # In a turn-based game the first mover is the first seat: every opponent is met from both (draws counted).
    if any(is_outside_name(n) for n in names) or (names and game):
        return _eval_seats(args, policy, names, common)
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


def _game_players(cfg: Any) -> list[str]:
    """A turn-based game's own players, random play first ([] for an env that is no game): whom `eval` meets
    without --vs."""
    env = make(cfg.env, num_envs=1, device="cpu", seed=0, **cfg.env_options)
    try:
        return list(dict.fromkeys(("random", *env.scripted_names))) if env.turn_based else []
    finally:
        env.close()


def _eval_seats(args: argparse.Namespace, policy: Any, names: list[str], common: dict[str, Any]) -> int:
    """`--vs` naming players written outside Phalanx (module:callable), or any players of a turn-based game: the policy
    against each --vs player from each seat; an outside player's illegal moves are counted, not played."""
    cfg = policy.config
    table = {}
    for name in names:
        if name.startswith("snapshot:"):
            name, opponent = _snapshot(name, Path(args.run_dir), policy)
        else:
            opponent = outside_player(name) if is_outside_name(name) else name
        table[name] = evaluate_seats(policy, cfg.env, opponent, greedy=not args.sample, **common)
    if args.json:
        print(json.dumps({"vs": table}))
        return 0
    print(f"{cfg.env}: learner ({'sampled' if args.sample else 'greedy'}, {_evaluated(args.run_dir, policy.step)}) vs each "
          f"player from each seat, {args.episodes} games a seat")
    width = max(24, *(len(n) + 2 for n in names))
    print(f"{'opponent':<{width}}{'seat':>8}{'win':>6}{'draw':>6}{'loss':>6}{'distinct':>10}{'win rate [95% CI]':>22}"
          f"{'its illegal moves':>20}")
    for name, r in table.items():
        illegal = f"{r['opponent_illegal_moves']} of {r['opponent_moves']}" if "opponent_moves" in r else "-"
        for seat in ("first", "second"):
            s = r[seat]
            lo, hi = s["win_rate_ci95"]
            # One game played again and again is one sample: no interval to give.
            ci = f"{s['win_rate']:.2f} (one game)" if s["distinct_games"] == 1 and s["episodes"] > 1 else \
                f"{s['win_rate']:.2f} [{lo:.2f}, {hi:.2f}]"
            print(f"{name if seat == 'first' else '':<{width}}{seat:>8}{s['wins']:>6}{s['draws']:>6}{s['losses']:>6}"
                  f"{s['distinct_games']:>10}{ci:>22}{illegal if seat == 'first' else '':>20}")
    print("distinct: how many of a seat's games differ; a greedy policy against a deterministic player plays one game "
          "again and again")
    return 0


def _snapshot(name: str, run_dir: Path, policy: Any) -> tuple[str, Any]:
    """`snapshot:NAME` or `snapshot:LATEST` of a league run -> (the snapshot's name, its policy)."""
    want = name.split(":", 1)[1]
    if want == "LATEST":
        league_path = run_dir / LEAGUE_FILE
        state = json.loads(league_path.read_text()) if league_path.is_file() else {}
        snapshots = sorted((o["step"], o["name"]) for o in state.get("opponents", []) if o["kind"] == "snapshot")
        if not snapshots:
            raise PhalanxError(f"run '{run_dir}' has no league snapshots for '{name}'")
        want = snapshots[-1][1]
    return want, load_snapshot(run_dir, want, policy)


def _eval_head_to_head(args: argparse.Namespace, policy: Any, common: dict[str, Any]) -> int:
    """A league run: the learner against each --vs opponent; the games also update the ratings."""

    cfg, run_dir = policy.config, Path(args.run_dir)
    league_path = run_dir / LEAGUE_FILE
    state = json.loads(league_path.read_text()) if league_path.is_file() else None
    table: dict[str, Any] = {}
    for name in [v.strip() for v in args.vs.split(",") if v.strip()]:
        opponent: Any = name
        if name.startswith("snapshot:"):
            name, opponent = _snapshot(name, run_dir, policy)
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
        r["status"] = "learner" if r["name"] == "learner" else "learner seat" if r["name"].startswith("learner@") else (
            "scripted" if o and o["kind"] == "scripted" else "frozen" if o and o["kind"] == "frozen" else
            "pinned" if o and o["pinned"] else "pool" if o and not o["retired"] else "retired")
    if args.json:
        print(json.dumps({"step": state["step"], "ratings": rows}))
        return 0
    print(f"league of {run_dir} at step {state['step']:,} (rating = mu - 3 sigma, OpenSkill Plackett-Luce)")
    print(f"{'name':<26}{'status':>14}{'rating':>9}{'mu':>8}{'sigma':>8}{'games':>8}{'learner win rate vs it':>24}")
    for r in rows:
        wr = "" if r["learner_win_rate"] is None else f"{r['learner_win_rate']:.2f}"
        print(f"{r['name']:<26}{r['status']:>14}{r['rating']:>9.2f}{r['mu']:>8.2f}{r['sigma']:>8.2f}{r['games']:>8}{wr:>24}")
    return 0

